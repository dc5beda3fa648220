"""Search for inputs on which a rescale policy gives a non-finite output, and shrink them.

    from fa_lab import adversary
    res = adversary.search("lazy_unfixed", budget_s=30, seed=0)
    res.found, res.shrunk.size, res.repro        # the smallest failing input and one line
    adversary.save_regression(res, "tests/regressions/lazy_unfixed.npz")

    fa-lab attack POLICY [--budget 60] [--space scores|values] [--seed 0] [--json]
                         [--baseline eager] [--random-starts] [--regression FILE.npz]

**What counts as a failure**: the model (``backend="emulator"``, the bf16/f16
DUALWAVE_SWP kernel) returns a row with a non-finite element where an fp64 reference
(``reference.attention(dtype=float64)``) is finite, or, with ``tolerance``, a finite row
whose max error exceeds ``tolerance * max|ref row|``.

**The search space** (``SPACES``) is named and bounded. An input is a ``Candidate``:

* family ``"onehot"``: rows built from per-row score sequences, as PR #1033's one-hot fp8
  test builds them (and ``experiments.drag_case``): row ``r`` has ``Q[r, d_r] = 8`` on its
  own dimension, so ``K[:, d_r]`` *is* its score sequence. A *trigger* row's per-tile peak
  rises by ``rise`` per tile; ``1 + n_victims`` *victim* rows start at ``start`` and fall
  by ``fall`` per tile (plus ``wobble`` alternating and ``noise``); the peak sits at column
  ``peak_col`` of each tile and the rest of the tile ``background`` below it. The rows'
  places in the wave (``trigger_row``, ``victim_row``), the KV length (``n_tiles``,
  ``trim``), Sq (``n_rows``), ``causal``, D and the dtype are searched too.
* family ``"random"``: the seed's recipe at small sizes: q, v ~ N(0, 1),
  k = N(0, 1) * ``k_scale``.
* V is all ones, random signs or N(0, 1), times ``2**v_log2``: ``"scores"`` keeps
  ``v_log2 <= 2`` (the values users have); ``"values"`` lets it reach 2^126, which finds the
  limit of *every* online softmax's unnormalised fp32 accumulator.

**The optimiser** is a (1 + λ) evolution strategy with restarts over the candidate's
fields, seeded with a few structured starting points (a drag case, the seed's recipe).
Its fitness is ``fa_lab.onset``'s tile-level estimate of how close the worst row comes to
2^128 (``128 - margin``: continuous, cheap), so the search climbs towards overflow before
any row overflows; every candidate is then judged by the model itself.

**Shrinking** a failing input: greedy passes that try fewer tiles, fewer rows, no trim,
non-causal, D = 64, bf16, no noise, no wobble, no extra victims, a flat tile, V = ones, and
the smallest magnitudes (bisection) and simplest row placement, keeping each change only
if the model still fails. The result is what ``save_regression`` checks in.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

#: The candidate fields: (kind, choices or (low, high)).
FIELDS = {
    "family": ("choice", ("onehot", "random")),
    "dtype": ("choice", ("bf16", "f16")),
    "D": ("choice", (64, 128)),
    "causal": ("choice", (False, True)),
    "n_rows": ("int", (32, 64)),
    "n_tiles": ("int", (4, 48)),
    "trim": ("int", (0, 63)),
    "trigger_row": ("int", (0, 63)),
    "victim_row": ("int", (0, 63)),
    "n_victims": ("int", (0, 8)),
    "start": ("float", (-200.0, 2000.0)),
    "fall": ("float", (0.0, 200.0)),
    "rise": ("float", (0.0, 200.0)),
    "wobble": ("float", (0.0, 50.0)),
    "noise": ("float", (0.0, 20.0)),
    "peak_col": ("int", (0, 63)),
    "background": ("float", (0.0, 64.0)),
    "k_scale": ("float", (1.0, 128.0)),
    "v_kind": ("choice", ("ones", "signed", "randn")),
    "v_log2": ("float", (0.0, 2.0)),
    "seed": ("int", (0, 2 ** 31 - 1)),
}


@dataclass(frozen=True)
class Space:
    """A named, bounded search space: ``bounds`` overrides ``FIELDS``' ranges."""

    name: str
    bounds: dict
    description: str = ""

    def kind(self, f):
        return FIELDS[f][0]

    def range(self, f):
        return self.bounds.get(f, FIELDS[f][1])

    def to_dict(self) -> dict:
        return {"name": self.name, "description": self.description,
                "fields": {f: list(self.range(f)) for f in FIELDS}}


