"""Column sizes compared both ways by one rule (``nexuscrm.db.dialect.size_change``):
what ApplyAll widens in place and what a pack plan refuses as a shrink."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st
from sqlalchemy import Numeric, String, Text

from nexuscrm.db.dialect import size_change, widens

decimals = st.builds(lambda p, s: Numeric(p, min(s, p)), st.integers(1, 18), st.integers(0, 18))
texts = st.one_of(st.builds(String, st.integers(1, 65535)), st.just(Text()))


@given(st.one_of(st.tuples(decimals, decimals), st.tuples(texts, texts)))
def test_one_side_wider_is_the_other_side_narrower(pair):
    have, want = pair
    there, back = size_change(have, want), size_change(want, have)
    assert there in ("wider", "narrower", "same")
    if there == "wider":
        assert back == "narrower"
    if there == "same":
        assert back == "same"
    assert widens(have, want) == (there == "wider")


def test_examples_of_each_answer():
    assert size_change(String(10), String(100)) == "wider"
    assert size_change(String(100), Text()) == "wider"
    assert size_change(Text(), String(100)) == "narrower"
    assert size_change(Text(), Text()) == "same"
    assert size_change(Numeric(16, 2), Numeric(18, 2)) == "wider"
    assert size_change(Numeric(16, 2), Numeric(18, 4)) == "wider"
    # more decimals but fewer integer digits: some stored values would not fit
    assert size_change(Numeric(16, 2), Numeric(16, 4)) == "narrower"
    assert size_change(Numeric(16, 4), Numeric(16, 2)) == "narrower"
    # no common size: left alone
    assert size_change(String(10), Numeric(10, 2)) is None
    assert size_change(String(), String(10)) is None
