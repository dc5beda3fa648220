"""The sentences of lesson 00 (notebooks/00_tour.ipynb), computed again: each test recomputes the
numbers its markdown states, on its own inputs (its CPU defaults), so that a change to the
package that makes a sentence false fails here. The lessons keep only the asserts that check
the learner (fa_lab.lab.exercises); tests/lab/claims/ holds one file per lesson."""

import pytest
import torch

for _extra in ("plotly", "ipywidgets", "anywidget"):  # fa_lab.lab needs the [lab] extra
    pytest.importorskip(_extra, reason="fa_lab.lab needs the [lab] extra")

import fa_lab  # noqa: E402
from fa_lab.lab import lessons  # noqa: E402
from fa_lab.studies import experiments  # noqa: E402

# ---- lesson 00: the repro and one row's story ----------------------------------------------

def _tour_inputs(k_scale=32, rows=None):
    q, k, v = experiments.bf16_inputs(1, 8192, 1, 128, k_scale, seed=0)
    return (q if rows is None else q[:, :rows].contiguous()), k, v


@pytest.mark.slow
@pytest.mark.parametrize("k_scale", [8, 16, 24, 32, 48, 64])
def test_00_the_repro_is_within_a_point_of_the_report(k_scale):
    """Section 1 and its "Try this": the bare call before the fix, on the tour's first 1024
    query rows against all 8192 keys, within a point of the report's NaN share at each of its
    K scales (none at 8 and 16); the eager switch and today's call finite. A block alone
    comes out as in the longer run (the tour runs 1024 rows and traces the first block)."""
    q, k, v = _tour_inputs(k_scale, rows=1024)
    report = {r["k_scale"]: r["lazy_unfixed_nan_pct"] for r in experiments.seed_table("bf16")["rows"]}
    with fa_lab.using_upstream("main-11c4174d"):
        before = fa_lab.flash_attn_func(q, k, v, causal=False)
        block = fa_lab.flash_attn_func(q[:, 256:512].contiguous(), k, v, causal=False)
    share = 100 * before.isnan().float().mean().item()
    assert abs(share - report[k_scale]) < 1
    assert (share == 0) == (k_scale <= 16)
    assert torch.equal(block.nan_to_num(7.0), before[:, 256:512].nan_to_num(7.0))
    if k_scale == 32:
        with fa_lab.using_upstream("main-11c4174d"):
            eager = fa_lab.flash_attn_func(q, k, v, causal=False, dualwave_swp_lazy_rescale=False)
        after = fa_lab.flash_attn_func(q, k, v, causal=False)
        assert torch.isfinite(eager).all() and torch.isfinite(after).all()


@pytest.mark.slow
def test_00_one_rows_story():
    """Section 2's table and text: before the fix the gap under the row's best score stays
    below 128 until the tile where l overflows; after it the base never moves down and lags
    by more than 1 and at most 8; the deepest dip of log2(l) is the tile's jump, and l is
    back near 2^0 one step later."""
    q, k, v = _tour_inputs()
    qb = q[:, :256].contiguous()
    with fa_lab.using_upstream("main-11c4174d"):
        before = fa_lab.flash_attn_func(qb, k, v, causal=False)
    rows_nan = before[0, :, 0].isnan().any(-1).nonzero().flatten().tolist()
    assert rows_nan
    traces = {name: fa_lab.trace(qb, k, v, rows=rows_nan, causal=False, rescale=rule)
              for name, rule in (("before", "lazy_unfixed"), ("after", "lazy"))}
    assert torch.equal(traces["before"].out.nan_to_num(7.0),
                       before[0, rows_nan, 0].float().nan_to_num(7.0))
    lag = lessons.with_deficit(traces["after"]).groupby("lane").deficit.max()
    lane = int(lag.idxmax())
    tb, ta = traces["before"].lane(lane), traces["after"].lane(lane)
    first = int(traces["before"].lanes.loc[lane, "first_nonfinite_step"])
    gap_b, gap_a = tb.mt.cummax() - tb.m, ta.mt.cummax() - ta.m
    assert (tb.m.diff() < 0)[:first + 1].sum() > 1                 # "again and again"
    assert gap_b[:first].max() < 128 <= gap_b[first] and not tb.l_finite[first]
    assert (ta.m.diff().dropna() >= 0).all() and 1 < gap_a.max() <= 8
    assert ta.o_finite.all() and ta.l_finite.all()
    dip = lessons.l_lag_dip(traces["after"], lane)
    jump = ta.m[dip["step"]] - ta.mt.cummax()[dip["step"] - 1]
    assert abs(dip["log2_l"] + jump) < 1 and abs(dip["log2_l_next"]) < 1
