"""The gfx950 primitives the models are written in (docs/semantics.md §1.1).

Every function takes and returns fp32 tensors (the kernels' accumulators are fp32), so a
rounding is always explicit: ``bf16(x)`` is an fp32 tensor holding bfloat16 values.
Shared by the models, the Triton ports' tests and the notebooks.
"""

from __future__ import annotations

import contextlib
import math
import struct

import torch

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
E4M3_MAX = 448.0
# Causal rows floor their running max here so that a fully masked row keeps a finite base.
CAUSAL_FLOOR = -3e38
# The smallest normal fp32 value; below it fp32 values are multiples of 2**-149.
FP32_TINY = 2.0 ** -126


def f32(x: float) -> float:
    """Round a Python float to the nearest fp32 value, ties to even, past fp32's range to
    +-inf (what a kernel constant holds). Host arithmetic only: it runs on every call."""
    try:
        return struct.unpack("f", struct.pack("f", x))[0]
    except OverflowError:  # |x| rounds past FLT_MAX
        return math.copysign(math.inf, x)


def log2_scale(q_descale: float, k_descale: float, head_dim: int = 128) -> float:
    """The fp8 kernels' score scale in log2 units (FlyDSL's ``c_logit_scale``), so a raw fp8
    product S is ``S * ls`` log2 units: the descales' fp32 product first, then the softmax
    constant times it, ``ls = f32(c * f32(q_descale * k_descale))`` with ``c =
    f32(f32(1/sqrt(D)) * f32(log2 e))`` (``DualwaveFp8KernelContext.init_descale``,
    docs/semantics.md §3.1). The kernel takes 1/sqrt(D) from a fast rsqrt; this takes the
    correctly rounded value."""
    c = f32(f32(1.0 / math.sqrt(head_dim)) * f32(LOG2E))
    return f32(c * f32(f32(q_descale) * f32(k_descale)))


def bf16(x: torch.Tensor) -> torch.Tensor:
    """Round to nearest even to bfloat16 (``v_cvt_pk_bf16_f32``); inf and NaN pass."""
    return x.to(torch.bfloat16).to(torch.float32)


def f16(x: torch.Tensor) -> torch.Tensor:
    """Round to nearest even to float16 (overflow to inf, as the f16 kernel's packs)."""
    return x.to(torch.float16).to(torch.float32)


def bf16_trunc(x: torch.Tensor) -> torch.Tensor:
    """Drop the low 16 bits of an fp32 value (the generic kernel's P pack)."""
    bits = x.contiguous().view(torch.int32) & ~0xFFFF
    return bits.view(torch.float32)


def round_to(dtype: torch.dtype):
    """The P-pack / Q rounding of a kernel whose inputs are ``dtype``."""
    if dtype == torch.bfloat16:
        return bf16
    if dtype == torch.float16:
        return f16
    raise TypeError(f"no 16-bit rounding for dtype {dtype}")


def e4m3(x: torch.Tensor, saturate: bool = True) -> torch.Tensor:
    """Round to nearest even to OCP float8_e4m3fn, subnormals down to 2**-9.

    ``saturate=True`` clamps out-of-range values (infinities included) to +-448, as a
    saturating conversion does; ``saturate=False`` turns every value that rounds past 448
    into NaN: |x| > 464 (464 itself, the midpoint to the NaN code 480, ties to the even 448,
    as a bit-level round to nearest even does). NaN stays NaN either way.
    """
    x = x.to(torch.float32)
    if saturate:
        y = x.clamp(-E4M3_MAX, E4M3_MAX)
    else:
        y = torch.where(x.abs() > 464.0, torch.full_like(x, float("nan")), x)
    # In range, torch's conversion is round-to-nearest-even with subnormals (checked in tests).
    return y.to(torch.float8_e4m3fn).to(torch.float32)


def exp2(x: torch.Tensor) -> torch.Tensor:
    """2**x of fp32 x, correctly rounded to fp32 (through fp64): +inf from x >= 128,
    subnormals kept, 0 at -inf, NaN stays NaN. Correct rounding is the one definition that
    every device reproduces: the CPU's and CUDA's fp32 exp2 each err by up to 1-2 ulps in
    their own ways, and an approximate exp2 moves outputs across the overflow boundary
    (docs/performance.md has the GPU's count)."""
    return torch.exp2(x.to(torch.float64)).to(torch.float32)


