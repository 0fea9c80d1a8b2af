"""Error classes shared by the domain core.

Activities translate these into Temporal failures: ``FatalError`` (and its
subclasses) become non-retryable ``ApplicationError``s, anything else is
retried with backoff as a transient fault.
"""

from __future__ import annotations


class NexusError(Exception):
    """Base class for every error the domain core raises on purpose."""


class FatalError(NexusError):
    """A failure that retrying cannot fix (bad input, broken invariant)."""


class PackError(FatalError):
    """A pack cannot be loaded, ordered or applied.

    ``pack`` names the pack (or source path) so the operator can find it.
    """

    def __init__(self, pack: str, message: str) -> None:
        super().__init__(f"pack {pack}: {message}")
        self.pack = pack


class ManifestError(PackError):
    """A pack manifest or Salesforce DX file is malformed.

    The message names the file and element at fault.
    """


class LeaseLostError(FatalError):
    """A control-plane activity found a newer lease epoch than the one it holds.

    Raised by ``nexuscrm.controlplane.lease.require_lease``: the run that
    scheduled this activity was superseded (terminated, reset), so it must not
    write. Port of the seed's ``requireControlPlaneApplyLockScope`` fence.
    """


class VerifyError(FatalError):
    """Verify found drift; ``findings`` lists each one as a readable line."""

    def __init__(self, findings: list[str]) -> None:
        head = "; ".join(findings[:10])
        more = f" (+{len(findings) - 10} more)" if len(findings) > 10 else ""
        super().__init__(f"verify found {len(findings)} finding(s): {head}{more}")
        self.findings = findings


class RepairError(FatalError):
    """A fatal repair step failed, or the convergence-critical gate tripped."""
