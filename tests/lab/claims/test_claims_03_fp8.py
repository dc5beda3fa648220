"""The sentences of lesson 03 (notebooks/03_fp8.ipynb), computed again: each test recomputes the
numbers its markdown states, on its own inputs (its CPU defaults), so that a change to the
package that makes a sentence false fails here. The lessons keep only the asserts that check
the learner (fa_lab.lab.exercises); tests/lab/claims/ holds one file per lesson."""

import math

import pytest
import torch

for _extra in ("plotly", "ipywidgets", "anywidget"):  # fa_lab.lab needs the [lab] extra
    pytest.importorskip(_extra, reason="fa_lab.lab needs the [lab] extra")

from fa_lab.lab import lessons  # noqa: E402
from fa_lab.lab import recorded  # noqa: E402
from fa_lab.lab import solutions as sol  # noqa: E402
from fa_lab.studies import experiments  # noqa: E402

# ---- lesson 03, section 1: the fp8 helper ------------------------------------------------

@pytest.mark.slow
def test_03_the_fp8_helper_at_k5000():
    """Section 1: ls as the kernel rounds it, one log2 unit about 1300 raw units, the
    threshold in raw units, 96 steps of 128 keys, a score spread of about 50 natural-log
    units."""
    from fa_lab.kernels.swp_fp8 import model as swp_fp8
    from fa_lab.numerics import f32

    (q8, k8, v8), ds = lessons.Fp8Lesson("cpu").inputs(5000)
    qd, kd, _ = ds
    ls = swp_fp8.log2_scale(qd, kd)
    tr5 = lessons.trace_fp8((q8, k8, v8), ds, range(256), rescale="lazy_unfixed")
    nat = (q8[0, :, 0].float() * qd) @ (k8[0, :1024, 0].float() * kd).T / math.sqrt(128)
    assert ls == f32(f32(f32(f32(1 / math.sqrt(128)) * f32(math.log2(math.e))) * f32(qd)) * f32(kd))
    assert 1250 < 1 / ls < 1350 and abs(tr5.threshold_units * ls - 8.0) < 1e-6 * 8.0
    assert tr5.n_steps == 12288 // 128 == 96 and (tr5.lane(0).col0.diff().dropna() == 128).all()
    assert abs(nat.std().item() / 50 - 1) < 0.05


# ---- lesson 03, section 3: the fp8 branch of the bug -------------------------------------

def test_03_the_fp8_table_and_its_sentences():
    """Section 3's table at the lesson's CPU sizes, as the lesson reads it from its record
    (tests/lab/test_lesson_records.py checks the record against the model), against the
    sentences under it and the bug report's figures."""
    import json

    import pandas as pd

    st = recorded.recorded("lesson03_table", **recorded.LESSON_PARAMS["lesson03_table"])[0]["table"]
    h200 = pd.DataFrame(json.loads((experiments.REFERENCE_DIR / "seed_fp8_h200_sat.json").read_text())
                        ["rows"]).set_index(["variant", "k_scale"])
    n_report = lessons.seed_fp8_elements()
    unfixed_nan = st.loc["unfixed"].nan_frac
    rare = h200.loc[("bound 32", 20000), "nan"] / h200.loc[("bound 32", 20000), "elements"] \
        * st.loc[("bound 32", 20000), "elements"]
    assert unfixed_nan[1000] == 0 and unfixed_nan[5000] > 0.5 and unfixed_nan[20000] == 1
    assert abs(unfixed_nan[5000] - lessons.seed_fp8("lazy_unfixed", 5000, "nan") / n_report) < 0.05
    assert abs(h200.loc[("unfixed", 5000), "nan"] / lessons.seed_fp8("lazy_unfixed", 5000, "nan") - 1) < 0.02
    assert (st.loc[["bound 8", "bound 16", "monotonic", "eager"]].nan == 0).all()
    assert st.loc[("bound 32", 5000), "nan"] > 0 and st.loc[("bound 32", 1000), "nan"] == 0
    assert st.loc[("bound 32", 20000), "nan"] == 0 and rare < 5
    assert 1000 < lessons.seed_fp8("lazy_capped", 20000, "nan", 32) < 10_000 and 20e6 < n_report < 30e6
    assert 1000 < h200.loc[("bound 32", 20000), "nan"] < 10_000
    assert st.loc[("unfixed", 1000), "mean_abs_dev"] == st.loc[("bound 16", 1000), "mean_abs_dev"] \
        == st.loc[("bound 32", 1000), "mean_abs_dev"]
    assert st.loc[("unfixed", 5000), "mean_abs_dev"] == 0 and math.isnan(st.loc[("unfixed", 20000), "mean_abs_dev"])
    mono = st.loc[("monotonic", 1000), "mean_abs_dev"]
    assert mono > 3 * st.loc[[("bound 8", 1000), ("bound 16", 1000), ("eager", 1000)], "mean_abs_dev"].max()


