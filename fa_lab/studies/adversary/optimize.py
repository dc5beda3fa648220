"""The search: random starts, mutation and the two optimisers (an evolution strategy and
CMA-ES) within a time budget; ``Attack`` holds what they found."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import shlex
import time
import warnings
from dataclasses import dataclass, field

import numpy as np
from .space import (Candidate, FIELDS, KERNEL, MODS, SPACES, Space, ZOO_FIELDS, _MOD_OF, canonical,
                    check_mods, check_space, kernel_for, parse_mods)
from .judge import SILENT_TOL, Verdict, check_classes, judge
from .shrink import shrink_candidate, trace_rows


def _clip(space: Space, f, x):
    kind = space.kind(f)
    if kind == "choice":
        return x if x in space.range(f) else space.range(f)[0]
    lo, hi = space.range(f)
    x = min(max(x, lo), hi)
    return round(x) if kind == "int" else float(x)


def _fields(space: Space) -> list:
    """The fields ``space`` searches: every field but those of modifiers it does not draw,
    and the zoo's unless it draws them (so a space without either draws exactly the random
    numbers it drew before they existed)."""
    return [f for f in FIELDS if _MOD_OF.get(f) in (None, *space.mods)
            and (space.zoo or f not in ZOO_FIELDS)]


def random_candidate(space: Space, rng: np.random.Generator) -> Candidate:
    """A uniform draw from ``space`` (near a drag case: 32 rows, no trim, non-causal, most
    of the time; each modifier it draws is left off a third of the time)."""
    vals = {}
    for f in _fields(space):
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
    for m in space.mods:
        if rng.random() < 1 / 3:
            vals.update({f: getattr(Candidate(), f) for f in MODS[m]})
    return Candidate(**vals)


#: Draws of the zoo space's unshifted family, tried after the shared random starts
#: (``unshifted_candidate``), and the share of the optimiser's fresh restarts that begin
#: from one (``_cma_loop``, ``_es_loop``).
UNSHIFTED_STARTS = 3
UNSHIFTED_RESTARTS = 0.5


def unshifted_candidate(space: Space, rng: np.random.Generator) -> Candidate:
    """A draw of ``random_candidate`` with the zoo's ``shift`` at 0: the scores left where
    the draw put them. ``shift``'s range spans five decades below zero, so a uniform draw
    almost never leaves them there, and a kernel that assumes where the scores lie (a fixed
    max: P = exp2 of the raw score) fails only on scores far above zero. ``search`` draws
    this family from a stream of its own (``_family_rng``), so every other draw of a seed
    is what it was without it."""
    c = random_candidate(space, rng)
    return dataclasses.replace(c, shift=Candidate().shift) if space.zoo else c


def _family_rng(seed: int) -> np.random.Generator:
    """The unshifted family's own stream for ``seed`` (independent of the shared one)."""
    return np.random.default_rng([int(seed), 1])


def _fresh_centre(sp: Space, rng: np.random.Generator, family_rng) -> Candidate:
    """A restart's fresh random point: a shared draw (from ``rng``, as ever), and, in the
    zoo space, ``UNSHIFTED_RESTARTS`` of the time the same draw unshifted (the decision
    from ``family_rng``, so ``rng``'s stream is the same either way)."""
    c = random_candidate(sp, rng)
    if sp.zoo and family_rng is not None and family_rng.random() < UNSHIFTED_RESTARTS:
        c = dataclasses.replace(c, shift=Candidate().shift)
    return c


def mutate(c: Candidate, space: Space, rng: np.random.Generator, sigma: float) -> Candidate:
    """Perturb a few fields: numbers by a Gaussian step of ``sigma`` times their range,
    choices by a new draw."""
    vals = c.to_dict()
    names = _fields(space)
    n = max(1, int(rng.poisson(2.0)))
    for f in rng.choice(names, size=min(n, len(names)), replace=False):
        kind, r = space.kind(f), space.range(f)
        if kind == "choice":
            vals[f] = r[rng.integers(len(r))]
        elif kind == "float" and (r[0] >= 0 or r[1] <= 0) and rng.random() < 0.5:
            # magnitudes span decades: half the steps are multiplicative (on |x| for a
            # range below zero, so a shift of -1e5 reaches -10 in a few steps)
            sign = 1.0 if r[0] >= 0 else -1.0
            mag = max(sign * vals[f], 1e-3) * math.exp(3 * sigma * rng.normal())
            vals[f] = _clip(space, f, sign * mag)
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


