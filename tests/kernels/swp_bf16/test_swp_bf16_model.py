"""The bf16/f16 DUALWAVE_SWP model against an independent fp32/fp64 reference and
hand-built cases where the wave ballot drags a row."""

import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

import fa_lab
from fa_lab import reference
from fa_lab.studies.experiments import bf16_inputs, drag_case
from fa_lab.kernels.swp_bf16.model import softmax_scale_log2

UNIT_ROUNDOFF = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


def run(q, k, v, **kw):
    # pinned to DUALWAVE_SWP: upstream routes short sequences to the generic kernel
    return fa_lab.flash_attn_func(q, k, v, return_lse=True, backend="emulator", kernel="swp_bf16", **kw)


def check_against_reference(q, k, v, causal, out, lse):
    """Error bounds from the kernel's roundings: Q*c and P are rounded to the input type
    (relative u each), the output once more; LSE errs by at most u * max|score|."""
    u = UNIT_ROUNDOFF[q.dtype]
    ref, ref_lse = reference.attention(q, k, v, causal=causal, dtype=torch.float64)
    assert torch.isfinite(out).all()
    vmax = v.double().abs().max().item()
    assert (out.double() - ref).abs().max().item() <= 6 * u * vmax + 1e-6
    fin = torch.isfinite(ref_lse)
    assert torch.equal(torch.isinf(lse), ~fin)  # fully masked rows: -inf in both
    if fin.any():
        G = q.shape[2] // k.shape[2]
        kk = k.double().repeat_interleave(G, dim=2)
        smax = torch.einsum("bshd,bthd->bhst", q.double().abs(), kk.abs()).amax(-1) / math.sqrt(q.shape[-1])
        tol = 2 * u * smax + 1e-4
        assert ((lse.double() - ref_lse).abs() <= tol)[fin].all()
    # masked rows (causal with Sq > Skv) see nothing: zero output
    assert (out.double()[ref.abs().sum(-1) == 0] == 0).all()


@settings(max_examples=25, deadline=None)
@given(
    sq=st.integers(1, 600), skv=st.integers(1, 600), hkv=st.sampled_from([1, 2]),
    group=st.sampled_from([1, 2]), d=st.sampled_from([64, 128]), causal=st.booleans(),
    dtype=st.sampled_from([torch.bfloat16, torch.float16]), scale=st.sampled_from([1.0, 4.0]),
    seed=st.integers(0, 2**16),
)
def test_eager_matches_reference(sq, skv, hkv, group, d, causal, dtype, scale, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, sq, hkv * group, d, generator=g).to(dtype)
    k = (torch.randn(1, skv, hkv, d, generator=g) * scale).to(dtype)
    v = torch.randn(1, skv, hkv, d, generator=g).to(dtype)
    out, lse = run(q, k, v, causal=causal, rescale="eager")
    assert out.dtype == dtype and out.shape == q.shape and lse.shape == (1, hkv * group, sq)
    check_against_reference(q, k, v, causal, out, lse)


@pytest.mark.parametrize("policy", ["lazy", "lazy_unfixed"])
def test_lazy_matches_reference_on_narrow_scores(policy):
    # K x1: no row ever jumps by 8, so nothing fires after the prologue and both lazy
    # variants are the plain online softmax.
    q, k, v = bf16_inputs(1, 700, 2, 64, 1.0, seed=3)
    for causal in (False, True):
        out, lse = run(q, k, v, causal=causal, rescale=policy)
        check_against_reference(q, k, v, causal, out, lse)


def test_hand_case_uniform_scores():
    # q = 0: every score is 0, P = 1 on each of the Skv columns; out is the mean of V and
    # lse = ln(Skv) exactly up to fp32 rounding.
    skv = 200  # V holds 0..199, exact in bf16; their mean 99.5 is too
    q = torch.zeros(1, 5, 1, 64, dtype=torch.bfloat16)
    v = torch.arange(skv, dtype=torch.float32).repeat(64, 1).T.reshape(1, skv, 1, 64).bfloat16()
    k = torch.randn(1, skv, 1, 64).bfloat16()
    for policy in ("eager", "lazy", "lazy_unfixed"):
        out, lse = run(q, k, v, causal=False, rescale=policy)
        assert (out.float() == (skv - 1) / 2).all()
        assert torch.allclose(lse, torch.full_like(lse, math.log(skv)), rtol=0, atol=1e-6)


