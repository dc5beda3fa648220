"""Fast Triton flash-attention forward, bf16/f16, with the gfx950 rescale policies.

For throughput, not for reproducing the faithful model bit for bit. What it keeps from
``fa_lab.models.swp_bf16`` (the policy semantics):

- Q is pre-scaled into log2 units and rounded once to the input dtype
  (``Qs = round(Q * c)``, ``c = f32(1/sqrt(D)) * f32(log2 e)``); scores are fp32.
- The first KV tile sets the base (``m = rowmax``, floored at -3e38 when causal).
- ``eager`` rebases every row to ``fmax(m, tile max)`` every tile.
- Lazy policies vote per 32-row wave (rows ``32w .. 32w+31`` of the query sequence): a
  row votes when ``not (mt - m <= threshold)`` (log2 units, NaN votes yes); if any row of
  its wave voted, every row of the wave rebases, to ``fmax(m, mt)`` (``lazy``, PR #1033)
  or to its own tile max ``mt`` (``lazy_unfixed``, which can drag a row's base down and
  overflow). Otherwise the row keeps its base and its P may reach 2**threshold.
- P is rounded to the input dtype before the PV product; l sums the unrounded P;
  ``out = round(O * (1/l if l > 0 else 0))``, ``lse = m ln2 + ln l`` (-inf when l = 0).
- Bottom-right-aligned causal mask; GQA/MQA (q head h reads kv head h // (H / Hkv)).

What is its own (so NaN fractions and the last bits differ from the model): the tiling
(BLOCK_M x BLOCK_N chosen by the autotuner; a vote happens once per BLOCK_N columns, not
per 64), no 16-column split of the PV product around the rescale, no always-eager last
three tiles, and the fp32 summation order of the tensor cores.

How lazy saves work: when no row of the whole block voted (the usual case once the first
tiles have set the base), the kernel skips the O and l rescale altogether. The test is a
block-wide OR of the row votes (``block_any``), the only cross-warp step on the fast path
(a wgmma warp holds 16 rows, so a 32-row wave always spans two warps); the per-wave vote,
which moves rows between warps, runs only inside that rare branch. With
``row_sum_filter`` the fast path does not even take row maxes: it computes P on the old
base and tests the row sums (a row can vote only if some P > 2**threshold, so only if its
row sum is that large); only a block where some row sum is that large recomputes the
scores, decides exactly and redoes P. Both variants take the same decisions (tested); the
filter is the faster on an H200 and the autotuned default.

Split-K (``num_kv_splits``, module ``fast_bf16_splitk``) and packed batches
(``forward_varlen``, module ``fast_bf16_varlen``) are kernels of their own built from the
same device pieces: ``_walk`` (a query block's walk over a KV column range, whose first
tile sets the base), ``_load_q``, ``_normalise`` and ``_lse``.

Measured on an H200 (data/results/bench_h200.json, one run beside its peers), B2 S8192
H32 D128 bf16, with the kernel as it was before ``block_any`` below: lazy 490 TFLOP/s
non-causal (1.41x SDPA FlashAttention, 1.04x compiled flex_attention, 0.81x cuDNN), 447
causal; lazy_unfixed within 0.3 % of lazy (the same binary: the rebase rule is a run-time
argument); eager 494 / 459, i.e. the block-wide vote cost a little more than the rescale it
skipped. Where that cost sat (benchmarks/ptx_barriers.py: the sm_90 PTX as Triton 3.6, the
H200's, compiles it for the benchmark's aligned shapes; data/results/ptx_barriers_sm90.json):
per KV tile the eager loop has 2 CTA barriers and lazy's fast path had 5, two for
``tl.max`` over the block (partials into shared memory, the result back out) and one more
among the loads around the branch. Now the vote is ``_fast_common.block_any`` (one
exchange) and V is loaded before it: 3 barriers, and 211 registers instead of 227 at BN64
(233 instead of 255 at BN128), no spills. The H200 timing of this version is still to be
taken. A vote with no exchange at all needs a warp-group-scoped reduction and branch,
which Triton does not have (Gluon, or inline PTX with named barriers, would).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from fa_lab.models.swp_bf16 import softmax_scale_log2  # c, exactly as the model
from fa_lab.policies import POLICIES_BF16, RescalePolicy

from . import _fast_common as common
from ._fast_common import (Config, block_any, load_tile, program_rows, round_bf16_bits,
                           wave_any)

KERNEL = "fast_bf16"
HEAD_DIMS = (64, 128)
DTYPES = (torch.bfloat16, torch.float16)
FP32_MAX = 3.4028234663852886e38

#: What fa_lab.bench.config_sweep times (pinned, one by one) on a new GPU. On an H200
#: (B2 S8192 H32 D128, non-causal) BLOCK_M 128 with 4 warps spills registers, and
#: BLOCK_N 128 with 3 stages over-runs shared memory.
CANDIDATE_CONFIGS = (
    Config(128, 128, 8, 2, True),
    Config(128, 64, 8, 3, True),
    Config(128, 128, 8, 2, False),
    Config(128, 64, 8, 3, False),
    Config(64, 64, 4, 2, True),
    Config(64, 64, 4, 3, True),
    Config(64, 64, 4, 2, False),
)
#: The autotuner's list (Hopper). Measured on an H200 (data/results/bench_h200.json,
#: autotune_timings), B2 S8192 H32 D128 non-causal, ms: eager 4.584 / 4.445 for the two
#: below (BM64 BN64 w4 s3 tma: 5.261); lazy with the row-sum filter 4.476 / 4.747, without
#: 4.621 / 5.023. The filter won in all nine lazy comparisons (3 shapes x 3 tilings), so
#: lazy policies autotune with it on; Config(row_sum_filter=False) still selects the other.
CONFIGS = (
    Config(128, 128, 8, 2, False),
    Config(128, 64, 8, 3, False),
)
#: Small tiles for the CPU interpreter (whole waves, cheap numpy work per program).
INTERPRET_CONFIG = Config(64, 64, 4, 1, False)


@triton.jit
def _round_input(x, DTYPE: tl.constexpr, INTERPRET: tl.constexpr):
    """Round fp32 to the input dtype (nearest even): a DTYPE tensor on the GPU; under the
    interpreter an fp32 tensor holding DTYPE values (its bf16 arithmetic is unusable)."""
    if INTERPRET:
        if DTYPE == tl.bfloat16:
            r = round_bf16_bits(x)
        else:
            r = x.to(tl.float16).to(tl.float32)
    else:
        r = x.to(DTYPE)
    return r


@triton.jit
def _mma(a, b, acc, INTERPRET: tl.constexpr):
    if INTERPRET:
        out = tl.dot(a, b, acc, input_precision="ieee")
    else:
        out = tl.dot(a, b, acc)
    return out


@triton.jit
def _scores(qs, k, n0, rows, seqlen_kv, diag, zero, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
            CAUSAL: tl.constexpr, MASKED: tl.constexpr, INTERPRET: tl.constexpr):
    """S = Qs K^T (log2 units), -inf past Skv and beyond the causal diagonal. ``zero``
    (0.0, as a run-time value) starts the accumulator: a second call then is a product of
    its own, which the compiler cannot merge with the first."""
    s = _mma(qs, tl.trans(k), tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32) + zero, INTERPRET)
    if MASKED:
        cols = n0 + tl.arange(0, BLOCK_N)
        valid = (cols < seqlen_kv)[None, :]
        if CAUSAL:
            valid = valid & (cols[None, :] <= rows[:, None] + diag)
        s = tl.where(valid, s, float("-inf"))
    return s


@triton.jit
def _rebase(acc, l, m, mt, vote, rebase, BLOCK_M: tl.constexpr):
    """The rare branch: rows of a fired 32-row wave rebase (fixed: fmax(m, mt); unfixed:
    mt), O and l follow; rows of silent waves keep their base."""
    fire = wave_any(vote, BLOCK_M) > 0
    target = tl.where(rebase == 1, mt, tl.maximum(m, mt))
    corr = tl.where(fire, tl.math.exp2(m - target), 1.0)
    return acc * corr[:, None], l * corr, tl.where(fire, target, m)


@triton.jit
def _tile(acc, l, m, qs, desc_k, desc_v, k_base, v_base, stride_ks, stride_vs, kv_row0, kv_col0,
          n0, rows, seqlen_kv, diag, threshold, vote_limit, rebase,
          DTYPE: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
          CAUSAL: tl.constexpr, LAZY: tl.constexpr, FIRST: tl.constexpr, MASKED: tl.constexpr,
          USE_TMA: tl.constexpr, INTERPRET: tl.constexpr, ROW_SUM_FILTER: tl.constexpr,
          FLOOR: tl.constexpr):
    """One KV tile: scores, the rescale decision, P, and O += P V. ``FLOOR``: the first
    tile's base is at least -3e38 (for rows that may see no column: P = 0, not NaN)."""
    k = load_tile(desc_k, k_base, stride_ks, kv_row0, kv_col0, n0, seqlen_kv, BLOCK_N, D,
                  USE_TMA, MASKED)
    # V is issued before the vote: after it, the pipelined load took one more CTA barrier
    # per tile (sm_90 PTX, benchmarks/ptx_barriers.py)
    v = load_tile(desc_v, v_base, stride_vs, kv_row0, kv_col0, n0, seqlen_kv, BLOCK_N, D,
                  USE_TMA, MASKED)
    if INTERPRET:
        k = k.to(tl.float32)
    s = _scores(qs, k, n0, rows, seqlen_kv, diag, 0.0, BLOCK_M, BLOCK_N, CAUSAL, MASKED, INTERPRET)
    if FIRST:
        m = tl.max(s, 1)
        if FLOOR:
            m = tl.maximum(m, -3e38)
        p = tl.math.exp2(s - m[:, None])
        row_sum = tl.sum(p, 1)
    elif LAZY:
        if ROW_SUM_FILTER:
            # Optimistic: P on the old base. A row votes (mt - m > threshold) only if some
            # P > 2**threshold, hence only if its row sum is >= vote_limit (2**threshold, a
            # hair lower for exp2's rounding): no row max on the fast path.
            p = tl.math.exp2(s - m[:, None])
            row_sum = tl.sum(p, 1)
            maybe = tl.where(row_sum < vote_limit, 0, 1)  # NaN: maybe
            if block_any(maybe, BLOCK_M):  # rare: decide exactly, then redo P
                # the scores again (the same product): keeping them live across the
                # branch would cost 64 registers a thread on the fast path
                s = _scores(qs, k, n0, rows, seqlen_kv, diag, rebase * 0.0, BLOCK_M, BLOCK_N,
                            CAUSAL, MASKED, INTERPRET)
                mt = tl.max(s, 1)
                vote = tl.where(mt - m <= threshold, 0, 1)  # NaN votes yes
                acc, l, m = _rebase(acc, l, m, mt, vote, rebase, BLOCK_M)
                p = tl.math.exp2(s - m[:, None])
                row_sum = tl.sum(p, 1)
        else:
            mt = tl.max(s, 1)
            vote = tl.where(mt - m <= threshold, 0, 1)  # NaN votes yes
            if block_any(vote, BLOCK_M):  # the O rescale is skipped otherwise
                acc, l, m = _rebase(acc, l, m, mt, vote, rebase, BLOCK_M)
            p = tl.math.exp2(s - m[:, None])
            row_sum = tl.sum(p, 1)
    else:
        m_new = tl.maximum(m, tl.max(s, 1))
        corr = tl.math.exp2(m - m_new)
        acc = acc * corr[:, None]
        l = l * corr
        m = m_new
        p = tl.math.exp2(s - m[:, None])
        row_sum = tl.sum(p, 1)
    l = l + row_sum
    if MASKED and USE_TMA:  # TMA read the next batch's rows past seqlen_kv: P is 0 there,
        cols = n0 + tl.arange(0, BLOCK_N)  # but 0 * inf would not be
        v = tl.where((cols < seqlen_kv)[:, None], v, 0.0)
    if INTERPRET:
        v = v.to(tl.float32)
    acc = _mma(_round_input(p, DTYPE, INTERPRET), v, acc, INTERPRET)
    return acc, l, m


