"""Exact candidates: the packs (sources and digests) a deploy pipeline means to serve.

Port of the seed's offline candidate as far as this port has it
(``offlineCandidateMatchesActivatedState``, the whole-target verifier, the
component-delta retry and ``ApplyAllFinalVerify``). A candidate file
(JSON or YAML)::

    packs:
      - {name: platform-core, digest: 3f2a...}            # shipped with the release
      - {name: dreamhouse-lwc, digest: 9c1b..., source: /packs/dreamhouse-lwc}

names every pack of the target: ApplyAll's plan built from the candidate's
sources (platform packs, the sources, app packs already installed) must be
exactly the candidate, names and digests, or the run is refused before it
writes anything (``CandidateMismatchError``). ``nexusctl candidate write``
prints one for the current sources.

Classification (:func:`classify`), under policy ``exact_candidate`` (or
``auto_start`` with a candidate, which never takes the delta):

- marker not completed, or rebuild debt owed: full apply;
- every candidate pack installed ``active`` with its digest and nothing else
  active: whole-target verify (tables, columns, views, indexes, payload
  hashes); no finding -> ``skip``, a finding (live-state drift) -> full apply;
- otherwise, when only packs already installed changed digest (and no
  deferred view rebuild): ``delta`` re-applies just those packs;
- else full apply.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, select

from nexuscrm.contracts.candidate import CandidatePack, CandidateSpec
from nexuscrm.controlplane import markers, release, verify
from nexuscrm.db import tables as t
from nexuscrm.db.dialect import table_names as physical_tables
from nexuscrm.errors import FatalError
from nexuscrm.inputs import InputLimitError, load_document
from nexuscrm.packs.hashing import payload_hash
from nexuscrm.packs.loader import load_pack_source
from nexuscrm.packs.model import PackManifest

_DIGEST = re.compile(r"^[0-9a-f]{64}$")
_ENTRY_KEYS = {"name", "digest", "source"}

SKIP, DELTA, APPLY, HALT = "skip", "delta", "apply", "halt_for_migration"


class CandidateError(FatalError):
    """A candidate file or input is malformed (the message names the file and entry)."""


class CandidateMismatchError(FatalError):
    """The candidate's sources do not build exactly the candidate (names or digests)."""


class FinalVerifyError(FatalError):
    """The final-verify hook (``NEXUS_FINAL_VERIFY_COMMAND``) failed or timed out."""


def parse_candidate(data: Any, where: str) -> CandidateSpec:
    """Validate a decoded candidate document (``{"packs": [...]}``) into a spec.

    Raises ``CandidateError`` naming ``where``: not a mapping with a ``packs``
    list; else every problem of every entry at once, each naming the entry
    (``packs[3] (name)``): unknown keys, a missing name, a digest that is not
    64 lower-case hex digits, a source that is not a string, a duplicate name.
    """
    if not isinstance(data, Mapping) or set(data) != {"packs"}:
        raise CandidateError(f"candidate {where}: expected a mapping with exactly one key 'packs'")
    packs = data["packs"]
    if not isinstance(packs, list) or not packs:
        raise CandidateError(f"candidate {where}: 'packs' must be a non-empty list")
    out: list[CandidatePack] = []
    seen: set[str] = set()
    problems: list[str] = []
    for i, entry in enumerate(packs):
        at = f"packs[{i}]"
        if not isinstance(entry, Mapping):
            problems.append(f"{at}: expected a mapping with name, digest, source")
            continue
        unknown = set(entry) - _ENTRY_KEYS
        if unknown:
            problems.append(f"{at}: unknown key(s) {sorted(unknown)}")
        name, digest, source = entry.get("name"), entry.get("digest"), entry.get("source", "")
        bad = len(problems)
        if not isinstance(name, str) or not name:
            problems.append(f"{at}: 'name' must be a non-empty string, got {name!r:.80}")
            name = "?"
        if not isinstance(digest, str) or not _DIGEST.match(digest):
            problems.append(
                f"{at} ({name}): 'digest' must be a sha256 payload hash (64 lower-case hex), "
                f"got {digest!r:.80}"
            )
        if not isinstance(source, str):
            problems.append(f"{at} ({name}): 'source' must be a path string, got {source!r:.80}")
        if name in seen:
            problems.append(f"{at}: pack {name} is listed twice")
        seen.add(name)
        if len(problems) == bad and not unknown:
            out.append(CandidatePack(name=name, digest=str(digest), source=str(source)))
    if problems:
        # Every problem of every entry at once, in one message naming the file.
        raise CandidateError(
            f"candidate {where}: {len(problems)} problem(s): " + "; ".join(problems)
        )
    return CandidateSpec(packs=out)