def test_lazy_with_zero_threshold_is_eager_bit_for_bit():
    # With THR = 0 a wave fires whenever any row's max grows, and rows that did not grow get
    # corr = exp2(0) = 1 exactly, so the lazy loop is the eager loop.
    q, k, v = bf16_inputs(1, 512, 2, 128, 32.0, seed=5)
    eager = run(q, k, v, causal=False, rescale="eager")
    lazy = run(q, k, v, causal=False, rescale="lazy", rescale_threshold=0.0)
    assert torch.equal(eager[0], lazy[0]) and torch.equal(eager[1], lazy[1])


def test_wide_scores_unfixed_nans_fixed_and_eager_do_not():
    q, k, v = bf16_inputs(1, 1024, 2, 128, 64.0, seed=0)
    ref, _ = reference.attention(q, k, v, causal=False)
    res = {p: run(q, k, v, causal=False, rescale=p) for p in ("lazy_unfixed", "lazy", "eager")}
    bad = torch.isnan(res["lazy_unfixed"][0])
    assert bad.float().mean() > 0.05
    # NaN rows report LSE = +inf: the row statistics overflowed first
    nan_rows = bad.any(-1).permute(0, 2, 1)
    assert (res["lazy_unfixed"][1][nan_rows] == math.inf).float().mean() > 0.9
    for p in ("lazy", "eager"):
        assert torch.isfinite(res[p][0]).all() and torch.isfinite(res[p][1]).all()
    rl = {p: fa_lab.metrics.rel_l2(res[p][0], ref) for p in ("lazy", "eager")}
    assert rl["eager"] < 2e-2 and abs(rl["lazy"] / rl["eager"] - 1) < 0.01


@settings(max_examples=12, deadline=None)
@given(scale=st.sampled_from([8.0, 24.0, 48.0, 96.0]), causal=st.booleans(),
       seed=st.integers(0, 1000), thr=st.sampled_from([0.0, 2.0, 8.0, 20.0]))
def test_lazy_finite_wherever_eager_is(scale, causal, seed, thr):
    q, k, v = bf16_inputs(1, 600, 1, 64, scale, seed=seed)
    eager = run(q, k, v, causal=causal, rescale="eager")[0]
    lazy = run(q, k, v, causal=causal, rescale="lazy", rescale_threshold=thr)[0]
    assert torch.isfinite(eager).all()
    assert torch.isfinite(lazy).all()


def victim_scores(q, k, D=64, row=1):
    """Exact per-tile maxima of one row, computed independently in fp64."""
    qs = (q.double() * softmax_scale_log2(D)).to(torch.bfloat16).double()
    s = qs[0, row, 0] @ k.double()[0, :, 0].T
    return s.reshape(-1, 64).amax(-1)


def test_constructed_drag_overflows_only_when_a_row_fires():
    q, k, v = drag_case(trigger=True)
    out, lse = run(q, k, v, causal=False, rescale="lazy_unfixed")
    assert torch.isnan(out[0, 1]).all() and lse[0, 0, 1] == math.inf
    others = torch.cat([out[0, :1], out[0, 2:]])
    assert (others.float() == 1).all()  # V = ones: every finite row is exactly 1
    for policy in ("lazy", "eager"):
        assert (run(q, k, v, causal=False, rescale=policy)[0].float() == 1).all()
    # same victim, no trigger: nothing fires, nothing overflows
    q, k, v = drag_case(trigger=False)
    assert (run(q, k, v, causal=False, rescale="lazy_unfixed")[0].float() == 1).all()


