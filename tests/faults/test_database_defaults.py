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


COLLATIONS = ["utf8mb4_general_ci", "utf8mb4_unicode_ci", "utf8mb4_bin", "utf8mb4_0900_ai_ci"]


@pytest.mark.slow
@pytest.mark.parametrize("collation", COLLATIONS)
async def test_all_corpus_projects_install_on_a_database_of_any_utf8mb4_collation(
    temporal_env: Any, tmp_path: Path, collation: str
) -> None:
    """All seven corpus projects, unedited, on one MariaDB database created with
    ``collation`` (issue 13 item 7). DreamHouse's views (an IMAGE formula mixes
    a cast number with column text) failed with 1267 'Illegal mix of
    collations' on a ``utf8mb4_unicode_ci`` database: tables now carry utf8mb4
    explicitly, so column and expression collations agree whatever the
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