# ---- lesson 03, section 4: why the fix costs accuracy -------------------------------------

@pytest.mark.slow
def test_03_where_the_e4m3_error_comes_from():
    from fa_lab.kernels.swp_fp8 import model as swp_fp8
    from fa_lab.numerics import e4m3, exp2, fma_f32

    rows = 256
    (q8, k8, v8), ds = lessons.Fp8Lesson("cpu", rows=rows).inputs(1000, 1)
    ls = swp_fp8.log2_scale(ds[0], ds[1])
    S = q8[0, :, 0].float() @ k8[0, :, 0].float().T
    parts = {name: lessons.e4m3_error_parts(S, ls, lessons.trace_fp8((q8, k8, v8), ds, range(rows),
                                                                     rescale=pol))
             for name, pol in (("unfixed", "lazy_unfixed"), ("monotonic", "lazy"), ("eager", "eager"))}
    u, mo, eg = parts["unfixed"], parts["monotonic"], parts["eager"]
    total = "o - 1 before rounding"
    assert u["pairs based at their own best key %"] > 95 > 20 > eg["pairs based at their own best key %"]
    s_top = S.gather(1, S.argmax(1, keepdim=True))[:, 0]
    expo = fma_f32(s_top, ls, 0.0 - ls * s_top)
    assert 0 < expo.abs().max() < 1e-5 and e4m3(exp2(expo)).eq(1).all()   # P = 1 + rounding -> 1
    assert u["largest term"] < 1e-6 and u["other pairs' largest terms"] < 1e-5
    assert 0.2 < eg["share of l in other pairs' maxima"] < 0.35            # "about a quarter"
    assert eg["other pairs' largest terms"] > 0.5 * eg[total]               # "most of eager's error"
    assert mo["largest term"] > 0.5 * mo[total]                             # "most of its error"
    assert 30 < mo[total] / u[total] < 120 and 10 < eg[total] / u[total] < 50
    assert u["rows not exactly 1"] == 1 and u["o - 1, bf16 output"] == 2.0 ** -8 / rows
    assert u[total] < 2.0 ** -9 / 10


# ---- lesson 03, section 5: the cap, by hand ---------------------------------------------

@pytest.mark.slow
def test_03_the_cap_by_hand():
    """Section 5's row built by hand: under bound 16 the victim is dragged at every pair after
    the first, each correction within the cap, their product past 2^128; the unfixed rule
    and bound 16 end it as NaN, bound 8, the fix and eager keep it finite with no correction
    above 1."""
    import numpy as np

    from fa_lab.kernels.swp_fp8 import model as swp_fp8

    kd = 0.46875 / swp_fp8.log2_scale(1.0, 1.0)
    victim = [448, 416, 384, 352, 320, 288, 256, 240, 224, 208, 192, 176, 160, 144, 128]
    q = torch.zeros(1, 32, 1, 128)
    q[0, 0, 0, 0], q[0, 1, 0, 1] = 2.0, 1.0
    k = torch.zeros(1, 128 * len(victim), 1, 128)
    for p, x in enumerate(victim):
        k[0, 128 * p:128 * (p + 1), 0, 0] = -x
        k[0, 128 * p:128 * (p + 1), 0, 1] = x
    hand = tuple(t.to(torch.float8_e4m3fn) for t in (q, k, torch.ones_like(k)))
    assert torch.equal(hand[1].float(), k)
    tr = {name: lessons.trace_fp8(hand, (1.0, kd, 1.0), [0, 1], rescale=pol, rebase_bound=bd)
          for name, pol, bd in (("unfixed", "lazy_unfixed", None), ("bound 16", "lazy_capped", 16.0),
                                ("bound 8", "lazy_capped", 8.0), ("monotonic", "lazy", None),
                                ("eager", "eager", None))}
    vic = tr["bound 16"].lane(1)
    drags = vic[vic.swept]
    assert (drags["corr"] <= 2.0 ** 16).all() and len(drags) == len(victim) - 1
    assert np.log2(drags["corr"]).sum() > 128
    assert 0 < int(vic[~vic.l_finite].step.min()) < len(victim) - 1
    assert not tr["bound 16"].lanes.out_finite[1] and not tr["unfixed"].lanes.out_finite[1]
    for name in ("bound 8", "monotonic", "eager"):
        assert tr[name].lanes.out_finite.all() and (tr[name].steps["corr"] <= 1).all()


