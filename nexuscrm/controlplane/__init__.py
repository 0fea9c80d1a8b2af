"""Control-plane phases (ports of the seed package ``controlplane``).

Each module holds one concern; activities call these functions and nothing
here knows about Temporal.
"""