#: Structured starting points with score modifiers, tried first when the space draws the
#: modifiers they need: a causal document mask of one-tile documents on small random
#: scores (rows of one wave see different tiles, so the ballot fires on tiles some rows
#: cannot see), left padding of one tile on the seed's recipe, the seed's recipe under a
#: steep ALiBi slope, and the drag case with a sink.
MOD_STARTS = (
    (("bias",), Candidate(family="random", causal=True, n_tiles=8, k_scale=1.0,
                          mask="block_diag", mask_len=64)),
    (("bias",), Candidate(family="random", n_tiles=8, k_scale=8.0, mask="pad_left",
                          mask_len=64)),
    (("alibi_slopes",), Candidate(family="random", n_tiles=8, k_scale=16.0, alibi_slope=0.25)),
    (("sink",), Candidate(sink=True, sink_logit=4.0)),
)


#: Structured starting points of the zoo's space (``SPACES["zoo"]``), tried before random
#: ones: the shapes the public reports name. Scores of a few log2 units' spread over five
#: tiles (stale maxima within a threshold), a causal call with more queries than keys (rows
#: that see nothing), nine tiles of left padding (first tiles with nothing visible),
#: logits 1e5 below zero (past a finite sentinel), a KV cache with a NaN tail, and a row
#: that sees nothing beside an outlier key 20 log2 units up; last, twenty tiles of scores
#: 8 log2 units apart with signed V (partials of unequal mass whose outputs differ: what a
#: merge's weights move).
ZOO_STARTS = (
    Candidate(family="scores", spread=4.0, n_tiles=5),
    Candidate(family="scores", spread=2.0, causal=True, n_rows=48, n_tiles=1, trim=40),
    Candidate(family="scores", spread=2.0, n_tiles=10, mask="pad_left", mask_len=576),
    Candidate(family="scores", spread=2.0, n_tiles=2, shift=-1e5),
    Candidate(family="scores", spread=2.0, n_tiles=2, trim=30, seqused=0.6, cache="nan"),
    Candidate(family="scores", spread=2.0, n_tiles=3, mask="pad_rows", mask_len=1, jump=20.0,
              jump_col=100),
    Candidate(family="scores", spread=8.0, n_tiles=20, v_kind="signed"),
)


@dataclass
class Attack:
    """``search``'s answer. ``found``: a failing input was found; ``first`` is it as found,
    ``shrunk`` after shrinking (``Candidate``s). ``best``: the highest-fitness input when
    nothing was found (the near miss). Times are seconds; ``evals`` counts model runs;
    ``optimizer`` names the optimiser that searched (``OPTIMIZERS``). ``imports``: the
    files (or modules) that register a user's policy, which ``repro`` runs first."""

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
    optimizer: str = "cma"
    imports: tuple = ()
    classes: tuple = ("nonfinite",)
    found_classes: list = field(default_factory=list)
    outside: int = 0

    @property
    def repro(self) -> str:
        """One line of Python that rebuilds the shrunk input (or the near miss), judges it
        and prints whether it fails (``True``), with the user's policy files run first:
        ``python -c "<repro>"`` runs it as printed (``repro_command``)."""
        c = self.shrunk or self.best
        if c is None:
            return ""
        thr = "" if self.threshold is None else f", threshold={self.threshold!r}"
        base = "" if self.baseline is None else f", baseline={self.baseline!r}"
        cls = "" if self.classes == ("nonfinite",) else f", classes={self.classes!r}"
        first = "".join(_import_line(x) for x in self.imports)
        return (f"{first}from fa_lab.studies import adversary; "
                f"print(adversary.judge(adversary.Candidate(**{_short(c)}), "
                f"{self.policy!r}{thr}{base}{cls}).failed)")

    @property
    def repro_command(self) -> str:
        """``repro`` as a shell command: ``python -c "..."``."""
        line = self.repro
        if not line:
            return ""
        quoted = f'"{line}"' if not set(line) & set('"$`\\!') else shlex.quote(line)
        return f"python -c {quoted}"

    @property
    def mods(self) -> list:
        """The score modifiers the search drew (``MODS`` names)."""
        return list(self.space.get("mods", []))

    def to_dict(self) -> dict:
        d = {"policy": self.policy, "found": self.found, "space": self.space, "mods": self.mods,
             "budget_s": self.budget_s, "seed": self.seed, "threshold": self.threshold,
             "evals": self.evals, "search_s": self.search_s,
             "time_to_first_s": self.time_to_first_s, "evals_to_first": self.evals_to_first,
             "shrink_evals": self.shrink_evals, "structured": self.structured,
             "baseline": self.baseline, "optimizer": self.optimizer, "shrink_s": self.shrink_s,
             "best_fitness": self.best_fitness, "bad_rows": self.bad_rows, "repro": self.repro,
             "trace": self.trace, "history": self.history, "classes": list(self.classes),
             "found_classes": self.found_classes, "outside_region": self.outside}
        for key in ("first", "shrunk", "best"):
            c = getattr(self, key)
            d[key] = None if c is None else {**c.to_dict(), "size": c.size}
        d["size"] = (self.shrunk or self.best).size if (self.shrunk or self.best) else None
        c = self.shrunk or self.best
        d["input_mods"] = None if c is None else c.mod_summary()
        return d


