"""Temporal activities: thin adapters from workflow calls to ``nexuscrm.*``."""
