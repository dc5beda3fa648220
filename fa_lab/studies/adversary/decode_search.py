"""The attack on the paged-attention decode: random draws from ``decode.DECODE_SPACE``, then a
(1 + lambda) evolution strategy on the decode fitness (``decode.judge``), shrinking of a
failing call, and the attack record.

    from fa_lab.studies.adversary import decode_search
    res = decode_search.search("flydsl-985c653a^", budget_s=60, seed=0)
    res.found, res.shrunk.size, res.repro
    decode_search.summary(res)      # "... nothing in N runs found a failure" when none

The search is given no failing call: it starts from ``random_starts``
draws (``random_candidate``: a quarter of the numbers at an end of their range) and
``boundary_starts`` draws of the partition-boundary family (``boundary_candidate``: a call
cut where a decode's geometry has its edges, a tile that begins a partition and that the
MTP rows' bounds straddle, with an outlier token at its start; drawn from a stream of its
own, so the shared draws of a seed are what they were), and climbs
the space's generic fitness (``decode.judge``: how close some row comes to a fully masked
tile, and how close an exp2 the kernel takes comes to fp32's overflow); the fields that
make a call fail are its coordinates like every other. Candidates are judged without the
fp64 reference while no row is non-finite (``judge(quick=True)``).
Deterministic for a seed (given ``max_evals``; the wall-clock budget decides how far a
run gets).
"""

from __future__ import annotations

import math

import numpy as np

from . import climb, decode
from .decode import model
from .decode import DECODE_FIELDS, DECODE_SPACES, DecodeCandidate, DecodeSpace, canonical, judge
from .optimize import Attack


def _clip(sp: DecodeSpace, f, x):
    kind, r = DECODE_FIELDS[f][0], sp.range(f)
    if kind == "choice":
        return x if x in r else r[0]
    x = min(max(x, r[0]), r[1])
    return int(round(x)) if kind == "int" else float(x)


#: The share of draws (and of a mutation's numeric steps) that put a number at an end of
#: its range: a decode call's geometry fails at its ends (a context one token into a
#: tile, a token at the first or last position, the most rows, the largest outlier), which
#: a uniform draw over 0..256 or 0..1 almost never hits.
AT_END = 0.25


#: The fields that size a call (its cost grows with each): their end is the low one, the
#: cheapest call of the geometry the other fields set.
SIZES = ("n_seqs", "num_kv_heads", "tiles", "spare_pages")


def _end(sp: DecodeSpace, f, rng: np.random.Generator):
    """One end of ``f``'s range (the low end of a size, ``SIZES``), or, for ``last``
    (tokens into the last tile), one of its smallest non-empty counts half of the time (1
    or 2: 0 makes the last tile the previous one)."""
    r = sp.range(f)
    if f == "last" and rng.random() < 0.5:
        return min(max(int(rng.integers(1, 3)), r[0]), r[1])
    return r[0] if f in SIZES or rng.random() < 0.5 else r[1]


def random_candidate(sp: DecodeSpace, rng: np.random.Generator) -> DecodeCandidate:
    """A draw from ``sp``: each number uniform in its range, or at one of its ends
    (``AT_END`` of the time; ``_end``); each choice uniform (``outlier_log2`` is 0 half of
    the time)."""
    vals = {}
    for f, (kind, _) in DECODE_FIELDS.items():
        r = sp.range(f)
        if kind != "choice" and r[0] == r[1]:   # a field the space pins (no draw)
            vals[f] = r[0]
        elif kind == "choice":
            vals[f] = r[rng.integers(len(r))]
        elif f != "seed" and rng.random() < AT_END:
            vals[f] = _end(sp, f, rng)
        elif kind == "int":
            vals[f] = int(rng.integers(r[0], r[1] + 1))
        else:
            vals[f] = float(rng.uniform(r[0], r[1]))
    if rng.random() < 0.5:
        vals["outlier_log2"] = 0.0
    return DecodeCandidate(**vals)


#: Draws of the partition-boundary family tried after the shared random starts
#: (``boundary_candidate``), and the share of the strategy's fresh restarts that begin from
#: one.
BOUNDARY_STARTS = 4
BOUNDARY_RESTARTS = 0.5


