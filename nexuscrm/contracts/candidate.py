"""The exact candidate a deploy pipeline pins: pack sources with their digests.

Wire format (a field of ``ApplyAllInput``); no ``from __future__ import
annotations`` (see ``nexuscrm.contracts.controlplane``).
"""

from dataclasses import dataclass, field


@dataclass
class CandidatePack:
    """One pack of the candidate.

    name: the pack's name (``name:`` of its manifest, or the SFDX project's).
    digest: its payload hash (sha256 hex of the canonical payload, the
      ``PayloadHash`` of ``_System_InstalledPack``).
    source: the pack source on the worker's machine (an app pack); empty for
      a pack the release ships (platform packs) or one already installed.
    """

    name: str
    digest: str
    source: str = ""


@dataclass
class CandidateSpec:
    """The whole target of an ApplyAll: every pack it serves, each with its digest."""

    packs: list[CandidatePack] = field(default_factory=list)
