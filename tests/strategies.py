"""Hypothesis strategies the property tests share."""

from __future__ import annotations

from hypothesis import strategies as st


def json_values(max_size: int = 3, max_leaves: int = 8, max_text: int = 8):
    """Any JSON-shaped value: null, booleans, integers past 64 bits, any float (NaN too),
    short strings, and lists and objects of them."""
    scalars = st.one_of(
        st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(),
        st.text(max_size=max_text),
    )  # fmt: skip
    return st.recursive(
        scalars,
        lambda c: (
            st.lists(c, max_size=max_size)
            | st.dictionaries(st.text(max_size=8), c, max_size=max_size)
        ),
        max_leaves=max_leaves,
    )
