"""Hostile input at the event entry points: ``events enqueue`` and ``events import-sfdx-data``.

Each bad file gives one clear error naming the file, the line (or record) and
the field, a non-zero exit, no traceback, and nothing half-enqueued: the
event and work-item tables are counted after every case (the source of truth,
not the CLI's own words). SQLite and MariaDB.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, func, select

from nexuscrm.connectors import queue
from nexuscrm.connectors.eventfile import MAX_LINE_BYTES
from nexuscrm.db import tables as t
from nexuscrm.db.engine import make_engine
from tests.builders import SF_SYNC, cli_env, install, invoke_async


def good(n: int, **over: Any) -> dict[str, Any]:
    """A valid salesforce-sync upsert event line."""
    line: dict[str, Any] = {
        "event_kind": "salesforce.record.upsert",
        "idempotency_key": f"Account:h{n}",
        "source_object": "Account",
        "source_id": f"h{n}",
        "payload": {"sobject": "Account", "remote_id": f"h{n}", "fields": {"Name": f"H {n}"}},
    }
    line.update(over)
    return line


def lines(*rows: Any) -> bytes:
    return b"\n".join(r if isinstance(r, bytes) else json.dumps(r).encode() for r in rows) + b"\n"


def _crashed(res: Any) -> bool:
    """The command raised something other than its own exit (an uncaught error)."""
    return res.exception is not None and not isinstance(res.exception, SystemExit)


def counts(engine: Engine) -> tuple[int, int]:
    with engine.connect() as conn:
        events = conn.execute(select(func.count()).select_from(t.connector_event)).scalar_one()
        items = conn.execute(select(func.count()).select_from(t.connector_work_item)).scalar_one()
    return int(events), int(items)


TWICE_SOURCE_ID = (
    b'{"event_kind": "salesforce.record.upsert", "idempotency_key": "k", '
    b'"source_object": "Account", "source_id": "a", "source_id": "b", "payload": {}}'
)
TWICE_IN_PAYLOAD = (
    b'{"event_kind": "salesforce.record.upsert", "idempotency_key": "k", '
    b'"source_object": "Account", "source_id": "a", '
    b'"payload": {"fields": {"Name": "A", "Name": "B"}}}'
)
DEEP = b"[" * 50_000 + b"]" * 50_000

# name -> (file bytes, substrings the one error must contain)
ENQUEUE_CASES: dict[str, tuple[bytes, list[str]]] = {
    "integer idempotency_key": (lines(good(1, idempotency_key=17)), [":1:", "idempotency_key"]),
    "upsert payload of the wrong shape": (
        lines(
            good(1),
            good(2, payload={"sobject": "Account", "remote_id": "h2", "fields": ["Name"]}),
            good(3, payload={"sobject": "Account", "remote_id": "h3", "references": "a1"}),
            good(4, payload={"sobject": "Account", "remote_id": "h4", "references": {"X": [1]}}),
        ),
        [
            ":2: payload.fields must be a JSON object (name: value), got a list",
            ":3: payload.references must be a JSON object (name: value), got a string",
            ":4: payload.references.X must be a remote id (text), got a list",
            "upsert_record",
        ],
    ),
    "integer source_id": (lines(good(1), good(2, source_id=5)), [":2:", "source_id"]),
    "integer queue_class": (lines(good(1, queue_class=3)), [":1:", "queue_class"]),
    "unknown queue_class": (lines(good(1, queue_class="urgent")), ["queue_class", "'urgent'"]),
    "non-numeric route_version": (lines(good(1, route_version="two")), ["route_version"]),
    "route_version zero": (lines(good(1, route_version=0)), ["route_version"]),
    "event_kind too long": (lines(good(1, event_kind="k" * 300)), ["event_kind", "128"]),
    "source_object too long": (lines(good(1, source_object="O" * 300)), ["source_object"]),
    "payload a string": (lines(good(1, payload="just text")), ["payload", "dictionary"]),
    "payload a list": (lines(good(1, payload=[1, 2])), ["payload"]),
    "not an object": (lines([1, 2, 3]), [":1:", "must be a JSON object"]),
    "null": (lines(good(1), None), [":2:", "must be a JSON object, got null"]),
    "invalid UTF-8": (lines(good(1), b'{"event_kind": "\xff\xfe"}'), [":2:", "not UTF-8"]),
    "malformed JSON": (
        lines(good(1), b'{"event_kind": '),
        [":2:", "invalid JSON at line 1 column"],
    ),
    "nested 50,000 deep": (lines(DEEP), [":1:", "nested deeper than 64"]),
    "lone surrogate": (
        lines(good(1), good(2, payload={"x": "\ud800"})),
        [":2:", "payload.x", "lone surrogate"],
    ),
    "unknown key": (lines(good(1, payloads={})), ["payloads", "Extra inputs"]),
    "huge line": (
        lines(good(1, payload={"x": "y" * (MAX_LINE_BYTES + 10)})),
        [":1:", f"over the limit of {MAX_LINE_BYTES} bytes"],
    ),
    "bad half-way": (
        lines(*[good(i) for i in range(1, 500)], good(500, payload="oops"), good(501)),
        [":500:", "payload", "nothing was enqueued"],
    ),
    "unknown event kind": (
        lines(good(1, event_kind="salesforce.record.explode")),
        ["salesforce.record.explode", "no route"],
    ),
    "unknown kind and version among good lines, with a field problem": (
        lines(
            good(1),
            good(2),
            good(3, event_kind="nope.kind"),
            good(4, route_version=7),
            good(5, event_kind="nope.kind"),
            good(6, source_id=1),
        ),
        [
            ":3: event_kind 'nope.kind' v1",
            "(and 1 more line(s) of it: 5",
            ":4: event_kind",
            ":6:",
            "3 problem(s)",
        ],
    ),
    "duplicate key": (
        lines(good(1), TWICE_SOURCE_ID),
        [":2:", "'source_id' appears twice"],
    ),
    "duplicate key in the payload": (lines(TWICE_IN_PAYLOAD), [":1:", "'Name' appears twice"]),
    "one key, other content": (
        lines(good(1), good(2), good(3, idempotency_key="Account:h1")),
        [":3:", "'Account:h1' is also on line 1 with other content"],
    ),
    "a line's problems together, not in rounds": (
        lines(
            good(1, source_id=1, event_kind="nope.kind"),
            good(
                2,
                idempotency_key=5,
                payload={"sobject": "Account", "remote_id": "h2", "fields": ["Name"]},
            ),
            good(3, queue_class="urgent", event_kind="nope.kind"),
        ),
        [
            ":1: source_id:",
            ":1: event_kind 'nope.kind' v1",
            "(and 1 more line(s) of it: 3",
            ":2: idempotency_key:",
            ":2: payload.fields must be a JSON object",
            ":3: queue_class: 'urgent'",
            "5 problem(s)",
        ],
    ),
    "several problems at once": (
        lines(good(1, source_id=1), good(2), good(3, payload=[]), b"\xff"),
        [":1:", ":3:", ":4:", "3 problem(s)"],
    ),
    # Payloads the upsert flow could only fail, against the installed catalog (a
    # new user's trial enqueued each of these, exit 0; each then failed `mapping`).
    "upserts the installed objects and fields refuse": (
        lines(
            good(1),
            good(2, payload={"sobject": "Acount", "remote_id": "h2", "fields": {"Name": "A"}}),
            good(3, payload={"sobject": "Account", "fields": {"Name": "B"}}),
            good(4, payload={"sobject": "Account", "remote_id": "h4", "fields": {"Nmae": "C"}}),
            good(
                5,
                payload={"sobject": "Account", "remote_id": "h5", "references": {"Name": "x"}},
            ),
            # Every field the flow would refuse, not only the first.
            good(
                6,
                payload={
                    "sobject": "Account",
                    "remote_id": "h6",
                    "fields": {"Name": "D", "Phone": "9" * 41, "Nmae": "x"},
                },
            ),
        ),
        [
            ":2: destination object Acount is not installed (mapping)",
            ":3: event payload lacks sobject or remote_id (mapping)",
            ":4: Account has no field Nmae",
            ":5: Account.Name: named under references but not a lookup field",
            ":6: 2 field problem(s): field Phone: value ",
            "; field Nmae: Account has no field Nmae",
            "5 problem(s)",
        ],
    ),
}


async def test_events_enqueue_refuses_hostile_files_whole_with_one_clear_error(
    temporal_env: Any, settings: Any, tmp_path: Path
) -> None:
    await install(temporal_env, settings, [str(SF_SYNC)])
    engine = make_engine(settings.database_url)
    env = cli_env(settings, temporal_env)
    failures = []
    for name, (data, expected) in ENQUEUE_CASES.items():
        path = tmp_path / f"{name.replace(' ', '_')}.jsonl"
        path.write_bytes(data)
        res = await invoke_async(["events", "enqueue", str(path)], env)
        out = res.output
        problems = [
            f"exit {res.exit_code}" if res.exit_code != 1 else "",
            "traceback" if "Traceback" in out or _crashed(res) else "",
            f"error does not name the file {path}" if str(path) not in out else "",
            *(f"missing {e!r}" for e in expected if e not in out),
            f"enqueued something: {counts(engine)}" if counts(engine) != (0, 0) else "",
        ]
        problems = [p for p in problems if p]
        if problems:
            failures.append(f"{name}: {problems}\n{out[:600]}")
    for special in ("/dev/zero", str(tmp_path / "missing.jsonl"), str(tmp_path)):
        res = await invoke_async(["events", "enqueue", special], env)
        if res.exit_code != 1 or special not in res.output or "Traceback" in res.output:
            failures.append(f"{special}: exit {res.exit_code}\n{res.output[:400]}")
    assert not failures, "\n\n".join(failures)
    assert counts(engine) == (0, 0)
    # the same events, fixed, go in: a byte order mark and a line repeated
    # whole (one event, its duplicate skipped) are fine
    path = tmp_path / "fixed.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + lines(*[good(i) for i in range(1, 502)], good(7)))
    res = await invoke_async(["events", "enqueue", str(path)], env)
    assert res.exit_code == 0, res.output
    assert "enqueued 501 event(s)" in res.output
    assert counts(engine) == (501, 501)
    # a later file that reuses a stored key with other content is refused
    # whole, naming the file, the key and what differs; the same event again
    # (its payload's keys in another order) is a duplicate
    reordered = good(8)
    reordered["payload"] = dict(reversed(list(reordered["payload"].items())))
    changed = good(9, payload={"sobject": "Account", "remote_id": "h9", "fields": {"Name": "X"}})
    path = tmp_path / "later.jsonl"
    path.write_bytes(lines(good(900), reordered, changed, good(10, source_id="h10b")))
    res = await invoke_async(["events", "enqueue", str(path)], env)
    assert res.exit_code == 1 and not _crashed(res), res.output
    for wanted in (
        str(path),
        "2 of 4 request(s) reuse an idempotency key with other content",
        "nothing enqueued",
        "'Account:h9': payload differs from the stored event",
        "'Account:h10': source_id differs from the stored event",
    ):
        assert wanted in " ".join(res.output.split()), (wanted, res.output)
    assert counts(engine) == (501, 501)
    path.write_bytes(lines(good(900), reordered))
    res = await invoke_async(["events", "enqueue", str(path)], env)
    assert res.exit_code == 0, res.output
    assert "enqueued 1 event(s), 1 duplicate(s) skipped" in res.output
    assert counts(engine) == (502, 502)


def test_enqueue_refuses_what_no_worker_can_process(db_url: str) -> None:
    """The library entry point too: a payload that is not an object and a queue
    class no worker claims are refused (both would sit or fail forever), every
    request named at once, nothing written."""
    from nexuscrm.controlplane.metadata import ensure_system_schema
    from tests.builders import event

    engine = make_engine(db_url)
    ensure_system_schema(engine)
    reqs = [
        event("p", "ok"),
        event("p", "str", payload="text"),  # type: ignore[arg-type]
        event("p", "cls", queue_class="urgent"),
        event("p", "rv", route_version="1"),
    ]
    try:
        queue.enqueue(engine, reqs)
    except queue.InvalidWorkRequest as exc:
        message = str(exc)
    else:
        raise AssertionError("enqueue accepted unprocessable requests")
    assert "3 of 4 request(s) refused" in message
    assert "enqueue str: payload must be a JSON object" in message
    assert "enqueue cls: queue_class 'urgent'" in message
    assert "enqueue rv: route_version" in message
    assert counts(engine) == (0, 0)


PLAN_CASES: dict[str, tuple[bytes, list[str]]] = {
    "invalid UTF-8": (b'[{"sobject": "Account", "files": ["\xff.json"]}]', ["not UTF-8"]),
    "nested 50,000 deep": (DEEP, ["nested deeper than 64"]),
    "not a list": (b'{"sobject": "Account"}', ["JSON array"]),
    "integer sobject": (b'[{"sobject": 5, "files": ["a.json"]}]', ["'sobject' must be a string"]),
    "duplicate key": (
        b'[{"sobject": "Account", "sobject": "Contact", "files": ["a.json"]}]',
        ["'sobject' appears twice"],
    ),
}


async def test_import_sfdx_data_refuses_hostile_plans_with_one_clear_error(
    temporal_env: Any, settings: Any, tmp_path: Path
) -> None:
    await install(temporal_env, settings, [str(SF_SYNC)])
    engine = make_engine(settings.database_url)
    env = cli_env(settings, temporal_env)
    failures = []
    records = tmp_path / "records.json"
    records.write_text(
        json.dumps(
            {"records": [{"attributes": {"type": "Account", "referenceId": 7}, "Name": "A"}]}
        )
    )
    cases = dict(PLAN_CASES)
    cases["integer referenceId"] = (
        json.dumps([{"sobject": "Account", "files": ["records.json"]}]).encode(),
        ["records.json", "record 0 (Account): attributes.referenceId must be a string, not a"],
    )
    (tmp_path / "bad-values.json").write_text(
        json.dumps({"records": [
            {"attributes": {"type": "Account", "referenceId": "A1"}, "Name": {"a": 1}},
            {"attributes": {"type": "Account", "referenceId": "A2"}, "Name": "x" * 300,
             "Nope__c": 1},
        ]})
    )  # fmt: skip
    (tmp_path / "ghosts.json").write_text(
        json.dumps({"records": [{"attributes": {"type": "Ghost__c", "referenceId": "G1"}}]})
    )
    (tmp_path / "shapeless.json").write_text(
        json.dumps({"records": [{"Name": "x"}, {"attributes": {"type": "Account"}}]})
    )
    (tmp_path / "one.json").write_text("[1]")
    (tmp_path.parent / "outside.json").write_text(
        json.dumps({"records": [{"attributes": {"type": "Account", "referenceId": "O1"}}]})
    )
    cases.update({
        "no sobject": (
            json.dumps([{"files": ["ghosts.json"]}]).encode(), ["entry 0: missing 'sobject'"]
        ),
        "absolute file": (
            json.dumps([{"sobject": "Account", "files": ["/etc/passwd"]}]).encode(),
            ["entry 0 (Account): file '/etc/passwd': an absolute path"],
        ),
        "file outside the plan's folder": (
            json.dumps([{"sobject": "Account", "files": ["../outside.json"]}]).encode(),
            ["entry 0 (Account): file '../outside.json': points outside the plan's folder"],
        ),
        "unknown sobject": (
            json.dumps([{"sobject": "Ghost__c", "files": ["ghosts.json"]}]).encode(),
            ["entry 0 (Ghost__c): object Ghost__c is not installed"],
        ),
        "values that do not fit": (
            json.dumps([{"sobject": "Account", "files": ["bad-values.json"]}]).encode(),
            ["bad-values.json: record 0 (A1): field Name: value is an object",
             "bad-values.json: record 1 (A2): field Name: value has 300 characters; the "
             "field holds at most 255",
             "bad-values.json: record 1 (A2): field Nope__c: Account has no field Nope__c",
             "nothing enqueued"],
        ),
        "every problem of every file": (
            json.dumps([{"sobject": "Account", "files": ["shapeless.json", "one.json"]}]).encode(),
            ["shapeless.json: record 0: missing 'attributes'",
             "shapeless.json: record 1 (Account): missing attributes.referenceId",
             "one.json: expected an object with a 'records' array"],
        ),
    })  # fmt: skip
    twice = tmp_path / "twice.json"
    twice.write_text('{"records": [{"attributes": {"type": "Account"}, "Name": "A", "Name": "B"}]}')
    cases["duplicate key in a records file"] = (
        json.dumps([{"sobject": "Account", "files": ["twice.json"]}]).encode(),
        ["twice.json", "'Name' appears twice"],
    )
    for name, (data, expected) in cases.items():
        plan = tmp_path / f"{name.replace(' ', '_')}.json"
        plan.write_bytes(data)
        res = await invoke_async(["events", "import-sfdx-data", str(plan)], env)
        output = " ".join(res.output.split())
        missing = [e for e in expected if e not in output]
        if res.exit_code != 1 or missing or "Traceback" in res.output:
            failures.append(f"{name}: exit {res.exit_code}, missing {missing}\n{res.output[:400]}")
    res = await invoke_async(["events", "import-sfdx-data", "/dev/zero"], env)
    if res.exit_code != 1 or "/dev/zero" not in res.output or "64 MiB" not in res.output:
        failures.append(f"/dev/zero: exit {res.exit_code}\n{res.output[:400]}")
    assert not failures, "\n\n".join(failures)
    assert counts(engine) == (0, 0)