def fmax(a: torch.Tensor, b: torch.Tensor | float) -> torch.Tensor:
    """maxNum: the non-NaN operand wins; fmax(-inf, x) = x."""
    if not isinstance(b, torch.Tensor):
        b = torch.full_like(a, b)
    return torch.fmax(a, b)


def le(a: torch.Tensor, b: torch.Tensor | float) -> torch.Tensor:
    """a <= b, False when either side is NaN (an ordered compare)."""
    return a <= b


def guarded_rcp(l: torch.Tensor) -> torch.Tensor:
    """The epilogue's ``rcp(l) if l > 0 else 0``; rcp(inf) = 0, NaN l gives 0."""
    return torch.where(l > 0, 1.0 / l, torch.zeros_like(l))


def fma_f32(a: torch.Tensor, b: float | torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """fp32 fused multiply-add a*b + c with one rounding to nearest even (IEEE fma).

    The product of two fp32 values is exact in fp64 (48 significant bits). Rounding their
    fp64 sum to fp32 rounds twice, and that goes the wrong way only where the fp64 sum
    lands exactly on an fp32 halfway point that the exact value is not on: an fp64 value
    whose low 29 stored bits are ``1 << 28`` in fp32's normal range, an odd multiple of
    2**-150 below it. There the sum is rounded to odd instead: its rounding error (TwoSum,
    exact) says on which side the exact value lies, and the sum moves one fp64 ulp towards
    it, so the fp32 rounding that follows is the one rounding of the exact value
    (53 >= 24 + 2 bits). ``b`` is an fp32 value (a tensor, or a float that fp32 holds
    exactly).
    """
    # One device for all three: a float b, or a 0-d CPU tensor beside CUDA ones (which
    # addcmul would accept), is indexed below with indices on the others' device.
    dev = next((t.device for t in (a, b, c) if isinstance(t, torch.Tensor) and t.device.type != "cpu"),
               torch.device("cpu"))
    a64, c64 = a.to(dev, torch.float64), c.to(dev, torch.float64)
    b64 = (b.to(dev, torch.float64) if isinstance(b, torch.Tensor)
           else torch.tensor(b, dtype=torch.float64, device=dev))
    s = torch.atleast_1d(torch.addcmul(c64, a64, b64))  # the product is exact: one rounding
    out = s.to(torch.float32)
    mag = out.abs()  # fp32's halfway points: bit 28 alone below it, or below FP32_TINY
    maybe = ((s.view(torch.int64) & 0x1FFFFFFF) == 0x10000000) | ((mag <= FP32_TINY) & (mag > 0))
    flat = maybe.view(-1).nonzero().squeeze(1)
    if flat.numel():
        at = torch.unravel_index(flat, s.shape)
        st = s[at]
        u = st * 2.0 ** 150
        tie = torch.where(st.abs() < FP32_TINY, (u == u.trunc()) & (u.remainder(2) == 1),
                          (st.view(torch.int64) & 0x1FFFFFFF) == 0x10000000)
        pt, ct = (torch.atleast_1d(x).expand_as(s)[at] for x in (a64, c64))
        pt = pt * torch.atleast_1d(b64).expand_as(s)[at]
        z = st - pt
        err = (pt - (st - z)) + (ct - z)  # exact: st + err == pt + ct
        step = torch.where(tie & (err != 0), torch.where((err > 0) == (st > 0), 1, -1), 0)
        out[at] = (st.view(torch.int64) + step).view(torch.float64).to(torch.float32)
    return out.reshape(torch.broadcast_shapes(a.shape, b64.shape, c.shape))


def exact_dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b for fp32 tensors holding 16-bit values, as the correctly rounded fp32 of the
    exact dot product: each product of two bf16/f16 values is exact in fp64, their fp64 sum
    over <= 128 terms is exact (or off by 2**-53 of the largest term), then one rounding to
    fp32. This is the models' definition of a dot product because it has no summation
    order: the CPU, cuBLAS and a Triton port all give it bit for bit, where fp32 sums in
    each one's own order disagree in the last bits and, at an overflow boundary, in the
    NaN mask. The MFMA's fp32 accumulation approximates it to a few ulps."""
    return (a.to(torch.float64) @ b.to(torch.float64)).to(torch.float32)


@contextlib.contextmanager
def ieee_fp32_matmul():
    """Disable TF32 for fp32 matmuls inside (CUDA would otherwise be allowed to use it)."""
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old