SPACES = {
    "scores": Space("scores", {}, "score structure only: |V| <= 4, bf16/f16, one wave or two"),
    "values": Space("values", {"v_log2": (0.0, 126.0)},
                    "as 'scores', and V up to 2^126 (still finite in bf16 and in the reference)"),
}


@dataclass(frozen=True)
class Candidate:
    """One input of the search space (see the module docstring); ``build`` makes it."""

    family: str = "onehot"
    dtype: str = "bf16"
    D: int = 64
    causal: bool = False
    n_rows: int = 32
    n_tiles: int = 8
    trim: int = 0
    trigger_row: int = 0
    victim_row: int = 1
    n_victims: int = 0
    start: float = 100.0
    fall: float = 40.0
    rise: float = 10.0
    wobble: float = 0.0
    noise: float = 0.0
    peak_col: int = 0
    background: float = 0.0
    k_scale: float = 32.0
    v_kind: str = "ones"
    v_log2: float = 0.0
    seed: int = 0

    @property
    def seqlen_q(self) -> int:
        return self.n_rows

    @property
    def seqlen_kv(self) -> int:
        return max(1, 64 * self.n_tiles - self.trim)

    @property
    def size(self) -> dict:
        return {"Sq": self.seqlen_q, "Skv": self.seqlen_kv, "D": self.D,
                "tiles": math.ceil(self.seqlen_kv / 64)}

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


ONEHOT_ONLY = ("trigger_row", "victim_row", "n_victims", "start", "fall", "rise", "wobble",
               "noise", "peak_col", "background")
RANDOM_ONLY = ("k_scale",)


def canonical(c: Candidate) -> Candidate:
    """The same input with the fields it does not use at their defaults (so equal inputs
    compare equal and a repro names only what matters)."""
    base = Candidate()
    unused = RANDOM_ONLY if c.family == "onehot" else ONEHOT_ONLY
    vals = {f: getattr(base, f) for f in unused}
    if c.family == "onehot" and c.noise == 0 and c.v_kind == "ones":
        vals["seed"] = base.seed
    return dataclasses.replace(c, **vals)


def _dtype(name):
    return {"bf16": torch.bfloat16, "f16": torch.float16}[name]


def build(c: Candidate):
    """The candidate's (q, k, v), [1, Sq, 1, D] and [1, Skv, 1, D], in its dtype."""
    from .models.swp_bf16 import softmax_scale_log2

    dt = _dtype(c.dtype)
    Sq, Skv, D = c.seqlen_q, c.seqlen_kv, c.D
    g = torch.Generator().manual_seed(int(c.seed))
    if c.family == "random":
        q = torch.randn(1, Sq, 1, D, generator=g)
        k = torch.randn(1, Skv, 1, D, generator=g) * c.k_scale
    else:
        qv = 8.0
        qs = float(torch.tensor(qv * softmax_scale_log2(D)).to(dt))
        q = torch.zeros(1, Sq, 1, D)
        k = torch.zeros(1, Skv, 1, D)
        t = torch.arange(Skv) // 64
        col = torch.arange(Skv) % 64
        off = torch.where(col == c.peak_col, 0.0, -c.background)
        rows = _rows(c)
        # dim 0: the trigger; dims 1..: the victims
        q[0, rows[0], 0, 0] = qv
        k[0, :, 0, 0] = (c.rise * t + off) / qs
        for i, r in enumerate(rows[1:]):
            seq = c.start - c.fall * t + c.wobble * (1 - 2 * (t % 2))
            if c.noise:
                seq = seq + c.noise * torch.randn(int(t.max()) + 1, generator=g)[t]
            q[0, r, 0, 1 + i] = qv
            k[0, :, 0, 1 + i] = (seq + off) / qs
    if c.v_kind == "ones":
        v = torch.ones(1, Skv, 1, D)
    elif c.v_kind == "signed":
        v = torch.randint(0, 2, (1, Skv, 1, D), generator=g).float() * 2 - 1
    else:
        v = torch.randn(1, Skv, 1, D, generator=g)
    v = v * 2.0 ** c.v_log2
    return q.to(dt), k.to(dt), v.to(dt)


