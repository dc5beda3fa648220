"""The primitives against hand-computed values."""

import math
from fractions import Fraction

import numpy as np
import pytest
import torch

from fa_lab import numerics as nx

T = lambda *xs: torch.tensor(xs, dtype=torch.float32)  # noqa: E731


def test_bf16_rounds_to_nearest_even():
    one = 1.0
    ulp = 2.0**-7  # bf16 has 7 stored mantissa bits
    got = nx.bf16(T(one + ulp / 2, one + 3 * ulp / 2, one + ulp / 2 + 2**-20, -(one + ulp / 2)))
    # ties go to the even neighbour (1.0 and 1 + 2 ulp), just above a tie rounds up
    assert got.tolist() == [1.0, one + 2 * ulp, one + ulp, -1.0]


def test_bf16_keeps_specials_and_overflows_like_hardware():
    got = nx.bf16(T(math.inf, -math.inf, math.nan, 3.4e38))
    assert got[0] == math.inf and got[1] == -math.inf and math.isnan(got[2])
    assert got[3] == math.inf  # above bf16's max (3.39e38) rounds to inf


def test_bf16_trunc_drops_low_bits():
    x = T(1.0 + 2.0**-7 - 2.0**-20)  # just below 1 + ulp: rounding goes up, truncation down
    assert nx.bf16(x).item() == 1.0 + 2.0**-7
    assert nx.bf16_trunc(x).item() == 1.0


def test_f16_and_round_to():
    assert nx.round_to(torch.float16)(T(65520.0)).item() == math.inf  # past f16 max rounds to inf
    assert nx.round_to(torch.bfloat16) is nx.bf16
    with pytest.raises(TypeError):
        nx.round_to(torch.float32)


@pytest.mark.parametrize("x, want", [
    (448.0, 448.0), (460.0, 448.0), (1.0625, 1.0), (1.1875, 1.25),
    (2.0**-9, 2.0**-9), (2.0**-10, 0.0), (1.5 * 2.0**-10, 2.0**-9), (3 * 2.0**-10, 2.0**-8),
    (-2.0**-10, -0.0),
])
def test_e4m3_round_to_nearest_even(x, want):
    assert nx.e4m3(T(x)).item() == want


def test_e4m3_out_of_range_saturates_or_nans():
    big = T(464.00003, 1e6, math.inf, -math.inf, math.nan)
    sat = nx.e4m3(big, saturate=True)
    assert sat[:3].tolist() == [448.0, 448.0, 448.0] and sat[3] == -448.0 and math.isnan(sat[4])
    assert torch.isnan(nx.e4m3(big, saturate=False)).all()
    assert nx.e4m3(T(463.9), saturate=False).item() == 448.0  # below the midpoint to 480
    assert nx.e4m3(T(464.0), saturate=False).item() == 448.0  # the midpoint ties to even 448
    assert nx.e4m3(T(-464.0), saturate=False).item() == -448.0


def test_e4m3_values_are_representable_and_nearest():
    # every e4m3fn value is a fixed point; the neighbours' midpoints split correctly
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    vals = codes[torch.isfinite(codes)]
    assert torch.equal(nx.e4m3(vals), vals)
    pos = torch.unique(vals[vals >= 0])
    mids = (pos[1:] + pos[:-1]) / 2
    assert torch.equal(nx.e4m3(mids - mids * 2**-20), pos[:-1])
    assert torch.equal(nx.e4m3(mids + mids * 2**-20), pos[1:])


def test_exp2_fmax_le_rcp():
    assert nx.exp2(T(127.0, 128.0, -math.inf)).tolist() == [2.0**127, math.inf, 0.0]
    assert math.isnan(nx.exp2(T(math.nan)).item())
    assert nx.fmax(T(math.nan, -math.inf), T(3.0, 5.0)).tolist() == [3.0, 5.0]
    assert nx.le(T(math.nan, 8.0, 8.5), 8.0).tolist() == [False, True, False]
    assert nx.guarded_rcp(T(4.0, 0.0, math.inf, math.nan, -1.0)).tolist() == [0.25, 0.0, 0.0, 0.0, 0.0]


def test_fma_rounds_once():
    a = T(1.0 + 2.0**-12)
    c = T(-(1.0 + 2.0**-11))
    assert (a * a + c).item() == 0.0  # a*a rounded first loses the 2**-24 term
    assert nx.fma_f32(a, a, c).item() == 2.0**-24


