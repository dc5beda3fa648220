"""Exact model of the gfx950 MLA decode forward, fp8 Q and fp8 KV, 128 heads
(docs/semantics.md §14).

References are to ROCm/FlyDSL ``main`` 11c4174d: ``kernels/attention/mla_fwd_decode_m16x8_fp8_fp8.py``
(``K``, the kernel) and ``kernels/attention/mla_fwd_decode.py`` (``L``, the launcher).

Shapes (K l.40-55, L l.56-167). DeepSeek's latent attention: one KV head whose 576-wide row
is the 512-wide latent (``kv_lora_rank``) followed by 64 rope columns; QK dots run over all
576, V is the row's first 512 columns. Pages hold one token (``page_size * num_kv_heads ==
1``). Q and KV are float8_e4m3fn with no descales: the only scale is ``softmax_scale``.

Work (K l.1588-1608). A persistent worker w runs the work items ``work_indptr[w] ..
work_indptr[w+1]``; an item is 8 int32 words of which the kernel reads four: word 1
``partial_qo_loc`` (the split_output / split_lse row block it writes), word 2 ``qo_start``
(the query token: its 128 heads are the item's 128 rows), words 4, 5 ``kv_start, kv_end``
(positions in ``kv_page_indices``; position p reads KV row ``kv_page_indices[p]``).
Positions at or past ``kv_end`` are never read (K l.403-418, l.455-461: -1 rows are
zero-filled) and their scores are -inf (K l.855-874).

Geometry (K l.51-55, l.853-947). 8 warps of 16 heads (TILE_M = 16: the "m16x8"), KV tiles
of BLOCK_N = 64 keys on gfx950. In one warp, lane ``l`` holds head ``l % 16`` and, of each
16-key quarter h of the tile, the 4 keys ``16 h + 4 (l // 16) + i`` (i < 4): 16 scores.

Per tile t of an item, per head (eager: every tile rebases; K l.877-932):

  S  = Q . K over 576 columns (fp8 x fp8 MFMA, fp32 out: the exactly rounded dot here)
  x  = f32(S * softmax_scale);  x = -inf past kv_end           natural units
  mt = maxNum over the 64 keys (a lane's 16, then lanes xor 32, 16)
  m' = mt on the first tile, else maxNum(mt, m);  r = exp2(f32((m - m') * log2e))
  P  = exp2(f32((x - m') * log2e))                              in (0, 1]
  l  = sum(P) on the first tile, else fma(r, l, sum(P))        fp32, P before its cast
  O  = f32(f32(O * r) + f32(e4m3(P) . V))                      (first tile: O = e4m3(P) . V)

``sum(P)`` is the kernel's order: each lane adds its 16 values in register order, then
lanes xor 32 and xor 16: ``(g0 + g2) + (g1 + g3)`` over the four 16-lane groups. The fp32
``l = r * l + sum`` is one ``v_fma_f32``: the JIT launcher compiles with fast math
(K l.2061-2063), which contracts it. **P is cast to e4m3 as it is, in (0, 1]** (K l.934-947): values below
2**-6 go subnormal and P <= 2**-10 rounds to 0, while ``l`` keeps the fp32 P. The model's
``p_headroom`` H (0 upstream) is the fix #1020 made in the prefill kernel: the exponent
becomes ``fma(x - m', log2e, H)``, so P is lifted by 2**H before the cast (and ``l`` with
it), and the LSE subtracts H.

Epilogue (K l.1804-1854, l.1439-1458). Always the split path: ``split_output`` row
``partial_qo_loc * 128 + head`` gets ``f32(O * rcp(l))`` in fp32, ``split_lse`` gets
``fma(log2 l - H, f32(1/log2e), m)``: natural log units, since m is a scaled score.
``final_output`` is never written by the kernel; a reduce merges the partials (``reduce``).

Sentinels. An item with ``kv_end == kv_start`` runs one fully masked tile: m = -inf,
``-inf - -inf`` = NaN, so its partial and LSE are NaN. NaN scores (NaN codes in Q or KV)
are skipped by maxNum and poison l and O of their head.

Conventions the model fixes where the hardware leaves freedom: each MFMA chain is the
exactly rounded fp32 of its exact sum (fp8 products are exact, and so is their fp64 sum
here), one rounding per tile; exp2 and log2 are correctly rounded; rcp is IEEE 1/l.
"""

from __future__ import annotations

import math

import torch

from fa_lab.numerics import e4m3, exp2, f32, fma_f32, fmax

