"""The natural wrong answers to the lessons' exercises, and how a check tells which one it met.

A check in ``fa_lab.lab.exercises`` that finds an answer wrong asks this module what went
wrong before it raises. Each function here runs the learner's function on a small probe
whose right answer and whose answer under each natural mistake are all different (or, for
the combine, builds what the mistake would return on the check's own case) and returns a
sentence naming the mistake, or None when the answer matches none of them; the check then
falls back to its general message. The sentences say what is wrong and where to look, not
the formula.
"""

from __future__ import annotations

import math
import statistics

import torch


def _same(got, want, rel=1e-9) -> bool:
    return math.isfinite(got) and abs(got - want) <= rel * max(1.0, abs(want))


def _first(named, got) -> str | None:
    """The message of the first (message, predicate) whose predicate holds for ``got``."""
    return next((msg for msg, holds in named if holds(*got)), None)


# ---- lesson 01: the update and the merge ----------------------------------------------------

def update(fn) -> str | None:
    """What is wrong with lesson 01's ``update(state, s, v)``, from one row's step: base 0,
    ``l = 1`` and ``O = 1`` (D = 1), then a tile of two keys scoring 3 and 2 (log2 units) with
    ``v = 0``. The right step moves the base to 3 and both sums by ``corr = 2^-3``, and adds
    the tile's P of 1 and 1/2 to ``l``; a second step from ``l = 0`` reads the tile's P alone."""
    f64 = torch.float64
    s, v = torch.tensor([[3.0, 2.0]], dtype=f64), torch.zeros(2, 1, dtype=f64)
    try:
        m1, l1, o1 = (float(t.reshape(-1)[0]) for t in fn(
            (torch.zeros(1, dtype=f64), torch.ones(1, dtype=f64), torch.ones(1, 1, dtype=f64)), s, v))
        p = float(fn((torch.zeros(1, dtype=f64), torch.zeros(1, dtype=f64),
                      torch.zeros(1, 1, dtype=f64)), s, v)[1].reshape(-1)[0])
    except Exception:      # an answer that cannot take the probe: the check's own message
        return None
    if m1 != 3.0:
        return None
    corr_l, corr_o, e3 = l1 - p, o1, math.exp(-3)
    return _first([
        ("the scores are in log2 units: exponentiate them with exp2, not exp (for corr and "
         "for the tile's P)",
         lambda cl, co, p: _same(co, e3) or _same(cl, e3) or _same(p, 1 + math.exp(-1))),
        ("corr is upside down: it grew l and O 8-fold when the base rose by 3; moving a sum to "
         "a larger base shrinks it (corr <= 1, identity 1)",
         lambda cl, co, p: _same(co, 8.0) or _same(cl, 8.0)),
        ("neither l nor O is moved to the new base: both sums were computed against the old "
         "one and must be multiplied by corr before the tile's terms are added",
         lambda cl, co, p: _same(cl, 1.0) and _same(co, 1.0)),
        ("l is moved to the new base and O is not: O's terms were computed against the old "
         "base too, so O is multiplied by corr as l is",
         lambda cl, co, p: _same(cl, 0.125) and _same(co, 1.0)),
        ("O is moved to the new base and l is not: l's terms were computed against the old "
         "base too, so l is multiplied by corr as O is",
         lambda cl, co, p: _same(co, 0.125) and _same(cl, 1.0)),
        ("the tile's own terms are taken against the old base: P is against the new base "
         "m_new, as everything in l and O now is",
         lambda cl, co, p: _same(p, 12.0)),
    ], (corr_l, corr_o, p))


def merge(fn) -> str | None:
    """What is wrong with lesson 01's ``merge(a, b)``, from one row: ``a`` has base 0,
    ``l = 2``, ``O = 1``; ``b`` base 3, ``l = 1``, ``O = 4`` (D = 1). The right merge keeps
    base 3, ``l = 2/8 + 1`` and ``O = 1/8 + 4``; each natural mistake gives other sums (an
    upside-down factor, 2^(m - m_i), gives ``l = 16 + 1`` and ``O = 8 + 4``)."""
    f64 = torch.float64

    def state(m, l, o):
        return torch.tensor([m], dtype=f64), torch.tensor([l], dtype=f64), torch.tensor([[o]], dtype=f64)

    try:
        m, l, o = (float(t.reshape(-1)[0]) for t in fn(state(0.0, 2.0, 1.0), state(3.0, 1.0, 4.0)))
    except Exception:
        return None
    if m != 3.0:
        return None
    e3 = math.exp(-3)
    return _first([
        ("the parts are in log2 units: move them to the common base with exp2, not exp",
         lambda l, o: _same(o, e3 + 4) or _same(l, 2 * e3 + 1)),
        ("the parts are added as they are: each was computed against its own base and must "
         "first be moved to the common one (identity 1)",
         lambda l, o: _same(l, 3.0) and _same(o, 5.0)),
        ("l is moved to the common base and O is not: each part's O is against its own base "
         "too, so it takes the same factor as its l",
         lambda l, o: _same(l, 1.25) and _same(o, 5.0)),
        ("O is moved to the common base and l is not: each part's l takes the same factor as "
         "its O",
         lambda l, o: _same(o, 4.125) and _same(l, 3.0)),
        ("each part is weighted by the other's factor: a part's factor is 2 to its own base "
         "minus the common one",
         lambda l, o: _same(l, 2.125) and _same(o, 1.5)),
        ("a factor is upside down: moving a part to a larger base shrinks it (a factor <= 1)",
         lambda l, o: _same(l, 17.0) and _same(o, 12.0)),
        ("the merged output is an average of the parts' outputs: each part counts by its mass "
         "l (its softmax denominator), not equally",
         lambda l, o: _same(o / l, (1 / 2 + 4 / 1) / 2)),
    ], (l, o))