MAX_CANDIDATE_BYTES = 1024 * 1024
"""Largest candidate file read (1 MiB; a candidate of 1,000 packs is ~150 KB)."""


def load_candidate(path: str | Path) -> CandidateSpec:
    """Read a candidate file (JSON for ``.json``, else YAML) into a spec.

    At most :data:`MAX_CANDIDATE_BYTES` are read and the document may nest at
    most :data:`~nexuscrm.inputs.MAX_JSON_DEPTH` levels. Raises
    ``CandidateError`` naming the file: unreadable, over the limit, not
    UTF-8, not valid JSON/YAML, nested too deeply, or a bad shape
    (:func:`parse_candidate`).
    """
    p = Path(path)
    try:
        data = load_document(p, MAX_CANDIDATE_BYTES)
    except OSError as exc:
        raise CandidateError(f"candidate {p}: cannot read: {exc.strerror or exc}") from None
    except InputLimitError as exc:
        raise CandidateError(f"candidate {p}: {exc}") from None
    return parse_candidate(data, str(p))


def validate_spec(spec: CandidateSpec) -> CandidateSpec:
    """Re-validate a spec that arrived as workflow input (the ``temporal`` CLI)."""
    doc = {"packs": [{"name": p.name, "digest": p.digest, "source": p.source} for p in spec.packs]}
    return parse_candidate(doc, "input")


def sources(spec: CandidateSpec) -> list[str]:
    """The app pack sources of the candidate, in its order."""
    return [p.source for p in spec.packs if p.source]


def digests(spec: CandidateSpec) -> dict[str, str]:
    """Pack name -> digest."""
    return {p.name: p.digest for p in spec.packs}


def from_plan(plan: Sequence[PackManifest], app_sources: Sequence[str]) -> dict[str, Any]:
    """The candidate document of a plan (what ``nexusctl candidate write`` prints).

    ``app_sources`` are the sources the plan was built from; each is written
    beside the pack it loads.
    """
    by_name = {load_pack_source(s).name: s for s in app_sources}
    return {
        "packs": [
            {"name": p.name, "digest": payload_hash(p)}
            | ({"source": by_name[p.name]} if p.name in by_name else {})
            for p in plan
        ]
    }


def check_plan(spec: CandidateSpec, plan: Sequence[PackManifest]) -> None:
    """Raise ``CandidateMismatchError`` unless ``plan`` is exactly the candidate.

    Every entry with a source must load a pack of its name; the plan's packs
    and the candidate's must be the same names with the same digests.
    """
    problems: list[str] = []
    for entry in spec.packs:
        if entry.source:
            built = load_pack_source(entry.source).name
            if built != entry.name:
                problems.append(f"source {entry.source} builds pack {built}, not {entry.name}")
    want = digests(spec)
    have = {p.name: payload_hash(p) for p in plan}
    for name in sorted(set(want) | set(have)):
        if name not in have:
            problems.append(f"candidate pack {name} is not in the plan (no source builds it)")
        elif name not in want:
            problems.append(f"pack {name} ({have[name][:12]}) is in the plan but not the candidate")
        elif have[name] != want[name]:
            problems.append(
                f"pack {name}: its source builds {have[name][:12]}, the candidate pins "
                f"{want[name][:12]}"
            )
    if problems:
        raise CandidateMismatchError(
            "exact candidate does not match its sources, refusing before any write: "
            + "; ".join(problems)
        )