def _rows(c: Candidate) -> list[int]:
    """The trigger's row, then the victims' (distinct, within Sq and D - 1 dims)."""
    trig = c.trigger_row % c.n_rows
    out = [trig]
    r = c.victim_row % c.n_rows
    for _ in range(min(1 + c.n_victims, c.D - 1)):
        while r in out:
            r = (r + 1) % c.n_rows
        out.append(r)
        r = (r + 5) % c.n_rows
    return out


#: The kernel under attack: DUALWAVE_SWP, also for eager (which upstream routes short
#: calls away from, to the generic kernel).
KERNEL = "swp_bf16"


# ---- judging one input ----------------------------------------------------------------------

@dataclass
class Verdict:
    """The model's verdict on one candidate: ``failed``, the failing rows, the predictor's
    fitness (128 - its smallest margin), and the reference's state."""

    failed: bool
    bad_rows: list
    fitness: float
    ref_finite: bool
    max_err: float
    seconds: float


def judge(c: Candidate, policy, *, threshold=None, tolerance=None, baseline=None) -> Verdict:
    """Run the model and the fp64 reference on ``c`` under ``policy``. With ``baseline``
    (a policy), a row counts only where the baseline's output is finite: the failure is
    the policy's own, not one every kernel shares."""
    from . import api, onset, reference

    t0 = time.perf_counter()
    q, k, v = build(c)
    kw = {"causal": c.causal, "rescale": policy, "rescale_threshold": threshold,
          "kernel": KERNEL}
    out = api.flash_attn_func(q, k, v, backend="emulator", **kw)
    ref, _ = reference.attention(q, k, v, causal=c.causal, dtype=torch.float64)
    ref_ok = torch.isfinite(ref).all(-1)[0, :, 0]
    out_ok = torch.isfinite(out.float()).all(-1)[0, :, 0]
    bad = (~out_ok & ref_ok)
    if baseline is not None:
        base = api.flash_attn_func(q, k, v, backend="emulator", causal=c.causal,
                                   rescale=baseline, kernel=KERNEL)
        bad = bad & torch.isfinite(base.float()).all(-1)[0, :, 0]
    err = (out.double() - ref).abs().amax(-1)[0, :, 0]
    scale = ref.abs().amax(-1)[0, :, 0].clamp_min(1e-300)
    rel = torch.where(out_ok & ref_ok, err / scale, torch.zeros_like(err))
    if tolerance is not None:
        bad = bad | (rel > tolerance)
    fit = _fitness(q, k, v, kw)
    if baseline is not None:  # climb where the policy nears 2^128 and the baseline does not
        fb = _fitness(q, k, v, {**kw, "rescale": baseline, "rescale_threshold": None})
        fit -= 2.0 * max(0.0, fb - (onset.OVERFLOW_LOG2 - 8.0))
    if bool(bad.any()):
        fit = max(fit, onset.OVERFLOW_LOG2) + 1.0
    return Verdict(failed=bool(bad.any()), bad_rows=bad.nonzero().flatten().tolist(), fitness=fit,
                   ref_finite=bool(ref_ok.all()), max_err=float(rel.max()),
                   seconds=time.perf_counter() - t0)


