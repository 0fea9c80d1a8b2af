"""SQL functions SQLite lacks, registered on every SQLite connection.

SQLite's built-in ``upper()``/``lower()`` fold ASCII only, and it has no
``reverse()``, ``initcap()`` or URL encoding; formula views call these ``nx_*`` functions
instead (MySQL/MariaDB use their own, Unicode-aware, functions).  A view that
uses them only works on connections made by :func:`nexuscrm.db.engine.make_engine`
(or any connection passed to :func:`install_sqlite_functions`).

Each function returns NULL for a NULL argument, as SQL functions do.
"""

from __future__ import annotations

import math
import re
from typing import Any
from urllib.parse import quote

#: name -> (number of arguments, implementation)
SQLITE_FUNCTIONS: dict[str, tuple[int, Any]] = {}


def _nx_upper(x: str | None) -> str | None:
    return None if x is None else str(x).upper()


def _nx_lower(x: str | None) -> str | None:
    return None if x is None else str(x).lower()


def _nx_urlencode(x: str | None) -> str | None:
    # RFC 3986: everything but ALPHA DIGIT - . _ ~ percent-encoded, as UTF-8 bytes.
    return None if x is None else quote(str(x), safe="-._~")


def _nx_reverse(x: str | None) -> str | None:
    return None if x is None else str(x)[::-1]


def initcap(x: str) -> str:
    """Lower-case ``x``, then upper-case the first letter of each word.

    A word starts at the beginning of the text or after a character that is
    not a letter or digit (Salesforce's INITCAP: "the first character of each
    word in uppercase").  MariaDB evaluates the same rule in SQL.
    """
    out: list[str] = []
    prev_alnum = False
    for ch in x.lower():
        out.append(ch.upper() if not prev_alnum else ch)
        prev_alnum = ch.isalnum()
    return "".join(out)


def _nx_initcap(x: str | None) -> str | None:
    return None if x is None else initcap(str(x))


def number_text(x: float | int) -> str:
    """A number as formula TEXT() prints it: whole numbers without ``.0``,
    others with 15 significant digits in fixed notation, trailing zeros cut."""
    if not math.isfinite(x):
        return str(x)
    if x == int(x):
        return str(int(x))
    magnitude = math.floor(math.log10(abs(x)))
    decimals = max(0, 14 - magnitude)
    return (f"%.{decimals}f" % x).rstrip("0").rstrip(".")


def _nx_number_text(x: float | int | None) -> str | None:
    # One call instead of an expression that repeats its argument five times:
    # a formula that prints a formula's number nests too deep for SQLite's parser.
    return None if x is None else number_text(x)


def _nx_decimal(x: float | int | None) -> float | int | None:
    # FLOOR / CEILING / TRUNC's argument as a decimal: 15 significant digits
    # (a double's exact decimal precision), so 28.999999999999996 is 29.
    if x is None or isinstance(x, int) or not math.isfinite(x):
        return x
    return float(f"{x:.15g}")


_NUMBER_TEXT = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)")


def _nx_text_number(x: str | None) -> float | None:
    # VALUE(): the number a text holds, NULL when blank or not a number.
    if x is None:
        return None
    t = str(x).strip(" ")
    return float(t) if _NUMBER_TEXT.fullmatch(t) else None


def _nx_text_number_invalid(x: str | None) -> int:
    # 1 when VALUE() of x is a runtime error: text that is not blank and not a number.
    if x is None:
        return 0
    t = str(x).strip(" ")
    return int(t != "" and not _NUMBER_TEXT.fullmatch(t))


SQLITE_FUNCTIONS.update(
    {
        "nx_text_number": (1, _nx_text_number),
        "nx_text_number_invalid": (1, _nx_text_number_invalid),
        "nx_number_text": (1, _nx_number_text),
        "nx_decimal": (1, _nx_decimal),
        "nx_upper": (1, _nx_upper),
        "nx_lower": (1, _nx_lower),
        "nx_reverse": (1, _nx_reverse),
        "nx_initcap": (1, _nx_initcap),
        "nx_urlencode": (1, _nx_urlencode),
    }
)


def install_sqlite_functions(dbapi_conn: Any) -> None:
    """Register :data:`SQLITE_FUNCTIONS` on a ``sqlite3`` connection (deterministic),
    and the connection's acting user: ``nx_session_user()`` returns what
    ``nx_set_session_user(x)`` last set on this connection (NULL at first),
    as ``@nexus_user_id`` does on MariaDB (see :mod:`nexuscrm.db.session`)."""
    for name, (nargs, impl) in SQLITE_FUNCTIONS.items():
        dbapi_conn.create_function(name, nargs, impl, deterministic=True)
    state: dict[str, str | None] = {"user": None}

    def session_user() -> str | None:
        return state["user"]

    def set_session_user(x: Any) -> str | None:
        state["user"] = None if x is None else str(x)
        return state["user"]

    dbapi_conn.create_function("nx_session_user", 0, session_user)
    dbapi_conn.create_function("nx_set_session_user", 1, set_session_user)