def round_to_f32(x: Fraction) -> float:
    """The fp32 nearest to the exact x, ties to even (a reference independent of fp64
    sums: candidates around float(x), compared as fractions)."""
    near = np.float32(float(x))
    cands = {near, np.nextafter(near, np.float32(-np.inf)), np.nextafter(near, np.float32(np.inf))}
    best = min(abs(Fraction(float(c)) - x) for c in cands)
    ties = [c for c in cands if abs(Fraction(float(c)) - x) == best]
    return float(min(ties, key=lambda c: int(np.array(c).view(np.int32)) & 1))


#: (a, b, c) where the fp64 sum of the exact product and c lands on an fp32 halfway point
#: that the exact value is not on: rounding the fp64 sum to fp32 goes the wrong way.
FMA_DOUBLE_ROUNDING = [
    (1 + 2.0**-23, 2.0**-24 * (1 - 2.0**-23), 1 + 2.0**-23),  # just below a tie, odd below
    (1 + 2.0**-12, 1 + 2.0**-12, 2.0**-70),                     # just above a tie, even below
    (-(1 + 2.0**-12), 1 + 2.0**-12, -(2.0**-70)),
]


def test_fma_is_the_exact_value_rounded_once_where_fp64_would_round_twice():
    a, b, c = (T(*col) for col in zip(*FMA_DOUBLE_ROUNDING))
    exact = [round_to_f32(Fraction(float(x)) * Fraction(float(y)) + Fraction(float(z)))
             for x, y, z in zip(a.tolist(), b.tolist(), c.tolist())]
    twice = (a.double() * b.double() + c.double()).float().tolist()
    assert nx.fma_f32(a, b, c).tolist() == exact
    assert all(t != e for t, e in zip(twice, exact))  # each case defeats the plain fp64 sum


def test_fma_matches_the_exact_reference_on_random_and_special_inputs():
    g = torch.Generator().manual_seed(7)
    n = 3000
    a = torch.randn(n, generator=g) * torch.exp2(torch.randint(-60, 60, (n,), generator=g).float())
    b = torch.randn(n, generator=g) * torch.exp2(torch.randint(-60, 60, (n,), generator=g).float())
    # c near -a*b (cancellation) for a third, near a*b's last bits for a third, free otherwise
    p = (a * b)
    c = torch.cat([-p[:1000] * (1 + torch.randn(1000, generator=g) * 2.0**-20),
                   p[1000:2000] * 2.0**-25 * torch.randn(1000, generator=g),
                   torch.randn(1000, generator=g) * 1e3])
    got = nx.fma_f32(a, b, c)
    exact = [round_to_f32(Fraction(x) * Fraction(y) + Fraction(z))
             for x, y, z in zip(a.tolist(), b.tolist(), c.tolist())]
    assert got.tolist() == exact
    b_scalar = nx.fma_f32(a, 0.5, c)   # a Python float b (exact in fp32)
    assert torch.equal(b_scalar, nx.fma_f32(a, torch.full_like(a, 0.5), c))
    inf, nan = math.inf, math.nan
    sp = nx.fma_f32(T(inf, -inf, nan, 1.0, 3e38, 0.0), T(1.0, 0.0, 1.0, 1.0, 10.0, 5.0),
                    T(-inf, 1.0, 0.0, nan, 0.0, -0.0))
    assert sp[:4].isnan().all() and sp[4].item() == inf and sp[5].item() == 0.0
    tiny = nx.fma_f32(T(2.0**-75, 2.0**-70), T(2.0**-75, 2.0**-79), T(2.0**-149, -(2.0**-149)))
    assert tiny.tolist() == [2.0**-148, 0.0]   # 1.5 subnormal ulps: a tie, to the even 2**-148
    ties = nx.fma_f32(T(1.0, 1.0), T(2.0**-24, 2.0**-24), T(1 + 2.0**-23, 1.0))  # exact ties
    assert ties.tolist() == [1 + 2.0**-22, 1.0]   # to even, up and down


def test_f32_constant():
    assert nx.f32(0.1) == float(torch.tensor(0.1, dtype=torch.float32))
    assert nx.f32(0.1) != 0.1
