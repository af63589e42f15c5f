"""``stats.text_masks``: where each text of a column is, as ``values.astype(str) == text`` would say, for any mix of
objects (the same text from different objects, None, numbers) and for fixed-width text columns."""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from diag.rules.stats import text_masks

VALUES = st.one_of(st.sampled_from(["ok", "error", "rejected", "timeout"]), st.none(), st.integers(-3, 3), st.text(max_size=3))


@given(st.lists(VALUES, min_size=1, max_size=60))
def test_every_text_where_astype_str_puts_it(values: list[object]) -> None:
    column = np.empty(len(values), dtype=object)
    column[:] = values
    masks = text_masks(column)
    texts = column.astype(str)
    assert set(masks) == set(texts.tolist())
    for text, mask in masks.items():
        assert np.array_equal(mask, texts == text), text


def test_the_same_text_from_two_objects_is_one_mask_and_fixed_width_columns_work() -> None:
    column = np.array(["ok", 1, "1", None, "None"], dtype=object)
    assert {t: m.tolist() for t, m in text_masks(column).items()} == {
        "ok": [True, False, False, False, False],
        "1": [False, True, True, False, False],
        "None": [False, False, False, True, True],
    }
    fixed = np.array(["ok", "error", "ok"])
    assert {t: m.tolist() for t, m in text_masks(fixed).items()} == {"error": [False, True, False], "ok": [True, False, True]}
