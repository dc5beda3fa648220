"""The fp8 BN128 model against an fp32 reference on dequantised inputs, the seed's V = ones
cases at small size, and the rebase rules' defining properties."""


import pytest
import torch

import fa_lab
from fa_lab import metrics, reference
from fa_lab.studies.experiments import fp8_inputs, quantize_e4m3
from fa_lab.kernels.swp_fp8.model import log2_scale


def run(inputs, descales, **kw):
    (q, k, v), (qd, kd, vd) = inputs, descales
    return fa_lab.flash_attn_func(q, k, v, q_descale=qd, k_descale=kd, v_descale=vd,
                                  return_lse=True, backend="emulator", **kw)


def random_fp8(B, Sq, Skv, H, Hkv, k_scale=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    q8, qd = quantize_e4m3(torch.randn(B, Sq, H, 128, generator=g))
    k8, kd = quantize_e4m3(k_scale * torch.randn(B, Skv, Hkv, 128, generator=g))
    v8, vd = quantize_e4m3(torch.randn(B, Skv, Hkv, 128, generator=g))
    return (q8, k8, v8), (qd, kd, vd)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq, skv, h, hkv", [(300, 700, 2, 1), (513, 200, 4, 2), (64, 64, 1, 1)])
@pytest.mark.parametrize("policy", ["eager", "lazy"])
def test_matches_reference_on_dequantised_inputs(causal, sq, skv, h, hkv, policy):
    inputs, ds = random_fp8(1, sq, skv, h, hkv, k_scale=4.0)
    out, lse = run(inputs, ds, causal=causal, rescale=policy, p_headroom=True)
    ref, ref_lse = reference.attention(*inputs, causal=causal, q_descale=ds[0], k_descale=ds[1],
                                       v_descale=ds[2], dtype=torch.float64)
    # P is quantised to e4m3 (3 mantissa bits, relative error <= 2**-4): per element that
    # is far coarser than bf16, but it averages out over a row's columns.
    live = ref.abs().sum(-1) > 0
    assert torch.isfinite(out).all()
    assert metrics.rel_l2(out[live], ref[live]) < 3e-2
    fin = torch.isfinite(ref_lse)
    assert torch.equal(torch.isinf(lse), ~fin)
    assert (lse.double() - ref_lse)[fin].abs().max() < 2e-2


def test_v_ones_gives_ones_where_finite():
    inputs, ds = fp8_inputs(1, 1024, 2, 1000.0, seed=0)
    for policy, bound in (("eager", None), ("lazy", None), ("lazy_capped", 16.0), ("lazy_unfixed", None)):
        out, _ = run(inputs, ds, causal=False, rescale=policy, rebase_bound=bound)
        assert torch.isfinite(out).all()
        assert (out.double() - 1).abs().mean() < 1e-2


def test_seed_onset_at_small_size():
    # k x20000: the unfixed rebase overflows; bound 16, monotonic and eager stay finite.
    inputs, ds = fp8_inputs(1, 1024, 2, 20000.0, seed=0)
    nans = {}
    for label, policy, bound in (("unfixed", "lazy_unfixed", None), ("bound16", "lazy_capped", 16.0),
                                 ("monotonic", "lazy", None), ("eager", "eager", None)):
        out, _ = run(inputs, ds, causal=False, rescale=policy, rebase_bound=bound)
        nans[label] = int(torch.isnan(out).sum())
    assert nans["unfixed"] > 0.1 * 1024 * 2 * 128
    assert nans["bound16"] == nans["monotonic"] == nans["eager"] == 0


def test_monotonic_with_zero_threshold_is_eager_bit_for_bit():
    inputs, ds = fp8_inputs(1, 700, 2, 5000.0, seed=1)
    eager = run(inputs, ds, causal=True, rescale="eager")
    lazy = run(inputs, ds, causal=True, rescale="lazy", rescale_threshold=0.0)
    assert torch.equal(eager[0], lazy[0]) and torch.equal(eager[1], lazy[1])


def test_rules_in_the_trace():
    inputs, ds = fp8_inputs(1, 1024, 1, 5000.0, seed=0)
    rows = range(0, 256)
    ls = log2_scale(ds[0], ds[1])
    tr = {p: fa_lab.trace(*inputs, q_descale=ds[0], k_descale=ds[1], v_descale=ds[2], rows=rows,
                          causal=False, rescale=p, rebase_bound=b)
          for p, b in (("lazy_unfixed", None), ("lazy_capped", 16.0), ("lazy", None), ("eager", None))}
    steps = {p: t.steps for p, t in tr.items()}
    # every pair is a step of 128 columns; the first pair always fires (m = -inf before it)
    assert (steps["lazy"].col0 % 128 == 0).all()
    assert steps["lazy"][steps["lazy"].step == 0].fire.all()
    # monotonic and eager never scale up; the unfixed rule does on dragged rows
    for p in ("lazy", "eager"):
        assert (steps[p]["corr"] <= 1).all()
    dragged = steps["lazy_unfixed"][steps["lazy_unfixed"].swept]
    assert len(dragged) > 0 and (dragged["corr"] > 1).all()
    # the cap: a single step never scales up by more than 2**bound
    assert (steps["lazy_capped"]["corr"] <= 2.0**16 * (1 + 1e-6)).all()
    # and a skipped rebase keeps m: where the drop exceeded the bound, m did not move
    cap = steps["lazy_capped"].sort_values(["lane", "step"])
    prev_m = cap.groupby("lane")["m"].shift()
    big_drop = cap.fire & ((cap.mt - prev_m) * ls < -16)
    assert big_drop.any() and (cap.m[big_drop] == prev_m[big_drop]).all()
    assert tr["eager"].log2_per_unit == pytest.approx(ls)


def test_headroom_lifts_the_largest_p_to_448():
    from fa_lab.numerics import e4m3
    inputs, ds = fp8_inputs(1, 256, 1, 100.0, seed=0)
    # eager with headroom: the row max has P = 2**log2(448) = 448 after the cast
    pol = fa_lab.policies.resolve(fp8=True, seqlen_kv=256, rescale="eager", p_headroom=True)
    assert e4m3(torch.exp2(torch.tensor(pol.p_headroom, dtype=torch.float32))).item() == 448.0
    out_h, lse_h = run(inputs, ds, causal=False, rescale="eager", p_headroom=True)
    out_0, lse_0 = run(inputs, ds, causal=False, rescale="eager")
    # the lift cancels in out / l and in the LSE read-out, up to P's quantisation
    assert torch.allclose(lse_h, lse_0, atol=1e-3)
    assert (out_h.double() - out_0.double()).abs().max() < 2e-2


def test_saturate_option_changes_only_overflowing_casts():
    inputs, ds = fp8_inputs(1, 1024, 2, 5000.0, seed=0)
    sat = run(inputs, ds, causal=False, rescale="lazy", fp8_saturate=True)[0]
    nan = run(inputs, ds, causal=False, rescale="lazy", fp8_saturate=False)[0]
    assert torch.equal(sat, nan)  # monotonic: P <= 2**THR = 256 < 448, no cast overflows
    # with a headroom that pushes P past 448, only the NaN-mode cast produces NaN
    sat = run(inputs, ds, causal=False, rescale="lazy", p_headroom=4.0, fp8_saturate=True)[0]
    nan = run(inputs, ds, causal=False, rescale="lazy", p_headroom=4.0, fp8_saturate=False)[0]
    assert torch.isfinite(sat).all() and torch.isnan(nan).any()
