"""A MariaDB database whose default character set is ``latin1`` (the upstream
default) still stores any text (issue 17 item 7): every table is created
utf8mb4, so an event with Japanese text and an emoji is applied and read back
unchanged."""

from __future__ import annotations

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
from tests.conftest import fresh_database_url

TEXT = "東京の顧客 🚀 Ünïcödé"


@pytest.fixture
def latin1_settings(settings: Settings, tmp_path: Path) -> Iterator[Settings]:
    if not settings.database_url.startswith("mysql"):
        pytest.skip("a database default character set is a MySQL-family setting")
    for url in fresh_database_url("mysql", tmp_path, character_set="latin1"):
        yield settings.model_copy(update={"database_url": url})


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