def _import_line(x) -> str:
    """Python that registers what ``--import x`` registered: a file run, or a module imported."""
    if str(x).endswith(".py") or os.path.isfile(x):
        return f"import runpy; runpy.run_path({os.path.abspath(x)!r}); "
    return f"import {x}; "


def _short(c: Candidate) -> dict:
    """The candidate's fields that differ from the defaults (a short repro)."""
    base = Candidate()
    return {k: v for k, v in c.to_dict().items() if getattr(base, k) != v}


#: ``search``'s optimisers: mixed-integer CMA-ES with restarts (the ``cma`` package) or
#: the (1 + lambda) evolution strategy with restarts, both over every field.
OPTIMIZERS = ("cma", "es")


def _es_loop(res, sp, rng, evaluate, out_of_budget, *, lam, report, family_rng=None):
    """The (1 + lambda) evolution strategy with restarts, from ``res.best``: ``mutate``
    perturbs a few fields at a time (choices included), the step grows on success and
    shrinks on failure, and 12 generations without progress restart it from a fresh
    random point (``_fresh_centre``) or from the best so far. Returns (candidate, verdict)
    of the first failure, or None when the budget is spent."""
    parent, pfit, sigma, stall = res.best, res.best_fitness, 0.15, 0
    while not out_of_budget():
        best_child = None
        for _ in range(lam):
            c, v = evaluate(mutate(parent, sp, rng, sigma))
            if v.failed:
                return c, v
            if best_child is None or v.fitness > best_child[1].fitness:
                best_child = (c, v)
            if out_of_budget():
                break
        if best_child is None:
            break
        if best_child[1].fitness >= pfit:
            parent, pfit = best_child[0], best_child[1].fitness
            sigma, stall = min(0.5, sigma * 1.5), 0
        else:
            sigma, stall = max(0.01, sigma * 0.8), stall + 1
        if stall > 12:  # restart: from a fresh random point, or from the best so far
            parent = _fresh_centre(sp, rng, family_rng) if rng.random() < 0.5 else res.best
            pfit, sigma, stall = -math.inf, 0.2, 0
        report(f"sigma {sigma:.3f}")
    return None


def _cma_fields(space: Space) -> list:
    """The fields CMA-ES moves: every field ``space`` searches with more than one value,
    but the seed (a draw per candidate, not a coordinate)."""
    return [f for f in _fields(space) if f != "seed" and (
        len(space.range(f)) > 1 if space.kind(f) == "choice"
        else space.range(f)[1] > space.range(f)[0])]


def _import_cma():
    with _quiet():  # cma warns on import when matplotlib is absent
        import cma
    return cma


