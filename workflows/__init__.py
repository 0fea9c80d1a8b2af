"""Temporal workflows: deterministic, no I/O; phases run as activities."""
