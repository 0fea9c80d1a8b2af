"""A MariaDB database whose default character set is ``latin1`` (the upstream
default) still stores any text (issue 17 item 7): every table is created
utf8mb4, so an event with Japanese text and an emoji is applied and read back
unchanged."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text

from nexuscrm import catalog
from nexuscrm.connectors import queue
from nexuscrm.connectors.processor import Processor
from nexuscrm.connectors.routes import list_connector_packs
from nexuscrm.db.engine import make_engine
from nexuscrm.settings import Settings
from tests.builders import SF_SYNC, install, record_upsert
from tests.conftest import MYSQL_URL, fresh_database_url
from tests.faults.test_worker_kills import wide_pack

TEXT = "東京の顧客 🚀 Ünïcödé"


def mysql_settings(url: str) -> Settings:
    """Settings of a test's own MySQL-family database ``url`` (task queue of its own)."""
    return Settings(
        database_url=url,
        controlplane_task_queue=f"cp-{uuid.uuid4().hex[:8]}",
        env="development",
        NEXUS_DATABASE_ID=f"test-{uuid.uuid4().hex[:8]}",
    )


@pytest.fixture
def latin1_settings(tmp_path: Path) -> Iterator[Settings]:
    """A MariaDB database created with ``latin1`` as its default character set."""
    for url in fresh_database_url("mysql", tmp_path, character_set="latin1"):
        yield mysql_settings(url)


async def test_latin1_database_stores_any_text(temporal_env: Any, latin1_settings: Any) -> None:
    engine = make_engine(latin1_settings.database_url)
    with engine.connect() as conn:
        assert conn.execute(text("SELECT @@character_set_database")).scalar_one() == "latin1"
    await install(temporal_env, latin1_settings, [str(SF_SYNC)])
    catalog.CACHE.invalidate()
    with engine.connect() as conn:
        charsets = set(
            conn.execute(
                text(
                    "SELECT DISTINCT CCSA.character_set_name FROM information_schema.TABLES T "
                    "JOIN information_schema.COLLATION_CHARACTER_SET_APPLICABILITY CCSA "
                    "ON CCSA.collation_name = T.table_collation "
                    "WHERE T.table_schema = DATABASE() AND T.table_type = 'BASE TABLE'"
                )
            ).scalars()
        )
    assert charsets == {"utf8mb4"}
    (pack,) = list_connector_packs(engine)
    queue.enqueue(
        engine,
        [
            record_upsert(
                pack.install_id, pack.namespace, "Account", "jp1", {"Name": TEXT, "Phone": "1"}
            )
        ],
    )
    items = queue.claim(
        engine,
        queue.ClaimSpec(
            installed_pack_id=pack.install_id,
            queue_classes=(),
            batch_size=10,
            lease_owner="t",
            lease_seconds=60,
            max_processing_rows=10,
        ),
    )
    assert Processor(engine, flow_deadline=None).process(items).succeeded == 1
    with engine.connect() as conn:
        assert conn.execute(text("SELECT Name FROM Account")).scalar_one() == TEXT


COLLATIONS = [
    "utf8mb4_general_ci",
    "utf8mb4_unicode_ci",
    "utf8mb4_bin",
    "utf8mb4_0900_ai_ci",  # MySQL 8's default
    "utf8mb4_uca1400_ai_ci",  # MariaDB 11.4's default
]


@pytest.mark.slow
@pytest.mark.parametrize("collation", COLLATIONS)
async def test_all_corpus_projects_install_on_a_database_of_any_utf8mb4_collation(
    temporal_env: Any, tmp_path: Path, collation: str
) -> None:
    """All seven corpus projects, unedited, on one MariaDB database created with
    ``collation`` (issue 13 item 7). DreamHouse's views (an IMAGE formula mixes
    a cast number with column text) failed with 1267 'Illegal mix of
    collations' on a ``utf8mb4_unicode_ci`` database: the tables take the
    database's collation, connections speak it, and a number becomes text by
    ``CONCAT`` (MariaDB stores a view's ``CAST AS CHAR`` with utf8mb4's default
    collation), so column and expression collations agree whatever the
    database default. Every view is readable; a second ApplyAll writes
    nothing."""
    from tests.builders import install_whole_corpus

    if MYSQL_URL:
        admin = make_engine(MYSQL_URL)
        with admin.connect() as conn:
            known = conn.execute(text("SHOW COLLATION LIKE :c"), {"c": collation}).all()
        admin.dispose()
        if not known:  # MariaDB before 11.4 has no MySQL 8 collations
            pytest.skip(f"this server does not know {collation}")
    for url in fresh_database_url("mysql", tmp_path, collation=collation):
        views = await install_whole_corpus(temporal_env, mysql_settings(url))
        assert "v_Broker__c" in views and "v_Metadata_Driven_Trigger__mdt" in views


