"""The search loop the attack's kernel spaces share (the paged decode's, ``decode_search``,
the MLA decode's, ``mla``, and the paged fp8 prefill's, ``paged_fp8``): random draws, then a (1 + lambda) evolution strategy with
restarts on the space's fitness, stopping at the first failure; the greedy shrinker; and the
bookkeeping that fills an ``Attack`` with what was found.

A space brings its own pieces: ``draw(rng)`` (a candidate of the space), ``mutate(c, rng,
sigma)`` (a few fields moved by a step of ``sigma`` times their range) and ``judge(c)`` (a
``Verdict``: ``failed`` and ``fitness``, higher is nearer a failure). The loop knows nothing
of the failure it may find. Deterministic for a seed (given ``max_evals``: the wall-clock
budget decides how far a run gets).
"""

from __future__ import annotations

import dataclasses
import math
import time

import numpy as np

#: Generations without a gain after which the strategy restarts (from a fresh draw or from
#: the best so far, with even odds).
STALL = 12


def check_numbers(**kw) -> None:
    """Each keyword a number >= 0 (not a bool); ValueError naming it."""
    for name, x in kw.items():
        if isinstance(x, bool) or not isinstance(x, (int, float)) or x < 0:
            raise ValueError(f"{name} must be a number >= 0, got {x!r}")


def run_search(res, *, draw, mutate, judge, canonical, budget_s: float, seed: int,
               max_evals: int | None, random_starts: int, lam: int, family=None,
               family_starts: int = 0, family_restarts: float = 0.0, restart_after=STALL,
               progress=None):
    """Fill ``res`` (an ``Attack``) with a search: ``random_starts`` draws, then
    ``family_starts`` draws of the space's ``family`` (a second draw of its own, e.g. calls
    cut where the kernel's geometry has its edges; from a stream of its own, so a seed's
    shared draws are the same with or without it), then a (1 + ``lam``) evolution strategy
    from the fittest whose step grows on success and shrinks on failure, restarting after
    ``restart_after`` generations without a gain (None: never) from the best so far or from
    a fresh draw (the family's ``family_restarts`` of the time). Every candidate is ``canonical``-ised, then
    judged; the fittest is ``res.best``. Returns the first failing candidate, or None when
    the budget (``budget_s`` seconds or ``max_evals`` runs) is spent; ``res.search_s`` is
    set either way."""
    rng = np.random.default_rng(seed)
    family_rng = np.random.default_rng([int(seed), 1])
    t0 = time.perf_counter()

    def fresh():
        if family is not None and family_rng.random() < family_restarts:
            return family(family_rng)
        return draw(rng)

    def out_of_budget():
        return (time.perf_counter() - t0 >= budget_s
                or (max_evals is not None and res.evals >= max_evals))

    def evaluate(c):
        c = canonical(c)
        v = judge(c)
        res.evals += 1
        if v.fitness > res.best_fitness:
            res.best_fitness, res.best = v.fitness, c
            res.history.append({"evals": res.evals, "t": time.perf_counter() - t0,
                                "fitness": v.fitness})
        return c, v

    found = None
    starts = [lambda: draw(rng)] * random_starts
    starts += [lambda: family(family_rng)] * (family_starts if family is not None else 0)
    for start in starts:
        if out_of_budget():
            break
        c, v = evaluate(start())
        if v.failed:
            found = c
            break
    parent, pfit, sigma, stall = res.best, res.best_fitness, 0.15, 0
    while found is None and parent is not None and not out_of_budget():
        best_child = None
        for _ in range(lam):
            c, v = evaluate(mutate(parent, rng, sigma))
            if v.failed:
                found = c
                break
            if best_child is None or v.fitness > best_child[1]:
                best_child = (c, v.fitness)
            if out_of_budget():
                break
        if found is not None or best_child is None:
            break
        if best_child[1] >= pfit:
            parent, pfit = best_child
            sigma, stall = min(0.5, sigma * 1.5), 0
        else:
            sigma, stall = max(0.02, sigma * 0.8), stall + 1
        if restart_after is not None and stall > restart_after:
            parent = fresh() if rng.random() < 0.5 else res.best
            pfit, sigma, stall = -math.inf, 0.2, 0
        if progress is not None:
            progress(f"{res.policy}: {res.evals} evals, best fitness {res.best_fitness:.1f}")
    res.search_s = time.perf_counter() - t0
    return found


def shrink(c, simpler, *, fails, canonical, keep=None, budget_s: float = 20.0):
    """Greedy passes over ``simpler`` ((field, value or a callable of the current value
    giving the values to try), in order), each change kept only if ``fails`` still holds
    (and ``keep``, when given, accepts the simpler candidate); until a pass changes nothing
    or ``budget_s`` is spent. Returns the shrunk candidate and the runs spent."""
    t0, evals, changed = time.perf_counter(), 0, True
    while changed and time.perf_counter() - t0 < budget_s:
        changed = False
        for f, simple in simpler:
            cur = getattr(c, f)
            for val in (simple(cur) if callable(simple) else [simple]):
                if val == cur or time.perf_counter() - t0 >= budget_s:
                    continue
                cand = canonical(dataclasses.replace(c, **{f: val}))
                if keep is not None and not keep(cand):
                    continue
                evals += 1
                if fails(cand):
                    c, changed = cand, True
                    break
    return c, evals


def finish(res, found, *, shrink_found: bool, shrink_fn, judge_full) -> None:
    """Record ``found`` (or nothing) in ``res``: the first failure and its cost, its shrunk
    form (``shrink_fn(found) -> (candidate, evals)`` unless ``shrink_found`` is false) and
    the full judge's verdict on it (``bad_rows``, ``found_classes``)."""
    if found is None:
        return
    res.found, res.first = True, found
    res.time_to_first_s, res.evals_to_first = res.search_s, res.evals
    t1 = time.perf_counter()
    res.shrunk, res.shrink_evals = shrink_fn(found) if shrink_found else (found, 0)
    res.shrink_s = time.perf_counter() - t1
    final = judge_full(res.shrunk)
    res.bad_rows, res.found_classes = final.bad_rows, final.classes
