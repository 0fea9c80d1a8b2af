"""Formula syntax: the LALR grammar, the AST it produces, and reference walking.

Precedence, lowest to highest (every binary level is left-associative):

====  =========================================
1     ``||``
2     ``&&``
3     ``= == != <> < <= > >=``
4     ``+ - &``
5     ``* /``
6     ``^``  (left to right: ``2 ^ 3 ^ 2`` is 64)
7     unary ``-``, ``+`` and ``!`` (NOT)  (``-2 ^ 2`` is 4)
====  =========================================

Salesforce's help only says formulas use "standard operator precedence"; this
table is the one ``sformula`` (a Salesforce-compatible evaluator checked
against real orgs) uses, with ``^`` above ``*``/``/`` as mathematics and the
documentation expect.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lark import Lark, Token, Transformer, v_args
from lark.exceptions import (
    UnexpectedCharacters,
    UnexpectedEOF,
    UnexpectedInput,
    UnexpectedToken,
    VisitError,
)

GRAMMAR = r"""
?start: expr

?expr: or_expr

?or_expr: and_expr
        | or_expr OR_OP and_expr          -> binop

?and_expr: cmp_expr
         | and_expr AND_OP cmp_expr       -> binop

?cmp_expr: add_expr
         | cmp_expr CMP_OP add_expr       -> binop

?add_expr: mul_expr
         | add_expr ADD_OP mul_expr       -> binop

?mul_expr: pow_expr
         | mul_expr MUL_OP pow_expr       -> binop

?pow_expr: unary
         | pow_expr POW_OP unary          -> binop

?unary: atom
      | ADD_OP unary                      -> unop
      | NOT_OP unary                      -> unop

?atom: NUMBER                             -> number
     | STRING                             -> string
     | NAME "(" [expr ("," expr)*] ")"    -> call
     | NAME ("." NAME)*                   -> ref
     | "(" expr ")"

NOT_OP: "!"
OR_OP: "||"
AND_OP: "&&"
CMP_OP: /==|!=|<>|<=|>=|=|<|>/
ADD_OP: /[+\-&]/
MUL_OP: /[*\/]/
POW_OP: "^"
NUMBER: /(\d+(\.\d*)?|\.\d+)/
STRING: /'(\\.|[^'\\])*'/ | /"(\\.|[^"\\])*"/
NAME: /[A-Za-z_$][A-Za-z0-9_$]*(:[A-Za-z_][A-Za-z0-9_]*)?/
COMMENT: /\/\*(.|\n)*?\*\//

%import common.WS
%ignore WS
%ignore COMMENT
"""

_PARSER = Lark(GRAMMAR, parser="lalr", maybe_placeholders=False)

_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\", "'": "'", '"': '"'}


class FormulaSyntaxError(ValueError):
    """The formula text does not parse; the message says where and why."""


# --- AST -----------------------------------------------------------------


@dataclass(frozen=True)
class Num:
    """A number literal, kept as its source digits so no float rounding creeps in."""

    text: str


@dataclass(frozen=True)
class Str:
    """A string literal (escapes already resolved)."""

    value: str


@dataclass(frozen=True)
class Bool:
    """``TRUE`` / ``FALSE``."""

    value: bool


@dataclass(frozen=True)
class Null:
    """``NULL``."""


@dataclass(frozen=True)
class Ref:
    """A field reference; more than one part means a dotted (cross-object) path."""

    parts: tuple[str, ...]

    @property
    def dotted(self) -> str:
        """The reference as written, parts joined by dots."""
        return ".".join(self.parts)


@dataclass(frozen=True)
class Call:
    """A function call; ``name`` is upper-cased (function names are case-insensitive)."""

    name: str
    args: tuple[Node, ...]


@dataclass(frozen=True)
class BinOp:
    """A binary operator application; ``op`` is the operator's source text."""

    op: str
    left: Node
    right: Node


@dataclass(frozen=True)
class UnOp:
    """Unary ``-`` or ``+``."""

    op: str
    operand: Node


Node = Num | Str | Bool | Null | Ref | Call | BinOp | UnOp


