"""The reference answers to the lessons' exercises (``notebooks/``), kept out of the lessons
so that a learner meets a stub first and writes their own.

A lesson's check cell passes the learner's function through ``exercises.yours``: with the
environment variable ``FA_LAB_SOLUTIONS=1`` (set for nbval by ``notebooks/conftest.py`` and
for the docs build by ``docs/conf.py``) it returns the answer of the same name from here,
so CI runs every lesson with a working answer; otherwise it returns the learner's own.
``tests/lab/test_exercises.py`` holds each check against these answers and against wrong
ones. Each function is named as the lesson's stub is.
"""

from __future__ import annotations

import math
import statistics

import torch


# ---- lesson 00 ---------------------------------------------------------------------------

def lazy_bases(tile_max, threshold=8.0):
    """One row's base after each tile under the lazy rule for one row: the first tile sets it,
    and it moves, up to the tile max, only where the tile max beats it by more than
    ``threshold``."""
    bases = []
    for mt in tile_max:
        if not bases or mt - bases[-1] > threshold:
            bases.append(mt)
        else:
            bases.append(bases[-1])
    return bases


# ---- lesson 01 ---------------------------------------------------------------------------

def update(state, s, v):
    """Fold one tile (scores s [R, n] in log2 units, values v [n, D]) into state (m, l, O)."""
    m, l, O = state
    m_new = torch.maximum(m, s.amax(-1))           # the new base: the largest score so far
    corr = torch.exp2(m - m_new)                   # moves l and O to the new base (<= 1)
    p = torch.exp2(s - m_new[:, None])             # this tile's terms against the new base
    return m_new, l * corr + p.sum(-1), O * corr[:, None] + p @ v


def merge(a, b):
    """a ⊕ b: two states (m, l, O) of the same rows over disjoint sets of keys."""
    (m1, l1, O1), (m2, l2, O2) = a, b
    m = torch.maximum(m1, m2)
    w1, w2 = torch.exp2(m1 - m), torch.exp2(m2 - m)       # each part to the common base
    return m, w1 * l1 + w2 * l2, w1[:, None] * O1 + w2[:, None] * O2


# ---- lesson 02 ---------------------------------------------------------------------------

def my_rule(m, mt, threshold):
    """Only a row whose own tile max beats its base by more than the threshold moves, up to
    that tile max; the ballot is ignored (FlashAttention-4's per-row decision on the max)."""
    return torch.where(mt - m > threshold, mt, m)


def first_nan_tile(tile_max):
    """The first tile at which a row dies under the unfixed rule with its wave firing on every
    step: its base is then its current tile max, its deficit its best tile max so far minus
    that, and fp32 gives up once the deficit reaches 128 (log2 units). None if it never does."""
    best = -math.inf
    for t, mt in enumerate(tile_max):
        best = max(best, mt)
        if best - mt >= 128:
            return t
    return None


# ---- lesson 03 ---------------------------------------------------------------------------

def largest_safe_threshold(headroom=0.0):
    """The largest lazy threshold at which no P rounds past e4m3's last code: a row's tile max
    sits at most ``threshold`` above its base, so P is at most 2^(threshold + headroom); a P up
    to 464 (the midpoint to the next code, a tie that goes to the even 448) still rounds to 448."""
    return math.log2(464) - headroom


# ---- lesson 04 ---------------------------------------------------------------------------

def combine(parts):
    """The kernel's split-K combine of parts [(o [B, S, H, D], lse [B, H, S]), ...]."""
    lses = torch.stack([lse for _, lse in parts])
    lse = torch.logsumexp(torch.where(lses.isnan(), -math.inf, lses), 0)
    out = sum(torch.exp(x - lse).transpose(1, 2)[..., None] * o.float() for o, x in parts)
    return out, lse


# ---- appendix F ---------------------------------------------------------------------------

def best_case_speedup(ms):
    """Eager's median time over t_best = t_bound + (t_never - t_eager), each a median of its
    rounds."""
    med = {name: statistics.median(times) for name, times in ms.items()}
    return med["eager"] / (med["no_rescale_bound"] + med["lazy_never"] - med["eager"])


# ---- lesson 06 ---------------------------------------------------------------------------

def guaranteed_safe(threshold, n_keys, v_max):
    """Lesson 06's deficit bound: THR + log2 n + log2 max|v| < 128."""
    return threshold + math.log2(n_keys) + math.log2(v_max) < 128


# ---- lesson 07 ---------------------------------------------------------------------------

def zoo_policy():
    """One policy that survives the zoo (lesson 07's exercise). It is not the only answer, nor
    the smallest: ``epilogue_guard="zero"`` and ``v_tail="zero"`` are the defaults, and some
    guards overlap. Each field closes one section's mechanism."""
    from fa_lab import Policy
    from fa_lab.semantics import Semantics

    return Policy(
        vote="row", rebase="max",         # each row for itself, never downward: no drag
        threshold=0.75, p_headroom=8.0,   # 8 + 0.75 <= log2 448: no P can saturate
        name="answer",
        semantics=Semantics(
            p_cast="e4m3", block_n=128,
            tile_max_floor="always",      # a tile with nothing visible has a finite max
            empty_row_guard="zero_base",  # ... and an empty max exponentiates against 0
            clamp_exp_diff=True,          # a NaN difference becomes -inf, its exp2 0
            epilogue_guard="zero",        # a row that sees nothing gives 0
            o_gate="row",                 # a NaN factor is never applied by a vote
            v_tail="zero"))               # the cache past the sequence is never read


# ---- lesson 09 ---------------------------------------------------------------------------

#: dQ's LSE floor (FlyDSL's flash_attn_gfx950_dq.py at 1fa54fa3, docs/semantics.md §12.2).
LSE_FLOOR = -3e38


def lse2_floored(lse):
    """The LSE in log2 units, floored as the dQ kernel does it: convert first (fp32 multiply
    by log2 e), then maxNum with -3e38, so -inf and NaN become the floor."""
    return torch.fmax(lse.float() * math.log2(math.e), torch.tensor(LSE_FLOOR))


# ---- lesson 08 ---------------------------------------------------------------------------

def merge_partitions(maxes, sums, outs):
    """The decode's split reduce, guarded: partition p of a row holds its max ``maxes[p]``
    (natural-log units), its sum ``sums[p]`` against that max and its normalized output
    ``outs[p]``. Returns (out [R, D], lse [R]); a partition with sum 0 saw no token and adds
    nothing; a row none of whose partitions saw a token gets out 0 and LSE -inf."""
    seen = sums > 0                                         # an empty partition adds nothing
    top = torch.where(seen, maxes, -math.inf).amax(0)       # the common base M
    base = torch.where(torch.isfinite(top), top, 0.0)       # no token at all: no base to take
    w = torch.where(seen, sums * torch.exp(maxes - base), 0.0)
    total = w.sum(0)
    share = w / torch.where(total > 0, total, 1.0)          # normalized: they sum to 1
    out = torch.where(seen[..., None], share[..., None] * outs, 0.0).sum(0)
    return out, base + torch.log(total)                     # ln 0 = -inf for a row with none
