"""Every corpus project's SFDX data plans as one inbound sync (issue 11 item 11).

- :func:`corpus_plans`: ``(project, plan)`` for every data plan of every
  corpus project (``../shared/corpus/sfdx/*/data/*.json`` that are plans);
- :func:`corpus_app_packs`: one installable app pack per such project — the
  project itself when it loads, else a copy holding only the objects its
  plans write (and, of a platform object, only the custom fields they set);
- :func:`corpus_events`: the plans' records as shuffled upsert events, remote
  ids prefixed with the project (plans of different projects reuse
  ``AccountRef1``), with the matching records for
  :func:`tests.builders.verify_synced`.

A plan record whose object no pack provides (apex-recipes' ``Campaign``) is
left out and counted.
"""

from __future__ import annotations

import dataclasses
import json
import random
import shutil
from pathlib import Path
from typing import Any

from nexuscrm.connectors import queue
from nexuscrm.connectors.importer import events_from_sfdx_plan
from nexuscrm.errors import NexusError
from nexuscrm.packs.builtin import platform_packs
from nexuscrm.packs.loader import load_pack_source
from tests.builders import CORPUS, plan_records


def corpus_plans() -> list[tuple[str, Path]]:
    """``(project, plan path)`` of every data plan in the corpus, sorted; skips when absent."""
    if not CORPUS.is_dir():
        import pytest

        pytest.skip(f"corpus not found at {CORPUS} (../shared/corpus is absent)")
    out = []
    for project in sorted(p for p in CORPUS.iterdir() if p.is_dir()):
        for path in sorted((project / "data").glob("*.json")):
            try:
                doc = json.loads(path.read_text())
            except (OSError, ValueError):
                continue
            if isinstance(doc, list) and doc and all("files" in e for e in doc):
                out.append((project.name, path))
    return out


def _core_fields() -> dict[str, set[str]]:
    core = platform_packs(include_dev_sample=False)[0]
    return {
        o.api_name: {c.lower() for f in o.fields for c in f.column_names()} for o in core.objects
    }


def _sub_project(project: Path, plans: list[Path], out: Path) -> Path:
    """A copy of ``project`` with only the objects and custom fields ``plans`` write."""
    core = _core_fields()
    wanted: dict[str, set[str]] = {}
    for plan in plans:
        for rec in plan_records(plan):
            fields = wanted.setdefault(rec["attributes"]["type"], set())
            fields.update(k.lower() for k in rec if k != "attributes")
    root = out / project.name
    objects = root / "force-app" / "main" / "default" / "objects"
    objects.mkdir(parents=True)
    (root / "sfdx-project.json").write_text(
        json.dumps({"name": project.name, "packageDirectories": [{"path": "force-app"}]})
    )
    for obj, fields in sorted(wanted.items()):
        found = [d for d in project.rglob(f"objects/{obj}") if d.is_dir()]
        if not found:
            continue  # no pack provides it: its records are left out
        src = found[0]
        keep = [
            f
            for f in sorted(src.rglob("*.field-meta.xml"))
            if f.name.split(".")[0].lower() in fields
            and f.name.split(".")[0].lower() not in core.get(obj, set())
        ]
        if obj in core and not keep:
            continue  # a platform object the plans only write standard fields of
        dest = objects / obj
        (dest / "fields").mkdir(parents=True)
        for meta in src.glob("*.object-meta.xml"):
            shutil.copy(meta, dest / meta.name)
        for f in keep:
            shutil.copy(f, dest / "fields" / f.name)
    return root


def corpus_app_packs(tmp: Path) -> list[str]:
    """An installable app pack source for every corpus project with data plans."""
    by_project: dict[str, list[Path]] = {}
    for project, plan in corpus_plans():
        by_project.setdefault(project, []).append(plan)
    sources = []
    for _project, plans in sorted(by_project.items()):
        path = plans[0].parent.parent
        try:
            load_pack_source(str(path))
        except NexusError:
            path = _sub_project(path, plans, tmp)
        sources.append(str(path))
    return sources


def _prefixed(project: str, value: str) -> str:
    return f"{project}.{value}"


def corpus_events(
    install_id: str, namespace: str, objects: set[str], seed: int, copies: int = 1
) -> tuple[list[queue.EnqueueRequest], list[dict[str, Any]], int]:
    """Every plan record of an object in ``objects`` as an upsert event, shuffled by ``seed``.

    ``copies``: how many times each plan is synced, each copy under remote ids
    of its own (``<project>/<copy>.<referenceId>``), so a sync is as large as
    a test needs. Returns the events, the records as
    :func:`tests.builders.verify_synced` takes them (remote ids prefixed like
    the events'), and how many records were left out because no installed
    object takes them.
    """
    events: list[queue.EnqueueRequest] = []
    records: list[dict[str, Any]] = []
    left_out = 0
    plans = [(f"{project}/{n}", plan) for n in range(copies) for project, plan in corpus_plans()]
    for project, plan in plans:
        for ev in events_from_sfdx_plan(plan, installed_pack_id=install_id, namespace=namespace):
            payload = ev.payload
            if payload["sobject"] not in objects:
                left_out += 1
                continue
            refs = {k: _prefixed(project, v) for k, v in payload["references"].items()}
            fields = {k: refs.get(k, v) for k, v in payload["fields"].items()}
            remote = _prefixed(project, payload["remote_id"])
            events.append(
                dataclasses.replace(
                    ev,
                    idempotency_key=f"{payload['sobject']}:{remote}",
                    source_id=remote,
                    target_remote_id=remote,
                    payload={**payload, "remote_id": remote, "fields": fields, "references": refs},
                )
            )
        for rec in plan_records(plan):
            if rec["attributes"]["type"] not in objects:
                continue
            out = {
                k: "@" + _prefixed(project, v[1:])
                if isinstance(v, str) and v.startswith("@")
                else v
                for k, v in rec.items()
                if k != "attributes"
            }
            out["attributes"] = {
                **rec["attributes"],
                "referenceId": _prefixed(project, rec["attributes"]["referenceId"]),
            }
            records.append(out)
    random.Random(seed).shuffle(events)
    return events, records, left_out
