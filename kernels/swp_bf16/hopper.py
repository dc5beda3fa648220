"""The fast bf16/f16 forward written for Hopper in Gluon (sm_90: TMA, wgmma, warp
specialisation), with the same policy semantics as ``fast`` (see its docstring).

The schedule is FlashAttention-3's, expressed with Triton's Gluon dialect:

- One program owns a 128-row query block of one (batch, head) and runs three partitions:
  a one-warp loader and two consumer warpgroups of 64 rows each. The loader streams K and
  V tiles through a ring of ``STAGES`` shared-memory slots (TMA, one mbarrier per slot
  and direction: "ready" when the bytes landed, "empty" when both consumers released it).
- Each consumer overlaps its own work: the scores of tile j are issued (asynchronous
  wgmma) before the PV product of tile j-1, and the softmax of tile j runs while that
  product is still in flight; O is rescaled only after it has landed.
- With ``PINGPONG`` the two consumers take turns at the tensor cores: a consumer issues
  its two GEMMs of a step only after the other consumer issued its own, so the softmax of
  one warpgroup overlaps the GEMMs of the other (a work item's first S product and last
  PV product run outside the turns).
- With a persistent grid (one program per multiprocessor), each program walks several
  work items, handed out dynamically: the loader takes the next item from a global
  counter (an atomic add) while it streams the current one, and passes it to the
  consumers in shared memory beside the item's Q. Causal items differ in length, so a
  fixed share per program would finish unevenly; taken on demand, the heavy items (the
  bottom blocks of a small group of heads, which come first: ``_tile_of``) spread over
  the programs and the light ones fill the tail. A consumer hands Q's slot back after its last S product, and O is staged
  in a slot of its own, so the next item's Q and first K and V tiles load while the
  consumer finishes the current item's last PV product and stores its O.

What it keeps from the policy semantics is what ``fast`` keeps (Q pre-scaled into log2
units and rounded once, per-32-row-wave votes, the fixed or unfixed rebase, P rounded
before PV, l summing the unrounded P, the first tile setting the base, floored when
causal). Its tiling: 128-row blocks, ``BLOCK_N`` columns per vote, and a causal block's
walk bounds taken from the whole 128-row block (as ``fast`` at ``BLOCK_M`` 128), so on
the same inputs it takes ``fast``'s decisions at the same ``BLOCK_N``.

A warpgroup holds two 32-row waves in four warps of 16 rows, so a wave spans two warps.
The lazy vote is one ``bar.red.or`` per tile over the wave's 64 threads, on a named
barrier of the wave's own: each row learns whether its wave fired, without shared memory
and without a branch. O and l are then multiplied by ``corr`` (1 in a wave that did not
fire) as under eager: skipping that multiply would need a branch on a warpgroup-uniform
value, which Gluon can only take after a reduction across the warps (shared memory and a
barrier on the softmax's critical path), and that costs more than the multiply saves
(docs/performance.md).

Dense batches only (no varlen or split-K: those stay on ``fast``). K and V are read
through rank-3 TMA descriptors ([B, S, heads x D]), so a tile past a sequence's end reads
zeros, never the next batch's rows.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor

from fa_lab import timing
from fa_lab.capabilities import check_policy
from fa_lab.policies import Policy

from . import FAMILY
from .hopper_grid import unread_counter, work_counter
from .._triton import fast as common
from .._triton import tuner

# Gluon spells these two ways across the Triton versions the project meets: a barrier over
# the calling partition's warps, and the TMA load and store.
_sync_partition = getattr(gl, "thread_barrier", None) or gl.barrier
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
_tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global

KERNEL = "hopper_bf16"
HEAD_DIMS = common.BF16_HEAD_DIMS
DTYPES = common.BF16_DTYPES
#: Rows per program and per consumer warpgroup.
BLOCK_M = 128
WG_ROWS = 64
#: The first of the four named barriers the lazy vote uses (one per wave of each consumer
#: warpgroup); Triton's own partition barriers take the lowest ids.
WAVE_BARRIER = 8
#: Causal work items are ordered in groups of (B, head) pairs that hold about this many
#: query blocks (about one program per multiprocessor of a Hopper GPU; see ``_tile_of``).
GROUP_ITEMS = 128
#: Shared memory one program may use on sm_90 (227 KiB).
SHARED_BYTES = 232448


def available(device=None) -> bool:
    """True where this kernel can run: ``device`` (default: the current CUDA device) is a
    Hopper GPU."""
    if not torch.cuda.is_available():
        return False
    index = torch.cuda.current_device() if device is None else torch.device(device).index
    return _capability(torch.cuda.current_device() if index is None else index)[0] == 9


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


@functools.lru_cache(maxsize=None)
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


_BLOCK_M = gl.constexpr(BLOCK_M)
_WAVE_BARRIER = gl.constexpr(WAVE_BARRIER)


@gluon.jit
def _tile_of(t, n_m, BH, H, HG, seqlen_q, seqlen_kv, BLOCK_N: gl.constexpr,
             CAUSAL: gl.constexpr):
    """Work item t: (b, h, m0, n_tiles, n_full). The (batch, head) pairs come in
    groups of ``HG``; within a group, query block by query block (all its heads'
    first block, then their second, ..), so the programs running together share a
    few heads' K and V in L2. Causal walks take the heaviest (bottom) blocks first:
    the items handed out last are the lightest, for a short tail. A causal block's
    walk bounds are those of its whole 128 rows, for both warpgroups."""
    per_group = HG * n_m
    g = t // per_group
    heads = gl.minimum(HG, BH - g * HG)  # the last group may hold fewer
    r = t - g * per_group
    bh = g * HG + r % heads
    pid_m = r // heads
    if CAUSAL:
        pid_m = n_m - 1 - pid_m
    m0 = pid_m * _BLOCK_M
    diag = seqlen_kv - seqlen_q
    n_tiles = gl.cdiv(seqlen_kv, BLOCK_N)
    n_full = seqlen_kv // BLOCK_N
    if CAUSAL:
        last = m0 + _BLOCK_M - 1 + diag  # last visible column of the block's bottom row
        n_tiles = gl.minimum(n_tiles, gl.where(last >= 0, last // BLOCK_N + 1, 0))
        first = m0 + diag + 1  # columns visible to the block's top row
        n_full = gl.minimum(n_full, gl.where(first >= 0, first // BLOCK_N, 0))
    return bh // H, bh % H, m0, gl.maximum(n_tiles, 1), n_full


@gluon.jit
def _post_item(items, wg, t):
    """The loader writes work item t into consumer wg's slot (both partitions' lanes
    see the store before the mbarrier arrive that follows it)."""
    one: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
    items.index(wg).store(gl.full([1], t, gl.int32, layout=one))
    _sync_partition()


@gluon.jit
def _take_item(items, q_ready, wg, j):
    """A consumer's j-th work item (``total`` when there is none left), once the
    loader posted it and, for a real item, its Q landed."""
    four: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    mbarrier.wait(q_ready.index(wg), j & 1)
    return gl.max(items.index(wg).load(four), 0)


@gluon.jit
def _loader(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, items, q_ready, q_empty, k_ready,
            k_empty, v_ready, v_empty, Counter, BH, H, HG, GROUP, n_m, total, seqlen_q,
            seqlen_kv, D: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
            CAUSAL: gl.constexpr, PERSISTENT: gl.constexpr):
    """The loader warp: per work item, the item and both Q halves (once the consumers
    released Q), then K and V tile by tile into the ring; at the end, ``total`` (no
    item) to each consumer. A program's first item is its id; in a persistent grid of
    P programs, each further one comes from ``Counter`` (items P, P + 1, ..), asked for
    once the current item's loads are issued: the ring is full then, so the atomic's
    wait is hidden, and the items go to the programs that free up first. ``it`` counts
    ring tiles over the program's whole life, so slots and phases run on across work
    items; a wait on parity 1 passes on a fresh barrier."""
    it = 0
    j = 0
    t = gl.program_id(0)
    while t < total:
        b, h, m0, n_tiles, n_full = _tile_of(t, n_m, BH, H, HG, seqlen_q, seqlen_kv, BLOCK_N,
                                             CAUSAL)
        hk = h // GROUP
        for wg in gl.static_range(2):
            mbarrier.wait(q_empty.index(wg), (j & 1) ^ 1)
            _post_item(items, wg, t)
            mbarrier.expect(q_ready.index(wg), q_desc.block_type.nbytes)
            _tma_load(q_desc, [b, m0 + wg * 64, h * D], q_ready.index(wg), q_smem.index(wg))
        for i in range(n_tiles):
            slot = (it + i) % STAGES
            free = (((it + i) // STAGES) & 1) ^ 1
            mbarrier.wait(k_empty.index(slot), free)
            mbarrier.expect(k_ready.index(slot), k_desc.block_type.nbytes)
            _tma_load(k_desc, [b, i * BLOCK_N, hk * D], k_ready.index(slot), k_smem.index(slot))
            mbarrier.wait(v_empty.index(slot), free)
            mbarrier.expect(v_ready.index(slot), v_desc.block_type.nbytes)
            _tma_load(v_desc, [b, i * BLOCK_N, hk * D], v_ready.index(slot), v_smem.index(slot))
        it += n_tiles
        j += 1
        if PERSISTENT:  # asked for once the item's loads are issued: its wait is hidden
            t = gl.num_programs(0) + gl.atomic_add(Counter, 1, sem="relaxed")
        else:
            t = total
    if PERSISTENT:
        # The last program to run out of items sets the counter back to zero (every
        # program's last ask came before its count here), so a launch's arguments can
        # be launched again.
        if gl.atomic_add(Counter + 1, 1, sem="acq_rel") == gl.num_programs(0) - 1:
            gl.atomic_xchg(Counter, 0, sem="relaxed")
            gl.atomic_xchg(Counter + 1, 0, sem="relaxed")
    for wg in gl.static_range(2):
        mbarrier.wait(q_empty.index(wg), (j & 1) ^ 1)
        _post_item(items, wg, total)
        mbarrier.arrive(q_ready.index(wg))


@gluon.jit
def _masked(s, n0, rows, seqlen_kv, diag, s_layout: gl.constexpr, BLOCK_N: gl.constexpr,
            CAUSAL: gl.constexpr):
    """-inf past Skv and above the bottom-right causal diagonal."""
    cols = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    valid = cols[None, :] < seqlen_kv
    if CAUSAL:
        valid = valid & (cols[None, :] <= rows[:, None] + diag)
    return gl.where(valid, s, float("-inf"))


@gluon.jit
def _wave_any(vote, bar_ids):
    """For each row: whether any row of its 32-row wave voted (1) or not (0), the same
    for the whole wave. A wave spans two warps of the warpgroup, so the OR is one
    ``bar.red.or`` over their 64 threads on the wave's own named barrier (``bar_ids``,
    the same for both rows a thread holds): no shared memory, no branch. Each thread
    holds two rows of one wave (``pack=2`` hands both to one instance)."""
    return gl.inline_asm_elementwise(
        """
        {
        .reg .pred p;
        .reg .b32 v;
        or.b32 v, $2, $3;
        setp.ne.b32 p, v, 0;
        bar.red.or.pred p, $4, 64, p;
        selp.b32 $0, 1, 0, p;
        mov.b32 $1, $0;
        }
        """,
        "=r,=r,r,r,r,r", [vote, bar_ids], dtype=gl.int32, is_pure=False, pack=2)


@gluon.jit
def _decide(s, m, threshold, rebase, bar_ids, LAZY: gl.constexpr):
    """The rescale decision for one tile of scores: (P, new m, corr). Lazy: a row
    votes when not (mt - m <= threshold) (NaN votes yes); in a wave where some row
    voted, every row rebases (to fmax(m, mt), or to mt under the unfixed rule), and
    the others keep their base (corr = 1)."""
    mt = gl.max(s, 1)
    if LAZY:
        vote = gl.where(mt - m <= threshold, 0, 1)
        fire = _wave_any(vote, bar_ids) > 0
        target = gl.where(rebase == 1, mt, gl.maximum(m, mt))
        corr = gl.where(fire, gl.exp2(m - target), 1.0)
        m = gl.where(fire, target, m)
    else:
        m_new = gl.maximum(m, mt)
        corr = gl.exp2(m - m_new)
        m = m_new
    p = gl.exp2(s - m[:, None])
    return p, m, corr


@gluon.jit
def _step(g, step, n0, acc, l, m, p, q, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty,
          turn_mine, turn_other, rows, seqlen_kv, diag, threshold, rebase, bar_ids,
          s_layout: gl.constexpr, o_layout: gl.constexpr, D: gl.constexpr,
          BLOCK_N: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr,
          LAZY: gl.constexpr, MASKED: gl.constexpr, PINGPONG: gl.constexpr):
    """Ring tile g (columns n0..): S = Q K^T issued, then O += P V of ring tile g-1; the
    decision on S while PV runs; O rescaled once PV landed. ``step`` counts this
    consumer's turns at the tensor cores."""
    slot = g % STAGES
    prev = (g - 1) % STAGES
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    k_t = k_smem.index(slot).reshape([BLOCK_N, D]).permute((1, 0))
    v_prev = v_smem.index(prev).reshape([BLOCK_N, D])
    mbarrier.wait(k_ready.index(slot), (g // STAGES) & 1)
    mbarrier.wait(v_ready.index(prev), ((g - 1) // STAGES) & 1)
    if PINGPONG:
        mbarrier.wait(turn_mine, step & 1)
    s = warpgroup_mma(q, k_t, gl.zeros([64, BLOCK_N], gl.float32, layout=s_layout),
                      use_acc=False, is_async=True)
    acc = warpgroup_mma(gl.convert_layout(p.to(q.dtype), p_layout), v_prev, acc, is_async=True)
    if PINGPONG:
        mbarrier.arrive(turn_other)
    s = warpgroup_mma_wait(1, deps=(s, ))
    mbarrier.arrive(k_empty.index(slot))
    if MASKED:
        s = _masked(s, n0, rows, seqlen_kv, diag, s_layout, BLOCK_N, CAUSAL)
    p, m, corr = _decide(s, m, threshold, rebase, bar_ids, LAZY)
    acc = warpgroup_mma_wait(0, deps=(acc, ))
    mbarrier.arrive(v_empty.index(prev))
    acc = acc * gl.convert_layout(corr, gl.SliceLayout(1, o_layout))[:, None]
    l = l * corr + gl.sum(p, 1)
    return acc, l, m, p


@gluon.jit
def _consumer(wg, q_smem, k_smem, v_smem, o_smem, items, q_ready, q_empty, k_ready, k_empty,
              v_ready, v_empty, turns, o_desc, Lse, BH, H, HG, n_m, total, seqlen_q,
              seqlen_kv, scale_log2, threshold, rebase, D: gl.constexpr, BLOCK_N: gl.constexpr,
              STAGES: gl.constexpr, CAUSAL: gl.constexpr, LAZY: gl.constexpr,
              PINGPONG: gl.constexpr):
    """One warpgroup: rows m0 + 64 wg .. of each work item the loader posts; the whole
    KV walk, then O and lse. ``it`` runs on with the loader's; ``step`` counts the
    turns (consumer 0 takes the first: consumer 1 hands it over once, at the start).
    The turns stay paired across work items because both consumers take the same
    items and walk the same tiles (a causal block's bounds are the whole block's):
    n_tiles - 1 turns each per item."""
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, D, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    io_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    turn_mine = turns.index(wg)
    turn_other = turns.index(1 - wg)
    q = q_smem.index(wg).reshape([64, D])
    diag = seqlen_kv - seqlen_q
    # the named barrier of each row's wave (rows 0-31 and 32-63 of this warpgroup)
    wave = gl.where(gl.arange(0, 64, layout=row_layout) < 32, 0, 1)
    bar_ids = wave + (_WAVE_BARRIER + 2 * wg)
    if PINGPONG:
        if wg == 1:
            mbarrier.arrive(turn_other)
    o = o_smem.index(wg).reshape([64, D])
    it = 0
    step = 0
    j = 0
    t = _take_item(items, q_ready, wg, j)
    while t < total:
        b, h, m0, n_tiles, n_full = _tile_of(t, n_m, BH, H, HG, seqlen_q, seqlen_kv, BLOCK_N,
                                             CAUSAL)
        rows = m0 + wg * 64 + gl.arange(0, 64, layout=row_layout)

        # Qs = round(Q * c), in place (Q landed): the tensor cores read it from shared
        # memory.
        q.store((q.load(io_layout).to(gl.float32) * scale_log2).to(q.dtype))
        fence_async_shared()
        _sync_partition()

        # The first tile sets the base (floored when causal: a row that sees no key
        # gets P = 0, not NaN).
        k_t = k_smem.index(it % STAGES).reshape([BLOCK_N, D]).permute((1, 0))
        mbarrier.wait(k_ready.index(it % STAGES), (it // STAGES) & 1)
        s = warpgroup_mma(q, k_t, gl.zeros([64, BLOCK_N], gl.float32, layout=s_layout),
                          use_acc=False, is_async=True)
        s = warpgroup_mma_wait(0, deps=(s, ))
        mbarrier.arrive(k_empty.index(it % STAGES))
        s = _masked(s, 0, rows, seqlen_kv, diag, s_layout, BLOCK_N, CAUSAL)
        m = gl.max(s, 1)
        if CAUSAL:
            m = gl.maximum(m, -3e38)
        p = gl.exp2(s - m[:, None])
        l = gl.sum(p, 1)
        acc = gl.zeros([64, D], gl.float32, layout=o_layout)

        for i in range(1, n_full):
            acc, l, m, p = _step(it + i, step, i * BLOCK_N, acc, l, m, p, q, k_smem, v_smem,
                                 k_ready, k_empty, v_ready, v_empty, turn_mine, turn_other,
                                 rows, seqlen_kv, diag, threshold, rebase, bar_ids, s_layout,
                                 o_layout, D, BLOCK_N, STAGES, CAUSAL, LAZY, False, PINGPONG)
            step += 1
        for i in range(gl.maximum(n_full, 1), n_tiles):
            acc, l, m, p = _step(it + i, step, i * BLOCK_N, acc, l, m, p, q, k_smem, v_smem,
                                 k_ready, k_empty, v_ready, v_empty, turn_mine, turn_other,
                                 rows, seqlen_kv, diag, threshold, rebase, bar_ids, s_layout,
                                 o_layout, D, BLOCK_N, STAGES, CAUSAL, LAZY, True, PINGPONG)
            step += 1

        # Every S product of this item is done: Q's slot goes back to the loader.
        mbarrier.arrive(q_empty.index(wg))

        # The last tile's PV.
        g = it + n_tiles - 1
        v_last = v_smem.index(g % STAGES).reshape([BLOCK_N, D])
        mbarrier.wait(v_ready.index(g % STAGES), (g // STAGES) & 1)
        acc = warpgroup_mma(gl.convert_layout(p.to(q.dtype), p_layout), v_last, acc,
                            is_async=True)
        acc = warpgroup_mma_wait(0, deps=(acc, ))
        mbarrier.arrive(v_empty.index(g % STAGES))

        # out = round(O / l) (0 where l = 0) through O's slot (once the previous
        # item's store has read it) and TMA, which clips rows past Sq;
        # lse = m ln2 + ln l (-inf where l = 0).
        inv = gl.where(l > 0, 1.0 / l, 0.0)
        tma.store_wait(0)
        o.store((acc * gl.convert_layout(inv, gl.SliceLayout(1, o_layout))[:, None]).to(q.dtype))
        fence_async_shared()
        _sync_partition()
        _tma_store(o_desc, [b, m0 + wg * 64, h * D], o_smem.index(wg))
        lse = gl.where(l == 0, float("-inf"), m * 0.6931471805599453 + gl.log(l))
        gl.store(Lse + (b * H + h).to(gl.int64) * seqlen_q + rows, lse, mask=rows < seqlen_q)
        it += n_tiles
        j += 1
        t = _take_item(items, q_ready, wg, j)
    tma.store_wait(0)


@gluon.jit(do_not_specialize=["BH", "H", "HG", "GROUP", "seqlen_q", "seqlen_kv", "rebase"])
def _attn_fwd(q_desc, k_desc, v_desc, o_desc, Lse, Counter, BH, H, HG, GROUP, seqlen_q,
              seqlen_kv, scale_log2, threshold, rebase, D: gl.constexpr, BLOCK_N: gl.constexpr,
              STAGES: gl.constexpr, CAUSAL: gl.constexpr, LAZY: gl.constexpr,
              PINGPONG: gl.constexpr, PERSISTENT: gl.constexpr):
    """Program p takes work item p of the (B x H) x query-block items and, when the
    grid is persistent, further ones from ``Counter`` (int32 [2]: items handed out
    and programs done; zero at launch, and zero again when the launch ends) until none
    is left."""
    n_m = gl.cdiv(seqlen_q, _BLOCK_M)
    total = n_m * BH
    q_smem = gl.allocate_shared_memory(q_desc.dtype, [2] + q_desc.block_type.shape, q_desc.layout)
    o_smem = gl.allocate_shared_memory(o_desc.dtype, [2] + o_desc.block_type.shape, o_desc.layout)
    items = gl.allocate_shared_memory(gl.int32, [2, 1], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [STAGES] + k_desc.block_type.shape,
                                       k_desc.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, [STAGES] + v_desc.block_type.shape,
                                       v_desc.layout)
    q_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    turns = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for wg in gl.static_range(2):
        mbarrier.init(q_ready.index(wg), count=1)
        mbarrier.init(q_empty.index(wg), count=1)
        mbarrier.init(turns.index(wg), count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=2)  # one arrival per consumer
        mbarrier.init(v_empty.index(i), count=2)

    # Partitions: consumer 0 runs in the kernel's own 4 warps (the default partition),
    # consumer 1 in 4 more, the loader in 1; the loader gives its registers up (24) so
    # that each consumer thread can hold O, S and P (240).
    gl.warp_specialize([
        (_consumer, (0, q_smem, k_smem, v_smem, o_smem, items, q_ready, q_empty, k_ready,
                     k_empty, v_ready, v_empty, turns, o_desc, Lse, BH, H, HG, n_m, total,
                     seqlen_q, seqlen_kv, scale_log2, threshold, rebase, D, BLOCK_N, STAGES,
                     CAUSAL, LAZY, PINGPONG)),
        (_consumer, (1, q_smem, k_smem, v_smem, o_smem, items, q_ready, q_empty, k_ready,
                     k_empty, v_ready, v_empty, turns, o_desc, Lse, BH, H, HG, n_m, total,
                     seqlen_q, seqlen_kv, scale_log2, threshold, rebase, D, BLOCK_N, STAGES,
                     CAUSAL, LAZY, PINGPONG)),
        (_loader, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, items, q_ready, q_empty,
                   k_ready, k_empty, v_ready, v_empty, Counter, BH, H, HG, GROUP, n_m, total,
                   seqlen_q, seqlen_kv, D, BLOCK_N, STAGES, CAUSAL, PERSISTENT)),
    ], [4, 1], [240, 24])


def _descriptor(t3d: torch.Tensor, rows: int, head_dim: int):
    """A rank-3 TMA descriptor over a contiguous [B, S, heads x D] with [1, rows, D] tiles
    (zeros past S). The strides come from the shape: a contiguous tensor's size-1
    dimensions may carry any stride, which TMA would refuse."""
    block = [1, rows, head_dim]
    B, S, W = t3d.shape
    layout = _tile_layout(t3d.dtype, rows, head_dim)
    return GluonDescriptor(t3d, [B, S, W], [S * W, W, 1], block, layout)


@functools.lru_cache(maxsize=None)
def _tile_layout(dtype: torch.dtype, rows: int, head_dim: int):
    """The shared-memory layout of a [1, rows, head_dim] tile (built once per kind: its
    construction is a good part of a call's host work)."""
    return gl.NVMMASharedLayout.get_default_for(
        [1, rows, head_dim], gl.bfloat16 if dtype == torch.bfloat16 else gl.float16)


@dataclass(frozen=True)
class HopperConfig:
    """A launch of the Gluon kernel: columns per KV tile (and per vote), ring depth,
    whether the consumers take turns at the tensor cores, and whether the grid is
    persistent (one program per multiprocessor, walking work items) or one program per
    item."""

    block_n: int = 128
    stages: int = 2
    pingpong: bool = True
    persistent: bool = False

    def describe(self, lazy: bool = True) -> str:
        """Short text for tables (``lazy`` is unused: the signature of ``Config.describe``)."""
        return (f"gluon BM{BLOCK_M} BN{self.block_n} s{self.stages}"
                f"{' pingpong' if self.pingpong else ''}{' persistent' if self.persistent else ''}")

    def shared_bytes(self, head_dim: int) -> int:
        """Shared memory a program needs: Q and O for both warpgroups and the K and V ring
        (bf16/f16), plus a little for the barriers and the posted work items."""
        return 2 * 2 * WG_ROWS * head_dim * 2 + 2 * self.stages * self.block_n * head_dim * 2 + 1024

    def check(self, head_dim: int | None = None) -> "HopperConfig":
        """Refuse bad fields (naming them) and, given a head dim, a ring too large for
        a Hopper multiprocessor's shared memory."""
        if type(self.block_n) is not int or self.block_n not in (64, 128):
            raise ValueError(f"HopperConfig.block_n must be 64 or 128 (an int), got {self.block_n!r}")
        if isinstance(self.stages, bool) or not isinstance(self.stages, int) or not 2 <= self.stages <= 4:
            raise ValueError(f"HopperConfig.stages must be an int in 2..4, got {self.stages!r}")
        for name in ("pingpong", "persistent"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"HopperConfig.{name} must be a bool, got "
                                f"{type(getattr(self, name)).__name__}")
        if head_dim is not None and self.shared_bytes(head_dim) > SHARED_BYTES:
            raise ValueError(f"HopperConfig(block_n={self.block_n}, stages={self.stages}) needs "
                             f"{self.shared_bytes(head_dim)} bytes of shared memory at D={head_dim}; "
                             f"a Hopper multiprocessor gives a program {SHARED_BYTES}")
        return self


#: What the first call at a new shape times (``forward`` with no config), causal or not:
#: the turn-taking and the persistent grid each pay at some shapes and not at others.
#: (Causal items differ in length, as a block walks only the tiles left of its diagonal;
#: a fixed share per persistent program would spread them unevenly, but they are handed
#: out on demand.)
CONFIGS = tuple(HopperConfig(128, 2, pp, pers) for pers in (False, True) for pp in (True, False))

_TUNED: dict[tuple, HopperConfig] = {}
_TIMINGS: dict[tuple, list[dict]] = {}
_LAST_KEY: dict[bool, tuple] = {}  # per lazy flag: the last key tuned


def launch_args(q, k, v, causal: bool, policy: Policy, config: HopperConfig, num_sms: int = 0):
    """(grid, args, meta, out, lse) for ``_attn_fwd`` on contiguous [B, S, H, D] tensors
    whose data start on 16 bytes (TMA); ``num_sms``: the persistent grid's size."""
    config.check(q.shape[-1])
    if config.persistent and (isinstance(num_sms, bool) or not isinstance(num_sms, int) or num_sms < 1):
        raise ValueError(f"a persistent HopperConfig needs num_sms >= 1 (the grid), got {num_sms!r}")
    B, Sq, H, D = q.shape
    Skv, Hkv = k.shape[1], k.shape[2]
    out = torch.empty(q.shape, device=q.device, dtype=q.dtype)
    lse = torch.empty(B, H, Sq, device=q.device, dtype=torch.float32)
    descs = (_descriptor(q.view(B, Sq, H * D), WG_ROWS, D),
             _descriptor(k.view(B, Skv, Hkv * D), config.block_n, D),
             _descriptor(v.view(B, Skv, Hkv * D), config.block_n, D),
             _descriptor(out.view(B, Sq, H * D), WG_ROWS, D))
    scale_log2, threshold, _, rebase = common.policy_args(policy, D)
    # the persistent grid's work counters (the kernel leaves them at zero, so these args
    # can be launched again); one-program-per-item launches never read them
    counter = work_counter(q.device) if config.persistent else unread_counter(q.device)
    n_m = triton.cdiv(Sq, BLOCK_M)
    heads_per_group = min(B * H, triton.cdiv(GROUP_ITEMS, n_m)) if causal else 1
    args = (*descs, lse, counter, B * H, H, heads_per_group, H // Hkv, Sq, Skv, scale_log2,
            threshold, rebase)
    meta = dict(D=D, BLOCK_N=config.block_n, STAGES=config.stages, CAUSAL=causal,
                LAZY=policy.lazy, PINGPONG=config.pingpong, PERSISTENT=config.persistent)
    items = n_m * B * H
    grid = (min(items, num_sms),) if config.persistent else (items,)
    return grid, args, meta, out, lse


def _run(device, grid, args, meta):
    if device.index is None or device.index == torch.cuda.current_device():
        _attn_fwd[grid](*args, **meta, num_warps=4)  # 4: the default partition, consumer 0
    else:
        with torch.cuda.device(device):
            _attn_fwd[grid](*args, **meta, num_warps=4)


def _launch(q, k, v, causal, policy, config):
    num_sms = _num_sms(q.device.index if q.device.index is not None else torch.cuda.current_device())
    grid, args, meta, out, lse = launch_args(q, k, v, causal, policy, config, num_sms)
    _run(q.device, grid, args, meta)
    return out, lse


def _tune(q, k, v, causal, policy) -> tuple[HopperConfig, list[dict]]:
    """The fastest of ``CONFIGS`` here, and each one's times, ranked as the Triton
    kernels' launches are (``_triton.tuner.rank``: alternated rounds). Each kernel is timed
    alone (CUDA events, L2 flushed), its arguments built once (a persistent launch leaves
    its counters at zero, so they can be launched again): at short sequences one call's
    host work takes longer than its kernel, and timing whole calls would rank the host's
    time, not the GPU's."""
    num_sms = torch.cuda.get_device_properties(q.device).multi_processor_count
    fns = []  # (each candidate's outputs stay allocated until the pick is made)
    for c in CONFIGS:
        grid, args, meta, _, _ = launch_args(q, k, v, causal, policy, c, num_sms)
        fns.append(functools.partial(_run, q.device, grid, args, meta))
    return tuner.rank(CONFIGS, fns, timing.CudaTimer(q.device))


def _tma_ready(x: torch.Tensor) -> torch.Tensor:
    """Contiguous, starting on 16 bytes (TMA's alignment): a copy where needed."""
    x = x.contiguous()
    return x if x.data_ptr() % 16 == 0 else x.clone()


def _key(q, k, causal, lazy):
    """What the pick depends on: the shapes (B too: the work items against the GPU's
    multiprocessors decide whether a persistent grid pays), the flags and the device."""
    B, Sq, H, D = q.shape
    return (B, Sq, k.shape[1], H, H // k.shape[2], D, causal, lazy, q.dtype, q.device)


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool, policy: Policy,
            config: HopperConfig | None = None):
    """q [B, Sq, H, D], k and v [B, Skv, Hkv, D], bf16 or f16, D 64 or 128, on a Hopper GPU.
    ``config`` pins a launch; by default the first call at a new shape times ``CONFIGS``
    and keeps the fastest. Returns (out [B, Sq, H, D], lse [B, H, Sq] fp32, natural log)."""
    common.check_qkv(q, k, v, DTYPES, HEAD_DIMS)
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    check_policy(policy, FAMILY, "fast")
    if config is not None:
        if not isinstance(config, HopperConfig):
            raise TypeError(f"config must be a HopperConfig, got {type(config).__name__}")
        config.check(q.shape[-1])
    if q.device.type != "cuda" or not available(q.device):
        raise ValueError("the Gluon kernel runs on a Hopper GPU (sm_90) with CUDA tensors; "
                         f"got tensors on {q.device}")
    q, k, v = (_tma_ready(x) for x in (q, k, v))
    if config is None:
        key = _key(q, k, causal, policy.lazy)
        if key not in _TUNED:
            _TUNED[key], _TIMINGS[key] = _tune(q, k, v, causal, policy)
            _LAST_KEY[policy.lazy] = key
        config = _TUNED[key]
    return _launch(q, k, v, causal, policy, config)


def best_config(q, k, causal: bool, lazy: bool):
    """The tuned pick for these shapes (after a forward ran), or None."""
    return _TUNED.get(_key(q, k, causal, lazy))


def last_timings(lazy: bool) -> list[dict]:
    """The timings (ms per config) of the last shape tuned with this lazy flag; [] if none."""
    return list(_TIMINGS[_LAST_KEY[lazy]]) if lazy in _LAST_KEY else []