def collations(engine: Any) -> dict[str, set[str]]:
    """The collations in use in ``engine``'s database, from the server's catalog:
    ``tables`` (each base table's default), ``columns`` (text columns of base
    tables), ``views`` (text columns of views) and ``function`` (what
    ``nx_session_user()`` returns)."""
    with engine.connect() as conn:
        tables = set(
            conn.execute(
                text(
                    "SELECT DISTINCT TABLE_COLLATION FROM information_schema.TABLES "
                    "WHERE TABLE_SCHEMA = DATABASE() AND TABLE_TYPE = 'BASE TABLE'"
                )
            ).scalars()
        )
        by_kind: dict[str, set[str]] = {"BASE TABLE": set(), "VIEW": set()}
        for kind, collation in conn.execute(
            text(
                "SELECT DISTINCT T.TABLE_TYPE, C.COLLATION_NAME FROM information_schema.COLUMNS C "
                "JOIN information_schema.TABLES T ON T.TABLE_SCHEMA = C.TABLE_SCHEMA "
                "AND T.TABLE_NAME = C.TABLE_NAME WHERE C.TABLE_SCHEMA = DATABASE() "
                "AND C.COLLATION_NAME IS NOT NULL"
            )
        ):
            by_kind[kind].add(collation)
        function = set(
            conn.execute(
                text(
                    "SELECT COLLATION(nx_session_user()) FROM DUAL"
                    if conn.execute(
                        text(
                            "SELECT COUNT(*) FROM information_schema.ROUTINES "
                            "WHERE ROUTINE_SCHEMA = DATABASE() AND ROUTINE_NAME = 'nx_session_user'"
                        )
                    ).scalar_one()
                    else "SELECT NULL FROM DUAL WHERE 1 = 0"
                )
            ).scalars()
        )
    return {
        "tables": tables,
        "columns": by_kind["BASE TABLE"],
        "views": by_kind["VIEW"],
        "function": function,
    }


def users_own_table_joins_the_views(engine: Any, views: list[str]) -> None:
    """A platform team's own table, created with the database's defaults, joined on
    text to every view's ``Id`` and to the session function: no 1267 'Illegal mix of
    collations' (the statement is refused before any row is read)."""
    with engine.begin() as conn:
        conn.execute(text("CREATE TABLE team_notes (ref VARCHAR(64), note TEXT)"))
        conn.execute(text("INSERT INTO team_notes VALUES ('x', 'y')"))
    with engine.connect() as conn:
        for view in views:
            conn.execute(
                text(f"SELECT COUNT(*) FROM team_notes n JOIN `{view}` v ON v.Id = n.ref")
            ).scalar_one()
        conn.execute(
            text("SELECT COUNT(*) FROM team_notes WHERE ref = nx_session_user()")
        ).scalar_one()


def views_of(engine: Any) -> list[str]:
    """The database's views, from the server's catalog."""
    with engine.connect() as conn:
        return list(
            conn.execute(
                text(
                    "SELECT TABLE_NAME FROM information_schema.VIEWS "
                    "WHERE TABLE_SCHEMA = DATABASE() ORDER BY TABLE_NAME"
                )
            ).scalars()
        )


def skip_unless_known(collation: str) -> None:
    """Skip when this server does not know ``collation`` (MariaDB before 11.4 has no
    MySQL 8 collations; MySQL has no ``uca1400``)."""
    if not MYSQL_URL:
        return  # fresh_database_url skips
    admin = make_engine(MYSQL_URL)
    with admin.connect() as conn:
        known = conn.execute(text("SHOW COLLATION LIKE :c"), {"c": collation}).all()
    admin.dispose()
    if not known:
        pytest.skip(f"this server does not know {collation}")


