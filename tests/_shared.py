"""Helpers several test files share (pytest puts tests/ on sys.path)."""

import itertools
from pathlib import Path

import pytest
import torch

from fa_lab import reference
from fa_lab.metrics import rel_l2

BF16 = torch.bfloat16
#: bf16 output and P roundings: the fast kernels' rel-L2 against fp32 attention stays below.
BF16_TOL = 1e-2


def check_against_reference(out, lse, q, k, v, causal, tol=BF16_TOL):
    """[B, S, H, D] outputs against the fp32 reference; rows that see no key give 0, -inf."""
    ref, ref_lse = reference.attention(q.cpu(), k.cpu(), v.cpu(), causal=causal)
    out, lse = out.cpu(), lse.cpu()
    assert torch.isfinite(out.float()).all()
    assert rel_l2(out, ref) < tol
    empty = torch.isinf(ref_lse)
    assert torch.equal(torch.isinf(lse), empty)
    assert (out.float().permute(0, 2, 1, 3)[empty] == 0).all()
    assert torch.allclose(lse[~empty], ref_lse[~empty], atol=2e-2, rtol=0)


def packed(lens_q, lens_k, H=4, Hkv=2, D=64, k_scale=8.0, seed=0):
    """Packed varlen inputs: q [total_q, H, D], k and v [total_kv, Hkv, D] (k scaled by
    ``k_scale``), and int32 cu_seqlens for the given per-sequence lengths."""
    g = torch.Generator().manual_seed(seed)
    cu_q = torch.tensor([0, *itertools.accumulate(lens_q)], dtype=torch.int32)
    cu_k = torch.tensor([0, *itertools.accumulate(lens_k)], dtype=torch.int32)
    q = torch.randn(int(cu_q[-1]), H, D, generator=g).to(BF16)
    k = (torch.randn(int(cu_k[-1]), Hkv, D, generator=g) * k_scale).to(BF16)
    v = torch.randn(int(cu_k[-1]), Hkv, D, generator=g).to(BF16)
    return q, k, v, cu_q, cu_k


def assert_lse_close(lse_k, lse_m):
    """A port's LSE against the model's: same masks checked elsewhere; finite entries
    within 1e-5 of the largest finite |LSE|."""
    fin = torch.isfinite(lse_m)
    if fin.any():
        err = (lse_k.double() - lse_m.double())[fin].abs().max()
        assert err <= 1e-5 * lse_m[fin].abs().max() + 1e-6, f"lse: max |kernel - model| {err:.3g}"


def sm90_target():
    """Triton's sm_90 target, for compiling on the CPU (Triton's NVIDIA back end and its
    ptxas run here). Skips only where this Triton has no NVIDIA back end or ptxas; a
    kernel that fails to compile then fails its test."""
    import triton
    from triton.backends import backends
    from triton.backends.compiler import GPUTarget

    bin_dir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    if "nvidia" not in backends or not any((bin_dir / n).exists() for n in ("ptxas", "ptxas-blackwell")):
        pytest.skip("this Triton has no NVIDIA back end or ptxas to compile for sm_90")
    return GPUTarget("cuda", 90, 32)
