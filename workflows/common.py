"""Constants shared by the connector workflows (fleet and pack supervisor)."""

from __future__ import annotations

from datetime import timedelta

# Wakes arriving within this window are forwarded as one.
WAKE_COALESCE = timedelta(milliseconds=200)
