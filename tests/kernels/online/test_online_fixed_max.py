"""The online model's fixed max, cast row sum, flushed subnormals and l floor
(``Semantics.fixed_max``, ``l_sums_cast``, ``ftz``, ``l_floor``): each against a row whose
exact answer is known (V = 1, so a finite output is 1), at the edges +-1 ulp."""

import math

import numpy as np
import pytest
import torch

import fa_lab
from fa_lab import reference
from fa_lab.kernels.online import model
from fa_lab.semantics import Semantics

EDGE = 128 + math.log2(1 - 2.0 ** -9)   # bf16 P rounds to inf from 2^128 (1 - 2^-9)


def pol(**sem):
    return fa_lab.Policy("tile", "max", name="t", semantics=Semantics(**sem))


def row(policy, scores, v=1.0):
    """One query row over keys with the given log2-unit scores; V = v."""
    n = len(scores)
    q = torch.ones(1, 1, 1, 1)
    k = torch.tensor(scores, dtype=torch.float32).reshape(1, n, 1, 1)
    out, lse = model.forward(q, k, torch.full((1, n, 1, 1), v), policy=policy,
                             softmax_scale=model.LOG2_UNITS)
    return float(out.flatten()[0]), float(lse.flatten()[0])


def ulp(x, direction):
    return float(np.nextafter(np.float32(x), np.float32(direction)))


@pytest.mark.parametrize("bad, exc", [({"fixed_max": math.inf}, ValueError),
                                      ({"fixed_max": "0"}, TypeError),
                                      ({"l_floor": -1.0}, ValueError),
                                      ({"l_floor": math.nan}, ValueError),
                                      ({"ftz": 1}, TypeError), ({"l_sums_cast": None}, TypeError)])
def test_bad_values_are_refused_by_name(bad, exc):
    with pytest.raises(exc, match=next(iter(bad))):
        Semantics(**bad)


def test_a_fixed_max_overflows_at_the_bf16_edge_and_moves_with_the_max():
    for F in (0.0, 10.0):
        p = pol(fixed_max=F, p_cast="bf16", p_saturate=False)
        cast_l = pol(fixed_max=F, p_cast="bf16", p_saturate=False, l_sums_cast=True)
        # l of the fp32 P against O of the bf16 P: within bf16's rounding; l of the cast P: 1
        assert row(p, [ulp(EDGE + F, 0)])[0] == pytest.approx(1.0, abs=2.0 ** -8)
        assert row(cast_l, [ulp(EDGE + F, 0)])[0] == pytest.approx(1.0, abs=1e-6)
        assert math.isinf(row(p, [ulp(EDGE + F, 300)])[0])         # O = inf, l finite
        assert math.isnan(row(cast_l, [ulp(EDGE + F, 300)])[0])    # l = inf too: inf * 0
    # a saturating cast keeps P finite; fp32 l overflows only at 2^128 itself
    assert row(pol(fixed_max=0.0, p_cast="bf16"), [ulp(128.0, 0)])[0] == pytest.approx(1, abs=1e-2)


def test_a_fixed_max_is_the_softmax_where_nothing_overflows():
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 70, 2, 64, generator=g).bfloat16() for _ in range(3))
    out, lse = model.forward(q, k, v, policy=pol(fixed_max=0.0), causal=True)
    ref, ref_lse = reference.attention(q, k, v, causal=True, dtype=torch.float64)
    assert fa_lab.metrics.rel_l2(out, ref) < 1e-2
    assert (lse.double() - ref_lse).abs().max() < 1e-4


def test_flushed_subnormals_give_a_zero_row_and_kept_ones_an_overflowing_rcp():
    base = dict(fixed_max=0.0, p_cast="bf16", p_saturate=False)
    assert row(pol(**base, ftz=True), [-126.0])[0] == 1.0
    assert row(pol(**base, ftz=True), [ulp(-126.0, -200)]) == (0.0, -math.inf)
    # kept: P = 2^-130, l = 2^-130, rcp(l) = 2^130 = inf in fp32
    assert row(pol(**base), [-130.0])[0] == math.inf


def test_the_l_floor_scales_a_row_whose_l_is_below_it():
    out, _ = row(pol(fixed_max=0.0, l_floor=1e-12), [-50.0])        # l = 2^-50 < 1e-12
    assert out == pytest.approx(2.0 ** -50 / 1e-12, rel=1e-6)
    assert row(pol(fixed_max=0.0), [-50.0])[0] == 1.0
    assert row(pol(l_floor=1e-12), [-50.0])[0] == 1.0               # a running max: l = 1


def test_a_prescaled_q_is_rounded_before_the_product():
    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, 32, 1, 64, generator=g).bfloat16()
    k = (torch.randn(1, 64, 1, 64, generator=g) * 8).bfloat16()
    v = torch.ones(1, 64, 1, 64).bfloat16()
    c = fa_lab.numerics.f32(fa_lab.numerics.f32(1 / 8) * fa_lab.numerics.f32(math.log2(math.e)))
    want = {True: ((q.float() * c).bfloat16().double() @ k.double()[0, :, 0].T).float(),
            False: (q.double() @ k.double()[0, :, 0].T).float() * c}
    for pre in (True, False):
        rec = []
        model.forward(q, k, v, policy=pol(q_prescale=pre), record=rec)
        assert torch.equal(rec[0].mt[0, 0], want[pre][0, :, 0].amax(-1)), pre
    assert not torch.equal(want[True], want[False])        # the rounding is visible here
    q8 = torch.zeros(1, 32, 1, 128).to(torch.float8_e4m3fn)
    k8 = torch.zeros(1, 64, 1, 128).to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="q_prescale"):
        model.forward(q8, k8, k8, policy=pol(q_prescale=True), q_descale=1.0, k_descale=1.0,
                      v_descale=1.0)
