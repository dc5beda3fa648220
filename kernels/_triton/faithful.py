"""Device helpers the faithful ports share (``swp_bf16``, ``swp_fp8``, ``generic``, ``swa``):
the 32-row wave's ballot, one part of the split PV product, and the per-step trace record
(its host side is ``trace_plan``).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .dots import dot16


@triton.jit
def pv_part(pb, v, lo, hi, scratch, TILE_N: tl.constexpr, DOT_MODE: tl.constexpr):
    """Pb[:, lo:hi] @ V[lo:hi] as a full-width dot with the other columns of P and rows of
    V zeroed: a P that is inf or NaN outside the part becomes 0, not inf * 0 = NaN."""
    k = tl.arange(0, TILE_N)
    p_in = (k >= lo) & (k < hi)
    p_part = tl.where(p_in[None, :], pb, 0.0)
    v_part = tl.where(p_in[:, None], v, tl.zeros_like(v))
    return dot16(p_part, v_part, scratch, DOT_MODE)


@triton.jit
def wave_ballot(flags, ROWS: tl.constexpr, WAVE: tl.constexpr):
    """The ballot: True for every row of a 32-row wave where any row's flag is nonzero."""
    waves = tl.reshape(flags, [ROWS // WAVE, WAVE])
    fired = tl.max(waves, axis=1)
    return tl.reshape(tl.broadcast_to(fired[:, None], [ROWS // WAVE, WAVE]), [ROWS]) > 0


@triton.jit
def record_step(buf, slot, step, n_steps, keep, m, mt, vote, fire, swept, corr, l, O,
                N_FIELDS: tl.constexpr):
    """Store one step of the per-row trace for the traced rows (slot >= 0)."""
    ptr = buf + (slot * n_steps + step) * N_FIELDS
    ok = (slot >= 0) & keep
    o_finite = tl.min(tl.where(tl.abs(O) < float("inf"), 1.0, 0.0), axis=1)
    l_finite = tl.where(tl.abs(l) < float("inf"), 1.0, 0.0)
    tl.store(ptr + 0, m, mask=ok)
    tl.store(ptr + 1, mt, mask=ok)
    tl.store(ptr + 2, vote.to(tl.float32), mask=ok)
    tl.store(ptr + 3, fire.to(tl.float32), mask=ok)
    tl.store(ptr + 4, swept.to(tl.float32), mask=ok)
    tl.store(ptr + 5, corr, mask=ok)
    tl.store(ptr + 6, l, mask=ok)
    tl.store(ptr + 7, o_finite, mask=ok)
    tl.store(ptr + 8, l_finite, mask=ok)
