"""FlashAttention-3's forward schedule for Hopper in Gluon (sm_90: TMA, wgmma, warp
specialisation), with the fast kernels' policy semantics: for bf16/f16 those of
``swp_bf16.fast``, for fp8 (``FP8``) those of ``swp_fp8.fast`` (see their docstrings).
The host sides are ``swp_bf16.hopper`` and ``swp_fp8.hopper``.

The schedule, expressed with Triton's Gluon dialect:

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
- With a persistent grid, each program walks several work items; the loader brings an
  item's Q once both consumers handed the previous one back (after its O was stored), so
  K and V of the next item wait for that too.

What it keeps from the policy semantics is what the fast kernels keep: per-32-row-wave
votes, the fixed, unfixed (and for fp8 capped) rebase, P rounded before PV, l summing the
unrounded P, the first tile setting the base, floored when causal. bf16/f16: Q pre-scaled
into log2 units and rounded once, P = exp2(S - m). fp8: scores and m in the raw
fp8-product domain, ``ls`` converting a difference to log2 units, P = exp2(S ls - m ls + H)
with the P headroom H, cast to e4m3 with or without saturation, V read transposed
([B, Hkv, D, Skv]: Hopper's fp8 wgmma reads both operands K-major), out scaled by
``v_descale``. Its tiling: 128-row blocks, ``BLOCK_N`` columns per vote (128 for fp8, the
model's pair of 64-column tiles), and a causal block's walk bounds taken from the whole
128-row block, so on the same inputs it takes the Triton fast kernel's decisions at the
same ``BLOCK_N``.

A warpgroup holds two 32-row waves in four warps of 16 rows, so a wave spans two warps.
The lazy vote is one ``bar.red.or`` per tile over the wave's 64 threads, on a named
barrier of the wave's own: each row learns whether its wave fired, without shared memory
and without a branch. O and l are then multiplied by ``corr`` (1 in a wave that did not
fire) as under eager: skipping that multiply would need a branch on a warpgroup-uniform
value, which Gluon can only take after a reduction across the warps (shared memory and a
barrier on the softmax's critical path), and that costs more than the multiply saves
(data/results/hopper_rescale_cost_h200.json).

Dense batches only (no varlen or split-K: those stay on the Triton kernels). K (and bf16
V) are read through rank-3 TMA descriptors ([B, S, heads x D]), so a tile past a
sequence's end reads zeros, never the next batch's rows; fp8's transposed V is padded with
zeros past Skv.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

try:  # Gluon (triton.experimental.gluon): Triton >= 3.5
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor
    # Gluon spells these two ways across the Triton versions the project meets: a
    # barrier over the calling partition's warps, and the TMA load and store.
    _sync_partition = getattr(gl, "thread_barrier", None) or gl.barrier
    _tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    _tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global
except ImportError:  # pragma: no cover - the project pins a triton with Gluon
    gluon = None

#: Rows per program and per consumer warpgroup.
BLOCK_M = 128
WG_ROWS = 64
#: The first of the four named barriers the lazy vote uses (one per wave of each consumer
#: warpgroup); Triton's own partition barriers take the lowest ids.
WAVE_BARRIER = 8
#: Shared memory one program may use on sm_90 (227 KiB).
SHARED_BYTES = 232448


def available(device=None) -> bool:
    """True where this kernel can run: Gluon imports and ``device`` (default: the current
    CUDA device) is a Hopper GPU."""
    return (gluon is not None and torch.cuda.is_available()
            and torch.cuda.get_device_capability(device)[0] == 9)


if gluon is not None:

    _BLOCK_M = gl.constexpr(BLOCK_M)
    _WAVE_BARRIER = gl.constexpr(WAVE_BARRIER)

    @gluon.jit
    def _tile_of(t, n_m, H, seqlen_q, seqlen_kv, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr):
        """Work item t: (b, h, m0, n_tiles, n_full). A head's query blocks come one after
        another, so programs running together share its K and V in L2; causal walks take
        each head's heaviest (bottom) block first, for a shorter tail. A causal block's
        walk bounds are those of its whole 128 rows, for both warpgroups."""
        bh = t // n_m
        pid_m = t % n_m
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
    def _loader(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready,
                k_empty, v_ready, v_empty, BH, H, GROUP, n_m, total, seqlen_q, seqlen_kv,
                D: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                CAUSAL: gl.constexpr, FP8: gl.constexpr):
        """The loader warp: per work item, both Q halves (once the consumers released
        them), then K and V tile by tile into the ring (fp8: V's transposed [D, BLOCK_N]
        tiles). ``it`` counts ring tiles over the program's whole life, so slots and phases
        run on across work items; a wait on parity 1 passes on a fresh barrier."""
        it = 0
        j = 0
        for t in range(gl.program_id(0), total, gl.num_programs(0)):
            b, h, m0, n_tiles, n_full = _tile_of(t, n_m, H, seqlen_q, seqlen_kv, BLOCK_N, CAUSAL)
            hk = h // GROUP
            for wg in gl.static_range(2):
                mbarrier.wait(q_empty.index(wg), (j & 1) ^ 1)
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
                if FP8:
                    _tma_load(v_desc, [(b * (H // GROUP) + hk) * D, i * BLOCK_N],
                              v_ready.index(slot), v_smem.index(slot))
                else:
                    _tma_load(v_desc, [b, i * BLOCK_N, hk * D], v_ready.index(slot),
                              v_smem.index(slot))
            it += n_tiles
            j += 1

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
    def _probabilities(s, m, ls, headroom, FP8: gl.constexpr):
        """P on the base m: exp2(S - m) (bf16/f16: scores in log2 units), or
        exp2(fma(S, ls, -ls m + H)) (fp8: raw scores, H the P headroom)."""
        if FP8:
            return gl.exp2(gl.fma(s, ls, ((0.0 - ls * m) + headroom)[:, None]))
        else:
            return gl.exp2(s - m[:, None])

    @gluon.jit
    def _decide(s, m, threshold, rebase, bound, ls, headroom, bar_ids, LAZY: gl.constexpr,
                CAUSAL: gl.constexpr, FP8: gl.constexpr):
        """The rescale decision for one tile of scores: (P, new m, corr). Lazy: a row
        votes when not (d <= threshold), d = mt - m in log2 units (NaN votes yes); in a
        wave where some row voted, every row rebases by the policy's rule (0: to
        fmax(m, mt); 1: to mt; 2, fp8 only: to mt unless that moves the base down by more
        than ``bound``), and the other waves keep their base (corr = 1). fp8's tile max is
        floored at -3e38 when causal."""
        mt = gl.max(s, 1)
        if FP8:
            if CAUSAL:
                mt = gl.maximum(mt, -3e38)
            mono = gl.maximum(m, mt)
            if LAZY:
                d = (mt - m) * ls
                fire = _wave_any(gl.where(d <= threshold, 0, 1), bar_ids) > 0
                safe = d >= -bound  # NaN: not safe
                target = gl.where(rebase == 1, mt, gl.where(rebase == 2, gl.where(safe, mt, m), mono))
                corr = gl.where(rebase == 1, gl.exp2(-d),
                                gl.where(rebase == 2, gl.exp2(-gl.where(safe, d, 0.0)),
                                         gl.exp2((m - mono) * ls)))
                corr = gl.where(fire, corr, 1.0)
                m = gl.where(fire, target, m)
            else:
                corr = gl.exp2((m - mono) * ls)
                m = mono
        else:
            if LAZY:
                fire = _wave_any(gl.where(mt - m <= threshold, 0, 1), bar_ids) > 0
                target = gl.where(rebase == 1, mt, gl.maximum(m, mt))
                corr = gl.where(fire, gl.exp2(m - target), 1.0)
                m = gl.where(fire, target, m)
            else:
                m_new = gl.maximum(m, mt)
                corr = gl.exp2(m - m_new)
                m = m_new
        return _probabilities(s, m, ls, headroom, FP8), m, corr

    @gluon.jit
    def _p_operand(p, dtype: gl.constexpr, p_layout: gl.constexpr, FP8: gl.constexpr,
                   SATURATE: gl.constexpr):
        """P rounded to the PV product's input type, in the wgmma A-operand layout. fp8:
        the cast saturates at 448 (the GPU's satfinite cast) or, without ``SATURATE``, a P
        that rounds past 448 becomes NaN, as in the model."""
        if FP8:
            if not SATURATE:
                p = gl.where(p >= 464.0, float("nan"), p)
        return gl.convert_layout(p.to(dtype), p_layout)

    @gluon.jit
    def _v_operand(v_smem, slot, D: gl.constexpr, BLOCK_N: gl.constexpr, FP8: gl.constexpr):
        """V of a ring slot as the PV product's [BLOCK_N, D] B operand (fp8: a view of the
        transposed tile, so that the reduction dimension is the contiguous one)."""
        if FP8:
            return v_smem.index(slot).permute((1, 0))
        else:
            return v_smem.index(slot).reshape([BLOCK_N, D])

    @gluon.jit
    def _step(g, step, n0, acc, l, m, p, q, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty,
              turn_mine, turn_other, rows, seqlen_kv, diag, threshold, rebase, bound, ls, headroom,
              bar_ids, s_layout: gl.constexpr, o_layout: gl.constexpr,
              p_layout: gl.constexpr, D: gl.constexpr, BLOCK_N: gl.constexpr,
              STAGES: gl.constexpr, CAUSAL: gl.constexpr, LAZY: gl.constexpr,
              MASKED: gl.constexpr, PINGPONG: gl.constexpr, FP8: gl.constexpr,
              SATURATE: gl.constexpr):
        """Ring tile g (columns n0..): S = Q K^T issued, then O += P V of ring tile g-1; the
        decision on S while PV runs; O rescaled once PV landed. ``step`` counts this
        consumer's turns at the tensor cores."""
        slot = g % STAGES
        prev = (g - 1) % STAGES
        k_t = k_smem.index(slot).reshape([BLOCK_N, D]).permute((1, 0))
        mbarrier.wait(k_ready.index(slot), (g // STAGES) & 1)
        mbarrier.wait(v_ready.index(prev), ((g - 1) // STAGES) & 1)
        if PINGPONG:
            mbarrier.wait(turn_mine, step & 1)
        s = warpgroup_mma(q, k_t, gl.zeros([64, BLOCK_N], gl.float32, layout=s_layout),
                          use_acc=False, is_async=True)
        acc = warpgroup_mma(_p_operand(p, q.dtype, p_layout, FP8, SATURATE),
                            _v_operand(v_smem, prev, D, BLOCK_N, FP8), acc, is_async=True)
        if PINGPONG:
            mbarrier.arrive(turn_other)
        s = warpgroup_mma_wait(1, deps=(s, ))
        mbarrier.arrive(k_empty.index(slot))
        if MASKED:
            s = _masked(s, n0, rows, seqlen_kv, diag, s_layout, BLOCK_N, CAUSAL)
        p, m, corr = _decide(s, m, threshold, rebase, bound, ls, headroom, bar_ids, LAZY, CAUSAL, FP8)
        acc = warpgroup_mma_wait(0, deps=(acc, ))
        mbarrier.arrive(v_empty.index(prev))
        acc = acc * gl.convert_layout(corr, gl.SliceLayout(1, o_layout))[:, None]
        l = l * corr + gl.sum(p, 1)
        return acc, l, m, p

    @gluon.jit
    def _consumer(wg, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, k_empty, v_ready,
                  v_empty, turns, o_desc, Out, Lse, BH, H, n_m, total, seqlen_q, seqlen_kv,
                  scale_log2, threshold, rebase, bound, ls, headroom, v_descale,
                  D: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                  CAUSAL: gl.constexpr, LAZY: gl.constexpr, PINGPONG: gl.constexpr,
                  FP8: gl.constexpr, SATURATE: gl.constexpr):
        """One warpgroup: rows m0 + 64 wg .. of each work item; the whole KV walk, then O
        and lse. ``it`` runs on with the loader's; ``step`` counts the turns (consumer 0
        takes the first: consumer 1 hands it over once, at the start). The turns stay
        paired across work items because both consumers walk the same tiles (a causal
        block's bounds are the whole block's): n_tiles - 1 turns each per item."""
        MMA_K: gl.constexpr = 32 if FP8 else 16  # the wgmma instruction's K: 32 bytes
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, BLOCK_N, MMA_K])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, D, MMA_K])
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout,
                                                     k_width=4 if FP8 else 2)
        row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
        io_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        turn_mine = turns.index(wg)
        turn_other = turns.index(1 - wg)
        q = q_smem.index(wg).reshape([64, D])
        diag = seqlen_kv - seqlen_q
        # the named barrier of each row's wave (rows 0-31 and 32-63 of this warpgroup)
        bar_ids = gl.where(gl.arange(0, 64, layout=row_layout) < 32, 0, 1) + (_WAVE_BARRIER + 2 * wg)
        if PINGPONG:
            if wg == 1:
                mbarrier.arrive(turn_other)
        it = 0
        step = 0
        j = 0
        for t in range(gl.program_id(0), total, gl.num_programs(0)):
            b, h, m0, n_tiles, n_full = _tile_of(t, n_m, H, seqlen_q, seqlen_kv, BLOCK_N, CAUSAL)
            rows = m0 + wg * 64 + gl.arange(0, 64, layout=row_layout)

            mbarrier.wait(q_ready.index(wg), j & 1)
            if not FP8:
                # Qs = round(Q * c), in place: the tensor cores read it from shared memory.
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
            p = _probabilities(s, m, ls, headroom, FP8)
            l = gl.sum(p, 1)
            acc = gl.zeros([64, D], gl.float32, layout=o_layout)

            for i in range(1, n_full):
                acc, l, m, p = _step(it + i, step, i * BLOCK_N, acc, l, m, p, q, k_smem, v_smem,
                                     k_ready, k_empty, v_ready, v_empty, turn_mine, turn_other,
                                     rows, seqlen_kv, diag, threshold, rebase, bound, ls, headroom,
                                     bar_ids, s_layout, o_layout, p_layout, D, BLOCK_N, STAGES,
                                     CAUSAL, LAZY, False, PINGPONG, FP8, SATURATE)
                step += 1
            for i in range(gl.maximum(n_full, 1), n_tiles):
                acc, l, m, p = _step(it + i, step, i * BLOCK_N, acc, l, m, p, q, k_smem, v_smem,
                                     k_ready, k_empty, v_ready, v_empty, turn_mine, turn_other,
                                     rows, seqlen_kv, diag, threshold, rebase, bound, ls, headroom,
                                     bar_ids, s_layout, o_layout, p_layout, D, BLOCK_N, STAGES,
                                     CAUSAL, LAZY, True, PINGPONG, FP8, SATURATE)
                step += 1

            # The last tile's PV.
            g = it + n_tiles - 1
            mbarrier.wait(v_ready.index(g % STAGES), (g // STAGES) & 1)
            acc = warpgroup_mma(_p_operand(p, q.dtype, p_layout, FP8, SATURATE),
                                _v_operand(v_smem, g % STAGES, D, BLOCK_N, FP8), acc, is_async=True)
            acc = warpgroup_mma_wait(0, deps=(acc, ))
            mbarrier.arrive(v_empty.index(g % STAGES))

            # out = round(O / l) (0 where l = 0; fp8: times v_descale, to bf16); lse =
            # m ln2 + ln l (fp8: (m ls - H) ln2 + ln l; -inf where l = 0).
            inv = gl.where(l > 0, 1.0 / l, 0.0)
            o = acc * gl.convert_layout(inv, gl.SliceLayout(1, o_layout))[:, None]
            if FP8:
                # straight to global memory: bf16 O does not fit fp8 Q's slot
                o = gl.convert_layout((o * v_descale).to(gl.bfloat16), io_layout)
                io_rows = m0 + wg * 64 + gl.arange(0, 64, layout=gl.SliceLayout(1, io_layout))
                cols = gl.arange(0, D, layout=gl.SliceLayout(0, io_layout))
                ptrs = (Out + ((b * seqlen_q + io_rows).to(gl.int64) * H + h)[:, None] * D
                        + cols[None, :])
                gl.store(ptrs, o, mask=(io_rows < seqlen_q)[:, None])
                lse = gl.where(l == 0, float("-inf"),
                               (m * ls - headroom) * 0.6931471805599453 + gl.log(l))
                gl.store(Lse + (b * H + h).to(gl.int64) * seqlen_q + rows, lse, mask=rows < seqlen_q)
                mbarrier.arrive(q_empty.index(wg))
            else:
                # through Q's slot and TMA, which clips rows past Sq; the slot goes back
                # to the loader once the store has read it
                q.store(o.to(q.dtype))
                fence_async_shared()
                _sync_partition()
                _tma_store(o_desc, [b, m0 + wg * 64, h * D], q_smem.index(wg))
                lse = gl.where(l == 0, float("-inf"), m * 0.6931471805599453 + gl.log(l))
                gl.store(Lse + (b * H + h).to(gl.int64) * seqlen_q + rows, lse, mask=rows < seqlen_q)
                tma.store_wait(0)
                mbarrier.arrive(q_empty.index(wg))
            it += n_tiles
            j += 1

    @gluon.jit(do_not_specialize=["BH", "H", "GROUP", "seqlen_q", "seqlen_kv", "rebase"])
    def _attn_fwd(q_desc, k_desc, v_desc, o_desc, Out, Lse, BH, H, GROUP, seqlen_q, seqlen_kv,
                  scale_log2, threshold, rebase, bound, ls, headroom, v_descale,
                  D: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                  CAUSAL: gl.constexpr, LAZY: gl.constexpr, PINGPONG: gl.constexpr,
                  FP8: gl.constexpr, SATURATE: gl.constexpr):
        """Program p takes work items p, p + programs, .. of the (B x H) x query-block
        items: one each when the grid covers them all, several when it is persistent.
        bf16/f16 use ``scale_log2`` and store O through ``o_desc``; fp8 uses ``bound``,
        ``ls``, ``headroom`` and ``v_descale`` and stores bf16 O through ``Out``."""
        n_m = gl.cdiv(seqlen_q, _BLOCK_M)
        total = n_m * BH
        q_smem = gl.allocate_shared_memory(q_desc.dtype, [2] + q_desc.block_type.shape, q_desc.layout)
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
            (_consumer, (0, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, k_empty, v_ready,
                         v_empty, turns, o_desc, Out, Lse, BH, H, n_m, total, seqlen_q, seqlen_kv,
                         scale_log2, threshold, rebase, bound, ls, headroom, v_descale, D,
                         BLOCK_N, STAGES, CAUSAL, LAZY, PINGPONG, FP8, SATURATE)),
            (_consumer, (1, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, k_empty, v_ready,
                         v_empty, turns, o_desc, Out, Lse, BH, H, n_m, total, seqlen_q, seqlen_kv,
                         scale_log2, threshold, rebase, bound, ls, headroom, v_descale, D,
                         BLOCK_N, STAGES, CAUSAL, LAZY, PINGPONG, FP8, SATURATE)),
            (_loader, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready,
                       k_empty, v_ready, v_empty, BH, H, GROUP, n_m, total, seqlen_q, seqlen_kv, D,
                       BLOCK_N, STAGES, CAUSAL, FP8)),
        ], [4, 1], [240, 24])


