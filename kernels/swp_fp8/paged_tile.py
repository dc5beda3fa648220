"""Exact model of FlyDSL #1066's paged fp8 prefill on its per-tile (BN64) kernel
(docs/semantics.md §17.3).

Read at ROCm/FlyDSL 6aeb4321 (the #1066 commit in the code index; it gives files by
character offset, not line, so places are named by function):

* ``flash_attn_interface.py`` ``_flydsl_flash_attn_paged``: ``use_bn128`` holds for
  (D, Dv) = (128, 128) with an even count of pages of ``max_seqlen_kv`` (else
  max(seqlen_k)); every other paged fp8 call, (192, 128), (192, 192) and an odd page
  count (one page included), builds with ``paged_bn128=False`` and launches
  ``flash_attn_dualwave_swp_fp8_gfx950_kernel`` of ``flash_attn_fp8_paged_gfx950.py``.
  The builder's ``rescale_threshold=8.0`` is not overridden; ``dualwave_swp_lazy_rescale``
  picks ``lazy_rescale_o`` or ``rescale_o``.
* ``flash_attn_utils.py`` ``_make_dualwave_swp_fp8_traits`` with ``force_bn128=False``
  and ``paged=True``: 64-column tiles, 256-row blocks, 32-row waves; ``FP8_PV`` on for
  every paged (D, Dv) (Dv = 128, or 192 split 128 + 64 by ``_factor_fp8_pv_head_dim``),
  so P V multiplies e4m3 P by the raw fp8 V and the V descale waits for the epilogue.
* ``DualwaveFp8SoftmaxHelper``: ``sub_m`` takes the branch for paged and not BN128,
  ``fma(S, ls, 0 - ls*m)`` with **no** P headroom; ``cast_p`` packs P to bf16
  (``cvt_pk_bf16_f32``, nearest even); ``_lazy_rescale_o_paged`` ballots
  ``(mt - m) * ls <= THR`` over the 32-row wave and, when any row fails it, rebases every
  row of the wave by ``_lazy_correction`` (monotonic ``fmax``), scaling O, l and the
  pending bf16 P (``scale_v_p``: widen, multiply, repack to bf16); ``rescale_o`` does the
  same for every row, every tile.
* ``DualwaveFp8GemmHelper._pv_step_fp8`` (``_pv_step_fp8_segmented`` for Dv = 192):
  step 0 of a tile's P V packs P to e4m3 (``_p_to_fp8_i32x8``: bf16 P widened, then
  ``cvt_pk_fp8_f32``) and adds it into O's first 32 (Dv 192: 64) columns **before** the
  decision; for a paged kernel step 1 repacks the corrected P for the other columns.
* ``DualwaveFp8KernelContext.load_page_id``: tile t of sequence b reads block-table entry
  ``b * stride + t`` while t < ceil(seqlen_k[b] / 64), else entry 0 of the flat table,
  ``block_table[0, 0]`` (``PagedFp8.page_ids``); ``init_tile_bounds``: the dense tile
  count; ``init_sequence_lengths``: the lengths from ``cu_seqlens``.

The schedule is the bf16 DUALWAVE_SWP one (§2.2) on raw fp8 scores: a prologue tile 0
(its max floored at -3e38), a loop over tiles 1 .. N-4 with one decision per tile, and an
eager epilogue over the last three tiles (``rescale_from_tile_max``, P V of the previous
tile whole before the rescale). Masks and padding rows are the dense model's; rows past
seqlen_k in the last page and the padding tiles' page enter P V with P = 0.
"""

from __future__ import annotations

import torch

from fa_lab.capabilities import check_semantics
from fa_lab.checks import check_descale
from fa_lab.numerics import (CAUSAL_FLOOR, LN2, bf16, e4m3, exp2, f32, fma_f32, fmax,
                             guarded_rcp, ieee_fp32_matmul)
from fa_lab.paged import PagedFp8
from fa_lab.policies import Policy

