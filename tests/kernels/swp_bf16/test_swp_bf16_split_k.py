"""Split-K in the bf16 model: upstream's split boundaries, the combine against the
reference, and how shorter loops move the unfixed path's NaN."""

import pytest
import torch

import fa_lab
from fa_lab import reference
from fa_lab.studies.experiments import bf16_inputs
from fa_lab.kernels.swp_bf16.model import split_ranges


@pytest.mark.parametrize("n, splits, want", [
    (8, 2, [(0, 8), (6, 6)]),            # chunk 6; the 2-tile remainder joins split 0
    (10, 2, [(0, 6), (6, 10)]),
    (12, 4, [(0, 6), (6, 12), (12, 12), (18, 18)]),  # chunk floor of 6 tiles
    (128, 4, [(0, 32), (32, 64), (64, 96), (96, 128)]),
    (4, 3, [(0, 4), (6, 6), (12, 12)]),
])
def test_split_ranges_by_hand(n, splits, want):
    assert split_ranges(n, splits) == want


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("splits", [2, 3])
def test_split_k_eager_matches_reference(causal, splits):
    q, k, v = bf16_inputs(1, 640, 2, 64, 2.0, seed=0)
    sink = torch.tensor([1.0, 6.0])
    out, lse = fa_lab.flash_attn_func(q, k, v, causal=causal, rescale="eager", return_lse=True,
                                      num_kv_splits=splits, sink=sink)
    ref, ref_lse = reference.attention(q, k, v, causal=causal, dtype=torch.float64, sink=sink)
    # the combine rounds each split's partial to bf16 once more: 2 more roundings
    assert (out.double() - ref).abs().max() < 8 * 2.0**-8 * v.double().abs().max()
    assert (lse.double() - ref_lse).abs().max() < 2e-2
    # one split and the plain path are the same computation
    one = fa_lab.flash_attn_func(q, k, v, causal=causal, rescale="eager", num_kv_splits=1, sink=sink)
    plain = fa_lab.flash_attn_func(q, k, v, causal=causal, rescale="eager", sink=sink)
    assert torch.equal(one, plain)


def test_shorter_loops_drag_less():
    """Each split runs its own prologue and eager epilogue, so a split of 6 tiles has only
    2 loop tiles where a wave can drag a row: more splits, less NaN."""
    q, k, v = bf16_inputs(1, 2048, 2, 64, 48.0, seed=0)
    frac = {s: torch.isnan(fa_lab.flash_attn_func(q, k, v, causal=False, rescale="lazy_unfixed",
                                                  num_kv_splits=s)).float().mean().item()
            for s in (1, 2, 4)}
    assert frac[1] > frac[2] > frac[4] > 0
    for policy in ("lazy", "eager"):
        assert torch.isfinite(fa_lab.flash_attn_func(q, k, v, causal=False, rescale=policy,
                                                     num_kv_splits=4)).all()


@pytest.mark.parametrize("kw, exc, words", [
    (dict(num_kv_splits=0), ValueError, "num_kv_splits must be >= 1"),
    (dict(num_kv_splits=2.0), TypeError, "num_kv_splits must be an int"),
])
def test_bad_splits(kw, exc, words):
    q, k, v = bf16_inputs(1, 384, 1, 64, 1.0)
    with pytest.raises(exc, match=words):
        fa_lab.flash_attn_func(q, k, v, **kw)


def test_split_k_needs_long_sequences_and_a_tile_per_split():
    q, k, v = bf16_inputs(1, 383, 1, 64, 1.0)
    with pytest.raises(ValueError, match="seq_len >= 384"):
        fa_lab.flash_attn_func(q, k, v, num_kv_splits=2)
    q8 = torch.zeros(1, 512, 1, 128).to(torch.float8_e4m3fn)  # fp8 split-K: FlyDSL #1097
    with pytest.raises(ValueError, match="num_kv_splits=9 exceeds the 8 KV tiles"):
        fa_lab.flash_attn_func(q8, q8, q8, num_kv_splits=9, q_descale=1.0, k_descale=1.0, v_descale=1.0)