def _fitness(q, k, v, kw) -> float:
    """The predictor's estimate of how close the worst row comes to 2^128 (log2 units)."""
    from . import onset

    try:
        pred = onset.predict(q, k, v, level="tile", **kw)
    except (NotImplementedError, ValueError):
        return -1e3
    return float((onset.OVERFLOW_LOG2 - pred.margin[0, :, 0]).clamp(min=-1e3, max=1e3).max())


# ---- the search -----------------------------------------------------------------------------

def _clip(space: Space, f, x):
    kind = space.kind(f)
    if kind == "choice":
        return x if x in space.range(f) else space.range(f)[0]
    lo, hi = space.range(f)
    x = min(max(x, lo), hi)
    return round(x) if kind == "int" else float(x)


def random_candidate(space: Space, rng: np.random.Generator) -> Candidate:
    vals = {}
    for f in FIELDS:
        kind, r = space.kind(f), space.range(f)
        if kind == "choice":
            vals[f] = r[rng.integers(len(r))]
        elif kind == "int":
            vals[f] = int(rng.integers(r[0], r[1] + 1))
        else:
            vals[f] = float(rng.uniform(r[0], r[1]))
    # most random draws have no one-hot structure worth the name: start near a drag case
    vals["n_rows"] = 32 if rng.random() < 0.7 else vals["n_rows"]
    vals["trim"] = 0 if rng.random() < 0.5 else vals["trim"]
    vals["causal"] = bool(vals["causal"]) if rng.random() < 0.3 else False
    return Candidate(**vals)


def mutate(c: Candidate, space: Space, rng: np.random.Generator, sigma: float) -> Candidate:
    """Perturb a few fields: numbers by a Gaussian step of ``sigma`` times their range,
    choices by a new draw."""
    vals = c.to_dict()
    names = list(FIELDS)
    n = max(1, int(rng.poisson(2.0)))
    for f in rng.choice(names, size=min(n, len(names)), replace=False):
        kind, r = space.kind(f), space.range(f)
        if kind == "choice":
            vals[f] = r[rng.integers(len(r))]
        elif kind == "float" and r[0] >= 0 and rng.random() < 0.5:
            # magnitudes span decades: half the steps are multiplicative
            vals[f] = _clip(space, f, max(vals[f], 1e-3) * math.exp(3 * sigma * rng.normal()))
        else:
            step = rng.normal() * sigma * (r[1] - r[0])
            vals[f] = _clip(space, f, vals[f] + step)
    return Candidate(**vals)


#: Structured starting points: a drag case (``experiments.drag_case``), staircases (a
#: trigger that votes at every tile, a victim that falls a little at each) with falls a
#: factor 2 apart over the longest walk, and the seed's recipe.
STARTS = (
    Candidate(),
    *(Candidate(fall=f, rise=9.0, n_tiles=48, start=0.0) for f in (3.0, 6.0, 12.0, 24.0)),
    Candidate(family="random", n_tiles=16, k_scale=64.0, D=128),
)


