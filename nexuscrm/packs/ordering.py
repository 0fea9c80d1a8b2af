"""Apply order for a set of packs: category first, then dependencies.

Port of the ordering behind the seed's ``packs.AllPacks``: PlatformCore packs
apply first and DevSample last (:attr:`Category.rank`); within a category a
pack applies after the packs it depends on, ties broken by name, so the order
is the same on every run and machine.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

from nexuscrm.errors import PackError
from nexuscrm.packs.model import PackManifest


def _where(pack: PackManifest) -> str:
    return pack.source or "(no source)"


def _find_cycle(by_name: dict[str, PackManifest]) -> list[str] | None:
    """Return one dependency cycle as a path ``[a, b, ..., a]``, or None.

    Deterministic: nodes and their dependencies are visited in name order.
    """
    white, grey, black = 0, 1, 2
    colour = dict.fromkeys(by_name, white)
    stack: list[str] = []

    def visit(name: str) -> list[str] | None:
        colour[name] = grey
        stack.append(name)
        for dep in sorted(set(by_name[name].depends_on)):
            if colour[dep] == grey:
                return [*stack[stack.index(dep) :], dep]
            if colour[dep] == white:
                found = visit(dep)
                if found:
                    return found
        stack.pop()
        colour[name] = black
        return None

    for name in sorted(by_name):
        if colour[name] == white:
            found = visit(name)
            if found:
                return found
    return None


def order_packs(packs: Sequence[PackManifest]) -> list[PackManifest]:
    """Return ``packs`` in apply order (a new list; the input is not changed).

    Order: :attr:`Category.rank` first; within a category, every pack after
    the packs it depends on; among packs that are free to go, by name.

    Raises:
        PackError: two packs share a name (both sources named); a pack depends
            on a pack that is not in ``packs``; a pack depends on a pack of a
            later category; or the dependencies form a cycle (message gives the
            path, e.g. ``a -> b -> a``).
    """
    by_name: dict[str, PackManifest] = {}
    for pack in packs:
        prior = by_name.get(pack.name)
        if prior is not None:
            raise PackError(
                pack.name,
                f"declared twice (sources: {_where(prior)} and {_where(pack)})",
            )
        by_name[pack.name] = pack

    for pack in sorted(by_name.values(), key=lambda p: p.name):
        for dep in sorted(set(pack.depends_on)):
            target = by_name.get(dep)
            if target is None:
                available = ", ".join(sorted(by_name)) or "none"
                raise PackError(
                    pack.name,
                    f"depends on {dep}, which is not among the packs being ordered "
                    f"(available: {available})",
                )
            if target.category.rank > pack.category.rank:
                raise PackError(
                    pack.name,
                    f"category {pack.category} cannot depend on {dep} (category "
                    f"{target.category}): a pack may depend only on packs of its own "
                    "or an earlier category",
                )

    cycle = _find_cycle(by_name)
    if cycle is not None:
        raise PackError(cycle[0], f"dependency cycle: {' -> '.join(cycle)}")

    # Kahn's algorithm keyed by (category rank, name). Dependencies never point
    # to a later category, so this yields whole categories in rank order.
    waiting = {name: set(p.depends_on) for name, p in by_name.items()}
    dependents: dict[str, list[str]] = {name: [] for name in by_name}
    for name, deps in waiting.items():
        for dep in deps:
            dependents[dep].append(name)
    ready = [(by_name[n].category.rank, n) for n, deps in waiting.items() if not deps]
    heapq.heapify(ready)
    ordered: list[PackManifest] = []
    while ready:
        _rank, name = heapq.heappop(ready)
        ordered.append(by_name[name])
        for child in dependents[name]:
            waiting[child].discard(name)
            if not waiting[child]:
                heapq.heappush(ready, (by_name[child].category.rank, child))
    if len(ordered) != len(by_name):  # pragma: no cover - excluded by the cycle check
        stuck = sorted(set(by_name) - {p.name for p in ordered})
        raise PackError(stuck[0], f"unresolvable dependencies among {', '.join(stuck)}")
    return ordered
