"""onset.bound for FlyDSL #1097's fp8 split-K (``fa_lab.studies.onset.fp8_split``): the dense
fp8 region per split, and the combine's unit contract. With raw maxima (aiter #4676's
recorded bug) the region is exact: rows that see keys in two splits with different maxima
come out wrong, a call with one live split per row comes out as #1097's. Inputs inside
never fail against the fp64 reference."""

import pytest
import torch

from fa_lab import metrics, reference
from fa_lab.kernels.swp_fp8 import split
from fa_lab.studies import onset
from fa_lab.studies.experiments import quantize_e4m3

SCALED, RAW = "flydsl-20a76439", "aiter-4676-raw-m"


def inputs(skv, sq=300, seed=0, k_scale=3.0):
    g = torch.Generator().manual_seed(seed)
    q8, qd = quantize_e4m3(torch.randn(1, sq, 2, 128, generator=g))
    k8, kd = quantize_e4m3(torch.randn(1, skv, 1, 128, generator=g) * k_scale)
    v8, vd = quantize_e4m3(torch.randn(1, skv, 1, 128, generator=g))
    return q8, k8, v8, dict(q_descale=qd, k_descale=kd, v_descale=vd)


def run(q8, k8, v8, ds, splits, version, policy):
    return split.forward(q8, k8, v8, **ds, causal=True, policy=policy, num_kv_splits=splits,
                         upstream=version)[0].double()


def test_the_region_is_the_dense_one_per_split_and_the_combine():
    r, raw = onset.bound("swp_fp8_split"), onset.bound(f"swp_fp8_split:{RAW}")
    dense = onset.bound(r.policy, dtype="fp8", tolerance=0.25 - 2.0 ** -8)
    names = [h.name for h in dense.hazards]
    assert [h.name for h in r.hazards] == names + ["raw split maxima", "LSE keeps the P headroom"]
    never = {h.name: h.never for h in r.hazards}
    assert never["raw split maxima"] and not {h.name: h.never for h in raw.hazards}[
        "raw split maxima"]
    assert never["LSE keeps the P headroom"]          # both versions take H off the LSE
    assert r.version == SCALED and raw.version == RAW


def test_raw_maxima_are_wrong_exactly_where_two_live_splits_differ():
    """900 keys in 3 splits: rows see keys in several splits with different maxima, so the
    raw version is outside (and far off), #1097 inside (and close to the one-split call
    and the fp64 reference). 300 keys make one split: inside for both, bit for bit."""
    scaled, raw = onset.bound("swp_fp8_split"), onset.bound(f"swp_fp8_split:{RAW}")
    pol = scaled.policy
    q8, k8, v8, ds = inputs(900, sq=128)
    m = onset.fp8_split.measure(q8, k8, v8, **ds, causal=True, num_kv_splits=3)
    assert m.unequal_live and raw.violated(m) == ["raw split maxima"] and scaled.contains(m)
    ref = reference.attention(q8, k8, v8, causal=True, dtype=torch.float64, **ds)[0]
    good, bad = run(q8, k8, v8, ds, 3, SCALED, pol), run(q8, k8, v8, ds, 3, RAW, pol)
    vmax = float(v8.float().abs().max()) * ds["v_descale"]
    assert float((good - ref).abs().max()) <= 0.25 * vmax
    assert metrics.rel_l2(good, ref) < 3e-2 and metrics.rel_l2(bad, ref) > 0.3
    q8, k8, v8, ds = inputs(300, sq=64)
    one = onset.fp8_split.measure(q8, k8, v8, **ds, causal=True, num_kv_splits=3)
    assert not one.unequal_live and raw.contains(one) and len(one.parts) == 1
    assert torch.equal(run(q8, k8, v8, ds, 3, SCALED, pol), run(q8, k8, v8, ds, 3, RAW, pol))


@pytest.mark.parametrize("seed,k_scale", [(1, 1.0), (2, 12.0)])
def test_inputs_inside_the_region_do_not_fail(seed, k_scale):
    region = onset.bound("swp_fp8_split")
    q8, k8, v8, ds = inputs(700, sq=200, seed=seed, k_scale=k_scale)
    m = onset.fp8_split.measure(q8, k8, v8, **ds, causal=True, num_kv_splits=2)
    assert region.contains(m) and len(m.parts) == 2
    out = run(q8, k8, v8, ds, 2, SCALED, region.policy)
    ref = reference.attention(q8, k8, v8, causal=True, dtype=torch.float64, **ds)[0]
    vmax = float(v8.float().abs().max()) * ds["v_descale"]
    assert torch.isfinite(out).all() and float((out - ref).abs().max()) <= region.dense.tolerance * vmax


def test_refusals_name_why():
    with pytest.raises(ValueError, match="semantics of its own"):
        onset.bound("swp_fp8_split:sdpa_masked_row:before")
    with pytest.raises(ValueError, match="tolerance"):
        onset.fp8_split.region(tolerance=2.0 ** -9)
    q8, k8, v8, ds = inputs(200, sq=8)
    with pytest.raises(TypeError, match="q8"):
        onset.fp8_split.measure(q8.float(), k8, v8, **ds, causal=True, num_kv_splits=2)
    with pytest.raises(ValueError, match="num_kv_splits"):
        onset.fp8_split.measure(q8, k8, v8, **ds, causal=True, num_kv_splits=0)
