"""What a formula function is: its implementation and its argument counts."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from nexuscrm.packs.model import FieldSpec

from .values import Value

if TYPE_CHECKING:
    from .compiler import FormulaCompiler

FuncImpl = Callable[["FormulaCompiler", list[Value], FieldSpec], Value]


@dataclass
class Function:
    """One formula function: ``impl(compiler, args, scope)`` and its argument counts."""

    impl: FuncImpl
    min_args: int
    max_args: int | None  # None: unbounded


def arity(spec: Function) -> str:
    """``spec``'s argument count in words, for error messages."""
    lo, hi = spec.min_args, spec.max_args
    if hi is None:
        return f"at least {lo} argument{'s' if lo != 1 else ''}"
    if lo == hi:
        return f"{lo} argument{'s' if lo != 1 else ''}"
    return f"{lo} to {hi} arguments"