NUM_HEADS = 128
KV_LORA_RANK = 512
QK_ROPE_HEAD_DIM = 64
QK_HEAD_DIM = KV_LORA_RANK + QK_ROPE_HEAD_DIM
V_HEAD_DIM = KV_LORA_RANK
BLOCK_N = 64
TILE_M = 16
WORK_INFO_DW = 8
#: The kernel's fp32 constants (K l.59, l.363-364).
LOG2E = f32(1.4426950408889634)
INV_LOG2E = f32(1.0 / 1.4426950408889634)
#: The four 16-lane groups' keys within a tile, each in a lane's register order:
#: group j holds keys 16 h + 4 j + i for h < 4, i < 4 (K l.868, l.892).
LANE_KEYS = torch.tensor([[16 * h + 4 * j + i for h in range(4) for i in range(4)]
                          for j in range(4)])


def tile_max(x: torch.Tensor) -> torch.Tensor:
    """maxNum over the last dim (64 keys): NaN only where every value is NaN."""
    nan = x.isnan()
    m = x.masked_fill(nan, -math.inf).amax(-1)
    return torch.where(nan.all(-1), torch.full_like(m, math.nan), m)


def tile_sum(p: torch.Tensor) -> torch.Tensor:
    """The kernel's fp32 sum of one tile's 64 P values per row: (g0 + g2) + (g1 + g3)."""
    g = []
    for j in range(4):
        cols = p[..., LANE_KEYS[j].to(p.device)]
        acc = cols[..., 0]
        for i in range(1, 16):
            acc = acc + cols[..., i]
        g.append(acc)
    return (g[0] + g[2]) + (g[1] + g[3])