@triton.jit
def _walk(qs, desc_k, desc_v, k_base, v_base, stride_ks, stride_vs, kv_row0, kv_col0,
          kv_lo, kv_hi, m0, rows, diag, threshold, vote_limit, rebase,
          DTYPE: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
          CAUSAL: tl.constexpr, LAZY: tl.constexpr, USE_TMA: tl.constexpr,
          INTERPRET: tl.constexpr, ROW_SUM_FILTER: tl.constexpr, FLOOR: tl.constexpr):
    """KV columns [kv_lo, kv_hi) for the query block at row m0 (kv_lo a multiple of
    BLOCK_N; kv_hi at most the sequence's Skv; ``diag`` = Skv - Sq): the range's first tile
    sets the base, as a whole KV walk's tile 0 does (floored at -3e38 with ``FLOOR``, as
    causal walks are: then an empty range gives l = 0, O = 0). Returns (acc, l, m)."""
    t_lo = kv_lo // BLOCK_N
    # Tiles [t_lo, n_full) need no mask; [n_full, n_end) do (causal diagonal, ragged end).
    n_end = tl.cdiv(kv_hi, BLOCK_N)
    n_full = kv_hi // BLOCK_N
    if CAUSAL:
        last = m0 + BLOCK_M - 1 + diag  # last visible column of the block's bottom row
        n_end = tl.minimum(n_end, tl.where(last >= 0, last // BLOCK_N + 1, 0))
        first = m0 + diag + 1  # columns visible to the block's top row
        n_full = tl.minimum(n_full, tl.where(first >= 0, first // BLOCK_N, 0))
    # a block that sees none of the range still runs its first tile: out 0, l 0
    n_end = tl.maximum(n_end, t_lo + 1)

    acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
    l = tl.zeros([BLOCK_M], dtype=tl.float32)
    m = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc, l, m = _tile(acc, l, m, qs, desc_k, desc_v, k_base, v_base, stride_ks, stride_vs,
                      kv_row0, kv_col0, kv_lo, rows, kv_hi, diag, threshold, vote_limit, rebase,
                      DTYPE, D, BLOCK_M, BLOCK_N, CAUSAL, LAZY, True, True, USE_TMA, INTERPRET,
                      ROW_SUM_FILTER, FLOOR)
    # (counted from 0: a run-time lower bound cost registers in the pipelined loop)
    for t in range(0, n_full - t_lo - 1):
        acc, l, m = _tile(acc, l, m, qs, desc_k, desc_v, k_base, v_base, stride_ks, stride_vs,
                          kv_row0, kv_col0, kv_lo + (t + 1) * BLOCK_N, rows, kv_hi, diag,
                          threshold, vote_limit, rebase, DTYPE, D, BLOCK_M, BLOCK_N, CAUSAL,
                          LAZY, False, False, USE_TMA, INTERPRET, ROW_SUM_FILTER, FLOOR)
    for t in range(tl.maximum(n_full, t_lo + 1), n_end):
        acc, l, m = _tile(acc, l, m, qs, desc_k, desc_v, k_base, v_base, stride_ks, stride_vs,
                          kv_row0, kv_col0, t * BLOCK_N, rows, kv_hi, diag, threshold,
                          vote_limit, rebase, DTYPE, D, BLOCK_M, BLOCK_N, CAUSAL, LAZY, False,
                          True, USE_TMA, INTERPRET, ROW_SUM_FILTER, FLOOR)
    return acc, l, m


@triton.jit
def _load_q(q_base, stride_qs, rows, row_ok, scale_log2, D: tl.constexpr,
            DTYPE: tl.constexpr, INTERPRET: tl.constexpr):
    """Qs = round(Q * c) for ``rows`` of one (sequence, head); ``q_base`` points at row 0.
    Padding rows read 0 (and still vote, as the model's)."""
    ptrs = q_base + rows.to(tl.int64)[:, None] * stride_qs + tl.arange(0, D)[None, :]
    q = tl.load(ptrs, mask=row_ok[:, None], other=0.0)
    return _round_input(q.to(tl.float32) * scale_log2, DTYPE, INTERPRET)


@triton.jit
def _normalise(acc, l, DTYPE: tl.constexpr, INTERPRET: tl.constexpr):
    """out = round(O * (1/l if l > 0 else 0))."""
    inv = tl.where(l > 0, 1.0 / l, 0.0)
    return _round_input(acc * inv[:, None], DTYPE, INTERPRET)


@triton.jit
def _lse(l, m):
    """lse = m ln2 + ln l, natural log; -inf when l = 0."""
    return tl.where(l == 0, float("-inf"), m * 0.6931471805599453 + tl.log(l))


# Lengths and head counts are not specialised: one compile serves every shape.
@triton.jit(do_not_specialize=["H", "GROUP", "seqlen_q", "seqlen_kv", "rebase"])
def _attn_fwd(Q, K, V, Out, Lse, desc_k, desc_v,
              stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh,
              stride_vb, stride_vs, stride_vh, stride_ob, stride_os, stride_oh,
              H, GROUP, seqlen_q, seqlen_kv, scale_log2, threshold, vote_limit, rebase,
              D: tl.constexpr, CAUSAL: tl.constexpr, LAZY: tl.constexpr,
              INTERPRET: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              USE_TMA: tl.constexpr, ROW_SUM_FILTER: tl.constexpr):
    DTYPE: tl.constexpr = Q.dtype.element_ty
    b, h, hk, m0, rows = program_rows(H, GROUP, BLOCK_M, CAUSAL)
    row_ok = rows < seqlen_q
    qs = _load_q(Q + b.to(tl.int64) * stride_qb + h * stride_qh, stride_qs, rows, row_ok,
                 scale_log2, D, DTYPE, INTERPRET)
    acc, l, m = _walk(qs, desc_k, desc_v, K + b.to(tl.int64) * stride_kb + hk * stride_kh,
                      V + b.to(tl.int64) * stride_vb + hk * stride_vh, stride_ks, stride_vs,
                      b * seqlen_kv, hk * D, 0, seqlen_kv, m0, rows, seqlen_kv - seqlen_q,
                      threshold, vote_limit, rebase, DTYPE, D, BLOCK_M, BLOCK_N, CAUSAL, LAZY,
                      USE_TMA, INTERPRET, ROW_SUM_FILTER, CAUSAL)
    out = _normalise(acc, l, DTYPE, INTERPRET)
    o_ptrs = (Out + b.to(tl.int64) * stride_ob + h * stride_oh
              + rows.to(tl.int64)[:, None] * stride_os + tl.arange(0, D)[None, :])
    tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=row_ok[:, None])
    tl.store(Lse + (b * H + h).to(tl.int64) * seqlen_q + rows, _lse(l, m), mask=row_ok)


def _set_block_shapes(nargs):
    """Autotune pre-hook: TMA descriptors take the config's tile shape."""
    if common.TensorDescriptor is not None and isinstance(nargs["desc_k"], common.TensorDescriptor):
        shape = [nargs["BLOCK_N"], nargs["D"]]
        nargs["desc_k"].block_shape = shape
        nargs["desc_v"].block_shape = shape


_TUNED = common.autotuners(_attn_fwd, CONFIGS, ["seqlen_q", "seqlen_kv", "H", "GROUP", "D", "CAUSAL"],
                           _set_block_shapes, row_sum_filters=(True,))


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool,
            policy: RescalePolicy, interpret: bool = False, config: Config | None = None,
            num_kv_splits: int = 1):
    """q [B, Sq, H, D], k and v [B, Skv, Hkv, D], bf16 or f16 (D 64 or 128).

    ``interpret=True`` runs CPU tensors through Triton's interpreter. ``config`` pins a
    launch configuration (default: autotuned on the GPU, small tiles when interpreted).
    ``num_kv_splits`` > 1 runs split-K (``fast_bf16_splitk``): the model's split boundaries,
    one program per (query block, batch x head, split), then a combine kernel; 1 is the
    plain kernel, as in the model.
    Returns (out [B, Sq, H, D] in q's dtype, lse [B, H, Sq] fp32, natural log).
    """
    common.check_qkv(q, k, v, DTYPES, HEAD_DIMS)
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    common.check_policy(policy, POLICIES_BF16, "bf16/f16")
    common.check_device(q, interpret)
    config = common.check_config(config, fp8=False)
    common.check_splits(num_kv_splits, config)
    if config is None and interpret:
        config = INTERPRET_CONFIG

    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    if num_kv_splits > 1:
        from . import fast_bf16_splitk
        return fast_bf16_splitk.run(q, k, v, causal=causal, policy=policy, interpret=interpret,
                                    config=config, num_splits=num_kv_splits)
    B, Sq, H, D = q.shape
    Skv, Hkv = k.shape[1], k.shape[2]
    out = torch.empty_like(q)
    lse = torch.empty(B, H, Sq, device=q.device, dtype=torch.float32)
    desc_k, desc_v = descriptors(k.view(B * Skv, Hkv * D), v.view(B * Skv, Hkv * D), D, config)
    args = (q, k, v, out, lse, desc_k, desc_v,
            q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2), out.stride(0), out.stride(1), out.stride(2),
            H, H // Hkv, Sq, Skv, *policy_args(policy, D))
    meta = dict(D=D, CAUSAL=causal, LAZY=policy.name != "eager", INTERPRET=interpret)
    common.launch_fast(_attn_fwd, _TUNED, lambda bm: (triton.cdiv(Sq, bm), B * H), args, meta,
                       config, interpret)
    return out, lse


def forward_varlen(q, k, v, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv=None, *,
                   causal: bool, policy: RescalePolicy, interpret: bool = False,
                   config: Config | None = None):
    """Packed (varlen) batches in one launch: see ``fast_bf16_varlen.forward_varlen``."""
    from .fast_bf16_varlen import forward_varlen as run
    return run(q, k, v, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv, causal=causal,
               policy=policy, interpret=interpret, config=config)


def policy_args(policy: RescalePolicy, head_dim: int) -> tuple:
    """The kernels' run-time policy arguments: scale_log2, threshold, vote_limit, rebase."""
    return (softmax_scale_log2(head_dim), float(policy.threshold), vote_limit(policy.threshold),
            common.REBASE_RULES.get(policy.name, 0))


def descriptors(k2d: torch.Tensor, v2d: torch.Tensor, head_dim: int, config: Config | None):
    """TMA descriptors over 2-D [rows, Hkv * D] views of K and V (the autotuner's pre-hook
    re-sets their tile shape per config)."""
    block_n = config.block_n if config is not None else 64
    return (common.make_descriptor(k2d, [block_n, head_dim]),
            common.make_descriptor(v2d, [block_n, head_dim]))


def vote_limit(threshold: float) -> float:
    """The row-sum filter's bound: 2**threshold less 2**-12 relative (exp2 rounds), capped
    at the largest fp32 (a row sum of inf or NaN then still counts as a possible vote)."""
    try:
        limit = 2.0 ** threshold * (1.0 - 2.0 ** -12)
    except OverflowError:
        limit = math.inf
    return min(limit, FP32_MAX)


def best_config(q, k, causal: bool, lazy: bool):
    """The autotuner's pick for these shapes (after a forward ran), or None."""
    B, Sq, H, D = q.shape
    return common.tuned_config(_TUNED[lazy], (Sq, k.shape[1], H, H // k.shape[2], D, causal))


def tuning_timings(lazy: bool) -> list[dict]:
    """The autotuner's measurements at its last new key (for the benchmark's record)."""
    return common.tuning_timings(_TUNED[lazy], lazy)
