"""The lessons' recorded computations (fa_lab.lab.recorded, made by
benchmarks/lesson_records.py): each record holds what its function computes now at the
lesson's sizes (part of its grid recomputed: every grid point is computed on its own), the
lessons read a record only at the sizes it was made for, and the store round-trips."""

import math

import pandas as pd
import pytest

for _extra in ("plotly", "ipywidgets", "anywidget"):  # fa_lab.lab needs the [lab] extra
    pytest.importorskip(_extra, reason="fa_lab.lab needs the [lab] extra")

from fa_lab import results  # noqa: E402
from fa_lab.lab import recorded  # noqa: E402
from fa_lab.lab.recorded import LESSON_PARAMS  # noqa: E402


def _stored(name):
    rec = results.reference(name)
    assert rec["params"] == recorded._plain(LESSON_PARAMS[name])     # made at the lesson's sizes
    assert rec["provenance"]["git_commit"] and rec["provenance"]["date"]
    return recorded.from_json(rec["tables"])


def _same(now: pd.DataFrame, stored: pd.DataFrame):
    """Every line of ``now`` is in ``stored``, with equal values (NaN equal to NaN)."""
    part = stored.loc[now.index, now.columns]
    pd.testing.assert_frame_equal(now, part, check_dtype=False, check_exact=True)


@pytest.mark.slow
def test_lesson02_sweep_holds_what_the_model_computes_now():
    stored = _stored("lesson02_sweep")
    now = recorded.compute("lesson02_sweep", **{**LESSON_PARAMS["lesson02_sweep"], "k_grid": (32,),
                                               "thr_grid": (8, 96), "kv_grid": (1024, 8192)})
    for key in ("grid", "by_kv", "rates"):
        _same(now[key], stored[key])
    assert len(stored["grid"]) == 4 * 5 * 2 and len(stored["rates"]) == 5


@pytest.mark.slow
def test_lesson02_fates_hold_what_the_model_computes_now():
    stored = _stored("lesson02_fates")["fates"]
    now = recorded.compute("lesson02_fates", **LESSON_PARAMS["lesson02_fates"])["fates"]
    # the LSE column's +-inf are stored as null; the fate column names them
    _same(now.drop(columns="LSE"), stored.drop(columns="LSE"))
    assert len(now) == len(stored)


@pytest.mark.slow
def test_lesson03_table_holds_what_the_model_computes_now():
    stored = _stored("lesson03_table")["table"]
    now = recorded.compute("lesson03_table", **{**LESSON_PARAMS["lesson03_table"],
                                               "k_scales": (5000,)})["table"]
    _same(now, stored)
    assert len(stored) == 3 * 6


@pytest.mark.slow
def test_lesson03_casts_hold_what_the_model_computes_now():
    stored = _stored("lesson03_casts")["casts"]
    now = recorded.compute("lesson03_casts", **{**LESSON_PARAMS["lesson03_casts"],
                                               "settings": ((9.0, 0.0),)})["casts"]
    _same(now, stored)


def test_a_record_is_read_only_at_its_own_sizes(monkeypatch):
    tables, source = recorded.recorded("lesson03_casts", **LESSON_PARAMS["lesson03_casts"])
    assert source.startswith("recorded on ") and len(tables["casts"]) == 6
    calls = []
    monkeypatch.setitem(recorded.RECORDS, "lesson03_casts",
                        lambda **kw: calls.append(kw) or {"casts": pd.DataFrame()})
    _, source = recorded.recorded("lesson03_casts", **{**LESSON_PARAMS["lesson03_casts"], "rows": 512})
    assert source == "computed now" and calls[-1]["rows"] == 512
    _, source = recorded.recorded("lesson03_casts", live=True, **LESSON_PARAMS["lesson03_casts"])
    assert source == "computed now" and len(calls) == 2


def test_tables_round_trip_with_nan_and_a_multi_index():
    df = pd.DataFrame({"k": [1, 1, 2], "v": ["a", "b", "a"], "x": [0.1, math.nan, 3.0],
                       "n": [1, 2, 3]}).set_index(["k", "v"])
    back = recorded.from_json(results._clean_value(recorded.to_json({"t": df})))["t"]
    pd.testing.assert_frame_equal(back, df)


def test_bad_names_are_refused():
    with pytest.raises(ValueError, match="name must be one of"):
        recorded.recorded("lesson99", rows=1)
    with pytest.raises(ValueError, match="name must be one of"):
        recorded.compute("nope")
