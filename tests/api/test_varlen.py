"""Varlen (packed) batches: one dense run per sequence, and every bad boundary argument."""


import pytest
import torch
from _shared import packed

import fa_lab
from fa_lab import reference

BF = torch.bfloat16


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("policy, k_scale", [("eager", 4.0), ("lazy_unfixed", 48.0)])
def test_varlen_equals_dense_per_sequence(causal, policy, k_scale):
    lens_q, lens_k = [100, 300, 0, 257], [130, 300, 5, 200]
    q, k, v, cu_q, cu_k = packed(lens_q, lens_k, k_scale=k_scale)
    alibi = torch.tensor([[0.1, 0.2, 0.3, 0.4]] * 4)
    bias = (torch.randn(q.shape[0], 300) * 2).to(BF)
    out, lse = fa_lab.flash_attn_func(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_kv=cu_k,
                                      max_seqlen_q=300, max_seqlen_kv=300, causal=causal,
                                      rescale=policy, return_lse=True, bias=bias, alibi_slopes=alibi)
    assert out.shape == q.shape and lse.shape == (4, 4, 300)
    for b in range(4):
        q0, q1, k0, k1 = int(cu_q[b]), int(cu_q[b + 1]), int(cu_k[b]), int(cu_k[b + 1])
        assert (lse[b, :, q1 - q0:] == float("-inf")).all()  # padding past the sequence
        if q1 == q0:
            continue
        kw = dict(bias=bias[q0:q1, :k1 - k0].contiguous(), alibi_slopes=alibi[b])
        d_out, d_lse = fa_lab.flash_attn_func(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1],
                                              causal=causal, rescale=policy, return_lse=True, **kw)
        # bit for bit: waves never straddle two sequences
        assert torch.equal(out[q0:q1].isnan(), d_out[0].isnan())
        fin = d_out[0].isfinite()
        assert torch.equal(out[q0:q1][fin], d_out[0][fin])
        assert torch.equal(lse[b, :, :q1 - q0].nan_to_num(), d_lse[0].nan_to_num())
        if policy == "eager":
            ref, _ = reference.attention(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1],
                                         causal=causal, dtype=torch.float64,
                                         bias=kw["bias"].double(), alibi_slopes=kw["alibi_slopes"])
            assert (out[q0:q1].double() - ref[0]).abs().max() < 0.05
    if policy == "lazy_unfixed" and not causal:
        assert torch.isnan(out).any()  # the unfixed rebase still overflows in a packed batch


def test_sequence_without_keys_gives_zeros():
    q, k, v, cu_q, cu_k = packed([10, 20], [0, 20])
    out, lse = fa_lab.flash_attn_func(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_kv=cu_k,
                                      max_seqlen_q=20, max_seqlen_kv=20, return_lse=True)
    assert (out[:10] == 0).all() and (lse[0] == float("-inf")).all()


def I32(*x):
    return torch.tensor(x, dtype=torch.int32)


@pytest.mark.parametrize("kw, exc, words", [
    (dict(cu_seqlens_q=I32(0, 10, 30)), ValueError, "cu_seqlens_kv is required"),
    (dict(cu_seqlens_kv=I32(0, 10, 30)), ValueError, "cu_seqlens_q is required"),
    (dict(cu_seqlens_q=I32(0, 20, 10, 30), cu_seqlens_kv=I32(0, 10, 20, 30), max_seqlen_q=20),
     ValueError, "non-decreasing"),
    (dict(cu_seqlens_q=I32(1, 10, 30), cu_seqlens_kv=I32(0, 10, 30), max_seqlen_q=20), ValueError, "start at 0"),
    (dict(cu_seqlens_q=I32(0, 10, 29), cu_seqlens_kv=I32(0, 10, 30), max_seqlen_q=20), ValueError, "ends at 29"),
    (dict(cu_seqlens_q=torch.tensor([0, 10, 30]), cu_seqlens_kv=I32(0, 10, 30), max_seqlen_q=20),
     ValueError, "int32"),
    (dict(cu_seqlens_q=I32(0, 30), cu_seqlens_kv=I32(0, 10, 30), max_seqlen_q=30), ValueError, "sequences"),
    (dict(cu_seqlens_q=I32(0, 10, 30), cu_seqlens_kv=I32(0, 10, 30)), ValueError, "max_seqlen_q is required"),
    (dict(cu_seqlens_q=I32(0, 10, 30), cu_seqlens_kv=I32(0, 10, 30), max_seqlen_q=19), ValueError, "shorter"),
    (dict(cu_seqlens_q=I32(0, 10, 30), cu_seqlens_kv=I32(0, 10, 30), max_seqlen_q=20.0), TypeError, "max_seqlen_q"),
    (dict(cu_seqlens_q=I32(0, 10, 30), cu_seqlens_kv=I32(0, 15, 30), max_seqlen_q=20), ValueError, "max_seqlen_kv is required"),
    (dict(max_seqlen_q=20), ValueError, "varlen calls"),
    (dict(cu_seqlens_q=I32(0, 10, 30), cu_seqlens_kv=I32(0, 10, 30), max_seqlen_q=20,
          bias=torch.zeros(30, 19, dtype=BF)), ValueError, "bias has shape"),
    (dict(cu_seqlens_q=I32(0, 10, 30), cu_seqlens_kv=I32(0, 10, 30), max_seqlen_q=20,
          alibi_slopes=torch.zeros(3, 4)), ValueError, "alibi_slopes has shape"),
])
def test_bad_varlen_arguments(kw, exc, words):
    q, k, v, _, _ = packed([10, 20], [10, 20])
    with pytest.raises(exc, match=words):
        fa_lab.flash_attn_func(q, k, v, **kw)


def test_dense_tensors_with_cu_seqlens_are_rejected():
    q, k, v, cu_q, cu_k = packed([10, 20], [10, 20])
    with pytest.raises(ValueError, match="packed"):
        fa_lab.flash_attn_func(q[None], k[None], v[None], cu_seqlens_q=cu_q, cu_seqlens_kv=cu_k,
                               max_seqlen_q=20)


def test_varlen_fp8_runs_on_the_model_and_the_port_and_fast_refuses_it():
    """FlyDSL #1097 gave the fp8 kernel varlen: the model and the faithful port run it (one
    dense call per sequence); the fast kernel of the dense body refuses it by name."""
    q8 = torch.zeros(30, 2, 128).to(torch.float8_e4m3fn)
    kw = dict(cu_seqlens_q=I32(0, 10, 30), cu_seqlens_kv=I32(0, 10, 30), max_seqlen_q=20,
              q_descale=1.0, k_descale=1.0, v_descale=1.0)
    out = fa_lab.flash_attn_func(q8, q8, q8, **kw)
    assert out.shape == (30, 2, 128) and out.dtype == torch.bfloat16
    assert torch.equal(fa_lab.flash_attn_func(q8, q8, q8, backend="interpret", **kw), out)
    with pytest.raises(ValueError, match="varlen not supported by the swp_fp8 kernel on backend='fast'"):
        fa_lab.flash_attn_func(q8, q8, q8, backend="fast", **kw)
