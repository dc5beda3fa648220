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

Where docs/semantics.md §4 is silent, upstream (ROCm/FlyDSL ``main`` 11c4174d) decides; references are
to kernels/attention/flash_attn_generic.py (``generic.py``), flash_attn_utils.py
(``utils.py``) and flash_attn_interface.py (``interface.py``):

* Constants: c_sm_scale = f32(1/sqrt(D)), c_sm_scale_log2e = f32(1/sqrt(D) * log2 e) with the
  product taken in double and rounded once (utils.py l.2131-2142). Q is NOT pre-scaled or
  rounded: scores are raw fp32 Q K^T.
* Rows per program: ``interface._dense_generic_tile`` (l.80-90) picks BLOCK_M = 64 (two
  waves, 64-column step) when B * H * ceil(Sq/128) is below the CU count (256 on MI355X),
  else 256 when H >= 32 and B * Sq >= 4096, else 128; always 32 rows per wave. The outer
  KV step is 128 (two 64-column subtiles) on the "auto" path for causal D = 128, else 64
  (utils.py l.1266-1274). Neither changes a number: there is no ballot, and a subtile
  that is fully masked for a row leaves it exactly as it was (corr = exp2(0) = 1, P = 0).
  They decide how many subtiles a row visits (the trace's steps) and which padding rows
  exist, so the model follows them: causal q-blocks stop at
  ``kv_upper = min(max(0, q0 + BLOCK_M + Skv - Sq), Skv)`` (utils.py l.2202-2214), rounded
  up to whole outer steps (generic.py l.317 and l.343).
* Masks (utils.py ``apply_kv_mask`` l.2920-2960): causal blocks apply only the
  bottom-right causal mask (it covers every padding column of a real row); non-causal
  blocks mask columns >= Skv unless the launcher was built with ``skip_kv_pad_mask``,
  which upstream selects for every non-causal dense call with Sq % 64 == 0
  (generic.py ``_wrap_pad_mask_dispatch`` l.642-703; it tests Sq, not Skv). K/V rows past
  Skv are then real reads: on the 64-step path they are clamped to row Skv - 1
  (utils.py ``kv_row_clamp`` l.2224 used by ``coop_load_k``/``coop_load_v_global``), so a
  cross-length call with Sq % 64 == 0 and Skv % 64 != 0 attends to the last key
  ``64 * ceil(Skv/64) - Skv + 1`` times. The model reproduces this by default
  (``skip_kv_pad_mask=None``: upstream's rule) and reports it here because it was read,
  not observed on hardware; ``skip_kv_pad_mask=False`` gives the masked, correct path. On
  the DMA path (128-step) rows past Skv read as zeros (bounded buffer resource,
  utils.py ``init_dma`` l.2613-2636).
* Softmax step: utils.py ``online_softmax_stats``/``online_softmax`` l.2968-3014 (the floor
  is applied after the fmax with the running max; the exp2 argument is one fma), then
  ``rescale_o_accs`` (l.3016, all D chunks on gfx950) before ``gemm2_pv`` (generic.py
  l.423-487): O *= corr, then O += P V for the same subtile.
* P pack: bf16 drops the low 16 bits (``_pack_bf16_pair``, v_perm_b32 selector 0x07060302,
  utils.py l.3052-3074); f16 converts with round-to-nearest-even (``build_p_packs``
  l.3043-3047).
* Epilogue: ``rcp(l)`` guarded by ``l > 0`` only for causal builds (utils.py l.3186-3190;
  non-causal rows always have l >= 1); the output is converted with RNE
  (``cvt_pk_bf16_f32`` / f16 convert); LSE = m * f32(sm_scale) + ln(l) (``store_lse``
  l.3144-3154), which is -inf when l == 0 (a fully masked causal row, m = -3e38).

Not modelled: the kernel is built with denormals-are-zero and fast-math flags
(generic.py l.527-534); fp32 values below 2**-126 are kept here, which changes nothing
at the tolerance of any test (they sit 2**-103 below l >= 1 and the row's largest P).
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
                       dragged=false, corr=corr, l=l, O=O)
    inv = guarded_rcp(l) if causal else 1.0 / l
    out = rnd(O * inv[..., None])
    lse = m * sm_scale + torch.log(l)
    if rec is not None:
        rec.finish_group(out, lse)
    return out, lse

