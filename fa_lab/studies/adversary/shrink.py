"""Shrinking a failing candidate to a simpler one that still fails (fewer tiles, smaller
values, fewer victims), and the rows it traces."""

from __future__ import annotations

import dataclasses
import math
import time

from fa_lab.dispatch import routing_quiet

from .space import Candidate, FIELDS, KERNEL, build, build_mods, canonical, kernel_for
from .judge import SILENT_TOL, judge


def _loop_steps(n_tiles: int, trim: int = 0) -> int:
    """The bf16 kernel's lazy decisions for a block of this KV length (N - 4)."""
    t = math.ceil(max(1, 64 * n_tiles - trim) / 64)
    return max(4, t + t % 2) - 4


def _simpler(c: Candidate, zoo: bool = False):
    """Candidate simplifications, most valuable first (each a new Candidate): fewer KV
    tiles (also with the per-tile fall scaled up so the total drop is kept), fewer rows,
    each score modifier off (then a plainer one), then simpler structure, then rounder
    numbers. ``zoo``: also the zoo's simplifications (one tile, one row, no cache tail, no
    outlier, no offset, the scores family), for a candidate of the zoo's space."""
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
    if zoo:
        yield from _simpler_zoo(c)
    if c.n_rows != 32:
        yield rep(c, n_rows=32, trigger_row=c.trigger_row % 32, victim_row=c.victim_row % 32)
    if c.n_rows != 32:
        yield rep(c, n_rows=32, trigger_row=c.trigger_row % 32, victim_row=c.victim_row % 32)
    for f, simple in (("sink", False), ("alibi_slope", 0.0), ("bias_scale", 0.0),
                      ("mask", "none"), ("mask_value", "-inf"), ("sink_logit", 0.0)):
        if getattr(c, f) != simple:
            yield rep(c, **{f: simple})
    if c.mask in ("block_diag", "block_sparse") and c.mask_len != 64:
        yield rep(c, mask_len=64)
    for f, digits in (("alibi_slope", 2), ("bias_scale", 0), ("mask_density", 1)):
        x = getattr(c, f)
        if x != round(x, digits):
            yield rep(c, **{f: float(round(x, digits))})
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


def _simpler_zoo(c: Candidate):
    """The zoo's simplifications (``_simpler``)."""
    rep = dataclasses.replace
    for n in sorted({1, 2, c.n_tiles // 2} - {c.n_tiles}):
        if 1 <= n < c.n_tiles:
            yield rep(c, n_tiles=n)
    for n in sorted({1, 2, 16, 32} - {c.n_rows}):
        if n < c.n_rows:
            yield rep(c, n_rows=n, trigger_row=0, victim_row=min(1, n - 1))
    for f, simple in (("cache", "finite"), ("seqused", 1.0), ("jump", 0.0), ("shift", 0.0),
                      ("family", "scores")):
        if getattr(c, f) != simple:
            yield rep(c, **{f: simple})
    for f, digits in (("spread", 0), ("jump", 0), ("seqused", 2), ("shift", -3)):
        x = getattr(c, f)
        if x != round(x, digits):
            yield rep(c, **{f: float(round(x, digits))})


def _bisect_down(c: Candidate, f: str, fails, lo: float = 0.0, steps: int = 8):
    """The smallest value of numeric field ``f`` in [lo, current] that still fails,
    by bisection on integers (assumes failing is monotone in ``f``; checks the answer)."""
    num = int if FIELDS[f][0] == "int" else float
    hi = getattr(c, f)
    if hi <= lo:
        return c
    if fails(dataclasses.replace(c, **{f: num(lo)})):
        return dataclasses.replace(c, **{f: num(lo)})
    a, b = lo, hi
    for _ in range(steps):
        if b - a <= 1:
            break
        mid = num(math.floor((a + b) / 2))
        if fails(dataclasses.replace(c, **{f: mid})):
            b = mid
        else:
            a = mid
    top = dataclasses.replace(c, **{f: num(math.ceil(b))})
    return top if fails(top) else c


def shrink_candidate(c: Candidate, policy, *, threshold=None, tolerance=None, baseline=None,
                     budget_s: float = 30.0, classes=None, silent_tol: float = SILENT_TOL,
                     keep=None) -> tuple[Candidate, int]:
    """Greedy shrinking: keep any simplification (``_simpler``) under which ``policy``
    still fails (for ``classes``; within ``keep``, a callable(Candidate) -> bool, where
    given), then bisect the magnitudes (fall, start, v_log2, k_scale, spread, and a
    padding mask's length) down, until a pass changes nothing or the budget is spent.
    Returns (candidate, model runs)."""
    t0 = time.perf_counter()
    n = 0
    cache = {}

    def fails(x: Candidate) -> bool:
        nonlocal n
        x = canonical(x)
        key = tuple(x.to_dict().values())
        if key not in cache:
            if keep is not None and not keep(x):
                cache[key] = False
                return False
            n += 1
            cache[key] = judge(x, policy, threshold=threshold, tolerance=tolerance,
                               baseline=baseline, classes=classes, silent_tol=silent_tol).failed
        return cache[key]

    c = canonical(c)
    zoo = kernel_for(policy) != KERNEL
    for _ in range(100):
        changed = False
        for s in _simpler(c, zoo):
            if time.perf_counter() - t0 > budget_s:
                return c, n
            s = canonical(s)
            if s != c and fails(s):
                c, changed = s, True
                break
        if changed:
            continue
        before = c
        for f in ("fall", "v_log2", "k_scale", "start", "rise", "spread"):
            if time.perf_counter() - t0 > budget_s:
                return c, n
            lo = FIELDS[f][1][0] if f != "start" else 0.0
            if f == "k_scale" and c.family != "random":
                continue
            if f in ("start", "rise", "fall") and c.family != "onehot":
                continue
            if f == "spread" and c.family != "scores":
                continue
            c = canonical(_bisect_down(c, f, fails, lo=max(lo, 0.0)))
        if c.mask in ("pad_left", "pad_right") and time.perf_counter() - t0 <= budget_s:
            c = canonical(_bisect_down(c, "mask_len", fails, lo=1))
        if c == before:
            break
    return c, n


@routing_quiet()
def trace_rows(c: Candidate, policy, rows, *, threshold=None) -> list[dict]:
    """The step-by-step trace (``fa_lab.trace``) of the given rows of candidate ``c``, as
    plain records (step, phase, m, mt, vote, fire, swept, corr, l, o_finite)."""
    from fa_lab import api
    from fa_lab.trace import TraceRecorder

    if not rows:
        return []
    if kernel_for(policy) != KERNEL:  # the online family's model, with the candidate's KV length
        from .judge import run_online

        rec = TraceRecorder([(0, 0, r) for r in rows], group_size=1)
        _, _, _, pol, _ = run_online(c, policy, threshold=threshold, recorder=rec)
        tr = rec.build(kernel=kernel_for(policy), policy=pol, log2_per_unit=1.0,
                       threshold_units=float(pol.threshold))
    else:
        q, k, v = build(c)
        tr = api.trace(q, k, v, rows=list(rows), causal=c.causal, rescale=policy,
                       rescale_threshold=threshold, backend="emulator", kernel=KERNEL,
                       **build_mods(c))
    cols = ["lane", "row", "step", "phase", "m", "mt", "vote", "fire", "swept", "corr", "l",
            "o_finite", "l_finite"]
    return tr.steps[[x for x in cols if x in tr.steps.columns]].to_dict("records")
