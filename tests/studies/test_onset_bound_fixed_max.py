"""onset.bound for a fixed max (``Semantics.fixed_max``, the primus-a6a16cdc policy): each
hazard's edge against the model, +-1 ulp, and its formula's constants."""

import math

import numpy as np
import pytest
import torch

from fa_lab import policies
from fa_lab.kernels.online import model
from fa_lab.studies import onset

POL = "primus-a6a16cdc"


def case(score, n=1, v=1.0):
    """One row: n keys at ``score`` (or the scores of a list), V = v: (output, violated)."""
    q = torch.ones(1, 1, 1, 1)
    scores = score if isinstance(score, list) else [score] * n
    n = len(scores)
    k = torch.tensor(scores).reshape(1, n, 1, 1)
    vv = torch.full((1, n, 1, 1), v)
    pol = policies.get(POL)
    out = float(model.forward(q, k, vv, policy=pol, softmax_scale=model.LOG2_UNITS)[0].flatten()[0])
    m = onset.measure(q, k, vv, policy=pol, softmax_scale=model.LOG2_UNITS, dtype="fp32")
    return out, onset.bound(POL).violated(m)


def ulp(x, d):
    return float(np.nextafter(np.float32(x), np.float32(d)))


def test_the_region_names_its_edges():
    r = onset.bound(POL)
    names = [h.name for h in r.hazards]
    assert names[:2] == ["overflow at the fixed max", "underflow at the fixed max"]
    assert "127.997179" in r.hazards[0].formula and ">= -126" in r.hazards[1].formula
    assert r.hazards[1].exact and not r.hazards[0].exact
    # the silent side (rounding, tails, V's scale) and a non-finite V are live; the
    # structural NaNs of a moving max are not
    assert names[2] == "silent mass loss (rounding and flushed tails)" and not r.hazards[2].never
    assert names[-1] == "non-finite V" and not r.hazards[-1].never
    assert all(h.never for h in r.hazards[3:-1])


EDGE = 128 + math.log2(1 - 2.0 ** -9)   # bf16 P rounds to inf from 2^128 (1 - 2^-9)


@pytest.mark.parametrize("inside, outside, fails", [
    (ulp(EDGE, 0), ulp(EDGE, 300), math.isnan),             # the last safe score, the first bad
    (-126.0, ulp(-126.0, -300), lambda out: out == 0.0)])   # flushed: a zero row
def test_plus_epsilon_is_safe_and_minus_epsilon_fails(inside, outside, fails):
    out, violated = case(inside)
    assert violated == [] and out == pytest.approx(1.0, abs=1e-6)
    out, violated = case(outside)
    assert violated and fails(out)


def test_more_keys_and_larger_values_overflow_earlier_and_the_bound_says_so():
    for kw, symptom in (({"n": 2, "score": 127.0}, math.isnan),
                        ({"v": 2.0, "score": 127.5}, math.isinf)):
        out, violated = case(**kw)
        assert symptom(out) and violated == ["overflow at the fixed max"]
    # sufficient, not exact: keys at 127.5 and 0 sum to a finite l, but the bound reads
    # s_max + log2 n = 128.5
    out, violated = case([127.5, 0.0])
    assert math.isfinite(out) and violated == ["overflow at the fixed max"]


@pytest.mark.slow
def test_the_attack_finds_both_edges_and_the_bound_agrees():
    """The attack on the copy's policy: the onehot rows overflow (a row rising 9 log2 units a
    tile), the zoo space's shifted scores flush to a zero row; both lie outside the region."""
    from fa_lab.studies import adversary

    for space, hazard in (("scores", "overflow at the fixed max"),
                          ("zoo", "underflow at the fixed max")):
        res = adversary.search(POL, budget_s=30, seed=0, space=space)
        assert res.found, space
        c = res.shrunk
        q, k, v = adversary.space.build(c)
        m = onset.measure(q, k, v, policy=POL, causal=c.causal)
        assert hazard in onset.bound(POL).violated(m), (space, c)


def test_the_measure_reads_the_prescaled_scores_of_bf16_inputs():
    """bf16 inputs at the default scale: the measured best score is round(q c) . k, the
    score the model exponentiates, so the region's edge is the model's edge."""
    from fa_lab.numerics import f32

    D = 64
    c = f32(f32(1 / math.sqrt(D)) * f32(math.log2(math.e)))
    q = torch.zeros(1, 1, 1, D)
    q[..., 0] = 3.0
    k = torch.zeros(1, 1, 1, D)
    pol = policies.get(POL)
    seen = set()
    for kv in (235.0, 236.0, 237.0, 238.0):   # scores 127.1 .. 128.8: both sides of the edge
        k[..., 0] = kv
        qb, kb = q.bfloat16(), k.bfloat16()
        m = onset.measure(qb, kb, torch.ones_like(kb), policy=POL)
        score = float((q[0, 0, 0, 0] * c).bfloat16().double() * kv)
        assert float(m.s_max[0]) == pytest.approx(score, rel=1e-7)
        out = float(model.forward(qb, kb, torch.ones_like(kb), policy=pol)[0].float().flatten()[0])
        inside = onset.bound(POL).contains(m)
        assert inside == (out == 1.0) and (inside or math.isnan(out)), (kv, score, out)
        seen.add(inside)
    assert seen == {True, False}


@pytest.mark.slow
def test_the_atlas_is_reproduced_and_no_failing_row_lies_inside_the_region():
    """data/atlas/fixed_max_cpu (the seed's inputs, causal, over K scale): at K x16 every
    row lies inside and none fails; at K x18 the first row fails, and it lies outside. The
    model run here reproduces the atlas's counts, and the region's margin crosses 0
    between the two K scales."""
    from fa_lab.studies.onset import boundcheck

    r = boundcheck.fixed_max_atlas_onset(POL, k_scales=[16, 18])
    assert r["reproduced"] and r["sound"]
    k16, k18 = r["per_k"]
    assert k16["inside"] and k16["bad_rows"] == 0 and k16["s_max"] < 127.997179
    assert not k18["inside"] and k18["bad_rows"] >= 1 and k18["bad_rows_inside"] == 0
    assert k18["outside_rows"] >= k18["bad_rows"] and k18["s_max"] >= 127.997179
    assert 16 < r["k_formula"] < 18 and r["first_failing_k"] == 18


def test_the_atlas_check_refuses_what_it_cannot_check():
    from fa_lab.studies.onset import boundcheck

    with pytest.raises(ValueError, match="no fixed max"):
        boundcheck.fixed_max_atlas_onset("lazy")
    with pytest.raises(ValueError, match=r"k_scales \[17.0\]"):
        boundcheck.fixed_max_atlas_onset(POL, k_scales=[16, 17])
    with pytest.raises(ValueError, match="no rows for policy"):
        boundcheck.fixed_max_atlas_onset(POL, atlas="bf16_thresholds_cpu")


@pytest.mark.slow
def test_no_attack_run_inside_the_region_fails():
    """The attack with the region as its filter, every class of failure: nothing found."""
    from fa_lab.studies.onset import boundcheck

    r = boundcheck.attack_inside(POL, budget_s=8, seed=1)
    assert r["runs_inside"] > 0 and not r["found"], r["summary"]
