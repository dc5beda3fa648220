"""exp2 split between the SFU and the FMA units (the idea of FlashAttention-4's software
exp2), for the fast kernels' P tile.

Hopper's SFU (``ex2.approx``) serves 16 lanes per clock per SM; with fp8 tensor cores an
attention tile's exponentials take about as long as its two GEMMs. ``exp2_split`` sends
one element of every ``POLY_EVERY`` (2, 4 or 8; 0: none) through a cubic on the FMA
units instead, so the two pipes share the work.

The cubic (``poly_exp2``, the same arithmetic in NumPy for checks on any machine):

- clamp x to [-127, 128] (NaN stays NaN: ``max.NaN``/``min.NaN``);
- j = round-to-nearest(x) through the fp32 magic number 1.5 * 2**23, f = x - j in
  [-0.5, 0.5];
- p = 1 + f (C1 + f (C2 + f C3)), relative error below ``POLY_REL_ERROR`` against 2**f
  (coefficients fitted here for the minimax relative error with p(0) = 1 fixed);
- the result's bits are p's plus j << 23 (j added to the exponent field), with NaN put
  back for NaN inputs.

So integers are exact (p(0) = 1): 2**-127 and below give +0 (as -inf does), 128 and
above give +inf, as the SFU's ``ex2.approx.ftz`` does. Between 2**-127 and 2**-126 the
cubic gives a subnormal where the SFU flushes to 0; nothing in a P tile can tell them
apart (a row's sum holds at least 1, its max's P).
"""

from __future__ import annotations

import numpy as np
import triton
import triton.language as tl

#: p(f) = 1 + f (C1 + f (C2 + f C3)) ~ 2**f on [-0.5, 0.5].
C1, C2, C3 = 0.693282900442158, 0.24221037357288572, 0.05500858113379823
#: The bound ``tests`` check the cubic against (its fitted error is 1.01e-4, below it).
POLY_REL_ERROR = 1.1e-4
#: The elements sent to the cubic: one in every POLY_EVERY (0: none).
POLY_EVERY = (0, 2, 4, 8)

_MAGIC = 12582912.0  # 1.5 * 2**23: adding it rounds an fp32 in (-2**22, 2**22) to an integer


def _hex(x: float) -> str:
    """A PTX fp32 literal."""
    return "0f%08X" % int(np.float32(x).view(np.uint32))


def poly_exp2(x: np.ndarray) -> np.ndarray:
    """The cubic's arithmetic in float32 NumPy (each step rounded as the PTX rounds it;
    the fmas are single-rounded in PTX, here two roundings: within 1 ulp of it)."""
    x = np.asarray(x, dtype=np.float32)
    with np.errstate(invalid="ignore", over="ignore"):
        xc = np.where(np.isnan(x), x, np.clip(x, np.float32(-127.0), np.float32(128.0)))
        t = (xc + np.float32(_MAGIC)).astype(np.float32)
        f = (xc - (t - np.float32(_MAGIC))).astype(np.float32)
        p = np.float32(C3) * f + np.float32(C2)
        p = (p * f + np.float32(C1)).astype(np.float32)
        p = (p * f + np.float32(1.0)).astype(np.float32)
        bits = p.view(np.uint32) + (t.view(np.uint32) << np.uint32(23))
    return np.where(np.isnan(x), x, bits.view(np.float32))


def _poly_ptx(src: str, dst: str) -> str:
    return f"""{{
    .reg .f32 x, t, j, f, p;
    .reg .b32 e, r;
    .reg .pred nan;
    max.NaN.f32 x, {src}, {_hex(-127.0)};
    min.NaN.f32 x, x, {_hex(128.0)};
    add.rn.f32 t, x, {_hex(_MAGIC)};
    sub.rn.f32 j, t, {_hex(_MAGIC)};
    sub.rn.f32 f, x, j;
    fma.rn.f32 p, f, {_hex(C3)}, {_hex(C2)};
    fma.rn.f32 p, p, f, {_hex(C1)};
    fma.rn.f32 p, p, f, {_hex(1.0)};
    mov.b32 e, t;
    shl.b32 e, e, 23;
    mov.b32 r, p;
    add.s32 r, r, e;
    setp.nan.f32 nan, x, x;
    selp.b32 {dst}, {src}, r, nan;
}}"""


def split_asm(every: int) -> str:
    """PTX for ``every`` elements (outputs $0.., inputs $every..): the last through the
    cubic, the others through ``ex2.approx.ftz``."""
    lines = [f"ex2.approx.ftz.f32 ${i}, ${every + i};" for i in range(every - 1)]
    lines.append(_poly_ptx(f"${2 * every - 1}", f"${every - 1}"))
    return "\n".join(lines)


_ASM_2: tl.constexpr = tl.constexpr(split_asm(2))
_ASM_4: tl.constexpr = tl.constexpr(split_asm(4))
_ASM_8: tl.constexpr = tl.constexpr(split_asm(8))
_CONSTRAINTS_2: tl.constexpr = tl.constexpr(",".join(["=r"] * 2 + ["r"] * 2))
_CONSTRAINTS_4: tl.constexpr = tl.constexpr(",".join(["=r"] * 4 + ["r"] * 4))
_CONSTRAINTS_8: tl.constexpr = tl.constexpr(",".join(["=r"] * 8 + ["r"] * 8))


@triton.jit
def exp2_split(x, POLY_EVERY: tl.constexpr):
    """exp2 of an fp32 tensor, one element of every POLY_EVERY through the cubic (0: all
    through ``tl.math.exp2``). The interpreter has no inline PTX: callers pass 0 there."""
    if POLY_EVERY == 2:
        y = tl.inline_asm_elementwise(_ASM_2, _CONSTRAINTS_2, [x], dtype=tl.float32,
                                      is_pure=True, pack=2)
    elif POLY_EVERY == 4:
        y = tl.inline_asm_elementwise(_ASM_4, _CONSTRAINTS_4, [x], dtype=tl.float32,
                                      is_pure=True, pack=4)
    elif POLY_EVERY == 8:
        y = tl.inline_asm_elementwise(_ASM_8, _CONSTRAINTS_8, [x], dtype=tl.float32,
                                      is_pure=True, pack=8)
    else:
        tl.static_assert(POLY_EVERY == 0, "POLY_EVERY must be 0, 2, 4 or 8")
        y = tl.math.exp2(x)
    return y


try:  # the Gluon kernels' spelling of the same split (Triton >= 3.5)
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
except ImportError:  # pragma: no cover - the project pins a triton with Gluon
    gluon = None

if gluon is not None:

    @gluon.jit
    def exp2_split_gluon(x, POLY_EVERY: gl.constexpr):
        """``exp2_split`` for Gluon kernels (a distributed fp32 tensor of any layout)."""
        if POLY_EVERY == 2:
            y = gl.inline_asm_elementwise(_ASM_2, _CONSTRAINTS_2, [x], dtype=gl.float32,
                                          is_pure=True, pack=2)
        elif POLY_EVERY == 4:
            y = gl.inline_asm_elementwise(_ASM_4, _CONSTRAINTS_4, [x], dtype=gl.float32,
                                          is_pure=True, pack=4)
        elif POLY_EVERY == 8:
            y = gl.inline_asm_elementwise(_ASM_8, _CONSTRAINTS_8, [x], dtype=gl.float32,
                                          is_pure=True, pack=8)
        else:
            gl.static_assert(POLY_EVERY == 0, "POLY_EVERY must be 0, 2, 4 or 8")
            y = gl.exp2(x)
        return y