def installed_active(engine: Engine) -> dict[str, str]:
    """Pack name -> payload hash of every ``active`` installed pack."""
    if t.installed_pack.name not in physical_tables(engine):
        return {}
    ip = t.installed_pack
    with engine.connect() as conn:
        rows = conn.execute(select(ip.c.Name, ip.c.PayloadHash).where(ip.c.Status == "active"))
        return {r.Name: r.PayloadHash for r in rows}


def classify(
    engine: Engine, spec: CandidateSpec, policy: str, defer: bool
) -> tuple[str, str, list[str]]:
    """Decide skip / delta / apply / halt for a checked candidate (see the module doc).

    Returns ``(action, reason, changed packs)``. Read-only.
    """
    decision = markers.classify_auto_start(engine)
    if decision.action == markers.AutoStartAction.halt_for_migration:
        if policy == "auto_start":
            return HALT, decision.reason, []
        return APPLY, f"the exact candidate performs the required migration ({decision.reason})", []
    if decision.action != markers.AutoStartAction.skip:
        return APPLY, decision.reason, []
    preflight = release.completed_marker_preflight(engine)
    if preflight:
        return (
            APPLY,
            f"completed marker not trusted by this release: {'; '.join(preflight[:3])}",
            [],
        )
    if markers.rebuild_owed(engine):
        return (
            APPLY,
            "completed marker has outstanding formula-view rebuild debt; explicit exact "
            "candidate is promoting to full ApplyAll",
            [],
        )
    want = digests(spec)
    active = installed_active(engine)
    changed = sorted(n for n, d in want.items() if active.get(n) != d)
    extra = sorted(set(active) - set(want))
    if not changed and not extra:
        findings = verify.verify(engine, want)
        if findings:
            return (
                APPLY,
                "exact already-active candidate failed whole-target verification; promoting to "
                f"ApplyAll: {'; '.join(findings[:3])}",
                [],
            )
        return SKIP, "exact candidate is active and the whole target verifies", []
    if (
        policy == "exact_candidate"
        and not defer
        and not extra
        and all(name in active for name in changed)
    ):
        return (
            DELTA,
            "completed marker differs only by pack revisions; selecting component-delta apply "
            f"of {', '.join(changed)}",
            changed,
        )
    what = [f"{n} changed" for n in changed]
    what += [f"{n} installed but not in the candidate" for n in extra]
    return APPLY, f"completed marker does not match the exact candidate ({'; '.join(what)})", []


def run_final_verify(command: str, env: Mapping[str, str], timeout_s: float) -> str:
    """Run the final-verify hook; return the last line of its output.

    ``command`` is split like a shell command line (no shell); it runs with
    the worker's environment plus ``env``. A non-zero exit or a timeout
    raises ``FinalVerifyError`` with the tail of its output.
    """
    argv = shlex.split(command)
    if not argv:
        raise FinalVerifyError("final distribution verify: NEXUS_FINAL_VERIFY_COMMAND is empty")
    try:
        done = subprocess.run(
            argv,
            env={**os.environ, **env},
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        raise FinalVerifyError(
            f"final distribution verify: {argv[0]} did not finish within {timeout_s:g} s"
        ) from exc
    except OSError as exc:
        raise FinalVerifyError(f"final distribution verify: cannot run {argv[0]}: {exc}") from exc
    output = (done.stdout + done.stderr).strip()
    if done.returncode != 0:
        raise FinalVerifyError(
            f"final distribution verify: {argv[0]} exited {done.returncode}: {output[-2000:]}"
        )
    return output.splitlines()[-1] if output else f"{argv[0]} passed"
