"""Fast Triton fp8 (float8_e4m3fn) flash-attention forward with the fp8 rescale policies.

For throughput, not for reproducing the faithful model bit for bit. What it keeps from
``fa_lab.kernels.swp_fp8.model`` (the policy semantics):

- fp8 Q, K, V with fp32 per-tensor descales, D = 128, bf16 output. Scores and the running
  max m stay in the raw fp8-product domain; ``ls = c * (q_descale * k_descale)`` converts a
  raw difference to log2 units.
- One rescale decision per 128 KV columns (the model's pair of 64-column tiles):
  ``mt`` = the 128 columns' row max (floored at -3e38 when causal); ``eager`` rebases
  every row to ``fmax(m, mt)``; lazy policies vote per 32-row wave on
  ``not (d <= threshold)`` with ``d = (mt - m) * ls`` and, in a fired wave, rebase every
  row by the policy's rule: ``lazy`` (monotonic, PR #1033) to ``fmax(m, mt)``,
  ``lazy_unfixed`` to ``mt``, ``lazy_capped`` to ``mt`` unless that moves the base down by
  more than ``rebase_bound`` (log2 units).
- ``P = exp2(fma(S, ls, -ls*m + H))`` with the P headroom H; l sums P before the e4m3
  cast; the cast saturates at 448 (``saturate=True``) or gives NaN past it (False);
  ``out = bf16(O * ((1/l if l > 0 else 0) * v_descale))``.

What is its own: the tile height (BLOCK_M rows, a multiple of the 32-row wave), the order
of the tensor cores' fp32 sums, and V is first copied to a [B, Hkv, D, Skv] layout
(Hopper's fp8 tensor-core instructions read both operands K-major; the copy is part of
``forward`` and of its timing, unless V comes as a ``TransposedV``, made once and read by
any number of calls). The copy stores the keys of each 16 in the order of
``_in_stored_order``, and P's columns are reordered the same way before the PV product:
the same sum over the keys, in an order in which each thread of the scores' accumulator
already holds the P elements the fp8 instruction takes from it (the change of layout
renames registers instead of shuffling data between lanes). When no row of a block
voted, the O and l rescale is skipped (one block-wide max of the votes; the per-wave vote
runs only in that branch); with ``row_sum_filter`` the fast path tests the row sums of P
against 2**(threshold + H) instead of taking row maxes (as in ``swp_bf16.fast``; the same
decisions).

Shared with the bf16/f16 fast kernels (``_triton.fast``): the scores and their masks
(``scores``), the tiles a query block walks (``walk_bounds``), the block and wave votes,
the tile loader and the launch (autotuned, pinned or interpreted). Its own: the rescale
(raw-domain maxima, ``ls``, the capped rule), P with its headroom and e4m3 cast, the
transposed V, the read-out with ``v_descale``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fa_lab.kernels.swp_fp8.model import log2_scale
from fa_lab.capabilities import check_policy
from fa_lab.checks import check_descale
from fa_lab.policies import Policy

from . import FAMILY
from .._triton import fast as common
from .._triton.fast import (Config, block_any, load_tile, round_bf16_bits, round_e4m3_bits,
                            scores, walk_bounds, wave_any)

KERNEL = "fast_fp8"
HEAD_DIM = 128
FP8 = torch.float8_e4m3fn

CANDIDATE_CONFIGS = (
    Config(128, 128, 8, 3, True),
    Config(64, 128, 4, 3, True),
    Config(64, 128, 4, 2, True),
    Config(128, 128, 8, 3, False),
)
#: The tuner's list (Hopper; how it was chosen: docs/performance.md). The register-capped
#: two-stage launch fits three programs per multiprocessor instead of two: more programs
#: in flight where each walks few KV tiles (short causal shapes), fewer prefetch stages
#: where the walks are long. Lazy autotunes with and without the row-sum filter.
CONFIGS = (
    Config(64, 128, 4, 3, True),
    Config(64, 128, 4, 2, True, maxnreg=168),
    Config(128, 128, 8, 3, False),
)
INTERPRET_CONFIG = Config(64, 128, 4, 1, False)
#: Skv of the transposed V copy is padded to this many columns (TMA: 16-byte row strides;
#: ``_in_stored_order`` permutes keys within aligned groups of 16).
V_PAD = 16


@triton.jit
def _in_stored_order(p, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The columns of a [BLOCK_M, BLOCK_N] tile in the key order of the V^T copy: within
    each aligned group of 16, column 8 g + 2 i + e (g, e in 0..1, i in 0..3) moves to
    4 i + 2 g + e. A thread of wgmma's accumulator holds score columns 2i, 2i + 1 of each
    group of 8 (i: its lane mod 4), and an fp8 A operand takes keys 4i .. 4i + 3 of each
    16 from it: in this order, the scores' thread already holds its P operand."""
    tl.static_assert(BLOCK_N % 16 == 0)
    p = tl.reshape(p, [BLOCK_M, BLOCK_N // 16, 2, 4, 2])
    return tl.reshape(tl.permute(p, [0, 1, 3, 2, 4]), [BLOCK_M, BLOCK_N])


@triton.jit
def _load_vt(desc, base, row0, n0, seqlen_pad, BLOCK_N: tl.constexpr, D: tl.constexpr,
             USE_TMA: tl.constexpr, MASKED: tl.constexpr):
    """A [D, BLOCK_N] tile of the transposed V (zeros past the padded length)."""
    if USE_TMA:
        tile = desc.load([row0, n0])
    else:
        cols = n0 + tl.arange(0, BLOCK_N)
        ptrs = base + tl.arange(0, D)[:, None] * seqlen_pad + cols[None, :]
        if MASKED:
            tile = tl.load(ptrs, mask=(cols < seqlen_pad)[None, :], other=0.0)
        else:
            tile = tl.load(ptrs)
    return tile


@triton.jit
def _lazy_rebase(acc, l, m, s, ls, threshold, rebase, bound, BLOCK_M: tl.constexpr,
                 CAUSAL: tl.constexpr):
    """The exact decision: d = (mt - m) * ls; a wave fires if any row has not d <= THR;
    its rows rebase by the policy's rule (0 monotonic, 1 own tile max, 2 capped)."""
    mt = tl.max(s, 1)
    if CAUSAL:
        mt = tl.maximum(mt, -3e38)
    d = (mt - m) * ls  # +inf on the first tile (m = -inf)
    vote = tl.where(d <= threshold, 0, 1)  # NaN votes yes
    if block_any(vote, BLOCK_M):  # the O rescale is skipped otherwise
        fire = wave_any(vote, BLOCK_M) > 0
        mono = tl.maximum(m, mt)
        safe = d >= -bound  # lazy_capped; NaN -> not safe
        m_new = tl.where(rebase == 1, mt, tl.where(rebase == 2, tl.where(safe, mt, m), mono))
        corr = tl.where(rebase == 1, tl.math.exp2(-d),
                        tl.where(rebase == 2, tl.math.exp2(-tl.where(safe, d, 0.0)),
                                 tl.math.exp2((m - mono) * ls)))
        corr = tl.where(fire, corr, 1.0)
        acc = acc * corr[:, None]
        l = l * corr
        m = tl.where(fire, m_new, m)
    return acc, l, m


@triton.jit
def _tile(acc, l, m, q, desc_k, desc_vt, k_base, vt_base, stride_ks, kv_row0, kv_col0,
          vt_row0, seqlen_vpad, n0, rows, seqlen_kv, diag, ls, threshold, vote_limit, rebase,
          bound, headroom, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
          CAUSAL: tl.constexpr, LAZY: tl.constexpr, SATURATE: tl.constexpr,
          MASKED: tl.constexpr, USE_TMA: tl.constexpr, INTERPRET: tl.constexpr,
          ROW_SUM_FILTER: tl.constexpr):
    """128 KV columns: raw scores, the rescale decision, P, and O += e4m3(P) V."""
    k = load_tile(desc_k, k_base, stride_ks, kv_row0, kv_col0, n0, seqlen_kv, BLOCK_N, D,
                  USE_TMA, MASKED)
    # (INTERPRET False: the fp8 product is a plain tl.dot under the interpreter too)
    s = scores(q, k, n0, rows, seqlen_kv, diag, 0.0, BLOCK_M, BLOCK_N, CAUSAL, MASKED, False)
    if LAZY:
        if ROW_SUM_FILTER:
            # Optimistic: P on the old base. A row votes only if some P exceeds
            # 2**(threshold + H), so only if its row sum reaches vote_limit (that, less a
            # margin for the fma's rounding): no row max on the fast path.
            p = tl.math.exp2(tl.fma(s, ls, ((0.0 - ls * m) + headroom)[:, None]))
            row_sum = tl.sum(p, 1)
            maybe = tl.where(row_sum < vote_limit, 0, 1)  # NaN: maybe
            if block_any(maybe, BLOCK_M):  # rare (always on the first tile): decide exactly
                # on the scores again (the same product; keeping them live costs registers)
                s = scores(q, k, n0, rows, seqlen_kv, diag, rebase * 0.0, BLOCK_M, BLOCK_N,
                           CAUSAL, MASKED, False)
                acc, l, m = _lazy_rebase(acc, l, m, s, ls, threshold, rebase, bound, BLOCK_M, CAUSAL)
                p = tl.math.exp2(tl.fma(s, ls, ((0.0 - ls * m) + headroom)[:, None]))
                row_sum = tl.sum(p, 1)
        else:
            acc, l, m = _lazy_rebase(acc, l, m, s, ls, threshold, rebase, bound, BLOCK_M, CAUSAL)
            p = tl.math.exp2(tl.fma(s, ls, ((0.0 - ls * m) + headroom)[:, None]))
            row_sum = tl.sum(p, 1)
    else:
        mt = tl.max(s, 1)
        if CAUSAL:
            mt = tl.maximum(mt, -3e38)
        m_new = tl.maximum(m, mt)
        corr = tl.math.exp2((m - m_new) * ls)
        acc = acc * corr[:, None]
        l = l * corr
        m = m_new
        p = tl.math.exp2(tl.fma(s, ls, ((0.0 - ls * m) + headroom)[:, None]))
        row_sum = tl.sum(p, 1)
    l = l + row_sum
    if SATURATE:
        if INTERPRET:  # the GPU's cast saturates by itself (satfinite); NaN stays NaN
            p = tl.where(p > 448.0, 448.0, p)
    else:
        p = tl.where(p > 464.0, float("nan"), p)  # rounds past 448: NaN, as the model
    vt = _load_vt(desc_vt, vt_base, vt_row0, n0, seqlen_vpad, BLOCK_N, D, USE_TMA, MASKED)
    p = _in_stored_order(p, BLOCK_M, BLOCK_N)
    if INTERPRET:  # the interpreter's fp8 cast is unusable: round by hand, multiply in fp32
        acc = tl.dot(round_e4m3_bits(p), tl.trans(vt.to(tl.float32)), acc, input_precision="ieee")
    else:
        acc = tl.dot(p.to(tl.float8e4nv), tl.trans(vt), acc)
    return acc, l, m


# seqlen_vpad stays specialised (a multiple of 16: aligned V^T rows).
@triton.jit(do_not_specialize=["H", "GROUP", "HKV", "seqlen_q", "seqlen_kv", "rebase"])
def _attn_fwd_fp8(Q, K, Vt, Out, Lse, desc_k, desc_vt,
                  stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh,
                  stride_ob, stride_os, stride_oh,
                  H, GROUP, HKV, seqlen_q, seqlen_kv, seqlen_vpad, ls, v_descale, threshold,
                  vote_limit, rebase, bound, headroom,
                  D: tl.constexpr, CAUSAL: tl.constexpr, LAZY: tl.constexpr,
                  SATURATE: tl.constexpr, INTERPRET: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, USE_TMA: tl.constexpr, ROW_SUM_FILTER: tl.constexpr):
    b, h, hk, m0, rows = common.program_rows(H, GROUP, BLOCK_M, CAUSAL)
    offs_d = tl.arange(0, D)
    row_ok = rows < seqlen_q

    q_ptrs = (Q + b.to(tl.int64) * stride_qb + h * stride_qh
              + rows.to(tl.int64)[:, None] * stride_qs + offs_d[None, :])
    q = tl.load(q_ptrs, mask=row_ok[:, None], other=0.0)

    k_base = K + b.to(tl.int64) * stride_kb + hk * stride_kh
    vt_row0 = (b * HKV + hk) * D
    vt_base = Vt + vt_row0.to(tl.int64) * seqlen_vpad
    kv_row0 = b * seqlen_kv
    kv_col0 = hk * D

    diag = seqlen_kv - seqlen_q
    # tiles [0, n_full) unmasked, [n_full, n_end) masked; at least one tile
    n_full, n_end = walk_bounds(0, seqlen_kv, m0, diag, BLOCK_M, BLOCK_N, CAUSAL)

    acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
    l = tl.zeros([BLOCK_M], dtype=tl.float32)
    m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    for t in range(0, n_full):
        acc, l, m = _tile(acc, l, m, q, desc_k, desc_vt, k_base, vt_base, stride_ks, kv_row0,
                          kv_col0, vt_row0, seqlen_vpad, t * BLOCK_N, rows, seqlen_kv, diag, ls,
                          threshold, vote_limit, rebase, bound, headroom, D, BLOCK_M, BLOCK_N,
                          CAUSAL, LAZY, SATURATE, False, USE_TMA, INTERPRET, ROW_SUM_FILTER)
    for t in range(n_full, n_end):
        acc, l, m = _tile(acc, l, m, q, desc_k, desc_vt, k_base, vt_base, stride_ks, kv_row0,
                          kv_col0, vt_row0, seqlen_vpad, t * BLOCK_N, rows, seqlen_kv, diag, ls,
                          threshold, vote_limit, rebase, bound, headroom, D, BLOCK_M, BLOCK_N,
                          CAUSAL, LAZY, SATURATE, True, USE_TMA, INTERPRET, ROW_SUM_FILTER)

    inv = tl.where(l > 0, 1.0 / l, 0.0)
    out = acc * (inv * v_descale)[:, None]
    if INTERPRET:  # the interpreter's fp32 -> bf16 cast truncates
        out = round_bf16_bits(out)
    o_ptrs = (Out + b.to(tl.int64) * stride_ob + h * stride_oh
              + rows.to(tl.int64)[:, None] * stride_os + offs_d[None, :])
    tl.store(o_ptrs, out.to(tl.bfloat16), mask=row_ok[:, None])
    lse = tl.where(l == 0, float("-inf"), (m * ls - headroom) * 0.6931471805599453 + tl.log(l))
    tl.store(Lse + (b * H + h).to(tl.int64) * seqlen_q + rows, lse, mask=row_ok)


def _set_block_shapes(nargs):
    if isinstance(nargs["desc_k"], common.TensorDescriptor):
        nargs["desc_k"].block_shape = [nargs["BLOCK_N"], nargs["D"]]
        nargs["desc_vt"].block_shape = [nargs["D"], nargs["BLOCK_N"]]


# (the P cast, SATURATE, is a different kernel: a pick of its own)
_TUNED = common.autotuners(_attn_fwd_fp8, CONFIGS,
                           ["seqlen_q", "seqlen_kv", "H", "GROUP", "CAUSAL", "SATURATE"],
                           _set_block_shapes)


def vote_limit(threshold: float, headroom: float) -> float:
    """The row-sum filter's bound: 2**(threshold + H) less 2**-8 relative (the fma and exp2
    round differently from the exact test), capped at the largest fp32."""
    try:
        limit = 2.0 ** (threshold + headroom) * (1.0 - 2.0 ** -8)
    except OverflowError:
        limit = float("inf")
    return min(limit, common.FP32_MAX)


@triton.jit
def _transpose_v_kernel(V, Vt, stride_vb, stride_vs, stride_vh, Hkv, seqlen, seqlen_pad,
                        D: tl.constexpr, BLOCK_S: tl.constexpr):
    """One [BLOCK_S, D] slab of one (batch, kv head) of V, stored transposed with its keys
    in ``_in_stored_order``'s order; the padded keys (seqlen .. seqlen_pad) are written as
    zeros at their reordered columns, which may lie before column seqlen (a reader takes
    the whole padded width). Bytes are moved as uint8."""
    s0 = tl.program_id(0) * BLOCK_S
    bh = tl.program_id(1)
    b = bh // Hkv
    h = bh % Hkv
    cols = s0 + tl.arange(0, BLOCK_S)
    dims = tl.arange(0, D)
    src = V + b.to(tl.int64) * stride_vb + h * stride_vh + cols[:, None].to(tl.int64) * stride_vs + dims[None, :]
    tile = tl.load(src, mask=(cols < seqlen)[:, None], other=0)
    dst = Vt + bh.to(tl.int64) * D * seqlen_pad + dims[:, None] * seqlen_pad + cols[None, :]
    tl.store(dst, _in_stored_order(tl.trans(tile), D, BLOCK_S),
             mask=(cols < seqlen_pad)[None, :])


#: Rows of V per program of the transpose (a [64, 128] byte slab: 8 KiB).
TRANSPOSE_BLOCK_S = 64


def transpose_v(v8: torch.Tensor, interpret: bool = False) -> torch.Tensor:
    """[B, Skv, Hkv, D] -> [B, Hkv, D, Skv_pad] contiguous, the keys of each 16 in
    ``_in_stored_order``'s order, the padded keys Skv .. Skv_pad zero.

    One pass of a Triton kernel over the bytes (``interpret``: through the CPU
    interpreter); a strided torch copy into a zero-filled buffer would read and write the
    whole output twice."""
    B, Skv, Hkv, D = v8.shape
    if v8.stride(-1) != 1:
        v8 = v8.contiguous()
    pad = -Skv % V_PAD
    vt = torch.empty(B, Hkv, D, Skv + pad, dtype=v8.dtype, device=v8.device)
    grid = (triton.cdiv(Skv + pad, TRANSPOSE_BLOCK_S), B * Hkv)
    args = (v8.view(torch.uint8), vt.view(torch.uint8), v8.stride(0), v8.stride(1), v8.stride(2),
            Hkv, Skv, Skv + pad)
    meta = dict(D=D, BLOCK_S=TRANSPOSE_BLOCK_S)
    if interpret:
        common.run_interpreted(_transpose_v_kernel, grid, *args, **meta)
    else:
        _transpose_v_kernel[grid](*args, **meta)
    return vt


def stored_columns(seqlen: int, device=None) -> torch.Tensor:
    """The column of the V^T copy that holds each key 0 .. seqlen-1 (int64): within each
    aligned group of 16, key 8 g + 2 i + e sits at column 4 i + 2 g + e (the order of
    ``_in_stored_order``)."""
    key = torch.arange(seqlen, device=device)
    group, r = key // 16 * 16, key % 16
    g, i, e = r // 8, r % 8 // 2, r % 2
    return group + 4 * i + 2 * g + e


class TransposedV:
    """V [B, Skv, Hkv, 128] float8_e4m3fn held as the fp8 kernel reads it: ``data``
    [B, Hkv, 128, Skv_pad] contiguous (Skv padded to a multiple of ``V_PAD``, the padded
    keys zero), the keys of each aligned 16 in ``_in_stored_order``'s order. ``forward``
    given one in place of V skips its per-call copy: for a V that several forwards read
    (a cache written once), the copy is paid once.

    Built by ``from_v`` only: the key order is the kernel's own, and a tensor transposed
    some other way would give wrong outputs rather than an error. Its fields cannot be
    rebound; ``data`` is the tensor itself, not a copy, so writing into it changes the V
    that every later call reads. ``to_v`` gives V back."""

    __slots__ = ("_data", "_seqlen")

    def __init__(self, *args, **kwargs):
        raise TypeError("build a TransposedV with TransposedV.from_v(v8): its key order is "
                        "the fp8 kernel's own")

    @classmethod
    def from_v(cls, v8: torch.Tensor, interpret: bool = False) -> "TransposedV":
        """V^T of ``v8`` [B, Skv, Hkv, 128] float8_e4m3fn, on the GPU (``interpret``: CPU
        tensors, through Triton's interpreter)."""
        if not isinstance(v8, torch.Tensor):
            raise TypeError(f"v8 must be a torch.Tensor, got {type(v8).__name__}")
        if v8.dtype != FP8:
            raise TypeError(f"v8 has dtype {v8.dtype}; the fp8 kernel takes torch.float8_e4m3fn")
        if v8.dim() != 4 or v8.shape[-1] != HEAD_DIM or min(v8.shape) < 1:
            raise ValueError(f"v8 must be [B, Skv, Hkv, {HEAD_DIM}] with no empty dimension, "
                             f"got shape {tuple(v8.shape)}")
        common.check_device(v8, interpret)
        self = object.__new__(cls)
        self._data = transpose_v(v8, interpret)
        self._seqlen = v8.shape[1]
        return self

    @property
    def data(self) -> torch.Tensor:
        """[B, Hkv, 128, Skv_pad] float8_e4m3fn, the keys in the kernel's order."""
        return self._data

    @property
    def seqlen(self) -> int:
        """Skv: the keys V holds (``data`` holds Skv_pad columns)."""
        return self._seqlen

    @property
    def shape(self) -> torch.Size:
        """The shape of the V it holds: [B, Skv, Hkv, D]."""
        B, Hkv, D, _ = self.data.shape
        return torch.Size([B, self.seqlen, Hkv, D])

    @property
    def device(self) -> torch.device:
        return self.data.device

    def to_v(self) -> torch.Tensor:
        """The V it holds, [B, Skv, Hkv, D] contiguous, byte for byte."""
        cols = stored_columns(self.seqlen, self.device)
        return self.data.view(torch.uint8)[..., cols].permute(0, 3, 1, 2).contiguous().view(FP8)

    def __repr__(self) -> str:
        return f"TransposedV(shape={tuple(self.shape)}, device={self.device})"


def forward(q8: torch.Tensor, k8: torch.Tensor, v8: torch.Tensor, *, q_descale: float,
            k_descale: float, v_descale: float, causal: bool, policy: Policy,
            saturate: bool = True, interpret: bool = False, config: Config | None = None):
    """q8 [B, Sq, H, 128], k8 and v8 [B, Skv, Hkv, 128], float8_e4m3fn; v8 may be a
    ``TransposedV`` of V instead (no V^T copy in the call).

    ``saturate`` picks the P cast: clamp to 448 (True) or NaN past it (False).
    ``interpret=True`` runs CPU tensors through Triton's interpreter; ``config`` pins a
    launch configuration (default: autotuned on the GPU).
    Returns (out [B, Sq, H, D] bf16, lse [B, H, Sq] fp32: natural log of the scaled
    softmax denominator, as the model's read-out).
    """
    stored = isinstance(v8, TransposedV)
    common.check_qkv(q8, k8, k8 if stored else v8, (FP8,), (HEAD_DIM,))
    if stored and (v8.shape != k8.shape or v8.device != k8.device):
        raise ValueError(f"v8 (a TransposedV of V {tuple(v8.shape)} on {v8.device}) must hold "
                         f"a V of k8's shape {tuple(k8.shape)} on its device {k8.device}")
    qd, kd, vd = (check_descale(n, x) for n, x in
                  (("q_descale", q_descale), ("k_descale", k_descale), ("v_descale", v_descale)))
    for name, x in (("causal", causal), ("saturate", saturate)):
        if not isinstance(x, bool):
            raise TypeError(f"{name} must be a bool, got {type(x).__name__}")
    check_policy(policy, FAMILY, "fast")
    common.check_device(q8, interpret)
    config = common.check_config(config, fp8=True)
    if config is None and interpret:
        config = INTERPRET_CONFIG

    q8, k8 = q8.contiguous(), k8.contiguous()
    B, Sq, H, D = q8.shape
    Skv, Hkv = k8.shape[1], k8.shape[2]
    vt = v8.data if stored else transpose_v(v8, interpret)
    out = torch.empty(B, Sq, H, D, dtype=torch.bfloat16, device=q8.device)
    lse = torch.empty(B, H, Sq, device=q8.device, dtype=torch.float32)
    block_n = 128
    desc_k = common.make_descriptor(k8.view(B * Skv, Hkv * D), [block_n, D])
    desc_vt = common.make_descriptor(vt.view(B * Hkv * D, vt.shape[-1]), [D, block_n])
    codes = policy.codes
    args = (q8, k8, vt, out, lse, desc_k, desc_vt,
            q8.stride(0), q8.stride(1), q8.stride(2), k8.stride(0), k8.stride(1), k8.stride(2),
            out.stride(0), out.stride(1), out.stride(2),
            H, H // Hkv, Hkv, Sq, Skv, vt.shape[-1], log2_scale(qd, kd, D), vd,
            codes.threshold, vote_limit(codes.threshold, codes.headroom),
            codes.rebase, codes.bound, codes.headroom)
    meta = dict(D=D, CAUSAL=causal, LAZY=policy.lazy, SATURATE=saturate,
                INTERPRET=interpret)
    common.launch_fast(_attn_fwd_fp8, _TUNED, lambda bm: (triton.cdiv(Sq, bm), B * H), args, meta,
                       config, interpret)
    return out, lse


def compile_only(target, config: Config, *, lazy: bool, causal: bool, **options):
    """The kernel built for ``target`` with ``config`` as a launch on contiguous tensors
    builds it (16-byte aligned pointers, strides and the padded V^T length multiples of
    16), without launching it: see ``_triton.fast.compile_only``. The config's compiler
    options (warps, stages, a register cap) go to ``triton.compile``, and so do
    ``options`` (others than those)."""
    if not isinstance(config, Config):
        raise TypeError(f"config must be a Config, got {type(config).__name__}")
    common.check_config(config, fp8=True)
    for name, x in (("lazy", lazy), ("causal", causal)):
        if not isinstance(x, bool):
            raise TypeError(f"{name} must be a bool, got {type(x).__name__}")
    fn = _attn_fwd_fp8
    pointers = {"Q": "*fp8e4nv", "K": "*fp8e4nv", "Vt": "*fp8e4nv", "Out": "*bf16", "Lse": "*fp32"}
    strides = [n for n in fn.arg_names if n.startswith("stride_")]
    types = {**pointers, **{n: "i32" for n in strides},
             "desc_k": f"tensordesc<fp8e4nv[{config.block_n}, {HEAD_DIM}]>",
             "desc_vt": f"tensordesc<fp8e4nv[{HEAD_DIM}, {config.block_n}]>",
             **{n: "i32" for n in ("H", "GROUP", "HKV", "seqlen_q", "seqlen_kv", "seqlen_vpad", "rebase")},
             **{n: "fp32" for n in ("ls", "v_descale", "threshold", "vote_limit", "bound", "headroom")}}
    meta = config.meta(lazy)
    constexprs = dict(D=HEAD_DIM, CAUSAL=causal, LAZY=lazy, SATURATE=True, INTERPRET=False,
                      **{k: v for k, v in meta.items() if k not in common.COMPILER_OPTIONS})
    given = sorted(set(options) & set(common.COMPILER_OPTIONS))
    if given:
        raise ValueError(f"options {given} come from the config; pass them there")
    return common.compile_only(fn, target, types=types, constexprs=constexprs,
                               aligned=[*pointers, *strides, "seqlen_vpad"],
                               **{k: v for k, v in meta.items() if k in common.COMPILER_OPTIONS},
                               **options)


def best_config(q8, k8, causal: bool, lazy: bool, saturate: bool = True):
    """The tuner's pick for these shapes and P cast (after a forward ran), or None."""
    B, Sq, H, D = q8.shape
    return common.tuned_config(_TUNED[lazy], (Sq, k8.shape[1], H, H // k8.shape[2], causal, saturate))


def tuning_timings(lazy: bool) -> list[dict]:
    """The tuner's measurements at its last new key (for the benchmark's record)."""
    return common.tuning_timings(_TUNED[lazy])
