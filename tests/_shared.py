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


class VirtualTime:
    """A clock that moves only when a stand-in kernel says so: ``now()`` (seconds) for
    ``timing.CpuTimer``, and ``kernel(name, ms_of_round)`` builds a callable that advances it
    by its round's time (and logs its name). ``calls_per_round`` calls make a round, after
    ``warm_calls`` untimed ones (1 s each: time_rounds' warm-up; run's first call too);
    within a round, calls take ``ms``, ``ms``, ... and every third one ``ms + 50`` (an
    outlier the per-round median must drop). Calls past the last round take the last
    round's time (run's call-alternated pairs come after its rounds)."""

    def __init__(self, calls_per_round, warm_calls=1):
        self.t = 0.0
        self.log = []
        self.per_round = calls_per_round
        self.warm = warm_calls

    def now(self):
        return self.t

    def kernel(self, name, ms_of_round, out=None):
        count = [0]

        def fn():
            k = count[0]
            count[0] += 1
            if k < self.warm:  # untimed
                ms = 1000.0
            else:
                r, j = divmod(k - self.warm, self.per_round)
                ms = ms_of_round[min(r, len(ms_of_round) - 1)] + (50.0 if j % 3 == 2 else 0.0)
            self.t += ms * 1e-3
            self.log.append(name)
            return out
        return fn

    def failing(self, on_call, message):
        """A callable that takes 1 ms a call and raises RuntimeError(``message``) on call
        number ``on_call`` (from 1)."""
        calls = [0]

        def fn():
            calls[0] += 1
            self.t += 1e-3
            if calls[0] == on_call:
                raise RuntimeError(message)
        return fn


class CappedClock:
    """A GPU stand-in whose clock drops once: calls of ``work`` ms take ``work`` ms of
    virtual time (``now()``, seconds) until ``t_drop`` (s), then ``work / 0.8`` (a power
    cap pulling the SM clock from 100 % to 80 %)."""

    def __init__(self, t_drop):
        self.t, self.t_drop = 0.0, t_drop

    def now(self):
        return self.t

    def kernel(self, work_ms):
        def fn():
            self.t += work_ms * 1e-3 / (1.0 if self.t < self.t_drop else 0.8)
        return fn
