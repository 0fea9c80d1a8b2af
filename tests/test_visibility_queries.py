"""The server-list queries of a database's live pools and waits refuse an id they
cannot quote (they would otherwise list another database's, or fail to parse)."""

from __future__ import annotations

import pytest

from nexuscrm.contracts.visibility import running_supervisors_query, running_waits_query


@pytest.mark.parametrize("query", [running_supervisors_query, running_waits_query])
@pytest.mark.parametrize("database_id", ["", "a'b", "a\\b", 'a"b', "a\nb"])
def test_an_unquotable_database_id_gets_no_query(query, database_id):
    assert query(database_id) is None


def test_the_queries_name_the_database_and_only_running_executions():
    pools = running_supervisors_query("crm-prod")
    waits = running_waits_query("crm-prod")
    assert pools is not None and waits is not None
    assert "STARTS_WITH 'connector/crm-prod/'" in pools
    assert "WorkflowType = 'PackSupervisor'" in pools
    assert "NexusDatabase='crm-prod'" in waits
    assert all("ExecutionStatus" in q and "'Running'" in q for q in (pools, waits))