_GL_DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16",
              torch.float8_e4m3fn: "float8e4nv"}


def descriptor(t: torch.Tensor, block: list[int]):
    """A TMA descriptor over a contiguous tensor with ``block`` tiles (zeros outside the
    tensor). The strides come from the shape: a contiguous tensor's size-1 dimensions may
    carry any stride, which TMA would refuse."""
    dtype = getattr(gl, _GL_DTYPES[t.dtype])
    layout = gl.NVMMASharedLayout.get_default_for(block, dtype)
    shape = list(t.shape)
    strides = [1] * len(shape)
    for i in range(len(shape) - 2, -1, -1):
        strides[i] = strides[i + 1] * shape[i + 1]
    return GluonDescriptor(t, shape, strides, block, layout)


def qkv_descriptors(q, k, block_n: int):
    """Rank-3 descriptors over q and k viewed as [B, S, heads x D]: [1, 64, D] tiles of Q
    (one consumer's rows), [1, block_n, D] tiles of K (zeros past S, never the next
    batch's rows)."""
    B, Sq, H, D = q.shape
    Skv, Hkv = k.shape[1], k.shape[2]
    return (descriptor(q.view(B, Sq, H * D), [1, WG_ROWS, D]),
            descriptor(k.view(B, Skv, Hkv * D), [1, block_n, D]))


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

    def shared_bytes(self, head_dim: int, elem_bytes: int = 2) -> int:
        """Shared memory a program needs: Q (which also stages a 16-bit O) for both
        warpgroups and the K and V ring, at ``elem_bytes`` per element (2: bf16/f16, 1:
        fp8), plus a little for the barriers."""
        return (2 * WG_ROWS * head_dim * elem_bytes
                + 2 * self.stages * self.block_n * head_dim * elem_bytes + 1024)

    def check(self, head_dim: int | None = None, elem_bytes: int = 2) -> "HopperConfig":
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
        if head_dim is not None and self.shared_bytes(head_dim, elem_bytes) > SHARED_BYTES:
            raise ValueError(f"HopperConfig(block_n={self.block_n}, stages={self.stages}) needs "
                             f"{self.shared_bytes(head_dim, elem_bytes)} bytes of shared memory "
                             f"at D={head_dim}; a Hopper multiprocessor gives a program {SHARED_BYTES}")
        return self


