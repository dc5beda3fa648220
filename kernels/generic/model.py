"""Exact model of the generic bf16/f16 forward, ``flash_attn_generic.py`` (gfx942 and
gfx950; docs/semantics.md §4).

Plain vectorised PyTorch, in the kernel's order: every 64-column KV subtile is a full
online-softmax step, eager, with no wave ballot. Per row, with c = f32(sm_scale * log2 e):

  m_new = fmax(m, rowmax(S_raw))            raw score domain; causal: fmax(., -3e38)
  corr  = exp2((m - m_new) * c)             O *= corr on every 64-column subtile
  P     = exp2(fma(S_raw, c, -(c * m_new)))
  l     = corr * l + sum(P)                 fp32, before the pack
  O    += pack(P) @ V                       bf16: TRUNCATED (low 16 bits dropped); f16: RNE
  out   = round(O * rcp(l)) to the input dtype; LSE = m * f32(sm_scale) + ln(l)

Launch shape, masks, the P pack and the epilogue follow upstream (ROCm/FlyDSL ``main``
11c4174d, kernels/attention/flash_attn_generic.py); docs/semantics.md §4.1 gives, point by
point, what upstream does and where. The model keeps one upstream quirk by default: a
non-causal call with Sq % 64 == 0 is built without the padding-column mask, and its
padding K/V rows are clamped copies of row Skv - 1 (``skip_kv_pad_mask``). Not modelled:
the build's denormals-are-zero flag (values below 2**-126 are kept here).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from fa_lab.numerics import (CAUSAL_FLOOR, LOG2E, bf16_trunc, exact_dot, exp2, f16, f32, fma_f32, fmax,
                        guarded_rcp, round_to)
from fa_lab.trace import TraceRecorder
from .._common.models import heads, run_groups
from .._common.geometry import BLOCK_N

KERNEL = "generic"
#: Compute units of an MI355X (``multi_processor_count``; upstream's fallback is also 256).
MI355X_CUS = 256
#: interface.py: B * Sq at which 32+ head launches take 256-row programs.
M256_MIN_TOKENS = 4096


def scale_constants(head_dim: int) -> tuple[float, float]:
    """(f32(1/sqrt(D)), f32(1/sqrt(D) * log2 e)): the kernel's two fp32 constants; the
    second is a double product rounded once (not a product of two fp32 values)."""
    sm_scale = 1.0 / math.sqrt(head_dim)
    return f32(sm_scale), f32(sm_scale * LOG2E)


@dataclass(frozen=True)
class LaunchTile:
    """Rows per program, and the KV columns walked per outer step (64 or 128)."""

    block_m: int
    kv_step: int


def launch_tile(batch: int, seqlen_q: int, num_heads: int, head_dim: int, causal: bool,
                num_cus: int = MI355X_CUS) -> LaunchTile:
    """Upstream's dense generic tile choice on gfx950 (interface.py ``_dense_generic_tile``
    and the "auto" path rule of ``_make_flash_attn_generic_traits``)."""
    if head_dim in (64, 128) and batch * num_heads * math.ceil(seqlen_q / 128) < num_cus:
        return LaunchTile(block_m=64, kv_step=BLOCK_N)  # the "light" tile, path N32
    block_m = 256 if num_heads >= 32 and batch * seqlen_q >= M256_MIN_TOKENS else 128
    return LaunchTile(block_m=block_m, kv_step=128 if causal and head_dim == 128 else BLOCK_N)


def skips_kv_pad_mask(seqlen_q: int, causal: bool) -> bool:
    """Upstream's dispatch: non-causal dense launches with Sq % 64 == 0 are built without
    the padding-column mask (the test reads Sq, not Skv)."""
    return (not causal) and seqlen_q % BLOCK_N == 0


def kv_upper(q0: int, block_m: int, seqlen_q: int, seqlen_kv: int, causal: bool) -> int:
    """The last KV column (exclusive) a q-block visits, before rounding to whole steps."""
    if not causal:
        return seqlen_kv
    return min(max(0, q0 + block_m + seqlen_kv - seqlen_q), seqlen_kv)


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool,
            recorder: TraceRecorder | None = None, skip_kv_pad_mask: bool | None = None,
            num_cus: int = MI355X_CUS):
    """q [B, Sq, H, D], k and v [B, Skv, Hkv, D], bf16 or f16 (checked by the caller).

    ``skip_kv_pad_mask``: None follows upstream's dispatch (see the module docstring);
    True/False force the build. ``num_cus`` only moves the tile choice (trace steps).
    Returns (out [B, Sq, H, D] in q's dtype, lse [B, H, Sq] fp32, natural log).
    The trace records one step per 64-column subtile (phase "tile"), with m and mt
    converted to log2 units (raw value * c) so that they compare with the swp kernels.
    """
    if skip_kv_pad_mask is not None and not isinstance(skip_kv_pad_mask, bool):
        raise TypeError(f"skip_kv_pad_mask must be a bool or None, got {type(skip_kv_pad_mask).__name__}")
    if isinstance(num_cus, bool) or not isinstance(num_cus, int) or num_cus < 1:
        raise ValueError(f"num_cus must be a positive int, got {num_cus!r}")
    B, Sq, H, D = q.shape
    Skv = k.shape[1]
    tile = launch_tile(B, Sq, H, D, causal, num_cus)
    skip = skips_kv_pad_mask(Sq, causal) if skip_kv_pad_mask is None else skip_kv_pad_mask
    if causal:
        skip = False  # causal builds never take the pad-mask branch; the causal mask covers it
    pack = bf16_trunc if q.dtype == torch.bfloat16 else f16
    rnd = round_to(q.dtype)

    n_rows = math.ceil(Sq / tile.block_m) * tile.block_m
    qf, kf, vf = heads(q, k, v, n_rows)

    def run(q_rows, rows, n_sub):
        kp, vp = _pad_kv(kf, vf, n_sub * BLOCK_N, clamp=tile.kv_step == BLOCK_N)
        return _run_group(q_rows, kp, vp, rows, n_sub, Sq, Skv, causal, skip, pack, rnd, recorder)

    groups = ((rows, n_sub) for n_sub, rows in _block_groups(Sq, Skv, causal, tile, q.device))
    return run_groups(qf, groups, run, recorder, q.dtype, Sq)


def _block_groups(Sq, Skv, causal, tile: LaunchTile, device):
    """(number of 64-column subtiles, global rows) for q-blocks that visit the same count."""
    per_step = tile.kv_step // BLOCK_N
    by_n: dict[int, list[int]] = {}
    for b in range(math.ceil(Sq / tile.block_m)):
        upper = kv_upper(b * tile.block_m, tile.block_m, Sq, Skv, causal)
        by_n.setdefault(math.ceil(upper / tile.kv_step) * per_step, []).append(b)
    groups = []
    for n_sub, blocks in sorted(by_n.items()):
        rows = torch.cat([torch.arange(b * tile.block_m, (b + 1) * tile.block_m) for b in blocks])
        groups.append((n_sub, rows.to(device)))
    return groups


def _pad_kv(kf, vf, n_cols, *, clamp: bool):
    """K and V to n_cols columns: rows past Skv repeat row Skv - 1 (clamped loads) or are
    zero (the DMA path's bounded buffer reads)."""
    extra = n_cols - kf.shape[-2]
    if extra <= 0:
        return kf[..., :n_cols, :], vf[..., :n_cols, :]
    if clamp:
        return (torch.cat([kf, kf[..., -1:, :].expand(*kf.shape[:-2], extra, kf.shape[-1])], -2),
                torch.cat([vf, vf[..., -1:, :].expand(*vf.shape[:-2], extra, vf.shape[-1])], -2))
    pad = (0, 0, 0, extra)
    return torch.nn.functional.pad(kf, pad), torch.nn.functional.pad(vf, pad)


def _masked(rows, col0, Sq, Skv, causal, skip_pad):
    """Bool [R, 64]: the kernel's -inf columns (causal mask, or the padding mask)."""
    cols = torch.arange(col0, col0 + BLOCK_N, device=rows.device)
    if causal:
        return cols[None, :] > rows[:, None] + (Skv - Sq)
    if skip_pad:
        return torch.zeros(rows.numel(), BLOCK_N, dtype=torch.bool, device=rows.device)
    return (cols >= Skv).expand(rows.numel(), BLOCK_N)


def _run_group(qf, kp, vp, rows, n_sub, Sq, Skv, causal, skip_pad, pack, rnd, rec):
    """q-blocks that visit n_sub subtiles; state per row [B, Hkv, G, R]."""
    inf = float("inf")
    sm_scale, c = scale_constants(qf.shape[-1])
    m = torch.full(qf.shape[:-1], -inf, device=qf.device)
    l = torch.zeros_like(m)
    O = torch.zeros(*m.shape, qf.shape[-1], device=qf.device)
    for t in range(n_sub):
        cols = slice(t * BLOCK_N, (t + 1) * BLOCK_N)
        s = exact_dot(qf, kp[..., cols, :].transpose(-1, -2))  # raw fp32 scores
        s = s.masked_fill(_masked(rows, t * BLOCK_N, Sq, Skv, causal, skip_pad), -inf)
        mt = s.amax(-1)
        m_new = fmax(m, mt)
        if causal:
            m_new = fmax(m_new, CAUSAL_FLOOR)
        corr = exp2((m - m_new) * c)
        p = exp2(fma_f32(s, c, -(m_new * c)[..., None]))
        l = corr * l + p.sum(-1)
        O = O * corr[..., None] + exact_dot(pack(p), vp[..., cols, :])
        m = m_new
        if rec is not None and rec.active:
            false = torch.zeros_like(m, dtype=torch.bool)
            rec.record(t, t * BLOCK_N, "tile", m=m * c, mt=mt * c, vote=false, fire=false,
                       swept=false, corr=corr, l=l, O=O)
    inv = guarded_rcp(l) if causal else 1.0 / l
    out = rnd(O * inv[..., None])
    lse = m * sm_scale + torch.log(l)
    if rec is not None:
        rec.finish_group(out, lse)
    return out, lse