# ---- lesson 04: split-K's combine ----------------------------------------------------------

LAYOUT = ("each part's o is [B, S, H, D] and its lse [B, H, S]: a weight made from the LSEs is "
          "[B, H, S] and must be brought to o's [B, S, H] layout, swapping the H and S "
          "dimensions (a transpose), before it multiplies o")


def combine_layout(parts, out) -> str | None:
    """Whether ``out`` is the combine with each part's weights [B, H, S] reshaped (or viewed)
    into [B, S, H] instead of transposed: the same shape, each weight on another (row,
    head)'s output. Compared where both are finite, to one bf16 step."""
    lses = torch.stack([x for _, x in parts])
    lse = torch.logsumexp(torch.where(lses.isnan(), -math.inf, lses), 0)
    b, h, s = lse.shape
    mixed = sum(torch.exp(x - lse).reshape(b, s, h)[..., None] * o.float() for o, x in parts)
    both = torch.isfinite(mixed) & torch.isfinite(out)
    if out.shape != mixed.shape or h == 1 or not both.any():
        return None
    rel = ((out - mixed).abs() / mixed.abs().clamp_min(1))[both].max().item()
    if rel > 2 ** -7:
        return None
    return ("your combine matches the parts weighted by their LSEs reshaped from [B, H, S] to "
            "[B, S, H]: a reshape keeps the memory order, so each weight lands on another row's "
            "and head's output; " + LAYOUT)


# ---- lesson 08: the decode's split reduce --------------------------------------------------

def merge_partitions_lse(lse, ref_lse) -> str | None:
    """Whether the LSE is the reference's in log2 units (times log2 e)."""
    if lse.shape == ref_lse.shape and torch.allclose(lse, ref_lse * math.log2(math.e), atol=1e-10):
        return ("an LSE in log2: yours is the natural-log LSE times log2(e); the maxima are "
                "natural logs and the LSE is returned in natural log too")
    return None


# ---- appendix F: the best case ------------------------------------------------------------

def best_case(fn, launch, want) -> str | None:
    """What is wrong with appendix F's ``best_case_speedup(ms)`` on the constructed ``launch``
    (every variant of the measurement, per-round times whose medians, means and minima all
    give different answers), whose right answer is ``want``: the answer each natural mistake
    gives, in turn, against the learner's."""
    try:
        got = float(fn({k: list(x) for k, x in launch.items()}))
    except Exception:
        return None
    if not math.isfinite(got):
        return None
    med = {k: statistics.median(x) for k, x in launch.items()}
    mean = {k: statistics.mean(x) for k, x in launch.items()}
    low = {k: min(x) for k, x in launch.items()}
    e, b, n = med["eager"], med["no_rescale_bound"], med["lazy_never"]

    def per_round(avg):
        return avg([x / (y + z - x) for x, y, z in zip(
            launch["eager"], launch["no_rescale_bound"], launch["lazy_never"])])

    def formula(m, vote="lazy_never"):
        return m["eager"] / (m["no_rescale_bound"] + m[vote] - m["eager"])

    wrong = [
        (1 / want, "the ratio is upside down: the answer is eager's time over t_best, above 1 "
                   "where the lazy policy would be faster"),
        (e / b, "that is eager over the bound alone: the bound has no multiply and no vote, "
                "and the best case still pays what the vote alone costs"),
        (formula(med, "lazy"), "the vote's cost is taken from `lazy`, whose waves also fire "
                               "and rescale now and then: which variant takes the vote and "
                               "never fires?"),
        (formula(med, "lazy_at_b7e066d"), "the vote's cost is taken from `lazy_at_b7e066d`, the "
                                          "earlier vote through shared memory and a CTA barrier; "
                                          "the best case pays the vote this kernel takes"),
        (e / (b + n), "the whole of lazy_never's time is added to the bound: only what its vote "
                      "adds to a kernel without one belongs in t_best"),
        (e / n, "that is eager over lazy_never: a kernel that takes the vote and still "
                "multiplies; the best case skips every multiply"),
        (e / (b - (n - e)), "the vote's cost is subtracted: a vote adds time"),
        (formula(mean), "each variant's mean over the rounds: take its median"),
        (formula(low), "each variant's fastest round: take its median over the rounds"),
        (per_round(statistics.median), "a median of per-round ratios: take each variant's "
                                       "median over the rounds first, then the ratio"),
        (per_round(statistics.mean), "a mean of per-round ratios: take each variant's median "
                                     "over the rounds first, then the ratio"),
    ]
    return next((msg for value, msg in wrong if abs(got - value) < 1e-9), None)
