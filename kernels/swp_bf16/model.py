"""Exact model of the gfx950 DUALWAVE_SWP bf16/f16 forward (docs/semantics.md §2).

Plain vectorised PyTorch: every row of a block group advances one KV tile per step, in the
kernel's order, so each rescale decision, rounding and overflow happens as on the GPU. Runs
on CPU and CUDA tensors alike. The schedule, per row:

  prologue (tile 0)  m = rowmax(S_0) (causal: floored at -3e38); Pf = exp2(S_0 - m)
  loop (1..N-4)      l += sum(Pf); Pb = round(Pf); O += Pb[:16] @ V
                     the rescale decision (eager, or a 32-row wave ballot for lazy)
                     O += Pb[16:] @ V; Pf = exp2(S_t - m)
  epilogue (N-3..)   always eager

Every product of 16-bit values (Qs K^T, P V) is ``numerics.exact_dot``: the exact sum,
rounded once to fp32, which no summation order changes (the hardware's fp32 accumulation
differs from it by a few ulps).
"""

from __future__ import annotations

import math

import torch

from fa_lab.numerics import (CAUSAL_FLOOR, LN2, LOG2E, exact_dot, exp2, f32, fmax, guarded_rcp,
                        round_to)
from fa_lab.capabilities import check_semantics
from fa_lab.paged import PagedKV
from fa_lab.policies import Policy
from fa_lab.trace import TraceRecorder
from . import FAMILY
from .._common.models import check_decidable, decide, heads, run_groups
from .._common.geometry import BLOCK_N, PV_SPLIT, block_groups, masked_columns, padded_rows

KERNEL = "swp_bf16"