def boundary_candidate(sp: DecodeSpace, rng: np.random.Generator) -> DecodeCandidate:
    """A draw of the partition-boundary family: a ``random_candidate`` whose call is cut
    where a decode's geometry has its edges. One sequence (the cheapest call of that
    geometry, its context not emptied) ending ``last`` = 1 .. ``query_length`` tokens into
    its last tile, so the MTP rows' bounds straddle the tile's start (the earliest rows see
    none of it, the latest one token or a few); ``num_partitions`` from ``tiles`` up, so every tile,
    that last one included, begins a partition of its own (and the partitions past the
    tiles are empty); and one outlier token, in K or V, at that tile's first token, the
    only one there that the earliest row to see the tile sees (a per-token scale outlier,
    or a per-tensor scale that flushes the rest). Every value is clipped into ``sp``'s
    ranges."""
    c = random_candidate(sp, rng)
    vals = c.to_dict()
    vals["n_seqs"], vals["empty_seq"] = sp.range("n_seqs")[0], "none"
    vals["last"] = int(rng.integers(1, max(1, c.query_length) + 1))
    np_lo, np_hi = sp.range("num_partitions")
    vals["num_partitions"] = int(rng.integers(min(max(c.tiles, np_lo), np_hi), np_hi + 1))
    lo, hi = sp.range("outlier_log2")
    vals["outlier_log2"] = float(rng.uniform(lo, hi))
    ctx0 = model.TILE_TOK * (c.tiles - 1) + vals["last"]
    first = model.TILE_TOK * (c.tiles - 1)     # the last tile's first token
    vals["outlier_at"] = 1.0 if ctx0 <= 1 else min(1.0, (first + 0.5) / (ctx0 - 1))
    return DecodeCandidate(**{f: _clip(sp, f, x) for f, x in vals.items()})


def mutate(c: DecodeCandidate, sp: DecodeSpace, rng: np.random.Generator,
           sigma: float) -> DecodeCandidate:
    """Perturb a few fields: numbers to an end of their range (``AT_END`` of the time) or by
    a Gaussian step of ``sigma`` times their range (ints half the time by a multiplicative
    step, so small values are reached), choices by a new draw; the seed is redrawn."""
    vals = c.to_dict()
    names = [f for f in DECODE_FIELDS if f != "seed"
             and (DECODE_FIELDS[f][0] == "choice" or sp.range(f)[0] != sp.range(f)[1])]
    n = max(1, int(rng.poisson(2.0)))
    for f in rng.choice(names, size=min(n, len(names)), replace=False):
        kind, r = DECODE_FIELDS[f][0], sp.range(f)
        if kind == "choice":
            vals[f] = r[rng.integers(len(r))]
        elif rng.random() < AT_END:
            vals[f] = _end(sp, f, rng)
        elif r[0] >= 0 and rng.random() < 0.5:
            vals[f] = _clip(sp, f, max(vals[f], 1) * math.exp(2 * sigma * rng.normal()))
        else:
            vals[f] = _clip(sp, f, vals[f] + rng.normal() * sigma * (r[1] - r[0]))
    vals["seed"] = int(rng.integers(0, 2 ** 31 - 1))
    return DecodeCandidate(**vals)


class DecodeAttack(Attack):
    """``Attack`` for a decode version: ``policy`` names it (``fa_lab.upstream``);
    ``repro`` rebuilds the shrunk call (``decode.repro_line``)."""

    @property
    def repro(self) -> str:
        c = self.shrunk or self.best
        return "" if c is None else decode.repro_line(c, self.policy, self.classes)


#: Simplifications the shrinker tries, in order: (field, value or a callable of the
#: current value giving the values to try).
_SIMPLER = (
    ("n_seqs", 1), ("empty_seq", "none"), ("num_kv_heads", 1), ("tail", "finite"),
    ("outlier_log2", 0.0), ("k_log2", 0.0), ("head_dim", 64), ("block_size", 16),
    ("shuffle", False), ("trans_v", True), ("spare_pages", 0), ("ctx_step", 0),
    ("num_partitions", lambda v: [1, 2] if v > 2 else [1]),
    ("tiles", lambda v: list(range(1, v))), ("group", lambda v: list(range(1, v))),
    ("query_length", lambda v: list(range(2, v))),
    ("last", lambda v: [x for x in (1, 2, 4, 8, 16, 32, 64, 128) if x < v]),
)


def _blind_rows(c: DecodeCandidate) -> int:
    """How many rows (per kv head) see no token: a shrunk call keeps no more than it had."""
    return sum(b <= 0 for ctx in c.contexts
               for b in decode.model.row_bounds(ctx, c.query_length, c.group))


def shrink(c: DecodeCandidate, upstream: str, classes, *, budget_s: float = 20.0):
    """Greedy passes over ``_SIMPLER`` (``climb.shrink``), each change kept only if the call
    still fails (for one of ``classes``) and has no more rows that see nothing than the
    call found; until a pass changes nothing or the budget is spent. Returns the shrunk
    candidate and the model runs spent."""
    blind = _blind_rows(c)
    return climb.shrink(c, _SIMPLER, canonical=canonical, budget_s=budget_s,
                        keep=lambda cand: _blind_rows(cand) <= blind,
                        fails=lambda cand: judge(cand, upstream, classes=classes).failed)