def _cma_run(center, sp, rng, evaluate, out_of_budget, *, sigma0, popsize, report,
             stall_gens=8, min_gain=0.5):
    """One run of mixed-integer CMA-ES (``cma.CMAEvolutionStrategy``, ask and tell) over
    ``_cma_fields``, from ``center``. Each field is one coordinate in its own units,
    bounded by the space's range (``bounds``), with ``CMA_stds`` the range's width, so
    ``sigma0`` is a fraction of every range: a number as it is, an int rounded, a choice
    as the index of its value (ints and choices are ``integer_variables``, so their steps
    never shrink below one). The seed is drawn anew for each candidate: a run climbs
    towards the settings where failing inputs are likely, not one lucky draw. The normal
    draws come from ``rng`` (``randn``); ``cma``'s integer handling draws from numpy's
    global random state, so the run seeds it from ``rng`` and puts the caller's state back
    when it ends (the search stays deterministic, and the caller's draws unchanged). The
    run ends on CMA-ES's own termination, ``stall_gens`` generations without a fitness
    ``min_gain`` above the run's best, the budget, or a failure (returned as
    (candidate, verdict))."""
    cma = _import_cma()
    dims = _cma_fields(sp)
    kinds = [sp.kind(f) for f in dims]
    ranges = [sp.range(f) for f in dims]
    lo = np.array([0.0 if k == "choice" else float(r[0]) for k, r in zip(kinds, ranges)])
    hi = np.array([float(len(r) - 1) if k == "choice" else float(r[1])
                   for k, r in zip(kinds, ranges)])

    def coord(f, k, r):
        x = getattr(center, f)
        if k == "choice":
            return float(r.index(x)) if x in r else 0.0
        return float(x)

    def candidate(x):
        vals = {}
        for f, k, r, xi, a, b in zip(dims, kinds, ranges, x, lo.tolist(), hi.tolist()):
            xi = min(max(float(xi), a), b)          # a Python float: round() gives an int
            vals[f] = r[round(xi)] if k == "choice" else round(xi) if k == "int" else xi
        vals["seed"] = int(rng.integers(0, 2 ** 31 - 1))
        return dataclasses.replace(center, **vals)

    if not dims:
        c, v = evaluate(candidate([]))
        return (c, v) if v.failed else None
    x0 = np.clip([coord(f, k, r) for f, k, r in zip(dims, kinds, ranges)], lo, hi)
    opts = {"bounds": [lo.tolist(), hi.tolist()], "CMA_stds": (hi - lo).tolist(),
            "integer_variables": [i for i, k in enumerate(kinds) if k != "float"],
            "popsize": popsize, "randn": lambda *shape: rng.standard_normal(shape),
            "seed": np.nan, "verbose": -9, "verb_log": 0, "verb_disp": 0}
    outer = np.random.get_state()
    np.random.seed(int(rng.integers(0, 2 ** 32)))
    try:
        with _quiet():
            es = cma.CMAEvolutionStrategy(x0.tolist(), sigma0, opts)
        best, stall = -math.inf, 0
        while stall < stall_gens:
            with _quiet():
                if es.stop():
                    break
                xs = es.ask()
            fits = []
            for x in xs:
                if out_of_budget():
                    return None
                c, v = evaluate(candidate(x))
                if v.failed:
                    return c, v
                fits.append(-v.fitness)     # cma minimises
            with _quiet():
                es.tell(xs, fits)
            if -min(fits) > best + min_gain:
                best, stall = -min(fits), 0
            else:
                stall += 1
            report(f"cma sigma {es.sigma:.3f}, popsize {len(xs)}")
        return None
    finally:
        np.random.set_state(outer)


