"""DUALWAVE_SWP extras in the bf16 model (bias, ALiBi, sink) and FA4's per-row policy:
eager against the fp64 reference with the same modifiers folded in, and what each one
does to the unfixed path's NaN."""


import pytest
import torch

import fa_lab
from fa_lab import metrics, reference
from fa_lab.studies.experiments import bf16_inputs

U = 2.0**-8  # bf16 unit roundoff


@pytest.fixture(scope="module")
def inputs():
    q, k, v = bf16_inputs(1, 700, 2, 64, 8.0, seed=0)
    g = torch.Generator().manual_seed(1)
    mods = {
        "bias": {"bias": (torch.randn(700, 700, generator=g) * 4).bfloat16()},
        "alibi_h": {"alibi_slopes": torch.tensor([0.5, 0.05])},
        "alibi_bh": {"alibi_slopes": torch.tensor([[0.25, 0.01]])},
        "sink": {"sink": torch.tensor([3.0, 40.0])},
    }
    return (q, k, v), mods


@pytest.mark.parametrize("mod", ["bias", "alibi_h", "alibi_bh", "sink"])
@pytest.mark.parametrize("causal", [False, True])
def test_eager_with_modifiers_matches_reference(inputs, mod, causal):
    (q, k, v), mods = inputs
    kw = mods[mod]
    out, lse = fa_lab.flash_attn_func(q, k, v, causal=causal, rescale="eager", return_lse=True, **kw)
    ref, ref_lse = reference.attention(q, k, v, causal=causal, dtype=torch.float64, **kw)
    assert torch.isfinite(out).all()
    assert (out.double() - ref).abs().max() <= 6 * U * v.double().abs().max()
    # LSE: Q is rounded to bf16 after scaling, so scores err by u * sum|q_i k_i| / sqrt(D)
    smax = torch.einsum("bshd,bthd->bhst", q.double().abs(), k.double().abs()).amax(-1) / 8
    assert ((lse.double() - ref_lse).abs() <= 2 * U * smax + 1e-4).all()


def test_sink_can_dominate_the_row(inputs):
    (q, k, v), _ = inputs
    # a sink far above every score takes all the mass: output -> 0, lse -> sink
    out, lse = fa_lab.flash_attn_func(q, k, v, causal=False, return_lse=True,
                                      sink=torch.tensor([500.0, 500.0]))
    assert out.abs().max() == 0 and torch.allclose(lse, torch.full_like(lse, 500.0))


def nan_frac(q, k, v, policy, **kw):
    return torch.isnan(fa_lab.flash_attn_func(q, k, v, causal=False, rescale=policy, **kw)).float().mean().item()


def test_what_each_modifier_does_to_the_unfixed_nan():
    """Bias and ALiBi reshape the score range the ballot sees, so they move where the
    unfixed rebase overflows; the sink is folded in after the last tile and cannot undo
    an overflow that already happened. Fixed lazy and eager stay finite with all three."""
    q, k, v = bf16_inputs(1, 1024, 2, 64, 32.0, seed=0)
    g = torch.Generator().manual_seed(0)
    base = nan_frac(q, k, v, "lazy_unfixed")
    widened = nan_frac(q, k, v, "lazy_unfixed", bias=(torch.randn(1024, 1024, generator=g) * 20).bfloat16())
    alibi = nan_frac(q, k, v, "lazy_unfixed", alibi_slopes=torch.tensor([0.5, 0.05]))
    sink = nan_frac(q, k, v, "lazy_unfixed", sink=torch.tensor([3.0, 200.0]))
    assert 0 < base < widened  # a wider score range: more drags past 2**128
    assert alibi > base  # ALiBi makes tile maxima fall with distance: victims everywhere
    assert sink >= base  # the sink comes too late to help
    for policy in ("lazy", "eager"):
        for kw in ({"bias": (torch.randn(1024, 1024, generator=g) * 20).bfloat16()},
                   {"alibi_slopes": torch.tensor([0.5, 0.05])}, {"sink": torch.tensor([3.0, 200.0])}):
            assert nan_frac(q, k, v, policy, **kw) == 0