def test_trace_shows_the_drag_by_hand():
    q, k, v = drag_case(trigger=True, n_tiles=8, fall=40.0)
    mt = victim_scores(q, k)  # the victim's tile maxima, about 100 - 40 t
    tr = fa_lab.trace(q, k, v, rows=[0, 1], causal=False, rescale="lazy_unfixed", kernel="swp_bf16")
    lane = tr.lane(1)
    loop = lane[lane.phase == "loop"]
    assert list(loop.step) == [1, 2, 3, 4]  # N = 8: loop tiles 1..N-4
    assert loop.fire.all() and loop.swept.all() and not loop.vote.any()
    # each drag rebases the victim to its own (lower) tile max: corr = 2**(m_prev - mt)
    for t in (1, 2, 3, 4):
        row = loop[loop.step == t].iloc[0]
        assert row["m"] == pytest.approx(mt[t].item(), abs=0)
        assert row["corr"] == pytest.approx(2.0 ** (mt[t - 1] - mt[t]).item(), rel=1e-6)
    # l and O stop being finite at the drag that takes the product past 2**128
    assert tr.lanes.loc[1, "first_nonfinite_step"] == 4
    assert (mt[0] - mt[4]).item() > 128 > (mt[0] - mt[3]).item()
    assert not tr.lanes.loc[1, "out_finite"] and tr.lanes.loc[1, "lse"] == math.inf
    # the trigger row voted every loop tile and was never dragged
    trig = tr.lane(0)
    assert trig[trig.phase == "loop"].vote.all() and not trig.swept.any()
    # the fixed policy: same fires, the victim keeps its max, corr = 1
    fixed = fa_lab.trace(q, k, v, rows=[1], causal=False, rescale="lazy", kernel="swp_bf16").lane(0)
    floop = fixed[fixed.phase == "loop"]
    assert floop.swept.all() and (floop["corr"] == 1).all() and (floop.m == mt[0].item()).all()


def test_trace_out_equals_forward():
    q, k, v = bf16_inputs(1, 300, 2, 64, 32.0, seed=2)
    out, lse = run(q, k, v, causal=True, rescale="lazy_unfixed")
    tr = fa_lab.trace(q, k, v, rows=[(0, 1, 5), (0, 0, 299), (0, 1, 257)], causal=True,
                      rescale="lazy_unfixed")
    for lane, (b, h, s) in enumerate([(0, 1, 5), (0, 0, 299), (0, 1, 257)]):
        assert torch.equal(tr.out[lane], out[b, s, h].float())
        assert tr.lanes.loc[lane, "lse"] == lse[b, h, s].item()
    # causal: row 5 sits in block 0 (N = 4: no loop), row 257 in block 1 (N = 6 here)
    assert tr.lane(0).phase.tolist() == ["prologue", "epilogue", "epilogue", "epilogue"]
    assert tr.lane(2).step.max() == 5


def test_causal_fully_masked_loop_tile_drags_to_nan():
    # (Skv - Sq) mod 32 != 0: a wave straddles the diagonal, so late rows of a fired wave
    # can face a loop tile that is fully masked for an earlier row (mt = -inf): corr = inf.
    q, k, v = bf16_inputs(1, 1024, 2, 64, 64.0, seed=1)
    k2, v2 = k[:, :1024 - 48], v[:, :1024 - 48]
    out = run(q, k2, v2, causal=True, rescale="lazy_unfixed")[0]
    tr = fa_lab.trace(q, k2, v2, rows=range(512, 1024), causal=True, rescale="lazy_unfixed")
    neg_inf_drags = tr.steps[(tr.steps.swept) & (tr.steps.mt == -math.inf)]
    assert len(neg_inf_drags) > 0 and (neg_inf_drags["corr"] == math.inf).all()
    assert torch.isnan(out).any()
    assert torch.isfinite(run(q, k2, v2, causal=True, rescale="lazy")[0]).all()


def test_nan_input_propagates():
    q, k, v = bf16_inputs(1, 64, 1, 64, 1.0)
    v = v.clone()
    v[0, 3, 0, 0] = float("nan")
    out = run(q, k, v, causal=False)[0]
    assert torch.isnan(out[..., 0]).all() and torch.isfinite(out[..., 1:]).all()
    assert reference.input_flags(q=q, k=k, v=v) == {"q": False, "k": False, "v": True}
