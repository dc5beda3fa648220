"""The primitives against hand-computed values."""

import math

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


def test_f32_constant():
    assert nx.f32(0.1) == float(torch.tensor(0.1, dtype=torch.float32))
    assert nx.f32(0.1) != 0.1