from . import FAMILY
from fa_lab.numerics import log2_scale
from .walk import tile_max
from .._common.geometry import BLOCK_N, block_groups, masked_columns, padded_rows
from .._common.models import check_decidable, decide, heads

#: Output columns of a tile's first P V step (before the decision), by Dv: Dv 128 runs
#: one 32-column chunk per step; Dv 192's segmented P V runs chunks 0-1 in step 0.
FIRST_STEP_COLS = {128: 32, 192: 64}


def first_step_cols(dv: int) -> int:
    """Columns of O that take a tile's P before its rescale decision."""
    if dv not in FIRST_STEP_COLS:
        raise ValueError(f"v head dim Dv={dv}: the per-tile paged fp8 kernel takes Dv in "
                         f"{tuple(FIRST_STEP_COLS)}")
    return FIRST_STEP_COLS[dv]


def walk(qf, kp, vp, rows, N, *, Sq, Skv, policy, ls, saturate, headroom, c0):
    """The per-tile schedule over N tiles (``kp``, ``vp`` [..., N*64, D]): (m, l, O) at
    the end, O unnormalised with v's head dim."""
    inf = float("-inf")

    def scores(t):
        s = qf @ kp[..., t * BLOCK_N:(t + 1) * BLOCK_N, :].transpose(-1, -2)
        return s.masked_fill(masked_columns(rows, t * BLOCK_N, Sq, Skv, True), inf)

    def p_of(s, m):
        return exp2(fma_f32(s, ls, ((0.0 - ls * m) + headroom)[..., None]))

    def pv(pb, t, cols=slice(None)):
        return e4m3(pb, saturate) @ vp[..., t * BLOCK_N:(t + 1) * BLOCK_N, cols]

    s = scores(0)
    m = fmax(tile_max(s), CAUSAL_FLOOR)  # the prologue's floor
    pf = p_of(s, m)
    l = torch.zeros_like(m)
    O = torch.zeros(*m.shape, vp.shape[-1], device=qf.device)
    for t in range(1, N):
        l = l + pf.sum(-1)  # fp32 P, before the bf16 pack
        pb = bf16(pf)
        s = scores(t)
        mt = tile_max(s)  # loop and epilogue maxima are not floored
        if t <= N - 4:  # the loop: the policy decides
            first = O[..., :c0] + pv(pb, t - 1, slice(0, c0))
            dec = decide(policy, m, mt, ls, where=f"the {FAMILY.name} per-tile paged model",
                         at=f"KV tile {t}", rows=rows)
            corr = dec.corr
            pb = bf16(pb * corr[..., None])  # scale_v_p: the pending P, repacked
            rest = O[..., c0:] * corr[..., None] + pv(pb, t - 1, slice(c0, None))
            O = torch.cat([first * corr[..., None], rest], -1)
            l = l * corr
            m = dec.target
        else:  # the epilogue: eager, the previous tile's P V whole first
            O = O + pv(pb, t - 1)
            m_new = fmax(m, mt)
            corr = exp2((m - m_new) * ls)
            m = m_new
            O = O * corr[..., None]
            l = l * corr
        pf = p_of(s, m)
    l = l + pf.sum(-1)
    O = O + pv(bf16(pf), N - 1)
    return m, l, O


