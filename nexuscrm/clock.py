"""UTC clock helpers (one place, so tests and phases agree on time zones)."""

from __future__ import annotations

from datetime import UTC, datetime


def utcnow() -> datetime:
    """Naive UTC ``datetime`` with whole seconds (what the DATETIME columns store)."""
    return datetime.now(UTC).replace(tzinfo=None, microsecond=0)