@contextlib.contextmanager
def _quiet():
    """A context in which ``cma``'s warnings (flat fitness, bounds, no matplotlib) are not
    shown."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _cma_loop(res, sp, rng, evaluate, out_of_budget, *, lam, report, family_rng=None):
    """Mixed-integer CMA-ES with restarts (``_cma_run``). The first run starts at
    ``res.best`` (the best starting point, sigma0 0.2, CMA-ES's default population
    4 + 3 ln n); then the restarts alternate between a fresh random point
    (``_fresh_centre``, sigma0 0.3, the default population) and the best input so far
    (sigma0 0.1, the population doubled at each such restart up to 64, as IPOP-CMA-ES
    does). ``lam`` is not used. Returns (candidate, verdict) of the first failure, or None
    when the budget is spent."""
    pop0 = 4 + int(3 * math.log(max(1, len(_cma_fields(sp)))))
    k, pop_local = 0, pop0
    while not out_of_budget():
        if k == 0:
            center, sigma0, pop = res.best, 0.2, pop0
        elif k % 2:
            center, sigma0, pop = _fresh_centre(sp, rng, family_rng), 0.3, pop0
        else:
            pop_local = min(64, 2 * pop_local)
            center, sigma0, pop = res.best, 0.1, pop_local
        found = _cma_run(center, sp, rng, evaluate, out_of_budget, sigma0=sigma0,
                         popsize=pop, report=report)
        if found is not None:
            return found
        k += 1
    return None


def search(policy, *, space=None, mods=None, budget_s: float = 60.0, seed: int = 0,
           threshold=None, tolerance=None, shrink: bool = True, max_evals: int | None = None,
           lam: int = 6, structured: bool = True, baseline=None, progress=None,
           optimizer: str = "cma", classes=None, silent_tol: float = SILENT_TOL,
           region=None) -> Attack:
    """Look for an input of ``space`` on which ``policy`` (a name or ``fa_lab.Policy``)
    fails (see the module docstring), for at most ``budget_s`` seconds of search (the
    shrinking that follows a find has its own budget of as much again). Stops at the first
    failure. ``space``: a ``SPACES`` name or a ``Space``; ``mods``: score modifiers it also
    draws (``parse_mods``: "bias", "alibi" / "alibi_slopes", "sink"; a comma-separated str
    or a list), refused before any work when unknown or when the model cannot run them
    under ``policy`` (``check_mods``). ``structured``: begin with the structured starting
    points (``MOD_STARTS`` the space can draw, then ``STARTS``: a drag case, a staircase,
    the seed's recipe) before random ones (False: random starts only, which measures the
    optimiser alone); ``baseline``: a policy that must stay finite on the same input
    (``judge``); ``progress``: a callable(str) for reports; ``optimizer``: what climbs the
    fitness after the starting points (``OPTIMIZERS``: ``"cma"``, mixed-integer CMA-ES with
    restarts, or ``"es"``, the (1 + ``lam``) evolution strategy; see the module
    docstring), refused with a ValueError naming ``optimizer`` before any work when
    unknown; ``lam``: children per generation of ``"es"``. For a given seed (and
    ``max_evals``) the search is deterministic under either optimiser.

    A policy with semantics of its own (the failure zoo's presets: ``kernel_for``) runs on
    the online-softmax family, in the ``"zoo"`` space by default (``space=None``: "zoo"
    for such a policy, "scores" otherwise), and fails on the ``classes`` of failure
    (``judge.CLASSES``; None: its entry's, ``judge.default_classes``) with ``silent_tol``
    for the silent class. ``region``: a callable(Candidate) -> bool; candidates it rejects
    are not judged (counted in ``Attack.outside``), so every run counted in ``evals`` lies
    inside it (``fa_lab.studies.onset.bound``'s safe regions are checked this way)."""
    from fa_lab import policies

    if not isinstance(optimizer, str):
        raise TypeError(f"optimizer must be a str, one of {OPTIMIZERS}, "
                        f"got {type(optimizer).__name__}")
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer={optimizer!r}; choose one of {OPTIMIZERS}")
    if space is None:
        space = "scores" if kernel_for(policy) == KERNEL else "zoo"
    if isinstance(space, str):
        if space not in SPACES:
            raise ValueError(f"space={space!r}; choose one of {tuple(SPACES)}")
        sp = SPACES[space]
    elif isinstance(space, Space):
        sp = space
    else:
        raise TypeError(f"space must be a name in {tuple(SPACES)} or a Space, "
                        f"got {type(space).__name__}")
    check_space(policy, sp)
    classes = check_classes(policy, classes)
    sp = sp.with_mods(check_mods(policy, (*sp.mods, *parse_mods(mods)), threshold=threshold))
    if baseline is not None:
        check_mods(baseline, sp.mods)
    if region is not None and not callable(region):
        raise TypeError(f"region must be None or a callable(Candidate) -> bool, "
                        f"got {type(region).__name__}")
    pol = policies.as_policy(policy) if isinstance(policy, str) else policy
    name = pol.name if isinstance(pol, policies.Policy) else str(policy)
    res = Attack(policy=name, space=sp.to_dict(), budget_s=float(budget_s), seed=int(seed),
                 threshold=None if threshold is None else float(threshold), structured=structured,
                 baseline=None if baseline is None else getattr(baseline, "name", str(baseline)),
                 optimizer=optimizer, classes=classes)
    rng = np.random.default_rng(seed)
    t0 = time.perf_counter()

    def out_of_budget():
        return (time.perf_counter() - t0 >= budget_s
                or (max_evals is not None and res.evals >= max_evals))

    def evaluate(c):
        c = canonical(Candidate(**{f: _clip(sp, f, x) for f, x in c.to_dict().items()}))
        if region is not None and not region(c):
            res.outside += 1
            if res.best is None:  # a centre for the optimiser, below any judged input
                res.best, res.best_fitness = c, -2e3
            return c, Verdict(failed=False, bad_rows=[], fitness=-2e3, ref_finite=True,
                              max_err=0.0, seconds=0.0)
        v = judge(c, pol, threshold=threshold, tolerance=tolerance, baseline=baseline,
                  classes=classes, silent_tol=silent_tol)
        res.evals += 1
        if v.fitness > res.best_fitness:
            res.best_fitness, res.best = v.fitness, c
            res.history.append({"evals": res.evals, "t": time.perf_counter() - t0,
                                "fitness": v.fitness})
        return c, v

    found = None
    mod_starts = [c for need, c in MOD_STARTS if set(need) <= set(sp.mods)]
    zoo_starts = list(ZOO_STARTS) if sp.zoo else []
    family_rng = _family_rng(seed) if sp.zoo else None
    starts = [*((*zoo_starts, *mod_starts, *STARTS) if structured else ()),
              *(random_candidate(sp, rng) for _ in range(4)),
              *(unshifted_candidate(sp, family_rng) for _ in range(UNSHIFTED_STARTS if sp.zoo
                                                                 else 0))]
    for c in starts:
        if out_of_budget():
            break
        c, v = evaluate(c)
        if v.failed:
            found = (c, v)
            break
    if found is None and res.best is not None:
        def report(msg):
            if progress is not None:
                progress(f"{name}: {res.evals} evals, best fitness {res.best_fitness:.1f}, {msg}")

        loop = _es_loop if optimizer == "es" else _cma_loop
        found = loop(res, sp, rng, evaluate, out_of_budget, lam=lam, report=report,
                     family_rng=family_rng)
    res.search_s = time.perf_counter() - t0
    if found is None:
        return res
    c, v = found
    res.found, res.first = True, c
    res.time_to_first_s, res.evals_to_first = res.search_s, res.evals
    if shrink:
        t1 = time.perf_counter()
        keep = region if region is not None else (lambda x: True)
        res.shrunk, res.shrink_evals = shrink_candidate(c, pol, threshold=threshold,
                                                        tolerance=tolerance, baseline=baseline,
                                                        budget_s=max(10.0, budget_s),
                                                        classes=classes, silent_tol=silent_tol,
                                                        keep=keep)
        res.shrink_s = time.perf_counter() - t1
    else:
        res.shrunk = c
    final = judge(res.shrunk, pol, threshold=threshold, tolerance=tolerance, baseline=baseline,
                  classes=classes, silent_tol=silent_tol)
    res.bad_rows, res.found_classes = final.bad_rows, final.classes
    res.trace = trace_rows(res.shrunk, pol, final.bad_rows[:1], threshold=threshold)
    return res


def summary(res: Attack) -> str:
    """A few lines: what was found, how fast, how small."""
    if res.found:
        s = res.shrunk
        mods = "".join(f"; {m} {d}" for m, d in s.mod_summary().items())
        what = ("non-finite rows" if res.classes == ("nonfinite",)
                else f"{', '.join(res.found_classes)} rows")
        return (f"{res.policy}: FAILS ({', '.join(res.found_classes) or 'nonfinite'}). "
                f"First failure after {res.time_to_first_s:.1f} s "
                f"({res.evals_to_first} model runs) in space {res.space['name']!r}; shrunk in "
                f"{res.shrink_evals} runs to Sq={s.seqlen_q} Skv={s.seqlen_kv} D={s.D} "
                f"({s.family}, {s.dtype}, causal={s.causal}{mods}); {what} "
                f"{res.bad_rows}\n  repro: {res.repro_command}")
    inside, skipped = ("", "") if not res.outside else \
        (" inside the region", f"{res.outside} outside it skipped; ")
    return (f"{res.policy}: nothing in {res.evals} runs{inside} found a failure "
            f"({skipped}{res.search_s:.1f} s, budget {res.budget_s:g} s, space {res.space['name']!r}, "
            f"classes {', '.join(res.classes)}); best fitness {res.best_fitness:.1f} (128 means a "
            "failure: a predicted overflow, or an error at the tolerance)")
