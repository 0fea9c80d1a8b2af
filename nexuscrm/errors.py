"""Error classes shared by the domain core.

Activities translate these into Temporal failures: ``FatalError`` (and its
subclasses) become non-retryable ``ApplicationError``s, anything else is
retried with backoff as a transient fault.
"""

from __future__ import annotations

import re
from dataclasses import dataclass


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
        self.detail = message


class ManifestError(PackError):
    """A pack manifest or Salesforce DX file is malformed.

    The message names the file and element at fault.
    """


@dataclass(frozen=True)
class Problem:
    """One problem of a pack: the file (or pack) at fault, the element, the message.

    ``file`` is a path for a Salesforce DX / manifest file, else ``pack <name>``;
    ``element`` is an XML element (``<type>``), an ``Object.Field`` name, or "".
    """

    file: str
    element: str
    message: str

    def line(self) -> str:
        """``element: message`` (or just the message when there is no element)."""
        return f"{self.element}: {self.message}" if self.element else self.message


_ELEMENT_RE = re.compile(r"^((?:<[A-Za-z]+>)+)(?:\[\d+\])?:\s*")


def problem_from(exc: PackError) -> Problem:
    """A ``Problem`` from a ``PackError``: its pack/path is the file; a leading
    ``<element>:`` of its detail becomes the element."""
    detail = exc.detail
    m = _ELEMENT_RE.match(detail)
    if m:
        return Problem(exc.pack, m.group(1), detail[m.end() :])
    return Problem(exc.pack, "", detail)


def format_problems(problems: list[Problem]) -> str:
    """Every problem, grouped by file (files in first-seen order), one per line:

    ``<file>:`` then ``  - element: message`` lines.
    """
    groups: dict[str, list[Problem]] = {}
    for p in problems:
        groups.setdefault(p.file, []).append(p)
    out: list[str] = []
    for file, entries in groups.items():
        out.append(f"{file}:")
        out.extend(f"  - {p.line()}" for p in entries)
    return "\n".join(out)


class PackProblems(ManifestError):
    """Every problem found in one or more packs, collected instead of stopping at
    the first (loader, plan validation, ``import-sfdx``).

    ``problems`` holds (file, element, message) entries; ``str()`` starts with
    the count and lists them grouped by file (:func:`format_problems`).
    """

    def __init__(self, pack: str, problems: list[Problem], partial: object = None) -> None:
        # ``partial``: the PackManifest of what did load (or None), so the plan
        # can still be checked and its problems reported with these.
        self.partial = partial
        self.problems = list(problems)
        n = len(self.problems)
        files = len({p.file for p in self.problems})
        super().__init__(
            pack,
            f"{n} problem(s) in {files} file(s):\n{format_problems(self.problems)}",
        )


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