@dataclass
class Attack:
    """``search``'s answer. ``found``: a failing input was found; ``first`` is it as found,
    ``shrunk`` after shrinking (``Candidate``s). ``best``: the highest-fitness input when
    nothing was found (the near miss). Times are seconds; ``evals`` counts model runs."""

    policy: str
    space: dict
    budget_s: float
    seed: int
    threshold: float | None
    found: bool = False
    evals: int = 0
    search_s: float = 0.0
    time_to_first_s: float | None = None
    evals_to_first: int | None = None
    first: Candidate | None = None
    shrunk: Candidate | None = None
    shrink_evals: int = 0
    shrink_s: float = 0.0
    best: Candidate | None = None
    best_fitness: float = -math.inf
    bad_rows: list = field(default_factory=list)
    trace: list = field(default_factory=list)
    history: list = field(default_factory=list)
    structured: bool = True
    baseline: str | None = None

    @property
    def repro(self) -> str:
        c = self.shrunk or self.best
        if c is None:
            return ""
        thr = "" if self.threshold is None else f", threshold={self.threshold!r}"
        base = "" if self.baseline is None else f", baseline={self.baseline!r}"
        return (f"fa_lab.adversary.judge(fa_lab.adversary.Candidate(**{_short(c)}), "
                f"{self.policy!r}{thr}{base}).failed")

    def to_dict(self) -> dict:
        d = {"policy": self.policy, "found": self.found, "space": self.space,
             "budget_s": self.budget_s, "seed": self.seed, "threshold": self.threshold,
             "evals": self.evals, "search_s": self.search_s,
             "time_to_first_s": self.time_to_first_s, "evals_to_first": self.evals_to_first,
             "shrink_evals": self.shrink_evals, "structured": self.structured,
             "baseline": self.baseline, "shrink_s": self.shrink_s,
             "best_fitness": self.best_fitness, "bad_rows": self.bad_rows, "repro": self.repro,
             "trace": self.trace, "history": self.history}
        for key in ("first", "shrunk", "best"):
            c = getattr(self, key)
            d[key] = None if c is None else {**c.to_dict(), "size": c.size}
        d["size"] = (self.shrunk or self.best).size if (self.shrunk or self.best) else None
        return d


def _short(c: Candidate) -> dict:
    """The candidate's fields that differ from the defaults (a short repro)."""
    base = Candidate()
    return {k: v for k, v in c.to_dict().items() if getattr(base, k) != v}


def search(policy, *, space="scores", budget_s: float = 60.0, seed: int = 0, threshold=None,
           tolerance=None, shrink: bool = True, max_evals: int | None = None,
           lam: int = 6, structured: bool = True, baseline=None, progress=None) -> Attack:
    """Look for an input of ``space`` on which ``policy`` (a name or ``fa_lab.Policy``)
    fails (see the module docstring), for at most ``budget_s`` seconds of search (the
    shrinking that follows a find has its own budget of as much again). Stops at the first
    failure. ``lam``: children per generation; ``structured``: begin with the structured
    starting points (``STARTS``: a drag case, a staircase, the seed's recipe) before random
    ones (False: random starts only, which measures the optimiser alone); ``baseline``: a
    policy that must stay finite on the same input (``judge``); ``progress``: a
    callable(str) for reports."""
    from . import policies

    sp = SPACES[space] if isinstance(space, str) else space
    pol = policies.as_policy(policy) if isinstance(policy, str) else policy
    name = pol.name if isinstance(pol, policies.Policy) else str(policy)
    res = Attack(policy=name, space=sp.to_dict(), budget_s=float(budget_s), seed=int(seed),
                 threshold=None if threshold is None else float(threshold), structured=structured,
                 baseline=None if baseline is None else getattr(baseline, "name", str(baseline)))
    rng = np.random.default_rng(seed)
    t0 = time.perf_counter()

    def out_of_budget():
        return (time.perf_counter() - t0 >= budget_s
                or (max_evals is not None and res.evals >= max_evals))

    def evaluate(c):
        c = canonical(Candidate(**{f: _clip(sp, f, x) for f, x in c.to_dict().items()}))
        v = judge(c, pol, threshold=threshold, tolerance=tolerance, baseline=baseline)
        res.evals += 1
        if v.fitness > res.best_fitness:
            res.best_fitness, res.best = v.fitness, c
            res.history.append({"evals": res.evals, "t": time.perf_counter() - t0,
                                "fitness": v.fitness})
        return c, v

    found = None
    starts = [*(STARTS if structured else ()), *(random_candidate(sp, rng) for _ in range(4))]
    for c in starts:
        if out_of_budget():
            break
        c, v = evaluate(c)
        if v.failed:
            found = (c, v)
            break
    parent, pfit, sigma, stall = res.best, res.best_fitness, 0.15, 0
    while found is None and not out_of_budget():
        best_child = None
        for _ in range(lam):
            c, v = evaluate(mutate(parent, sp, rng, sigma))
            if v.failed:
                found = (c, v)
                break
            if best_child is None or v.fitness > best_child[1].fitness:
                best_child = (c, v)
            if out_of_budget():
                break
        if found or best_child is None:
            break
        if best_child[1].fitness >= pfit:
            parent, pfit = best_child[0], best_child[1].fitness
            sigma, stall = min(0.5, sigma * 1.5), 0
        else:
            sigma, stall = max(0.01, sigma * 0.8), stall + 1
        if stall > 12:  # restart: from a fresh random point, or from the best so far
            parent = random_candidate(sp, rng) if rng.random() < 0.5 else res.best
            pfit, sigma, stall = -math.inf, 0.2, 0
        if progress is not None:
            progress(f"{name}: {res.evals} evals, best fitness {res.best_fitness:.1f}, sigma {sigma:.3f}")
    res.search_s = time.perf_counter() - t0
    if found is None:
        return res
    c, v = found
    res.found, res.first = True, c
    res.time_to_first_s, res.evals_to_first = res.search_s, res.evals
    if shrink:
        t1 = time.perf_counter()
        res.shrunk, res.shrink_evals = shrink_candidate(c, pol, threshold=threshold,
                                                        tolerance=tolerance, baseline=baseline,
                                                        budget_s=max(10.0, budget_s))
        res.shrink_s = time.perf_counter() - t1
    else:
        res.shrunk = c
    final = judge(res.shrunk, pol, threshold=threshold, tolerance=tolerance, baseline=baseline)
    res.bad_rows = final.bad_rows
    res.trace = trace_rows(res.shrunk, pol, final.bad_rows[:1], threshold=threshold)
    return res