def exact_dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b.T of fp32 tensors holding fp8 values, rounded once to fp32 from the exact sum
    (fp8 x fp8 products carry 8 bits on a 2**-18 grid; 576 of them sum exactly in fp64)."""
    return (a.double() @ b.double().transpose(-1, -2)).float()


def work_item(q: torch.Tensor, kv: torch.Tensor, softmax_scale: float, *,
              p_headroom: float = 0.0):
    """One work item: ``q`` [H, 576] and ``kv`` [n, 576] (the item's KV rows in position
    order), fp32 holding e4m3 values. Returns (o [H, 512] fp32, lse [H] fp32, natural log),
    what the kernel stores for the item."""
    scale = f32(softmax_scale)
    headroom = f32(p_headroom)
    n = kv.shape[0]
    H = q.shape[0]
    num_tiles = max(1, -(-n // BLOCK_N))  # an empty item still runs its one tile
    m = l = O = None
    for t in range(num_tiles):
        rows = kv[t * BLOCK_N:(t + 1) * BLOCK_N]
        valid = rows.shape[0]
        k = torch.zeros(BLOCK_N, QK_HEAD_DIM, dtype=torch.float32, device=q.device)
        k[:valid] = rows  # rows past kv_end are zero-filled, then masked
        x = exact_dot(q, k) * scale
        x[:, valid:] = -math.inf
        mt = tile_max(x)
        if t == 0:
            m_new, r = mt, None
        else:
            m_new = fmax(mt, m)
            r = exp2((m - m_new) * LOG2E)
        p = exp2(fma_f32(x - m_new[:, None], LOG2E, torch.full_like(x, headroom)))
        s = tile_sum(p)
        pv = exact_dot(e4m3(p), k[:, :V_HEAD_DIM].T.contiguous())
        if t == 0:
            l, O = s, pv
        else:
            l = fma_f32(r, l, s)
            O = O * r[:, None] + pv
        m = m_new
    rcp = torch.ones(H, dtype=torch.float32, device=q.device) / l
    out = O * rcp[:, None]
    log2l = torch.log2(l.double()).float()
    lse = fma_f32(log2l - headroom, INV_LOG2E, m)
    return out, lse


def work_items(work_indptr: torch.Tensor, work_info_set: torch.Tensor):
    """The items in the order the workers run them: (partial_qo_loc, qo_start, kv_start,
    kv_end) per item, worker by worker (K l.383-388, l.1588-1607)."""
    ptr = work_indptr.tolist()
    info = work_info_set.reshape(-1, WORK_INFO_DW).tolist()
    return [(info[i][1], info[i][2], info[i][4], info[i][5])
            for w in range(len(ptr) - 1) for i in range(ptr[w], ptr[w + 1])]


def forward(query: torch.Tensor, kv_buffer: torch.Tensor, kv_page_indices: torch.Tensor,
            work_indptr: torch.Tensor, work_info_set: torch.Tensor,
            split_output: torch.Tensor, split_lse: torch.Tensor, softmax_scale: float, *,
            p_headroom: float = 0.0) -> None:
    """The launcher's call (checked by ``fa_lab.mla``): every work item's partial output
    and LSE written into ``split_output`` [N, 1, 128, 512] and ``split_lse`` [N, 1, 128, 1].
    ``query`` [S, 128, 576] and ``kv_buffer`` [P, 1, 1, 576] are float8_e4m3fn."""
    q = query.float().reshape(-1, NUM_HEADS, QK_HEAD_DIM)
    kv = kv_buffer.float().reshape(-1, QK_HEAD_DIM)
    pages = kv_page_indices.long()
    so = split_output.view(-1, NUM_HEADS, V_HEAD_DIM)
    sl = split_lse.view(-1, NUM_HEADS)
    for loc, qo, k0, k1 in work_items(work_indptr, work_info_set):
        o, lse = work_item(q[qo], kv[pages[k0:k1]], softmax_scale, p_headroom=p_headroom)
        so[loc] = o
        sl[loc] = lse


def reduce(split_output: torch.Tensor, split_lse: torch.Tensor, reduce_indptr: torch.Tensor,
           reduce_final_map: torch.Tensor, reduce_partial_map: torch.Tensor,
           final_output: torch.Tensor) -> None:
    """The split merge that upstream pairs with the kernel (ROCm/aiter ``mla_reduce_v1``;
    its FlyDSL port ``aiter/ops/flydsl/kernels/mla_reduce.py`` at e4048607, the many-split
    body l.557-640), at the level of its formula. Tile i merges the partial rows
    ``reduce_partial_map[reduce_indptr[i]:reduce_indptr[i+1]]`` into query token
    ``reduce_final_map[i, 0]``: M = max lse (NaN propagates), E = sum exp(lse_j - M),
    LSE = ln E + M (+inf where E is 0 or NaN), out = bf16(sum exp(lse_j - LSE) o_j), sums
    in split order, exp as exp2(f32(x * log2e)). A tile with one split is skipped
    (``num_splits <= 1``, reduce.cu): its final row keeps what it held."""
    so = split_output.view(-1, NUM_HEADS, V_HEAD_DIM)
    sl = split_lse.view(-1, NUM_HEADS)
    ptr = reduce_indptr.tolist()
    for i in range(len(ptr) - 1):
        rows = reduce_partial_map[ptr[i]:ptr[i + 1]].long()
        if rows.numel() <= 1:
            continue
        lses = sl[rows]  # [n, H]
        M = torch.where(lses.isnan().any(0), torch.full_like(lses[0], math.nan), lses.amax(0))
        E = torch.zeros_like(M)
        for j in range(rows.numel()):
            E = E + exp2((lses[j] - M) * LOG2E)
        bad = (E == 0) | E.isnan()
        lse = torch.where(bad, torch.full_like(E, math.inf), torch.log(E.double()).float() + M)
        acc = torch.zeros(NUM_HEADS, V_HEAD_DIM, dtype=torch.float32, device=so.device)
        for j, r in enumerate(rows.tolist()):
            acc = acc + exp2((lses[j] - lse) * LOG2E)[:, None] * so[r]
        final_output[int(reduce_final_map[i, 0])] = acc.to(final_output.dtype)


def schedule(kv_indptr, num_kv_splits: int, *, granularity: int = 16):
    """Work metadata in upstream's format for one decode token per sequence, one worker:
    sequence b's positions ``kv_indptr[b] .. kv_indptr[b+1]`` cut into at most
    ``num_kv_splits`` contiguous chunks of a multiple of ``granularity`` positions (an empty
    sequence gets one empty item). fa_lab's own schedule, not aiter's load balancer
    (``get_mla_metadata_v1``): the kernel's result depends on it only through the chunk
    boundaries. Returns a dict of int32 tensors: work_indptr, work_info_set [items, 8],
    reduce_indptr, reduce_final_map [seqs, 2], reduce_partial_map; and num_partial."""
    ind = [int(v) for v in kv_indptr]
    items, rptr, fmap, pmap = [], [0], [], []
    for b in range(len(ind) - 1):
        n = ind[b + 1] - ind[b]
        chunk = max(granularity, -(-max(n, 1) // num_kv_splits))
        chunk = -(-chunk // granularity) * granularity
        starts = list(range(0, n, chunk)) or [0]
        for s in starts:
            loc = len(items)
            items.append([b, loc, b, b + 1, ind[b] + s, ind[b] + min(n, s + chunk), 0, 0])
            pmap.append(loc)
        rptr.append(len(pmap))
        fmap.append([b, b + 1])
    i32 = dict(dtype=torch.int32)
    return {"work_indptr": torch.tensor([0, len(items)], **i32),
            "work_info_set": torch.tensor(items, **i32).reshape(-1, WORK_INFO_DW),
            "reduce_indptr": torch.tensor(rptr, **i32),
            "reduce_final_map": torch.tensor(fmap, **i32).reshape(-1, 2),
            "reduce_partial_map": torch.tensor(pmap, **i32),
            "num_partial": len(items)}


def reference(q: torch.Tensor, kv: torch.Tensor, softmax_scale: float):
    """The fp64 reference of one item: softmax(q k^T * scale) v over its n keys, from the
    same fp8 values. Returns (o [H, 512], lse [H]) in fp64 (natural log)."""
    s = (q.double() @ kv.double().T) * float(softmax_scale)
    lse = torch.logsumexp(s, -1)
    return torch.softmax(s, -1) @ kv[:, :V_HEAD_DIM].double(), lse
