"""The primitives against hand-computed values, on every device this machine has (CPU, and
CUDA where present: the models run on GPU tensors too, so a primitive that mixes devices
fails there and nowhere else)."""

import math

import pytest
import torch

from fa_lab import numerics as nx

from _fma import FLT_MAX, FMA_DOUBLE_ROUNDING, exact_fma, tie_hitting_triples

DEVICES = [pytest.param("cpu"), pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.fixture(params=DEVICES)
def device(request):
    return torch.device(request.param)


@pytest.fixture
def T(device):
    """fp32 tensor of the given values on the device under test."""
    return lambda *xs: torch.tensor(xs, dtype=torch.float32, device=device)


def test_bf16_rounds_to_nearest_even(T, device):
    one = 1.0
    ulp = 2.0**-7  # bf16 has 7 stored mantissa bits
    got = nx.bf16(T(one + ulp / 2, one + 3 * ulp / 2, one + ulp / 2 + 2**-20, -(one + ulp / 2)))
    # ties go to the even neighbour (1.0 and 1 + 2 ulp), just above a tie rounds up
    assert got.tolist() == [1.0, one + 2 * ulp, one + ulp, -1.0]


def test_bf16_keeps_specials_and_overflows_like_hardware(T, device):
    got = nx.bf16(T(math.inf, -math.inf, math.nan, 3.4e38))
    assert got[0] == math.inf and got[1] == -math.inf and math.isnan(got[2])
    assert got[3] == math.inf  # above bf16's max (3.39e38) rounds to inf


def test_bf16_trunc_drops_low_bits(T, device):
    x = T(1.0 + 2.0**-7 - 2.0**-20)  # just below 1 + ulp: rounding goes up, truncation down
    assert nx.bf16(x).item() == 1.0 + 2.0**-7
    assert nx.bf16_trunc(x).item() == 1.0


def test_f16_and_round_to(T, device):
    assert nx.round_to(torch.float16)(T(65520.0)).item() == math.inf  # past f16 max rounds to inf
    assert nx.round_to(torch.bfloat16) is nx.bf16
    with pytest.raises(TypeError):
        nx.round_to(torch.float32)


@pytest.mark.parametrize("x, want", [
    (448.0, 448.0), (460.0, 448.0), (1.0625, 1.0), (1.1875, 1.25),
    (2.0**-9, 2.0**-9), (2.0**-10, 0.0), (1.5 * 2.0**-10, 2.0**-9), (3 * 2.0**-10, 2.0**-8),
    (-2.0**-10, -0.0),
])
def test_e4m3_round_to_nearest_even(x, want, T, device):
    assert nx.e4m3(T(x)).item() == want


def test_e4m3_out_of_range_saturates_or_nans(T, device):
    big = T(464.00003, 1e6, math.inf, -math.inf, math.nan)
    sat = nx.e4m3(big, saturate=True)
    assert sat[:3].tolist() == [448.0, 448.0, 448.0] and sat[3] == -448.0 and math.isnan(sat[4])
    assert torch.isnan(nx.e4m3(big, saturate=False)).all()
    assert nx.e4m3(T(463.9), saturate=False).item() == 448.0  # below the midpoint to 480
    assert nx.e4m3(T(464.0), saturate=False).item() == 448.0  # the midpoint ties to even 448
    assert nx.e4m3(T(-464.0), saturate=False).item() == -448.0


def test_e4m3_values_are_representable_and_nearest(T, device):
    # every e4m3fn value is a fixed point; the neighbours' midpoints split correctly
    codes = torch.arange(256, dtype=torch.uint8, device=device).view(torch.float8_e4m3fn).float()
    vals = codes[torch.isfinite(codes)]
    assert torch.equal(nx.e4m3(vals), vals)
    pos = torch.unique(vals[vals >= 0])
    mids = (pos[1:] + pos[:-1]) / 2
    assert torch.equal(nx.e4m3(mids - mids * 2**-20), pos[:-1])
    assert torch.equal(nx.e4m3(mids + mids * 2**-20), pos[1:])


def test_exp2_fmax_le_rcp(T, device):
    assert nx.exp2(T(127.0, 128.0, -math.inf)).tolist() == [2.0**127, math.inf, 0.0]
    assert math.isnan(nx.exp2(T(math.nan)).item())
    assert nx.fmax(T(math.nan, -math.inf), T(3.0, 5.0)).tolist() == [3.0, 5.0]
    assert nx.le(T(math.nan, 8.0, 8.5), 8.0).tolist() == [False, True, False]
    assert nx.guarded_rcp(T(4.0, 0.0, math.inf, math.nan, -1.0)).tolist() == [0.25, 0.0, 0.0, 0.0, 0.0]


def test_fma_rounds_once(T, device):
    a = T(1.0 + 2.0**-12)
    c = T(-(1.0 + 2.0**-11))
    assert (a * a + c).item() == 0.0  # a*a rounded first loses the 2**-24 term
    assert nx.fma_f32(a, a, c).item() == 2.0**-24




def test_fma_is_the_exact_value_rounded_once_where_fp64_would_round_twice(T, device):
    a, b, c = (T(*col) for col in zip(*FMA_DOUBLE_ROUNDING))
    assert all(float(t) == v for t, col in zip((a, b, c), zip(*FMA_DOUBLE_ROUNDING))
               for t, v in zip(t, col))  # the operands are fp32 values
    exact = [exact_fma(*t) for t in FMA_DOUBLE_ROUNDING]
    twice = (a.double() * b.double() + c.double()).float().tolist()
    assert nx.fma_f32(a, b, c).tolist() == exact
    assert all(t != e for t, e in zip(twice, exact))  # each case defeats the plain fp64 sum
    assert exact[-1] == FLT_MAX and twice[-1] == math.inf
    assert nx.fma_f32(a[0], float(b[0]), c[0]).item() == exact[0]  # 0-d operands


def test_fma_matches_the_exact_reference_on_random_and_special_inputs(T, device):
    g = torch.Generator().manual_seed(7)
    n = 3000
    a = torch.randn(n, generator=g) * torch.exp2(torch.randint(-60, 60, (n,), generator=g).float())
    b = torch.randn(n, generator=g) * torch.exp2(torch.randint(-60, 60, (n,), generator=g).float())
    # c near -a*b (cancellation) for a third, near a*b's last bits for a third, free otherwise
    p = (a * b)
    c = torch.cat([-p[:1000] * (1 + torch.randn(1000, generator=g) * 2.0**-20),
                   p[1000:2000] * 2.0**-25 * torch.randn(1000, generator=g),
                   torch.randn(1000, generator=g) * 1e3])
    ties = tie_hitting_triples(2000, seed=1)
    a, b, c = (torch.cat([x, torch.tensor(col, dtype=torch.float32)]).to(device)
               for x, col in zip((a, b, c), zip(*ties)))
    triples = list(zip(a.tolist(), b.tolist(), c.tolist()))
    exact = [exact_fma(*t) for t in triples]
    assert nx.fma_f32(a, b, c).tolist() == exact
    twice = (a.double() * b.double() + c.double()).float().tolist()
    assert sum(t != e for t, e in zip(twice, exact)) > 100  # the tie-hitting triples bite
    assert torch.equal(nx.fma_f32(a, 0.5, c), nx.fma_f32(a, torch.full_like(a, 0.5), c))  # float b
    # broadcasting: a row of b against a column of a, c full
    col, row = a[:6, None], b[None, :5]
    assert torch.equal(nx.fma_f32(col, row, c[:30].reshape(6, 5)),
                       nx.fma_f32(col.expand(6, 5).reshape(-1), row.expand(6, 5).reshape(-1), c[:30]).reshape(6, 5))
    inf, nan = math.inf, math.nan
    sp = nx.fma_f32(T(inf, -inf, nan, 1.0, 3e38), T(1.0, 0.0, 1.0, 1.0, 10.0), T(-inf, 1.0, 0.0, nan, 0.0))
    assert sp[:4].isnan().all() and sp[4].item() == inf
    zeros = [(-0.0, 1.0, -0.0), (1.0, -1.0, 1.0), (0.0, -5.0, -0.0), (2.0**-100, -(2.0**-100), -0.0),
             (2.0**-100, -(2.0**-100), 0.0)]
    got = nx.fma_f32(*(T(*col) for col in zip(*zeros))).tolist()
    assert [math.copysign(1, r) for r in got] == [math.copysign(1, exact_fma(*t)) for t in zeros] \
        == [-1, 1, -1, -1, -1]   # the last one: a negative result below half the smallest subnormal
    tiny = nx.fma_f32(T(2.0**-75, 2.0**-70), T(2.0**-75, 2.0**-79), T(2.0**-149, -(2.0**-149)))
    assert tiny.tolist() == [2.0**-148, 0.0]   # 1.5 subnormal ulps: a tie, to the even 2**-148
    ties = nx.fma_f32(T(1.0, 1.0), T(2.0**-24, 2.0**-24), T(1 + 2.0**-23, 1.0))  # exact ties
    assert ties.tolist() == [1 + 2.0**-22, 1.0]   # to even, up and down


def test_fma_scalar_b_and_0d_operands_stay_on_the_device(T, device):
    # a float b and a 0-d CPU tensor b beside device tensors, at a tie that takes the
    # rounding-to-odd path (the path that indexes b with the others' indices)
    a, c = T(1 + 2.0**-23, 1.0), T(1 + 2.0**-23, 1 + 2.0**-23)
    b = 2.0**-24 * (1 - 2.0**-23)
    want = [exact_fma(float(x), b, float(z)) for x, z in zip(a.tolist(), c.tolist())]
    for bb in (b, torch.tensor(b), torch.tensor(b, device=device), torch.full((2,), b, device=device)):
        got = nx.fma_f32(a, bb, c)
        assert got.device.type == device.type and got.tolist() == want
    # 0-d a and c (one lane of a kernel's state), with each kind of b
    for bb in (b, torch.tensor(b), torch.tensor(b, device=device)):
        got = nx.fma_f32(a[0], bb, c[0])
        assert got.shape == () and got.device.type == device.type and got.item() == want[0]
    # a float b that fp32 does not hold is taken as given (fp64), not rounded to fp32 first
    third = 1 / 3
    assert nx.fma_f32(T(3.0), third, T(0.0)).item() == exact_fma(3.0, third, 0.0) == 1.0


def test_fma_subnormal_ties_on_the_device(T, device):
    # results in fp32's subnormal range land on odd multiples of 2**-150 (its halfway points)
    a, b, c = T(2.0**-75, 2.0**-75), T(2.0**-75, -(2.0**-75)), T(2.0**-149, 2.0**-148)
    want = [exact_fma(*t) for t in zip(a.tolist(), b.tolist(), c.tolist())]
    assert nx.fma_f32(a, b, c).tolist() == want == [2.0**-148, 2.0**-148]


def test_exact_dot_is_the_rounded_exact_sum(T, device):
    # 2**24 + 1 - 2**24: fp32 summation in order loses the 1, the exact sum keeps it
    a = T(2.0**12, 1.0, -(2.0**12)).reshape(1, 3)
    b = T(2.0**12, 1.0, 2.0**12).reshape(3, 1)
    assert nx.exact_dot(a, b).item() == 1.0
    with nx.ieee_fp32_matmul():
        assert (a @ b).item() in (0.0, 1.0)  # fp32 summation, order unspecified
    assert nx.exact_dot(a, b).device.type == device.type


def test_f32_constant():
    assert nx.f32(0.1) == float(torch.tensor(0.1, dtype=torch.float32))
    assert nx.f32(0.1) != 0.1
    flt_max = float.fromhex("0x1.fffffep127")
    half_ulp = 2.0 ** 103  # FLT_MAX's ulp is 2**104
    cases = [1 + 2.0**-24, 1 + 3 * 2.0**-24, -(1 + 2.0**-24), 2.0**-150, 3 * 2.0**-150, 2.0**-151,
             flt_max + half_ulp * 0.999, flt_max + half_ulp, -1e39, math.inf, -math.inf, 1e-50]
    for x in cases:  # ties to even, subnormals, overflow to inf: as torch's conversion
        assert nx.f32(x) == float(torch.tensor(x, dtype=torch.float32)), x
    assert math.isnan(nx.f32(math.nan))