# ---- shrinking ------------------------------------------------------------------------------

def _loop_steps(n_tiles: int, trim: int = 0) -> int:
    """The bf16 kernel's lazy decisions for a block of this KV length (N - 4)."""
    t = math.ceil(max(1, 64 * n_tiles - trim) / 64)
    return max(4, t + t % 2) - 4


def _simpler(c: Candidate):
    """Candidate simplifications, most valuable first (each a new Candidate): fewer KV
    tiles (also with the per-tile fall scaled up so the total drop is kept), fewer rows,
    then simpler structure, then rounder numbers."""
    rep = dataclasses.replace
    fewer = sorted({5, 6, max(4, c.n_tiles // 2), c.n_tiles - 1} - {c.n_tiles})
    for n in fewer:
        if n < 4 or n >= c.n_tiles:
            continue
        yield rep(c, n_tiles=n)
        old, new = _loop_steps(c.n_tiles, c.trim), _loop_steps(n, c.trim)
        if c.family == "onehot" and new > 0 and old > new:
            yield rep(c, n_tiles=n, fall=min(FIELDS["fall"][1][1], math.ceil(c.fall * old / new)))
    if c.trim != 63:
        yield rep(c, trim=63)
    if c.n_rows != 32:
        yield rep(c, n_rows=32, trigger_row=c.trigger_row % 32, victim_row=c.victim_row % 32)
    if c.n_rows != 32:
        yield rep(c, n_rows=32, trigger_row=c.trigger_row % 32, victim_row=c.victim_row % 32)
    for f, simple in (("causal", False), ("D", 64), ("dtype", "bf16"), ("noise", 0.0),
                      ("wobble", 0.0), ("n_victims", 0), ("background", 0.0), ("peak_col", 0),
                      ("v_kind", "ones"), ("trigger_row", 0), ("victim_row", 1), ("seed", 0)):
        if getattr(c, f) != simple:
            yield rep(c, **{f: simple})
    if c.family == "random" and c.k_scale != round(c.k_scale):
        yield rep(c, k_scale=float(round(c.k_scale)))
    for f in ("start", "fall", "rise", "v_log2", "k_scale"):
        x = getattr(c, f)
        if x != round(x):
            yield rep(c, **{f: float(round(x))})


def _bisect_down(c: Candidate, f: str, fails, lo: float = 0.0, steps: int = 8):
    """The smallest value of numeric field ``f`` in [lo, current] that still fails,
    by bisection on integers (assumes failing is monotone in ``f``; checks the answer)."""
    hi = getattr(c, f)
    if hi <= lo:
        return c
    if fails(dataclasses.replace(c, **{f: float(lo)})):
        return dataclasses.replace(c, **{f: float(lo)})
    a, b = lo, hi
    for _ in range(steps):
        if b - a <= 1:
            break
        mid = float(math.floor((a + b) / 2))
        if fails(dataclasses.replace(c, **{f: mid})):
            b = mid
        else:
            a = mid
    return dataclasses.replace(c, **{f: float(math.ceil(b))}) if fails(
        dataclasses.replace(c, **{f: float(math.ceil(b))})) else c


def shrink_candidate(c: Candidate, policy, *, threshold=None, tolerance=None, baseline=None,
                     budget_s: float = 30.0) -> tuple[Candidate, int]:
    """Greedy shrinking: keep any simplification (``_simpler``) under which ``policy``
    still fails, then bisect the magnitudes (fall, start, v_log2, k_scale) down, until a pass
    changes nothing or the budget is spent. Returns (candidate, model runs)."""
    t0 = time.perf_counter()
    n = 0
    cache = {}

    def fails(x: Candidate) -> bool:
        nonlocal n
        x = canonical(x)
        key = tuple(x.to_dict().values())
        if key not in cache:
            n += 1
            cache[key] = judge(x, policy, threshold=threshold, tolerance=tolerance,
                               baseline=baseline).failed
        return cache[key]

    c = canonical(c)
    for _ in range(100):
        changed = False
        for s in _simpler(c):
            if time.perf_counter() - t0 > budget_s:
                return c, n
            s = canonical(s)
            if s != c and fails(s):
                c, changed = s, True
                break
        if changed:
            continue
        before = c
        for f in ("fall", "v_log2", "k_scale", "start", "rise"):
            if time.perf_counter() - t0 > budget_s:
                return c, n
            lo = FIELDS[f][1][0] if f != "start" else 0.0
            if f == "k_scale" and c.family != "random":
                continue
            if f in ("start", "rise", "fall") and c.family == "random":
                continue
            c = canonical(_bisect_down(c, f, fails, lo=max(lo, 0.0)))
        if c == before:
            break
    return c, n


def trace_rows(c: Candidate, policy, rows, *, threshold=None) -> list[dict]:
    """The step-by-step trace (``fa_lab.trace``) of the given rows of candidate ``c``, as
    plain records (step, phase, m, mt, vote, fire, dragged, corr, l, o_finite)."""
    from . import api

    if not rows:
        return []
    q, k, v = build(c)
    tr = api.trace(q, k, v, rows=list(rows), causal=c.causal, rescale=policy,
                   rescale_threshold=threshold, backend="emulator", kernel=KERNEL)
    cols = ["lane", "row", "step", "phase", "m", "mt", "vote", "fire", "dragged", "corr", "l",
            "o_finite", "l_finite"]
    return tr.steps[[x for x in cols if x in tr.steps.columns]].to_dict("records")


# ---- regression files -----------------------------------------------------------------------

def _bits(x: torch.Tensor) -> np.ndarray:
    """A 16-bit tensor's exact bit patterns (numpy has no bfloat16)."""
    return x.contiguous().view(torch.int16).numpy().view(np.uint16)


def _from_bits(a: np.ndarray, dtype) -> torch.Tensor:
    return torch.from_numpy(a.view(np.int16).copy()).view(dtype)


def tensor_digest(*ts: torch.Tensor) -> str:
    """sha256 of the tensors' bytes (shape and dtype included)."""
    import hashlib

    h = hashlib.sha256()
    for t in ts:
        h.update(f"{tuple(t.shape)}{t.dtype}".encode())
        h.update(_bits(t).tobytes())
    return h.hexdigest()


def save_regression(res: Attack, path, *, expect: str | None = None) -> Path:
    """Write the shrunk input (or, with nothing found, the best one) as a compressed .npz
    with a JSON ``meta`` (policy, threshold, dtype, causal, the candidate, the failing rows,
    ``expect``: "nonfinite" or "finite", and the sha256 of q, k, v). A one-hot input is
    stored as its tensors' bit patterns (mostly zeros: a few KB). A ``random``-family
    input (dense N(0, 1) draws, tens of KB) is stored as its candidate only and rebuilt
    from its seed by ``load_regression``, which checks the digest."""
    c = res.shrunk if res.found else res.best
    if c is None:
        raise ValueError("the attack has no input to save")
    if expect is None:
        expect = "nonfinite" if res.found else "finite"
    q, k, v = build(c)
    meta = {"policy": res.policy, "threshold": res.threshold, "baseline": res.baseline,
            "dtype": c.dtype, "causal": c.causal, "expect": expect, "candidate": c.to_dict(),
            "size": c.size, "bad_rows": res.bad_rows, "space": res.space["name"],
            "budget_s": res.budget_s, "seed": res.seed, "found": res.found,
            "stored": "tensors" if c.family == "onehot" else "candidate",
            "sha256": tensor_digest(q, k, v)}
    arrays = ({"q": _bits(q), "k": _bits(k), "v": _bits(v)} if c.family == "onehot" else {})
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(path, meta=np.array(json.dumps(meta)), **arrays)
    return path


def load_regression(path):
    """(q, k, v, meta) of a regression file, q/k/v in the dtype it names (rebuilt from the
    candidate where only that is stored; either way checked against the digest)."""
    with np.load(path) as z:
        meta = json.loads(str(z["meta"]))
        dt = _dtype(meta["dtype"])
        if meta.get("stored", "tensors") == "tensors":
            q, k, v = (_from_bits(z[n], dt) for n in ("q", "k", "v"))
        else:
            q, k, v = build(Candidate(**meta["candidate"]))
    if tensor_digest(q, k, v) != meta["sha256"]:
        raise ValueError(f"{path}: the input does not match its digest (a different torch "
                         "random stream rebuilt a 'random'-family candidate?)")
    return q, k, v, meta


def run_regression(path, policy=None) -> dict:
    """Run a regression file's input under its policy (or ``policy``): whether the model's
    output has a non-finite row, which rows, and whether the fp64 reference is finite."""
    from . import api, reference

    q, k, v, meta = load_regression(path)
    pol = meta["policy"] if policy is None else policy
    out = api.flash_attn_func(q, k, v, causal=meta["causal"], rescale=pol,
                              rescale_threshold=meta["threshold"] if policy is None else None,
                              backend="emulator", kernel=KERNEL)
    ref, _ = reference.attention(q, k, v, causal=meta["causal"], dtype=torch.float64)
    bad = ~torch.isfinite(out.float()).all(-1)[0, :, 0]
    return {"policy": getattr(pol, "name", pol), "nonfinite": bool(bad.any()),
            "bad_rows": bad.nonzero().flatten().tolist(),
            "ref_finite": bool(torch.isfinite(ref).all()), "meta": meta}


def summary(res: Attack) -> str:
    """A few lines: what was found, how fast, how small."""
    if res.found:
        s = res.shrunk
        return (f"{res.policy}: FAILS. First failure after {res.time_to_first_s:.1f} s "
                f"({res.evals_to_first} model runs) in space {res.space['name']!r}; shrunk in "
                f"{res.shrink_evals} runs to Sq={s.seqlen_q} Skv={s.seqlen_kv} D={s.D} "
                f"({s.family}, {s.dtype}, causal={s.causal}); non-finite rows {res.bad_rows}\n"
                f"  repro: {res.repro}")
    return (f"{res.policy}: no failure found in {res.search_s:.1f} s ({res.evals} model runs, "
            f"budget {res.budget_s:g} s, space {res.space['name']!r}); best fitness "
            f"{res.best_fitness:.1f} (128 means a predicted overflow)")