def _unescape(raw: str) -> str:
    body = raw[1:-1]
    out: list[str] = []
    i = 0
    while i < len(body):
        ch = body[i]
        if ch == "\\" and i + 1 < len(body):
            nxt = body[i + 1]
            # Unknown escapes keep the escaped character, as Salesforce does for \' and \".
            out.append(_ESCAPES.get(nxt, nxt))
            i += 2
            continue
        out.append(ch)
        i += 1
    return "".join(out)


@v_args(inline=True)
class _ToAst(Transformer[Token, Node]):
    def number(self, tok: Token) -> Node:
        text = str(tok)
        if text.startswith("."):
            text = "0" + text
        if text.endswith("."):
            text = text[:-1]
        return Num(text)

    def string(self, tok: Token) -> Node:
        return Str(_unescape(str(tok)))

    def call(self, name: Token, *args: Node) -> Node:
        return Call(str(name).upper(), tuple(args))

    def ref(self, *parts: Token) -> Node:
        if len(parts) == 1:
            word = str(parts[0]).upper()
            if word in ("TRUE", "FALSE"):
                return Bool(word == "TRUE")
            if word == "NULL":
                return Null()
        return Ref(tuple(str(p) for p in parts))

    def binop(self, left: Node, op: Token, right: Node) -> Node:
        return BinOp(str(op), left, right)

    def unop(self, op: Token, operand: Node) -> Node:
        return UnOp(str(op), operand)


def parse(text: str) -> Node:
    """Parse formula source into an AST.

    Raises ``FormulaSyntaxError`` with the line and column of the first problem,
    followed by the line of the formula and a caret under the position; or
    saying it is nested too deeply to read (the tree is built recursively).
    """
    try:
        tree: Any = _PARSER.parse(text)
    except UnexpectedInput as exc:
        raise FormulaSyntaxError(_describe(exc) + _caret(text, exc)) from None
    try:
        node: Node = _ToAst().transform(tree)
    except RecursionError:
        raise FormulaSyntaxError(TOO_DEEP) from None
    except VisitError as exc:  # lark wraps what a rule callback raised
        if isinstance(exc.orig_exc, RecursionError):
            raise FormulaSyntaxError(TOO_DEEP) from None
        raise
    return node


TOO_DEEP = "the formula is nested too deeply to read"


def _caret(text: str, exc: UnexpectedInput) -> str:
    """The formula line at fault and a caret under the column (end of text at EOF)."""
    lines = text.split("\n") or [""]
    line = getattr(exc, "line", -1)
    column = getattr(exc, "column", -1)
    token = getattr(exc, "token", None)
    if isinstance(exc, UnexpectedEOF) or (token is not None and token.type == "$END") or line < 1:
        line, column = len(lines), len(lines[-1]) + 1
    shown = lines[line - 1].replace("\t", " ")
    return "\n  " + shown + "\n  " + " " * (column - 1) + "^"


def _describe(exc: UnexpectedInput) -> str:
    where = f"line {exc.line}, column {exc.column}"
    if isinstance(exc, UnexpectedEOF):
        return "syntax error: the formula ends too early"
    if isinstance(exc, UnexpectedToken):
        if exc.token.type == "$END":
            return "syntax error: the formula ends too early"
        return f"syntax error at {where}: unexpected {str(exc.token)!r}"
    if isinstance(exc, UnexpectedCharacters):
        return f"syntax error at {where}: unexpected character {exc.char!r}"
    return f"syntax error at {where}"


def walk(node: Node) -> list[Node]:
    """Every node of the tree, parents before children (iterative: no recursion limit)."""
    out: list[Node] = []
    stack: list[Node] = [node]
    while stack:
        cur = stack.pop()
        out.append(cur)
        if isinstance(cur, Call):
            stack.extend(reversed(cur.args))
        elif isinstance(cur, BinOp):
            stack.extend((cur.right, cur.left))
        elif isinstance(cur, UnOp):
            stack.append(cur.operand)
    return out


def references(node: Node) -> list[Ref]:
    """Field references in source order (duplicates kept)."""
    return [n for n in walk(node) if isinstance(n, Ref)]
