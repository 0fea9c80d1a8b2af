"""The platform packs the product ships (port of the seed's ``packs.AllPacks``).

They are native YAML manifests in ``nexuscrm/packs/platform/<pack>/pack.yaml``
(package data, so a non-editable install ships them too). Setting
``NEXUS_PACKS_DIR`` points the product at another folder of the same shape.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Final

from nexuscrm.errors import PackError, PackProblems, Problem, problem_from
from nexuscrm.packs.loader import find_native_manifest, load_native
from nexuscrm.packs.model import Category, PackManifest
from nexuscrm.packs.ordering import order_packs

PLATFORM_PACKS_DIR: Final = Path(__file__).resolve().parent / "platform"
# Connector packs shipped with the product; installed on request (``--app-pack``).
CONNECTOR_PACKS_DIR: Final = Path(__file__).resolve().parent / "connectors"
PACKS_DIR_ENV: Final = "NEXUS_PACKS_DIR"


def platform_packs_dir() -> Path:
    """The folder holding the platform packs: ``$NEXUS_PACKS_DIR`` when set and
    non-empty (user-expanded, resolved), else :data:`PLATFORM_PACKS_DIR`."""
    override = os.environ.get(PACKS_DIR_ENV, "").strip()
    if override:
        return Path(override).expanduser().resolve()
    return PLATFORM_PACKS_DIR


def platform_packs(include_dev_sample: bool) -> list[PackManifest]:
    """Load every pack folder under :func:`platform_packs_dir`, in apply order.

    Each sub-folder (hidden and ``_``-prefixed ones are skipped) must hold one
    native manifest (``pack.yaml``) whose ``name`` equals the folder name.
    DevSample packs are included only when ``include_dev_sample`` is true.
    Packs loaded from the shipped folder get ``source="builtin:<name>"``; from
    an override folder, the manifest path.

    Returns the packs ordered by :func:`order_packs`.

    Raises:
        PackError: the folder is missing or is a file (naming
            ``NEXUS_PACKS_DIR`` when it came from there).
        PackProblems: every problem at once: a sub-folder without a manifest,
            a manifest that does not load (see :func:`load_native`) or whose
            name differs from its folder, or ordering (:func:`order_packs`).
    """
    root = platform_packs_dir()
    shipped = root == PLATFORM_PACKS_DIR
    if not root.is_dir():
        what = "is a file, not a folder" if root.exists() else "does not exist"
        where = "" if shipped else f"{PACKS_DIR_ENV}: "
        raise PackError(str(root), f"{where}platform packs folder {what}")
    packs: list[PackManifest] = []
    problems: list[Problem] = []
    for folder in sorted(p for p in root.iterdir() if p.is_dir()):
        if folder.name.startswith((".", "_")):
            continue
        manifest_path = find_native_manifest(folder)
        if manifest_path is None:
            problems.append(Problem(str(folder), "", "pack folder has no pack.yaml"))
            continue
        try:
            pack = load_native(manifest_path)
        except PackProblems as exc:
            problems.extend(exc.problems)
            continue
        except PackError as exc:
            problems.append(problem_from(exc))
            continue
        if pack.name != folder.name:
            problems.append(
                Problem(
                    str(manifest_path),
                    "name",
                    f"pack name {pack.name!r} differs from its folder name",
                )
            )
            continue
        if pack.category == Category.DevSample and not include_dev_sample:
            continue
        if shipped:
            pack = pack.model_copy(update={"source": f"builtin:{pack.name}"})
        packs.append(pack)
    if problems:
        raise PackProblems(str(root), problems)
    return order_packs(packs)