def softmax_scale_log2(head_dim: int) -> float:
    """c = f32(1/sqrt(D)) * f32(log2 e), as an fp32 product: scores come out in log2 units."""
    return f32(f32(1.0 / math.sqrt(head_dim)) * f32(LOG2E))


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool,
            policy: Policy, recorder: TraceRecorder | None = None,
            bias: torch.Tensor | None = None, alibi_slopes: torch.Tensor | None = None,
            sink: torch.Tensor | None = None, num_kv_splits: int = 1, paged=None):
    """q [B, Sq, H, D], k and v [B, Skv, Hkv, D], bf16 or f16 (checked by the caller).

    ``paged`` (a checked ``fa_lab.paged.PagedKV``): k and v are the page cache, and each
    KV tile reads one whole page through the block table (padding tiles page 0), so rows
    past Skv hold what the page holds, masked in S but multiplied by P = 0 in P V.

    Optional score modifiers, all in natural-log units as upstream takes them: ``bias``
    [Sq, Skv] (added as bias * log2 e after scaling, before masking), ``alibi_slopes`` [H]
    or [B, H] (adds -slope * log2 e * |i + Skv - Sq - j|), ``sink`` [H] (one extra logit
    per head in the denominator, folded in after the last tile).
    ``num_kv_splits`` > 1 runs split-K: each split walks its own tiles with the full
    schedule and stores a normalised partial, and a combine pass merges them.
    Returns (out [B, Sq, H, D] in q's dtype, lse [B, H, Sq] fp32, natural log).
    """
    check_semantics(policy, FAMILY, "model")
    check_decidable(policy, f"the {FAMILY.name} model")
    B, Sq, H, D = q.shape
    Skv = k.shape[1]
    if paged is not None:
        if not isinstance(paged, PagedKV):
            raise TypeError(f"paged must be a fa_lab.paged.PagedKV, got {type(paged).__name__}")
        Skv = paged.seqlen_kv
        k, v = paged.gather(k, v, max(g.n_tiles for g in block_groups(Sq, Skv, causal, "cpu")))
    Hkv = k.shape[2]
    rnd = round_to(q.dtype)
    # Q is pre-scaled into log2 units and rounded once.
    qs, kf, vf = heads(rnd(q.float() * softmax_scale_log2(D)), k, v, padded_rows(Sq))
    mods = ScoreMods.build(bias, alibi_slopes, sink, B, Hkv, H // Hkv, Sq, Skv, q.device)

    def run(q_rows, rows, n_tiles):
        args = (q_rows, *_pad_kv(kf, vf, n_tiles), rows)
        if num_kv_splits == 1:
            return _run_group(*args, n_tiles, Sq, Skv, causal, policy, rnd, recorder, mods)[:2]
        return _split_k(args, n_tiles, num_kv_splits, Sq, Skv, causal, policy, rnd, recorder, mods)

    groups = ((g.rows, g.n_tiles) for g in block_groups(Sq, Skv, causal, q.device))
    return run_groups(qs, groups, run, recorder, q.dtype, Sq)


class ScoreMods:
    """bias / ALiBi / sink in the kernel's log2 domain, laid out for [B, Hkv, G, R, cols]."""

    def __init__(self, bias_log2, alibi_log2, sink_log2, seqlen_q, seqlen_kv):
        self.bias_log2 = bias_log2    # [Sq_pad, Skv] or None; padding rows read 0
        self.alibi_log2 = alibi_log2  # [B or 1, Hkv, G, 1, 1] = -slope * log2 e, or None
        self.sink_log2 = sink_log2    # [1, Hkv, G, 1] = sink * log2 e, or None
        self.seqlen_q, self.seqlen_kv = seqlen_q, seqlen_kv

    @classmethod
    def build(cls, bias, alibi_slopes, sink, B, Hkv, G, Sq, Skv, dev):
        log2e = f32(LOG2E)
        bias_log2 = alibi_log2 = sink_log2 = None
        if bias is not None:
            bias_log2 = torch.zeros(padded_rows(Sq), Skv, device=dev)
            bias_log2[:Sq] = bias.float() * log2e
        if alibi_slopes is not None:
            a = alibi_slopes.float().reshape(-1, Hkv, G, 1, 1)
            alibi_log2 = -(a * log2e)
        if sink is not None:
            sink_log2 = (sink.float() * log2e).reshape(1, Hkv, G, 1)
        return cls(bias_log2, alibi_log2, sink_log2, Sq, Skv)

    def scores(self, rows: torch.Tensor, col0: int, width: int):
        """The additive term for rows x [col0, col0 + width), or None."""
        extra = None
        if self.bias_log2 is not None:
            cols = torch.arange(col0, col0 + width, device=rows.device).clamp(max=self.seqlen_kv - 1)
            extra = self.bias_log2[rows][:, cols]  # padding columns are masked anyway
        if self.alibi_log2 is not None:
            cols = torch.arange(col0, col0 + width, device=rows.device)
            dist = (rows[:, None] + (self.seqlen_kv - self.seqlen_q) - cols[None, :]).abs().float()
            term = self.alibi_log2 * dist
            extra = term if extra is None else extra + term
        return extra


def split_ranges(n_tiles: int, num_splits: int) -> list[tuple[int, int]]:
    """Each split's [t0, t_end) as upstream cuts a block's N tiles: chunks of
    ceil(N / splits) rounded up to even, at least 6; a remainder under 4 tiles joins the
    split before it, and a split that would start with fewer than 4 tiles left is empty
    (t0 == t_end)."""
    chunk = max(6, ((n_tiles + num_splits - 1) // num_splits + 1) // 2 * 2)
    ranges = []
    for s in range(num_splits):
        t0 = s * chunk
        if t0 + 4 > n_tiles:
            ranges.append((t0, t0))
            continue
        t_end = min(t0 + chunk, n_tiles)
        if n_tiles - t_end < 4:
            t_end = n_tiles
        ranges.append((t0, t_end))
    return ranges


def _split_k(args, N, num_splits, Sq, Skv, causal, policy, rnd, rec, mods):
    """Split-K: per split a bf16 partial O normalised by its own l, with fp32 m and l
    (an empty split stores m = -1e30, l = 0); the combine weights each split by
    w_s l_s with w_s = exp2(m_s - m_max), folding the sink in exactly once."""
    parts = []
    for t0, t_end in split_ranges(N, num_splits):
        if t_end > t0:
            o_s, _, m_s, l_s = _run_group(*args, t_end - t0, Sq, Skv, causal, policy, rnd, rec,
                                          mods, t0=t0, sink=False)
            parts.append((o_s.float(), m_s, l_s))
        else:
            o_s = parts[0][0]
            parts.append((torch.zeros_like(o_s), torch.full_like(o_s[..., 0], -1e30),
                          torch.zeros_like(o_s[..., 0])))
    m_max = parts[0][1]
    for _, m_s, _ in parts[1:]:
        m_max = fmax(m_max, m_s)
    den = torch.zeros_like(m_max)
    if mods is not None and mods.sink_log2 is not None:
        sk = mods.sink_log2.expand_as(m_max)
        m_max = fmax(m_max, sk)
        sink_w = exp2(sk - m_max)
    acc = torch.zeros_like(parts[0][0])
    for o_s, m_s, l_s in parts:
        wl = torch.where(l_s > 0, exp2(m_s - m_max) * l_s, torch.zeros_like(l_s))
        den = den + wl
        acc = acc + wl[..., None] * o_s
    if mods is not None and mods.sink_log2 is not None:
        den = den + sink_w
    out = rnd(acc * guarded_rcp(den)[..., None])
    lse = torch.where(den == 0, torch.full_like(den, float("-inf")), m_max * f32(LN2) + torch.log(den))
    if rec is not None:
        rec.finish_group(out, lse)
    return out, lse


def _pad_kv(kf, vf, n_tiles):
    """Zero-pad K and V to n_tiles * 64 columns (extra tiles read zeros and are masked)."""
    extra = n_tiles * BLOCK_N - kf.shape[-2]
    if extra <= 0:
        return kf[..., : n_tiles * BLOCK_N, :], vf[..., : n_tiles * BLOCK_N, :]
    pad = (0, 0, 0, extra)
    return torch.nn.functional.pad(kf, pad), torch.nn.functional.pad(vf, pad)


def _run_group(qs, kp, vp, rows, N, Sq, Skv, causal, policy, rnd, rec, mods=None, t0=0,
               sink=True):
    """One group of query blocks walking N tiles from tile t0 (a split-K split starts past
    0); state per row [B, Hkv, G, R]. Returns (out, lse, m, l)."""
    inf = float("inf")

    def scores(t):
        c0 = (t0 + t) * BLOCK_N
        s = exact_dot(qs, kp[..., c0:c0 + BLOCK_N, :].transpose(-1, -2))
        extra = None if mods is None else mods.scores(rows, c0, BLOCK_N)
        if extra is not None:
            s = s + extra
        return s.masked_fill(masked_columns(rows, c0, Sq, Skv, causal), -inf)

    def v_tile(t, lo=0, hi=BLOCK_N):
        c0 = (t0 + t) * BLOCK_N
        return vp[..., c0 + lo:c0 + hi, :]

    def record(t, phase, *, mt, vote=None, fire=None, swept=None, corr=None):
        if rec is not None and rec.active:
            false = torch.zeros_like(m, dtype=torch.bool)
            rec.record(t0 + t, (t0 + t) * BLOCK_N, phase, m=m, mt=mt,
                       vote=false if vote is None else vote, fire=false if fire is None else fire,
                       swept=false if swept is None else swept,
                       corr=torch.ones_like(m) if corr is None else corr, l=l, O=O)

    # Prologue: tile 0 sets the first base.
    s = scores(0)
    m = s.amax(-1)
    if causal:
        m = fmax(m, CAUSAL_FLOOR)
    pf = exp2(s - m[..., None])
    l = torch.zeros_like(m)
    O = torch.zeros(*m.shape, qs.shape[-1], device=qs.device)
    record(0, "prologue", mt=m)

    # Main loop: the only place a lazy policy decides, per 32-row wave.
    for t in range(1, N - 3):
        l = l + pf.sum(-1)
        pb = rnd(pf)
        O = O + exact_dot(pb[..., :PV_SPLIT], v_tile(t - 1, 0, PV_SPLIT))
        s = scores(t)
        mt = s.amax(-1)
        dec = decide(policy, m, mt, where=f"the {FAMILY.name} model", at=f"KV tile {t0 + t}",
                     rows=rows)
        target, corr = dec.target, dec.corr
        O = O * corr[..., None]
        pb_rest = rnd(pb[..., PV_SPLIT:] * corr[..., None])  # packs not yet consumed
        l = l * corr
        m = target
        O = O + exact_dot(pb_rest, v_tile(t - 1, PV_SPLIT))
        pf = exp2(s - m[..., None])
        record(t, "loop", mt=mt, vote=dec.vote, fire=dec.fire, swept=dec.swept, corr=corr)

    # Epilogue: the last three tiles, always eager.
    for t in range(max(1, N - 3), N):
        l = l + pf.sum(-1)
        O = O + exact_dot(rnd(pf), v_tile(t - 1))
        s = scores(t)
        mt = s.amax(-1)
        mn = fmax(m, mt)
        corr = exp2(m - mn)
        m = mn
        pf = exp2(s - m[..., None])
        O = O * corr[..., None]
        l = l * corr
        if t < N - 1:
            record(t, "epilogue", mt=mt, corr=corr)
    l = l + pf.sum(-1)
    O = O + exact_dot(rnd(pf), v_tile(N - 1))
    if sink and mods is not None and mods.sink_log2 is not None:
        # the sink is one more logit in the denominator, with no value row
        sk = mods.sink_log2.expand_as(m)
        mn = fmax(m, sk)
        corr = exp2(m - mn)
        O = O * corr[..., None]
        l = l * corr + exp2(sk - mn)
        m = mn
    record(N - 1, "epilogue", mt=mt, corr=corr)

    out = rnd(O * guarded_rcp(l)[..., None])
    lse = torch.where(l == 0, torch.full_like(l, -inf), m * f32(LN2) + torch.log(l))
    if rec is not None:
        rec.finish_group(out, lse)
    return out, lse, m, l