# ---- lesson 03, section 6: PR #1020 ------------------------------------------------------

@pytest.mark.slow
def test_03_pr1020_headroom_and_thresholds():
    """Section 6 at k x1000 (256 rows): every largest P at or below 448 (eager + H at 448
    after the cast), THR 8's at or below 256; the headroom lowers the monotonic rule's error,
    the threshold by KV length more, to about two thirds, still above eager's."""
    from fa_lab import policies
    from fa_lab.numerics import e4m3, exp2, fma_f32

    inputs, ds = lessons.Fp8Lesson("cpu").inputs(1000, 1)

    def largest_p_seen(t):
        s = t.steps
        bias = (0.0 - torch.tensor(s.m.values, dtype=torch.float32) * t.log2_per_unit) + t.policy.p_headroom
        return exp2(fma_f32(torch.tensor(s.mt.values, dtype=torch.float32), t.log2_per_unit, bias)).max().item()

    variants = {"mono": dict(rescale="lazy"), "mono H": dict(rescale="lazy", p_headroom=True),
                "kv H": dict(rescale="lazy", rescale_threshold="by_kv_len", p_headroom=True),
                "eager": dict(rescale="eager"), "eager H": dict(rescale="eager", p_headroom=True)}
    tr = {n: lessons.trace_fp8(inputs, ds, range(256), **kw) for n, kw in variants.items()}
    big = {n: largest_p_seen(t) for n, t in tr.items()}
    r = {n: lessons.mean_abs_dev(t.out) for n, t in tr.items()}
    assert all(p <= 448 * (1 + 1e-5) and e4m3(torch.tensor(p)).item() <= 448 for p in big.values())
    assert big["mono"] <= 2 ** 8 and e4m3(torch.tensor(big["eager H"])).item() == 448
    assert r["kv H"] < r["mono H"] < r["mono"] and r["eager H"] < r["eager"] < r["kv H"]
    assert 0.55 < r["kv H"] / r["mono"] < 0.75 and tr["kv H"].policy.threshold == 4
    assert policies.threshold_by_kv_len(4096) == 6 and policies.threshold_by_kv_len(12288) == 4




# ---- lesson 03, section 2: e4m3 and P's headroom -------------------------------------------

def test_03_e4m3_rounding_range_and_headroom():
    """Section 2's table and line: 464 ties to the even 448 under both casts, 464.1 is 448
    saturating and NaN not; 2^-10 rounds to 0, a little above it to 2^-9; 1.0625 ties to 1;
    the worst relative rounding in [1, 2) 1/17, just under 1/16 (0.0588 on the lesson's sample); P's
    headroom 8.81 binades for eager, 0.81 for lazy at THR 8. Each value is checked against its
    neighbouring e4m3 codes, not against the cast alone."""
    from fa_lab.numerics import E4M3_MAX, e4m3

    def cast(x, saturate=True):
        return e4m3(torch.tensor(x), saturate=saturate).item()

    assert E4M3_MAX == 448 and cast(464.0) == cast(464.0, saturate=False) == 448
    assert cast(464.1) == 448 and math.isnan(cast(464.1, saturate=False))
    assert cast(463.9, saturate=False) == 448 and math.isnan(cast(470.0, saturate=False))
    assert cast(2.0 ** -10) == 0 and cast(1.01 * 2.0 ** -10) == 2.0 ** -9 == cast(2.0 ** -9)
    assert cast(1.0625) == 1 and cast(1.07) == 1.125 and cast(1.1875) == 1.25   # ties to even
    u = torch.rand(100_000, generator=torch.Generator().manual_seed(0)) + 1
    worst = ((e4m3(u) - u).abs() / u).max().item()
    assert 0.058 < worst < 1 / 16 and round(worst, 4) == 0.0588
    # the supremum: a value just below the midpoint 1.0625 moves down to 1, by 1/17 of itself
    assert worst <= 1 / 17 < 1 / 16 and 1 / 17 - worst < 1e-4
    assert round(math.log2(448), 2) == 8.81 and round(math.log2(448 / 2 ** 8), 2) == 0.81


