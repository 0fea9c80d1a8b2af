"""Connector inbound runtime: work queue, routes, flows, knobs, serving selection."""
