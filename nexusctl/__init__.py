"""The ``nexusctl`` application: Temporal client helpers, worker, dev stack, CLI.

Kept apart from ``nexuscrm`` (the domain core never imports temporalio).
"""