# ---- lesson 03, section 5: bound 32's row, and the try-this bounds ---------------------------

@pytest.fixture(scope="module")
def fp8_k5000():
    return lessons.Fp8Lesson("cpu").inputs(5000)


@pytest.mark.slow
def test_03_bound_32s_row_overflows_with_every_drop_within_the_cap(fp8_k5000):
    """Section 5's line: the first row that bound 32 turns into NaN at k x5000 moved its base
    down on 22 steps, each drop within the cap (29.6 at most), and sat 131 log2 units below
    its best score (past fp32's 128) where it overflowed."""
    out32 = lessons.run_fp8(*fp8_k5000, rescale="lazy_capped", rebase_bound=32.0)
    row, head = (int(x) for x in out32[0].isnan().any(-1).nonzero()[0])
    tr = lessons.trace_fp8(*fp8_k5000, [(0, head, row)], rescale="lazy_capped", rebase_bound=32.0)
    lane = tr.lane(0)
    drop = ((lane.m.shift() - lane.m) * tr.log2_per_unit).where(lane.swept, 0.0)
    deficit = (lane.mt.cummax() - lane.m) * tr.log2_per_unit
    first = int(tr.lanes.first_nonfinite_step[0])
    assert int((drop > 0).sum()) == 22 and 29.5 < drop.max() <= 32
    assert 128 < deficit[first] < 132 and deficit[:first].max() < 128


@pytest.mark.slow
def test_03_try_this_no_nan_up_to_bound_24_and_a_growing_leak_from_32(fp8_k5000):
    """Section 5's Try this: bounds 8, 16 and 24 give no NaN at k x5000; 32 leaks as the
    lesson's table says, and 48 leaks more."""
    st = recorded.recorded("lesson03_table", **recorded.LESSON_PARAMS["lesson03_table"])[0]["table"]
    nan = {b: int(lessons.run_fp8(*fp8_k5000, rescale="lazy_capped", rebase_bound=b).isnan().sum())
           for b in (8.0, 16.0, 24.0, 32.0, 48.0)}
    assert nan[8.0] == nan[16.0] == nan[24.0] == 0
    assert nan[32.0] == st.loc[("bound 32", 5000), "nan"] > 0 and nan[48.0] > nan[32.0]


# ---- lesson 03, section 7: saturation past the largest safe threshold ------------------------

def test_03_saturation_past_the_largest_safe_threshold():
    """Section 7 on the lesson's record of the kernel (tests/lab/test_lesson_records.py checks
    the record against the model): the casts agree up to log2 464 - H and part past it; the
    saturating cast's error is about 0.01 up to THR 9, then 0.09 at 12 and 0.27 at 16, rising;
    PR #1020's H leaves log2(464/448), about 0.05 binades, at every threshold."""
    casts = recorded.recorded("lesson03_casts", **recorded.LESSON_PARAMS["lesson03_casts"])[0]["casts"]
    for (thr, head), r in casts.iterrows():
        past = 2.0 ** (thr + head) > 464                       # independent of the answer's form
        assert past == (thr > sol.largest_safe_threshold(head))
        assert r["NaN rows, saturating"] == 0 and (r["NaN rows, non-saturating"] > 0) == past
    sat = casts.xs(0.0, level="headroom")["mean |o - 1|, saturating"]
    assert sat.loc[9.0:].is_monotonic_increasing and sat.loc[12.0] > 5 * sat.loc[9.0]
    assert all(round(sat[t], 2) == 0.01 for t in (8.0, 8.84, 9.0))
    assert round(sat[12.0], 2) == 0.09 and round(sat[16.0], 2) == 0.27
    for thr in (4, 6, 8):
        room = sol.largest_safe_threshold(math.log2(448) - thr) - thr
        assert abs(room - math.log2(464 / 448)) < 1e-12 and round(room, 2) == 0.05
