"""The generic-kernel model (flash_attn_generic.py) against an independent fp64 reference,
hand-computed cases (P truncated to bf16, f16 rounded), the launch geometry, the upstream
padding-mask dispatch, and its trace."""

import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from fa_lab import reference
from fa_lab.studies.experiments import bf16_inputs
from fa_lab.metrics import rel_l2
from fa_lab.kernels.generic import model as generic
from fa_lab.kernels.swp_bf16 import model as swp_bf16
from fa_lab.policies import get as get_policy
from fa_lab.trace import TraceRecorder

from _ports import F32_EPS, OUT_ROUND, P_PACK_ERR, check_generic_bounds

@settings(max_examples=20, deadline=None)
@given(
    sq=st.integers(1, 320), skv=st.integers(1, 320), hkv=st.sampled_from([1, 2]),
    group=st.sampled_from([1, 3]), d=st.sampled_from([64, 128]), causal=st.booleans(),
    dtype=st.sampled_from([torch.bfloat16, torch.float16]), scale=st.sampled_from([1.0, 4.0]),
    seed=st.integers(0, 2**16),
)
def test_matches_reference(sq, skv, hkv, group, d, causal, dtype, scale, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, sq, hkv * group, d, generator=g).to(dtype)
    k = (torch.randn(1, skv, hkv, d, generator=g) * scale).to(dtype)
    v = torch.randn(1, skv, hkv, d, generator=g).to(dtype)
    # the masked build; upstream's own dispatch differs only for Sq % 64 == 0, Skv % 64 != 0
    out, lse = generic.forward(q, k, v, causal=causal, skip_kv_pad_mask=False)
    assert out.dtype == dtype and out.shape == q.shape and lse.shape == (1, hkv * group, sq)
    check_generic_bounds(q, k, v, causal, out, lse)


def test_hand_case_uniform_scores():
    # q = 0: every score is 0, P = 1 (exact after truncation) on every column; O = sum V and
    # l = Skv are exact in fp32, and out rounds to the mean 99.5, lse = ln(200).
    skv = 200
    q = torch.zeros(2, 5, 2, 64, dtype=torch.bfloat16)
    v = torch.arange(skv, dtype=torch.float32).repeat(64, 1).T.reshape(1, skv, 1, 64)
    v = v.expand(2, skv, 2, 64).bfloat16()
    k = torch.randn(2, skv, 2, 64).bfloat16()
    out, lse = generic.forward(q, k, v, causal=False)
    assert (out.float() == (skv - 1) / 2).all()
    assert torch.allclose(lse, torch.full_like(lse, math.log(skv)), rtol=0, atol=1e-6)


def two_key_case(dtype, s1):
    """One query row, two keys: s0 = 0 (the row max, V = 0) and s1 < 0 (V = 1), so that
    out = pack(P1) / (1 + P1) with P1 = 2**(s1 c), computed here in fp64."""
    q = torch.zeros(1, 1, 1, 64)
    q[..., 0] = 1.0
    k = torch.zeros(1, 2, 1, 64)
    k[0, 1, 0, 0] = s1
    v = torch.zeros(1, 2, 1, 64)
    v[0, 1] = 1.0
    _, c = generic.scale_constants(64)
    p1 = 2.0 ** (s1 * c)  # the model's fp32 P1 differs by ~1e-7 relative
    return q.to(dtype), k.to(dtype), v.to(dtype), p1


def packed_candidates(p, mantissa_bits):
    """(truncated, rounded-to-nearest) p on a grid of ``mantissa_bits``, and p's position
    inside its ulp (0..1)."""
    e = math.floor(math.log2(p))
    ulp = 2.0 ** (e - mantissa_bits)
    pos = p / ulp - math.floor(p / ulp)
    down = math.floor(p / ulp) * ulp
    return down, down + ulp, pos


def predict_out(p_packed, p1, dtype, mantissa_bits):
    """round(p_packed / (1 + p1)) to ``dtype``, checked to sit far from a rounding tie."""
    x = p_packed / (1 + p1)
    ulp = 2.0 ** (math.floor(math.log2(x)) - mantissa_bits)
    assert abs((x / ulp) % 1 - 0.5) > 0.05
    return torch.tensor(x, dtype=torch.float64).to(dtype).item()


