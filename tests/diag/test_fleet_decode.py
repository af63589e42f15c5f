"""The fleet client's decoding of a reply: the same series, times and values as the single-target path's parser,
with the times of series on the same steps shared (read-only) rather than copied. Pure data, no server."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import numpy as np
import pytest

from diag.sources.fleet import _Grids, _lazy_matrix
from diag.sources.prometheus import _parse_matrix


def _reply() -> dict[str, Any]:
    rng = np.random.default_rng(7)
    series = []
    for i in range(12):
        scale = 10.0 ** rng.integers(-30, 30, 60)
        values = [[1_700_000_000 + 5 * k, repr(float(x))] for k, x in enumerate(rng.standard_normal(60) * scale)]
        series.append({"metric": {"__name__": "m", "i": str(i)}, "values": values})
    series[1]["values"][4][1] = "NaN"  # a gap: that point is dropped, the series keeps its other times
    series[2]["values"][5][1], series[2]["values"][6][1] = "+Inf", "-Inf"  # a quantile in the last bucket
    series[3]["values"] = [[t + 0.5, v] for t, v in series[3]["values"]]  # other steps
    series[4]["values"] = series[4]["values"][:20]
    series[5]["values"] = [[t, "NaN"] for t, _ in series[5]["values"]]  # nothing left: no series
    series.append({"metric": {"__name__": "odd"}, "values": [[1, "not a number"]]})  # left out, the rest loads
    return {"resultType": "matrix", "result": series}


def _raw(doc: dict[str, Any]) -> dict[str, msgspec.Raw]:
    return {key: msgspec.Raw(json.dumps(value).encode()) for key, value in doc.items()}


def test_the_same_series_as_the_single_path_parser() -> None:
    doc = _reply()
    old, new = _parse_matrix(json.loads(json.dumps(doc))), _lazy_matrix(_raw(doc))
    assert [r.labels for r in new] == [r.labels for r in old] and len(new) == 11
    for a, b in zip(old, new, strict=True):
        assert np.array_equal(a.ts, b.ts)
        assert np.array_equal(a.values, b.values)  # bit for bit: both parsers round correctly
    assert list(new[2].values[5:7]) == [np.inf, -np.inf]


def test_series_on_the_same_steps_share_one_read_only_time_array() -> None:
    grids = _Grids()
    first, second = _lazy_matrix(_raw(_reply()), grids), _lazy_matrix(_raw(_reply()), grids)
    full = [r for r in first + second if r.ts.size == 60 and r.ts[0] == 1_700_000_000]
    assert len(full) == 16 and len({id(r.ts) for r in full}) == 1  # across replies too
    assert len({id(r.ts) for r in first}) == 4  # the full grid, the one with a gap, the shifted and the short
    with pytest.raises(ValueError):
        full[0].ts[0] = 0.0
    assert not any(np.shares_memory(a.values, b.values) for a in full for b in full if a is not b)
