"""Exact model of FlyDSL #1066's paged fp8 prefill on its paired-page BN128 kernel
(docs/semantics.md §17), and the entry point of both its kernels: a call whose
``PagedFp8.schedule`` is ``"tile"`` runs the per-tile kernel's model, ``paged_tile``.

Read at ROCm/FlyDSL 6aeb4321 (the #1066 commit in the code index):
``kernels/attention/flash_attn_fp8_paged_gfx950.py``, ``build_flash_attn_paged_fp8_module``
(its refusals, ``rescale_threshold=8.0``) and ``flash_attn_paged_fp8_bn128_kernel`` (the
loop over tile pairs from ``split_t0`` to ``split_t_end``: both 64-column tiles' scores,
the causal pair mask, one merged tile max floored for causal rows, ``lazy_correct_o``,
then per tile ``sub_m``, exp2, the row sum, ``cast_p_fp8_direct`` and P V; the epilogue
``rcp(l)`` where l > 0, else 0, times the V descale, one factor for O); ``flash_attn_interface.py``
``_flydsl_flash_attn_paged`` (``use_bn128`` for (128, 128) head dims and an even page
count); ``flash_attn_utils.py`` ``DualwaveFp8SoftmaxHelper`` (``lazy_correct_o``: the
32-row wave ballot of ``(mt - m) * ls <= THR``, the monotonic ``_lazy_correction``;
``sub_m``'s headroom H = log2(448) - THR), ``DualwaveFp8KernelContext.init_tile_bounds``
(the dense kernel's tile count: cut at the bottom-right diagonal, rounded up to even, at
least 4; the sequence lengths from ``cu_seqlens``) and ``load_page_id_pair`` (a pair's two
page ids in one load). The code index gives these files by character offset, not line:
the places are named by function.

The loop body is the dense fp8 kernel's (``walk.walk``, ``walk.run_group``): what paging
changes is where each tile's rows come from. Per sequence b, tile pair (2p, 2p + 1) reads
the whole pages of block-table entries 2p and 2p + 1 while 2p < ceil(seqlen_k[b] / 64)
(an odd page count reads the entry after its last page as the partner), else of entries
0 and 1 (``fa_lab.paged.PagedFp8.page_ids``). Rows past seqlen_k[b] are masked in S, but
their V rows enter P V with P = 0, so a NaN or inf stored there, in the last page's tail
or in a page read only as a partner or a padding pair, reaches the output (0 * NaN). The kernel returns no LSE; the LSE here is
the model's read-out, as the dense model's.
"""

from __future__ import annotations

import torch

from fa_lab.capabilities import check_semantics
from fa_lab.checks import check_descale
from fa_lab.numerics import f32
from fa_lab.paged import PagedFp8
from fa_lab.policies import Policy

from . import FAMILY, paged_tile
from fa_lab.numerics import log2_scale
from .walk import run_group
from .._common.geometry import BLOCK_N, block_groups, padded_rows
from .._common.models import check_decidable, heads, run_groups


def gather(paged: PagedFp8, k8: torch.Tensor, v8: torch.Tensor, b: int, n_tiles: int):
    """Sequence ``b``'s K and V as its first ``n_tiles`` tiles read them,
    [1, n_tiles * 64, Hkv, D] each: tile t is the whole page ``page_ids(b, n_tiles)[t]``."""
    kl, vl = paged.linear(k8, v8)
    ids = paged.page_ids(b, n_tiles).to(kl.device)
    kg = kl[ids].reshape(1, n_tiles * paged.page_size, *kl.shape[2:])
    vg = vl[ids].reshape(1, n_tiles * paged.page_size, *vl.shape[2:])
    return kg, vg


def forward(q8: torch.Tensor, k8: torch.Tensor, v8: torch.Tensor, *, q_descale: float,
            k_descale: float, v_descale: float, causal: bool, policy: Policy, paged: PagedFp8,
            saturate: bool = True, recorder=None):
    """q8 packed [total_q, H, D], k8 and v8 the vectorized page-64 cache, float8_e4m3fn;
    ``paged`` the call checked by ``fa_lab.paged.check_fp8`` (BN128: D = Dv = 128).
    Returns (out [total_q, H, Dv] bf16, lse [B, H, max_seqlen_q] fp32, -inf past each
    sequence's rows)."""
    if not isinstance(paged, PagedFp8):
        raise TypeError(f"paged must be a fa_lab.paged.PagedFp8, got {type(paged).__name__}")
    if causal is not True:
        raise ValueError("the paged fp8 kernel is causal only (causal=True)")
    if recorder is not None:
        raise ValueError("the paged fp8 model records no trace; trace a dense fp8 call")
    if paged.schedule == "tile":
        return paged_tile.forward(q8, k8, v8, q_descale=q_descale, k_descale=k_descale,
                                  v_descale=v_descale, policy=policy, paged=paged,
                                  saturate=saturate)
    check_semantics(policy, FAMILY, "model")
    check_decidable(policy, f"the {FAMILY.name} paged model")
    qd, kd, vd = (check_descale(n, x) for n, x in
                  (("q_descale", q_descale), ("k_descale", k_descale), ("v_descale", v_descale)))
    total_q, H, D = q8.shape
    ls = log2_scale(qd, kd, D)
    out = torch.zeros(total_q, H, paged.head_dim_v, dtype=torch.bfloat16, device=q8.device)
    lse = torch.full((paged.batch, H, paged.max_seqlen_q), float("-inf"), device=q8.device)
    for b, skv in enumerate(paged.seqlen_k):
        q0, q1 = paged.cu_q[b], paged.cu_q[b + 1]
        Sq = q1 - q0
        if Sq == 0:
            continue
        groups = block_groups(Sq, skv, True, q8.device)
        kg, vg = gather(paged, k8, v8, b, max(g.n_tiles for g in groups))
        qf, kf, vf = heads(q8[q0:q1][None], kg, vg, padded_rows(Sq))

        def run(q_rows, rows, n_tiles, kf=kf, vf=vf, Sq=Sq, skv=skv):
            cols = n_tiles * BLOCK_N
            return run_group(q_rows, kf[..., :cols, :], vf[..., :cols, :], rows, n_tiles, Sq,
                              skv, True, policy, ls, f32(vd), saturate, None)

        o, l = run_groups(qf, ((g.rows, g.n_tiles) for g in groups), run, None, torch.bfloat16, Sq)
        out[q0:q1] = o[0]
        lse[b, :, :Sq] = l[0]
    return out, lse