def test_bf16_p_is_truncated_not_rounded():
    # s1 = -22.125: P1 = 2**-4 * 1.00699.., 0.89 of a bf16 ulp above 2**-4
    q, k, v, p1 = two_key_case(torch.bfloat16, -22.125)
    trunc, up, pos = packed_candidates(p1, 7)
    assert 0.6 < pos < 0.95  # truncation and round-to-nearest disagree, with margin
    want = predict_out(trunc, p1, torch.bfloat16, 7)
    assert want != predict_out(up, p1, torch.bfloat16, 7)  # 2 output ulps apart
    out, lse = generic.forward(q, k, v, causal=False)
    assert (out.float() == want).all()
    assert lse.item() == pytest.approx(math.log(1 + p1), abs=1e-6)


def test_f16_p_is_rounded_to_nearest():
    # s1 = -16: P1 = 2**-3 * 1.0827.., 0.67 of an f16 ulp above a grid point: RNE rounds up
    q, k, v, p1 = two_key_case(torch.float16, -16.0)
    trunc, up, pos = packed_candidates(p1, 10)
    assert 0.6 < pos < 0.95
    want = predict_out(up, p1, torch.float16, 10)
    assert want != predict_out(trunc, p1, torch.float16, 10)
    out, _ = generic.forward(q, k, v, causal=False)
    assert (out.float() == want).all()


def test_truncation_biases_rows_low_measurably():
    # Every P except the row max loses up to a bf16 ulp, so outputs of V = ones fall below 1
    # by up to 2**-7 (about 2**-8 on average), where the swp kernel's RNE P averages out.
    q, k, _ = bf16_inputs(1, 256, 2, 64, 1.0, seed=4)
    v = torch.ones_like(k)
    out = generic.forward(q, k, v, causal=False)[0].float()
    bias = (1 - out).mean().item()
    assert 2.0**-10 < bias < 2.0**-7 and (out <= 1).all()
    swp = swp_bf16.forward(q, k, v, causal=False, policy=get_policy("eager"))[0].float()
    assert abs(1 - swp.mean().item()) < bias / 8


def test_causal_rows_before_the_diagonal_are_zero_with_lse_minus_inf():
    q, k, v = bf16_inputs(1, 300, 2, 64, 1.0, seed=7)
    k, v = k[:, :100], v[:, :100]
    out, lse = generic.forward(q, k, v, causal=True)
    assert (out[:, :200].float() == 0).all() and (lse[..., :200] == -math.inf).all()
    assert torch.isfinite(lse[..., 200:]).all()
    check_generic_bounds(q, k, v, True, out, lse)


def test_upstream_pad_mask_dispatch_counts_the_last_key_again():
    # Non-causal, Sq % 64 == 0: upstream builds without the padding mask, and the clamped
    # loads repeat K/V row Skv - 1 over the 28 padding columns of the last tile.
    q, k, v = bf16_inputs(1, 128, 2, 64, 1.0, seed=9)
    k, v = k[:, :100], v[:, :100]
    assert generic.skips_kv_pad_mask(128, causal=False) and not generic.skips_kv_pad_mask(130, False)
    extra = 128 - 100
    k_rep = torch.cat([k, k[:, -1:].expand(1, extra, 2, 64)], 1)
    v_rep = torch.cat([v, v[:, -1:].expand(1, extra, 2, 64)], 1)
    ref_rep = reference.attention(q, k_rep, v_rep, causal=False, dtype=torch.float64)[0]
    ref = reference.attention(q, k, v, causal=False, dtype=torch.float64)[0]
    tol = (P_PACK_ERR[q.dtype] + OUT_ROUND[q.dtype] + 300 * F32_EPS) * v.double().abs().max().item()
    assert (ref_rep - ref).abs().max().item() > 10 * tol  # the two behaviours are told apart
    upstream = generic.forward(q, k, v, causal=False)[0].double()
    assert (upstream - ref_rep).abs().max().item() <= tol
    masked, lse = generic.forward(q, k, v, causal=False, skip_kv_pad_mask=False)
    check_generic_bounds(q, k, v, False, masked, lse)
    # Sq = 130 is not a multiple of 64: upstream masks, the default agrees with softmax
    q2 = torch.cat([q, q[:, :2]], 1)
    out2, lse2 = generic.forward(q2, k, v, causal=False)
    check_generic_bounds(q2, k, v, False, out2, lse2)


