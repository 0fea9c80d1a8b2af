"""SQL functions SQLite lacks, registered on every SQLite connection.

SQLite's built-in ``upper()``/``lower()`` fold ASCII only, and it has no
``reverse()``, ``initcap()`` or URL encoding; formula views call these ``nx_*`` functions
instead (MySQL/MariaDB use their own, Unicode-aware, functions).  A view that
uses them only works on connections made by :func:`nexuscrm.db.engine.make_engine`
(or any connection passed to :func:`install_sqlite_functions`).

Each function returns NULL for a NULL argument, as SQL functions do.
"""

from __future__ import annotations

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


SQLITE_FUNCTIONS.update(
    {
        "nx_upper": (1, _nx_upper),
        "nx_lower": (1, _nx_lower),
        "nx_reverse": (1, _nx_reverse),
        "nx_initcap": (1, _nx_initcap),
        "nx_urlencode": (1, _nx_urlencode),
    }
)


def install_sqlite_functions(dbapi_conn: Any) -> None:
    """Register :data:`SQLITE_FUNCTIONS` on a ``sqlite3`` connection (deterministic)."""
    for name, (nargs, impl) in SQLITE_FUNCTIONS.items():
        dbapi_conn.create_function(name, nargs, impl, deterministic=True)