def test_fa4_row_policy_never_scales_up_and_stays_accurate():
    q, k, v = bf16_inputs(1, 1024, 2, 64, 64.0, seed=0)
    ref, _ = reference.attention(q, k, v, causal=False)
    out = fa_lab.flash_attn_func(q, k, v, causal=False, rescale="fa4_row")
    eager = fa_lab.flash_attn_func(q, k, v, causal=False, rescale="eager")
    assert torch.isfinite(out).all()
    assert metrics.rel_l2(out, ref) <= 1.01 * metrics.rel_l2(eager, ref)
    tr = fa_lab.trace(q, k, v, rows=range(64), causal=False, rescale="fa4_row")
    st = tr.steps
    assert (st["corr"] <= 1).all()
    # per row: only rows that voted themselves rebase; others in a fired wave keep m
    loop = st[st.phase == "loop"]
    assert ((loop["corr"] < 1) <= loop.vote).all()
    assert (loop.fire & ~loop.vote).any()


@pytest.mark.parametrize("kw, exc, words", [
    (dict(bias=torch.zeros(700, 699, dtype=torch.bfloat16)), ValueError, r"bias has shape \[700, 699\]"),
    (dict(bias=torch.zeros(700, 700)), TypeError, "bias must be torch.bfloat16"),
    (dict(sink=torch.zeros(2, dtype=torch.float64)), TypeError, "sink must be torch.float32"),
    (dict(bias=[[0.0]]), TypeError, "bias must be a torch.Tensor"),
    (dict(bias=torch.zeros(700, 700, dtype=torch.int32)), TypeError, "bias must be torch.bfloat16"),
    (dict(alibi_slopes=torch.zeros(3)), ValueError, "alibi_slopes has shape"),
    (dict(alibi_slopes=torch.zeros(2, 2)), ValueError, "alibi_slopes has shape"),
    (dict(sink=torch.zeros(1, 2)), ValueError, "sink has shape"),
])
def test_bad_modifiers(inputs, kw, exc, words):
    (q, k, v), _ = inputs
    with pytest.raises(exc, match=words):
        fa_lab.flash_attn_func(q, k, v, **kw)


def test_modifiers_rejected_on_fp8():
    from fa_lab.studies.experiments import fp8_inputs
    (q8, k8, v8), (qd, kd, vd) = fp8_inputs(1, 64, 2, 1.0)
    with pytest.raises(ValueError, match="sink is not supported with float8"):
        fa_lab.flash_attn_func(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd,
                               sink=torch.zeros(2))
    with pytest.raises(ValueError, match="bias is not supported with float8"):
        fa_lab.flash_attn_func(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd,
                               bias=torch.zeros(64, 64, dtype=torch.float8_e4m3fn))


def test_modifiers_run_on_the_triton_port(inputs):
    # the faithful port takes them too (tests/kernels/swp_bf16/test_swp_bf16_faithful_features.py checks it
    # against the model); backend='triton' still needs GPU tensors
    (q, k, v), mods = inputs
    q, k, v = q[:, :256], k[:, :300], v[:, :300]
    kw = dict(causal=True, rescale="lazy", return_lse=True, **mods["sink"])
    out, lse = fa_lab.flash_attn_func(q, k, v, backend="interpret", **kw)
    ref, ref_lse = fa_lab.flash_attn_func(q, k, v, backend="emulator", **kw)
    assert (out.float() - ref.float()).abs().max() <= 2 * U * ref.float().abs().max()
    assert torch.allclose(lse, ref_lse, rtol=1e-5)
    with pytest.raises(ValueError, match="CUDA"):
        fa_lab.flash_attn_func(q, k, v, backend="triton", **mods["sink"])
