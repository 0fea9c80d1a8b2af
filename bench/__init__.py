"""Benchmark scripts (run as scripts; a package only so they share ``bench.machine``)."""