@pytest.mark.parametrize("collation", [*COLLATIONS, "utf8mb4_unicode_520_ci"])
async def test_tables_views_and_sessions_follow_the_database_collation(
    temporal_env: Any, tmp_path: Path, collation: str
) -> None:
    """A database created with ``collation``: every table, text column, view column
    and the session function take it (not utf8mb4's default ``general_ci``), so a
    platform team's own table, created with the database's defaults, joins the
    views. Before, a ``utf8mb4_unicode_ci`` database got ``general_ci`` tables and
    such a join failed with 1267 'Illegal mix of collations'."""
    skip_unless_known(collation)
    pack = wide_pack(tmp_path / "app.yaml", objects=2, fields=3)
    for url in fresh_database_url("mysql", tmp_path, collation=collation):
        settings = mysql_settings(url)
        await install(temporal_env, settings, [str(SF_SYNC), str(pack)])
        engine = make_engine(url)
        found = collations(engine)
        assert found == {
            "tables": {collation},
            "columns": {collation},
            "views": {collation},
            "function": {collation},
        }, found
        views = views_of(engine)
        assert "v_Account" in views and "v_Kill000__c" in views, views
        users_own_table_joins_the_views(engine, views)
        engine.dispose()


async def test_an_earlier_install_keeps_its_collation_when_the_database_default_differs(
    temporal_env: Any, tmp_path: Path
) -> None:
    """An install made before tables followed the database (``general_ci`` tables in a
    database whose default is now ``utf8mb4_unicode_ci``, as the old rule left it):
    the next ApplyAll, which creates new object tables and rebuilds the views,
    creates them ``general_ci`` like the install's ``_System_Object``, so the
    install's own tables and views never mix collations, and the team's tables of
    that collation join them."""
    pack = wide_pack(tmp_path / "app.yaml", objects=2, fields=3)
    for url in fresh_database_url("mysql", tmp_path, collation="utf8mb4_general_ci"):
        settings = mysql_settings(url)
        await install(temporal_env, settings, [str(SF_SYNC)])
        engine = make_engine(url)
        with engine.begin() as conn:
            name = conn.execute(text("SELECT DATABASE()")).scalar_one()
            conn.execute(text(f"ALTER DATABASE `{name}` COLLATE utf8mb4_unicode_ci"))
        engine.dispose()
        catalog.CACHE.invalidate()
        await install(temporal_env, settings, [str(SF_SYNC), str(pack)])
        engine = make_engine(url)
        with engine.connect() as conn:
            assert conn.execute(text("SELECT @@collation_database")).scalar_one() == (
                "utf8mb4_unicode_ci"
            )
        found = collations(engine)
        assert found["tables"] == found["columns"] == {"utf8mb4_general_ci"}, found
        assert found["views"] <= {"utf8mb4_general_ci"}, found
        views = views_of(engine)
        assert "v_Kill000__c" in views, views
        with engine.begin() as conn:  # the team's table, of the install's collation
            conn.execute(
                text("CREATE TABLE team_notes (ref VARCHAR(64) COLLATE utf8mb4_general_ci)")
            )
        with engine.connect() as conn:
            for view in views:
                conn.execute(
                    text(f"SELECT COUNT(*) FROM team_notes n JOIN `{view}` v ON v.Id = n.ref")
                ).scalar_one()
        engine.dispose()


def test_the_install_collation_rule() -> None:
    """:func:`nexuscrm.db.ddl.choose_collation`: the install's own first, then the
    database's when it is utf8mb4, then utf8mb4's default; nothing that is not a
    utf8mb4 collation name (it goes into SQL)."""
    from nexuscrm.db.ddl import choose_collation

    gen, uni = "utf8mb4_general_ci", "utf8mb4_unicode_ci"
    assert choose_collation(gen, "utf8mb4", uni, gen) == gen
    assert choose_collation(None, "utf8mb4", uni, gen) == uni
    assert choose_collation(None, "latin1", "latin1_swedish_ci", gen) == gen
    assert choose_collation("latin1_swedish_ci", "latin1", "latin1_swedish_ci", gen) == gen
    assert choose_collation(None, "utf8mb4", "utf8mb4_bin; DROP TABLE x", None) is None
    assert choose_collation(None, None, None, None) is None
