"""Hostile pack manifests (issue 17 items 5 and 6): an alias bomb, deep nesting and
an oversized file are refused at once, naming the file and the cause, without
exhausting memory and without being retried as if transient."""

from __future__ import annotations

import time
import tracemalloc
from pathlib import Path
from typing import Any

import pytest
from temporalio.client import WorkflowFailureError

from nexuscrm.contracts import ApplyAllInput
from nexuscrm.errors import ManifestError
from nexuscrm.packs.loader import MAX_MANIFEST_BYTES, load_native
from nexusctl.temporal import start_controlplane
from nexusctl.worker import build_worker
from tests.builders import db_state, installed_state, write_small_pack


def alias_bomb(path: Path) -> Path:
    """A ~15 KB YAML whose aliases stand for 10^9 items (9 levels of 10 x 10)."""
    lines = ['a0: &a0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    for level in range(1, 10):
        refs = ", ".join([f"*a{level - 1}"] * 10)
        lines.append(f"a{level}: &a{level} [{refs}]")
    lines.append("name: bomb\nversion: 1.0.0\ncategory: AppPack\nobjects: *a9")
    path.write_text("\n".join(lines) + "\n")
    return path


def test_alias_bomb_is_measured_not_built(tmp_path: Path) -> None:
    bomb = alias_bomb(tmp_path / "pack.yaml")
    tracemalloc.start()
    started = time.monotonic()
    with pytest.raises(ManifestError, match="alias bomb") as info:
        load_native(bomb)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert str(bomb) in str(info.value)
    assert time.monotonic() - started < 10
    assert peak < 50 * 1024 * 1024


@pytest.mark.parametrize(
    "body",
    [
        "name: x\ncategory: AppPack\ndescription: &d [*d]\n",
        "name: x\ncategory: AppPack\nobjects: [&o {api_name: G__c, fields: [*o]}]\n",
        "name: x\ncategory: AppPack\nmeta: &m {a: {b: *m}}\n",
    ],
)
def test_a_recursive_alias_is_refused_at_once(tmp_path: Path, body: str) -> None:
    """An anchor used inside itself stands for no end of nodes: it used to loop in
    the alias count, growing to gigabytes (CLI and worker alike)."""
    path = tmp_path / "pack.yaml"
    path.write_text(body)
    tracemalloc.start()
    started = time.monotonic()
    with pytest.raises(ManifestError, match="recursive YAML alias") as info:
        load_native(path)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert str(path) in str(info.value)
    assert time.monotonic() - started < 10 and peak < 50 * 1024 * 1024


@pytest.mark.parametrize(
    ("name", "body", "where"),
    [
        (
            "pack.json",
            '{"name": "x", "category": "AppPack", "description": "bad \\udc80"}',
            "description",
        ),
        (
            "pack.yaml",
            'name: x\ncategory: AppPack\nobjects:\n  - api_name: A__c\n    label: "\\ud800"\n',
            "objects[0].label",
        ),
    ],
)
def test_a_lone_surrogate_is_refused_naming_where(
    tmp_path: Path, name: str, body: str, where: str
) -> None:
    """JSON and YAML escapes can spell a lone UTF-16 surrogate, which UTF-8 cannot
    encode: it passed the dry run and failed ApplyAll's plan-packs with a bare
    ``UnicodeEncodeError`` naming nothing."""
    path = tmp_path / name
    path.write_text(body)
    with pytest.raises(ManifestError, match="lone surrogate") as info:
        load_native(path)
    assert str(path) in str(info.value) and f"{where}: \\u" in str(info.value), info.value


@pytest.mark.parametrize(
    ("name", "body", "message"),
    [
        ("deep.yaml", "a: " + "[" * 20_000 + "]" * 20_000 + "\n", "nested too deeply"),
        ("deep.json", "[" * 50_000 + "]" * 50_000, "nested too deeply"),
        ("big.yaml", "# " + "x" * (MAX_MANIFEST_BYTES + 10) + "\n", "larger than the limit"),
    ],
)
def test_deep_or_huge_manifests_are_refused_naming_the_file(
    tmp_path: Path, name: str, body: str, message: str
) -> None:
    path = tmp_path / name
    path.write_text(body)
    with pytest.raises(ManifestError, match=message) as info:
        load_native(path)
    assert str(path) in str(info.value)


async def test_applyall_fails_an_alias_bomb_at_once_without_retrying(
    temporal_env: Any, settings: Any, tmp_path: Path
) -> None:
    bomb = alias_bomb(tmp_path / "pack.yaml")
    engine, before = await installed_state(temporal_env, settings, tmp_path)
    good = write_small_pack(tmp_path / "good.yaml", "good-app", "Good__c")
    async with build_worker(temporal_env.client, settings):
        handle = await start_controlplane(
            temporal_env.client,
            settings,
            "ApplyAll",
            ApplyAllInput(app_pack_sources=[str(good), str(bomb)]),
        )
        with pytest.raises(WorkflowFailureError) as info:
            await handle.result()
    cause = str(info.value.cause)
    assert "alias bomb" in cause and str(bomb) in cause
    attempts = [
        e.activity_task_started_event_attributes.attempt
        async for e in handle.fetch_history_events()
        if e.HasField("activity_task_started_event_attributes")
    ]
    assert attempts and max(attempts) == 1, attempts  # no phase was retried
    # nothing half-applied: the good pack of the run neither
    try:
        assert db_state(engine) == before
    finally:
        engine.dispose()


def test_import_sfdx_names_a_missing_object_file_and_a_label_too_long(
    settings: Any, tmp_path: Path
) -> None:
    from tests.builders import cli_env, invoke, write_sfdx

    project = write_sfdx(
        tmp_path / "app",
        {
            "Broker__c": "<type>Lookup</type><referenceTo>Broker__c</referenceTo>",
            "Long__c": f"<type>Text</type><length>10</length><label>{'x' * 100_000}</label>",
        },
        obj="Property__c",
    )
    orphan = project / "force-app" / "main" / "default" / "objects" / "Broker__c" / "fields"
    orphan.mkdir(parents=True)
    (orphan / "N__c.field-meta.xml").write_text(
        '<?xml version="1.0" encoding="UTF-8"?>\n'
        '<CustomField xmlns="http://soap.sforce.com/2006/04/metadata">'
        "<fullName>N__c</fullName><type>Text</type><length>10</length></CustomField>"
    )
    res = invoke(["packs", "import-sfdx", str(project)], cli_env(settings))
    assert res.exit_code == 1, res.output
    assert "Traceback" not in res.output
    assert "Long__c.field-meta.xml" in res.output and "<label>" in res.output, res.output
    assert "the object file is missing" in res.output, res.output
    assert "standard object" not in res.output, res.output
    assert "references unknown object" not in res.output, res.output
    dev_null = invoke(["packs", "import-sfdx", "/dev/null"], cli_env(settings))
    assert dev_null.exit_code != 0
    assert "no such file" not in dev_null.output, dev_null.output
