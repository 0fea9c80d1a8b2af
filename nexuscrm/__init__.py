"""NexusCRM domain core: metadata, packs, formulas, control-plane phases.

Nothing under this package imports temporalio; workflows and activities adapt it.
"""