def search(upstream: str, *, space: str = "decode", budget_s: float = 60.0, seed: int = 0,
           classes=None, max_evals: int | None = None, random_starts: int = 8,
           boundary_starts: int = BOUNDARY_STARTS, lam: int = 6, shrink_found: bool = True,
           progress=None) -> DecodeAttack:
    """Look for a call of ``space`` (a ``decode.DECODE_SPACES`` name) on which the decode version ``upstream``
    (``fa_lab.upstream.DECODE_VERSIONS``) fails for ``classes`` (``decode.DECODE_CLASSES``;
    default ``nonfinite``), for at most ``budget_s`` seconds of search: ``random_starts``
    draws, ``boundary_starts`` draws of the partition-boundary family
    (``boundary_candidate``, a stream of its own), then a (1 + ``lam``) evolution strategy
    from the fittest with restarts (``climb.run_search``). Stops at the first failure and
    shrinks it (a budget of its own, as much again, at most 20 s). Every argument is checked
    before any work."""
    if not decode.is_decode_target(upstream):
        from fa_lab.upstream import DECODE_VERSIONS
        raise ValueError(f"upstream={upstream!r}: the decode space attacks a decode version, "
                         f"one of {tuple(DECODE_VERSIONS)}")
    classes = decode.check_decode_classes(classes)
    if space not in DECODE_SPACES:
        raise ValueError(f"space={space!r}; choose one of {tuple(DECODE_SPACES)}")
    sp = DECODE_SPACES[space]
    climb.check_numbers(budget_s=budget_s, seed=seed, random_starts=random_starts,
                        boundary_starts=boundary_starts, lam=lam)
    res = DecodeAttack(policy=upstream, space=sp.to_dict(), budget_s=float(budget_s),
                       seed=int(seed), threshold=None, structured=False, optimizer="es",
                       classes=classes)
    found = climb.run_search(
        res, draw=lambda rng: random_candidate(sp, rng),
        mutate=lambda c, rng, sigma: mutate(c, sp, rng, sigma),
        judge=lambda c: judge(c, upstream, classes=classes, quick=True),
        canonical=lambda c: canonical(DecodeCandidate(**{f: _clip(sp, f, x)
                                                         for f, x in c.to_dict().items()})),
        budget_s=budget_s, seed=seed, max_evals=max_evals, random_starts=random_starts,
        lam=lam, family=lambda rng: boundary_candidate(sp, rng), family_starts=boundary_starts,
        family_restarts=BOUNDARY_RESTARTS, progress=progress)
    climb.finish(res, found, shrink_found=shrink_found,
                 shrink_fn=lambda c: shrink(c, upstream, classes,
                                            budget_s=min(20.0, max(5.0, budget_s))),
                 judge_full=lambda c: judge(c, upstream, classes=classes))
    return res


def summary(res: DecodeAttack) -> str:
    """A few lines: what was found, how fast, how small; or how many runs found nothing."""
    if res.found:
        return (f"{res.policy}: FAILS ({', '.join(res.found_classes)}). First failure after "
                f"{res.time_to_first_s:.1f} s ({res.evals_to_first} model runs) in space "
                f"{res.space['name']!r}; shrunk in {res.shrink_evals} runs to {res.shrunk.size}; "
                f"rows [token row, q head] {res.bad_rows}\n  repro: {res.repro_command}")
    return (f"{res.policy}: nothing in {res.evals} runs found a failure ({res.search_s:.1f} s, "
            f"budget {res.budget_s:g} s, space {res.space['name']!r}, classes "
            f"{', '.join(res.classes)}); best fitness {res.best_fitness:.1f} (100 and above: a "
            "row met a fully masked tile; 129: a failure)")


def record(upstream: str, runs, *, params: dict, provenance: dict | None = None) -> dict:
    """The attack record (``record.RECORD_KEYS``) of one or more runs against the decode
    version ``upstream``: ``runs`` is a list of ``(DecodeAttack, wall_s)``."""
    from .record import summary_row

    if not runs:
        raise ValueError("runs is empty: a record holds at least one attack run")
    dicts = [{**attack.to_dict(), "wall_s": float(wall)} for attack, wall in runs]
    first = dicts[0]
    rec = {"policy": upstream, "found": first["found"], "repro": first["repro"],
           "size": first["size"], "mods": [], "description": decode.describe(upstream),
           "user_policy": False, "summary": [summary_row(d) for d in dicts], "runs": dicts,
           "params": dict(params)}
    if provenance is not None:
        rec["provenance"] = provenance
    return rec
