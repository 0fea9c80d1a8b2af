"""Apply order for a set of packs: category first, then dependencies.

Port of the ordering behind the seed's ``packs.AllPacks``: PlatformCore packs
apply first and DevSample last (:attr:`Category.rank`); within a category a
pack applies after the packs it depends on, ties broken by name, so the order
is the same on every run and machine.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

from nexuscrm.errors import PackProblems, Problem
from nexuscrm.packs.model import PackManifest


def _where(pack: PackManifest) -> str:
    return pack.source or "(no source)"


def _file(pack: PackManifest) -> str:
    """The file a problem of ``pack`` names: its source path, else ``pack <name>``."""
    src = pack.source
    return src if src and not src.startswith("stored:") else f"pack {pack.name}"


def _find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """Return one dependency cycle as a path ``[a, b, ..., a]``, or None.

    ``edges`` maps each pack to the packs it depends on (all present).
    Deterministic: nodes and their dependencies are visited in name order.
    """
    white, grey, black = 0, 1, 2
    colour = dict.fromkeys(edges, white)
    stack: list[str] = []

    def visit(name: str) -> list[str] | None:
        colour[name] = grey
        stack.append(name)
        for dep in sorted(edges[name]):
            if colour[dep] == grey:
                return [*stack[stack.index(dep) :], dep]
            if colour[dep] == white:
                found = visit(dep)
                if found:
                    return found
        stack.pop()
        colour[name] = black
        return None

    for name in sorted(edges):
        if colour[name] == white:
            found = visit(name)
            if found:
                return found
    return None


def plan_order(packs: Sequence[PackManifest]) -> tuple[list[PackManifest], list[Problem]]:
    """Apply order of ``packs`` and every ordering problem, found all at once.

    Returns ``(ordered, problems)``. ``problems`` lists, each naming the pack's
    file (or ``pack <name>``) and the element ``depends_on``: a name declared
    twice (both sources; the first is kept), a dependency that is not among
    ``packs``, a dependency on a pack of a later category, and each dependency
    cycle (its path, e.g. ``a -> b -> a``). ``ordered`` is a best-effort order
    that ignores the faulty edges, so the plan's other checks can still run
    and report their problems beside these; apply it only when ``problems``
    is empty.
    """
    by_name: dict[str, PackManifest] = {}
    problems: list[Problem] = []
    for pack in packs:
        prior = by_name.get(pack.name)
        if prior is not None:
            problems.append(
                Problem(
                    _file(pack),
                    "name",
                    f"pack {pack.name} declared twice (sources: {_where(prior)} and "
                    f"{_where(pack)})",
                )
            )
            continue
        by_name[pack.name] = pack

    edges: dict[str, set[str]] = {}
    for pack in sorted(by_name.values(), key=lambda p: p.name):
        edges[pack.name] = set()
        for dep in sorted(set(pack.depends_on)):
            target = by_name.get(dep)
            if target is None:
                available = ", ".join(sorted(by_name)) or "none"
                problems.append(
                    Problem(
                        _file(pack),
                        "depends_on",
                        f"pack {pack.name} depends on {dep}, which is not among the packs "
                        f"being ordered (available: {available})",
                    )
                )
            elif target.category.rank > pack.category.rank:
                problems.append(
                    Problem(
                        _file(pack),
                        "depends_on",
                        f"pack {pack.name}: category {pack.category} cannot depend on {dep} "
                        f"(category {target.category}): a pack may depend only on packs of "
                        "its own or an earlier category",
                    )
                )
            else:
                edges[pack.name].add(dep)

    # Every cycle is reported; each is broken at its closing edge so the rest
    # of the graph still orders.
    while (cycle := _find_cycle(edges)) is not None:
        problems.append(
            Problem(
                _file(by_name[cycle[0]]),
                "depends_on",
                f"pack {cycle[0]}: dependency cycle: {' -> '.join(cycle)}",
            )
        )
        edges[cycle[-2]].discard(cycle[-1])

    # Kahn's algorithm keyed by (category rank, name). Kept edges never point
    # to a later category, so this yields whole categories in rank order.
    waiting = {name: set(deps) for name, deps in edges.items()}
    dependents: dict[str, list[str]] = {name: [] for name in edges}
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
    return ordered, problems


def order_packs(packs: Sequence[PackManifest]) -> list[PackManifest]:
    """Return ``packs`` in apply order (a new list; the input is not changed).

    Order: :attr:`Category.rank` first; within a category, every pack after
    the packs it depends on; among packs that are free to go, by name.

    Raises:
        PackProblems: every problem :func:`plan_order` finds at once (a name
            declared twice, a missing dependency, a dependency on a later
            category, each dependency cycle with its path ``a -> b -> a``).
    """
    ordered, problems = plan_order(packs)
    if problems:
        files = {p.file for p in problems}
        names = ", ".join(dict.fromkeys(p.name for p in packs if _file(p) in files))
        raise PackProblems(names or "plan", problems)
    return ordered
