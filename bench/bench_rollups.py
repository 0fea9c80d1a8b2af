"""Benchmark: roll-ups computed in the view against a stored roll-up, on 100,000 children.

Usage:
    python bench/bench_rollups.py [--mysql-url mysql+pymysql://root@127.0.0.1:3306/nexus_test]
        [--children 100000] [--parents 1000]

For each backend (SQLite always, MariaDB/MySQL when a URL is given) it builds
``Project__c`` (COUNT with a filter, SUM of a child formula, MIN of a date, a
formula over two roll-ups) and ``Task__c`` as ApplyAll does (tables from
``catalog.object_table``, the master-detail column indexed, the view from
``build_view_select``), loads the children, then prints:

- ``view all``: ``SELECT *`` of every parent from the view (ms);
- ``view one``: one parent by ``Id`` from the view (ms, median of 50);
- ``stored read``: the same parents from a table holding the roll-ups as
  stored columns (what a maintained value costs to read, ms);
- ``stored upkeep``: keeping those columns right, one recount of the parent
  per child write (ms per child write, median of 200) - the cost a stored
  roll-up adds to every inbound event that touches a child.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
import uuid
from datetime import date, timedelta
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import make_url

from nexuscrm import catalog
from nexuscrm.db.engine import make_engine
from nexuscrm.formulas import CreateView, build_view_select, view_name
from nexuscrm.packs.model import FieldSpec, ObjectSpec


def _f(api_name: str, type_: str, **kw: Any) -> FieldSpec:
    return FieldSpec.model_validate({"api_name": api_name, "type": type_, **kw})


def _rollup(op: str, summarized: str | None = None, **kw: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {"operation": op, "foreign_key_field": "Task__c.Project__c", **kw}
    if summarized:
        spec["summarized_field"] = summarized
    return {"summary": spec}


PROJECT = ObjectSpec(
    api_name="Project__c",
    fields=(
        _f("Done__c", "Summary", **_rollup("count", filters=[
            {"field": "Task__c.Status__c", "operation": "equals", "value": "Done"}])),
        _f("Tasks__c", "Summary", **_rollup("count")),
        _f("Cost__c", "Summary", **_rollup("sum", "Task__c.Cost__c")),
        _f("First_Due__c", "Summary", **_rollup("min", "Task__c.Due__c")),
        _f("Progress__c", "Percent", scale=0, formula="IF(Tasks__c = 0, 0, Done__c / Tasks__c)"),
    ),
)  # fmt: skip
TASK = ObjectSpec(
    api_name="Task__c",
    fields=(
        _f("Project__c", "MasterDetail", reference_to="Project__c"),
        _f("Status__c", "Picklist", picklist_values=("New", "Done")),
        _f("Hours__c", "Number", precision=8, scale=2),
        _f("Rate__c", "Currency", precision=8, scale=2),
        _f("Cost__c", "Currency", scale=2, formula="Hours__c * Rate__c"),
        _f("Due__c", "Date"),
    ),
)


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f}"


def run(url: str, children: int, parents: int) -> None:
    engine = make_engine(url)
    dialect = engine.dialect.name
    md = sa.MetaData()
    project = catalog.object_table(PROJECT, dialect, md)
    task = catalog.object_table(TASK, dialect, md)
    sa.Index("ix_Task_Project", task.c.Project__c)
    stored = sa.Table(
        "Project_Stored",
        md,
        sa.Column("Id", sa.String(36), primary_key=True),
        sa.Column("Done__c", sa.Integer),
        sa.Column("Tasks__c", sa.Integer),
        sa.Column("Cost__c", sa.Numeric(18, 2)),
        sa.Column("First_Due__c", sa.Date),
    )
    md.create_all(engine)
    context = catalog.spec_context([PROJECT, TASK], dialect)
    with engine.begin() as conn:
        for spec, table in ((PROJECT, project), (TASK, task)):
            select, problems = build_view_select(spec, table, dialect, context)
            assert not problems, problems
            conn.execute(CreateView(view_name(spec.api_name), select))
    rnd = random.Random(7)
    ids = [f"p{i}" for i in range(parents)]
    with engine.begin() as conn:
        conn.execute(project.insert(), [{"Id": p, "Name": p, "IsDeleted": False} for p in ids])
        conn.execute(stored.insert(), [{"Id": p} for p in ids])
        batch = []
        for i in range(children):
            batch.append({
                "Id": f"t{i}", "Name": f"t{i}", "IsDeleted": False,
                "Project__c": rnd.choice(ids), "Status__c": rnd.choice(("New", "Done")),
                "Hours__c": rnd.randint(1, 40), "Rate__c": rnd.randint(10, 200),
                "Due__c": date(2024, 1, 1) + timedelta(days=rnd.randint(0, 700)),
            })  # fmt: skip
            if len(batch) == 5000:
                conn.execute(task.insert(), batch)
                batch = []
        if batch:
            conn.execute(task.insert(), batch)
    view = sa.table(view_name("Project__c"), sa.column("Id"))
    with engine.connect() as conn:
        start = time.perf_counter()
        rows = conn.execute(sa.select(sa.text("*")).select_from(view)).all()
        view_all = time.perf_counter() - start
        assert len(rows) == parents
        one = []
        for p in rnd.sample(ids, 50):
            start = time.perf_counter()
            conn.execute(sa.select(sa.text("*")).select_from(view).where(view.c.Id == p)).one()
            one.append(time.perf_counter() - start)
    recount = (
        sa.update(stored)
        .where(stored.c.Id == sa.bindparam("pid"))
        .values(
            Tasks__c=sa.select(sa.func.count()).where(task.c.Project__c == stored.c.Id)
            .scalar_subquery(),
            Done__c=sa.select(sa.func.count())
            .where(task.c.Project__c == stored.c.Id, task.c.Status__c == "Done")
            .scalar_subquery(),
            Cost__c=sa.select(sa.func.coalesce(sa.func.sum(task.c.Hours__c * task.c.Rate__c), 0))
            .where(task.c.Project__c == stored.c.Id)
            .scalar_subquery(),
            First_Due__c=sa.select(sa.func.min(task.c.Due__c))
            .where(task.c.Project__c == stored.c.Id)
            .scalar_subquery(),
        )
    )  # fmt: skip
    upkeep = []
    for i in range(200):
        pid = rnd.choice(ids)
        start = time.perf_counter()
        with engine.begin() as conn:
            conn.execute(task.insert(), [{"Id": f"x{i}", "Name": "x", "IsDeleted": False,
                                          "Project__c": pid, "Status__c": "Done",
                                          "Hours__c": 1, "Rate__c": 1}])  # fmt: skip
            conn.execute(recount, {"pid": pid})
        upkeep.append(time.perf_counter() - start)
    plain = []
    for i in range(200):
        start = time.perf_counter()
        with engine.begin() as conn:
            conn.execute(task.insert(), [{"Id": f"y{i}", "Name": "y", "IsDeleted": False,
                                          "Project__c": rnd.choice(ids), "Status__c": "New",
                                          "Hours__c": 1, "Rate__c": 1}])  # fmt: skip
        plain.append(time.perf_counter() - start)
    with engine.connect() as conn:
        start = time.perf_counter()
        conn.execute(sa.select(stored)).all()
        stored_read = time.perf_counter() - start
    backend = make_url(url).get_backend_name()
    print(
        f"{backend}: {children} children / {parents} parents: view all {_ms(view_all)} ms, "
        f"view one {_ms(statistics.median(one))} ms, stored read {_ms(stored_read)} ms, "
        f"child write {_ms(statistics.median(plain))} ms plain vs "
        f"{_ms(statistics.median(upkeep))} ms with stored upkeep"
    )
    engine.dispose()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mysql-url", default=None)
    parser.add_argument("--children", type=int, default=100_000)
    parser.add_argument("--parents", type=int, default=1_000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        run(f"sqlite:///{Path(tmp) / 'bench.db'}", args.children, args.parents)
    if args.mysql_url:
        name = f"nexus_bench_{uuid.uuid4().hex[:8]}"
        admin = make_engine(args.mysql_url)
        with admin.begin() as conn:
            conn.execute(sa.text(f"CREATE DATABASE `{name}` CHARACTER SET utf8mb4"))
        try:
            run(make_url(args.mysql_url).set(database=name).render_as_string(False),
                args.children, args.parents)  # fmt: skip
        finally:
            with admin.begin() as conn:
                conn.execute(sa.text(f"DROP DATABASE `{name}`"))
            admin.dispose()


if __name__ == "__main__":
    main()