def run_sequence(q8: torch.Tensor, kg: torch.Tensor, vg: torch.Tensor, *, Skv: int, ls: float,
                 v_descale: float, policy: Policy, saturate: bool):
    """One sequence: q8 [1, Sq, H, D], kg and vg [1, n*64, Hkv, D|Dv] as its tiles read
    them (at least the longest block's N tiles). Returns (out [Sq, H, Dv] bf16 values as
    fp32, lse [H, Sq]): out = bf16(O * (rcp(l) if l > 0 else 0) * v_descale), the
    descale folded into the reciprocal first; lse the model's read-out."""
    Sq, H = q8.shape[1], q8.shape[2]
    dv = vg.shape[-1]
    c0 = first_step_cols(dv)
    headroom = f32(policy.p_headroom)
    qf, kf, vf = heads(q8, kg, vg, padded_rows(Sq))
    Hkv, G = qf.shape[1], qf.shape[2]
    out = torch.zeros(1, Hkv, G, qf.shape[3], dv, device=q8.device)
    lse = torch.zeros(1, Hkv, G, qf.shape[3], device=q8.device)
    with ieee_fp32_matmul():
        for g in block_groups(Sq, Skv, True, q8.device):
            cols = g.n_tiles * BLOCK_N
            m, l, O = walk(qf[..., g.rows, :], kf[..., :cols, :], vf[..., :cols, :], g.rows,
                           g.n_tiles, Sq=Sq, Skv=Skv, policy=policy, ls=ls, saturate=saturate,
                           headroom=headroom, c0=c0)
            out[..., g.rows, :] = bf16(O * (guarded_rcp(l) * f32(v_descale))[..., None])
            lse[..., g.rows] = torch.where(l == 0, torch.full_like(l, float("-inf")),
                                           (m * ls - headroom) * f32(LN2) + torch.log(l))
    out = out[..., :Sq, :].reshape(H, Sq, dv).permute(1, 0, 2)
    return out, lse[..., :Sq].reshape(H, Sq)


def gather(paged: PagedFp8, k8: torch.Tensor, v8: torch.Tensor, b: int, n_tiles: int):
    """Sequence ``b``'s K and V as its first ``n_tiles`` tiles read them: tile t is the
    whole page ``paged.page_ids(b, n_tiles)[t]``."""
    kl, vl = paged.linear(k8, v8)
    ids = paged.page_ids(b, n_tiles).to(kl.device)
    return (kl[ids].reshape(1, n_tiles * paged.page_size, *kl.shape[2:]),
            vl[ids].reshape(1, n_tiles * paged.page_size, *vl.shape[2:]))


def forward(q8: torch.Tensor, k8: torch.Tensor, v8: torch.Tensor, *, q_descale: float,
            k_descale: float, v_descale: float, policy: Policy, paged: PagedFp8,
            saturate: bool = True):
    """q8 packed [total_q, H, D], k8 and v8 the vectorized page-64 cache, ``paged`` a
    checked call whose ``schedule`` is ``"tile"``. Returns (out [total_q, H, Dv] bf16,
    lse [B, H, max_seqlen_q] fp32, -inf past each sequence's rows)."""
    if not isinstance(paged, PagedFp8) or paged.schedule != "tile":
        raise ValueError("the per-tile model takes a PagedFp8 call on the per-tile schedule")
    check_semantics(policy, FAMILY, "model")
    check_decidable(policy, f"the {FAMILY.name} per-tile paged model")
    qd, kd, vd = (check_descale(n, x) for n, x in
                  (("q_descale", q_descale), ("k_descale", k_descale), ("v_descale", v_descale)))
    total_q, H, D = q8.shape
    ls = log2_scale(qd, kd, D)
    out = torch.zeros(total_q, H, paged.head_dim_v, dtype=torch.bfloat16, device=q8.device)
    lse = torch.full((paged.batch, H, paged.max_seqlen_q), float("-inf"), device=q8.device)
    for b, skv in enumerate(paged.seqlen_k):
        q0, q1 = paged.cu_q[b], paged.cu_q[b + 1]
        if q1 == q0:
            continue
        n = max(g.n_tiles for g in block_groups(q1 - q0, skv, True, q8.device))
        kg, vg = gather(paged, k8, v8, b, n)
        o, l = run_sequence(q8[q0:q1][None], kg, vg, Skv=skv, ls=ls, v_descale=vd,
                            policy=policy, saturate=saturate)
        out[q0:q1] = o.to(torch.bfloat16)
        lse[b, :, :q1 - q0] = l
    return out, lse