#: What the first call at a new shape times (no config given): the turn-taking and the
#: persistent grid each pay at some shapes and not at others.
CONFIGS = tuple(HopperConfig(128, 2, pp, pers) for pers in (False, True) for pp in (True, False))
_TUNED: dict[tuple, HopperConfig] = {}
_TIMINGS: dict[tuple, list[dict]] = {}
_LAST_KEY: dict[tuple, tuple] = {}  # per (family, lazy flag): the last key tuned


def grid(items: int, config: HopperConfig, num_sms: int) -> tuple[int]:
    """One program per work item, or ``num_sms`` (>= 1) programs for a persistent config."""
    if config.persistent and (isinstance(num_sms, bool) or not isinstance(num_sms, int) or num_sms < 1):
        raise ValueError(f"a persistent HopperConfig needs num_sms >= 1 (the grid), got {num_sms!r}")
    return (min(items, num_sms),) if config.persistent else (items,)


def launch(grid, args, meta, device) -> None:
    """Run ``_attn_fwd`` on ``device``'s stream (4 warps: the default partition, consumer 0)."""
    with torch.cuda.device(device):
        _attn_fwd[grid](*args, **meta, num_warps=4)


def num_sms(device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def tma_ready(x: torch.Tensor) -> torch.Tensor:
    """Contiguous, starting on 16 bytes (TMA's alignment): a copy where needed."""
    x = x.contiguous()
    return x if x.data_ptr() % 16 == 0 else x.clone()


def pick(key: tuple, family: str, lazy: bool, run) -> HopperConfig:
    """The tuned config for ``key``: on the first call with it, ``run(config)`` is timed
    for every one of ``CONFIGS`` and the fastest kept (with its timings, for
    ``last_timings(family, lazy)``)."""
    if key not in _TUNED:
        timings = [(triton.testing.do_bench(lambda c=c: run(c)), c) for c in CONFIGS]
        _TIMINGS[key] = [{"config": c.describe(), "ms": float(ms)} for ms, c in timings]
        _TUNED[key] = min(timings, key=lambda t: t[0])[1]
        _LAST_KEY[family, lazy] = key
    return _TUNED[key]


def tuned(key: tuple) -> HopperConfig | None:
    """The tuned pick for ``key``, or None."""
    return _TUNED.get(key)


def last_timings(family: str, lazy: bool) -> list[dict]:
    """The timings (ms per config) of ``family``'s last shape tuned with this lazy flag;
    [] if none."""
    return list(_TIMINGS[_LAST_KEY[family, lazy]]) if (family, lazy) in _LAST_KEY else []