def test_launch_tile_rules():
    lt = generic.launch_tile
    assert lt(1, 1000, 2, 128, True) == generic.LaunchTile(64, 64)  # 16 blocks < 256 CUs
    assert lt(1, 4096, 32, 128, True) == generic.LaunchTile(256, 128)  # H >= 32, B*Sq >= 4096
    assert lt(1, 4096, 32, 128, False) == generic.LaunchTile(256, 64)
    assert lt(1, 4095, 64, 64, True) == generic.LaunchTile(128, 64)  # D = 64: 64-column step
    assert lt(2, 4096, 16, 128, True) == generic.LaunchTile(128, 128)
    assert generic.kv_upper(0, 128, 300, 300, True) == 128
    assert generic.kv_upper(256, 128, 300, 300, True) == 300
    assert generic.kv_upper(0, 64, 300, 100, True) == 0  # the block sits before the diagonal


def trace_rows(q, k, v, triples, **kw):
    rec = TraceRecorder(triples, group_size=q.shape[2] // k.shape[2])
    out, lse = generic.forward(q, k, v, recorder=rec, **kw)
    tr = rec.build(kernel=generic.KERNEL, policy=None, log2_per_unit=1.0, threshold_units=math.nan)
    return tr, out, lse


def test_geometry_changes_steps_not_numbers():
    # num_cus=1 leaves the light tile: 128-row programs and a 128-column step (causal D=128).
    q, k, v = bf16_inputs(1, 300, 2, 128, 2.0, seed=11)
    rows = [(0, 0, 0), (0, 1, 299)]
    light, out_a, lse_a = trace_rows(q, k, v, rows, causal=True)
    wide, out_b, lse_b = trace_rows(q, k, v, rows, causal=True, num_cus=1)
    assert torch.equal(out_a, out_b) and torch.equal(lse_a, lse_b)
    assert light.lane(0).step.tolist() == [0]  # block of 64 rows: kv_upper = 64
    assert wide.lane(0).step.tolist() == [0, 1]  # block of 128 rows: kv_upper = 128
    assert light.lane(1).step.max() == 4 and wide.lane(1).step.max() == 5  # 300 -> 5 or 6 subtiles
    last = wide.lane(1).iloc[-1]
    assert last["corr"] == 1  # subtile 320..383 is padding: an exact no-op


def test_trace_records_every_subtile_eagerly():
    q, k, v = bf16_inputs(1, 500, 2, 64, 32.0, seed=2)
    triples = [(0, 0, 3), (0, 1, 250), (0, 0, 499)]
    tr, out, lse = trace_rows(q, k, v, triples, causal=True)
    s = tr.steps
    assert not (s.vote.any() or s.fire.any() or s.swept.any())
    assert (s["corr"] <= 1).all() and (s.phase == "tile").all()
    for lane, (b, h, r) in enumerate(triples):
        steps = tr.lane(lane)
        upper = generic.kv_upper((r // 64) * 64, 64, 500, 500, causal=True)  # 64-row programs
        assert steps.step.tolist() == list(range(math.ceil(upper / 64)))
        assert (steps.m.diff().dropna() >= 0).all()
        assert torch.equal(tr.out[lane], out[b, r, h].float())
        assert tr.lanes.loc[lane, "lse"] == lse[b, h, r].item()
        # m is the running raw max in log2 units: max_j q.k_j * f32(log2e / sqrt(D))
        raw_max = (q[b, r, h].double() @ k[b, :r + 1, h].double().T).max().item()  # H = Hkv
        assert steps.m.iloc[-1] == pytest.approx(raw_max * generic.scale_constants(64)[1], rel=1e-6)


def test_wide_scores_stay_finite():
    # K x64 (where the DUALWAVE_SWP unfixed rebase turns > 5 % of the outputs NaN, see
    # test_model_swp_bf16): the eager generic kernel has corr <= 1 and P <= 1 throughout.
    q, k, v = bf16_inputs(1, 1024, 1, 128, 64.0, seed=0)
    out, lse = generic.forward(q, k, v, causal=False)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    ref = reference.attention(q, k, v, causal=False)[0]
    assert rel_l2(out, ref) < 2e-2


def test_nan_input_propagates():
    q, k, v = bf16_inputs(1, 64, 1, 64, 1.0)
    v = v.clone()
    v[0, 3, 0, 0] = float("nan")
    out = generic.forward(q, k, v, causal=False)[0]
    assert torch.isnan(out[..., 0]).all() and torch.isfinite(out[..., 1:]).all()


def test_bad_arguments():
    q, k, v = bf16_inputs(1, 64, 1, 64, 1.0)
    with pytest.raises(TypeError, match="skip_kv_pad_mask"):
        generic.forward(q, k, v, causal=False, skip_kv_pad_mask=1)
    with pytest.raises(ValueError, match="num_cus"):
        generic.forward(q, k, v, causal=False, num_cus=0)
