"""Shrinking a failing candidate to a simpler one that still fails (fewer tiles, smaller
values, fewer victims), and the rows it traces."""

from __future__ import annotations

import dataclasses
import math
import time

from .space import Candidate, FIELDS, KERNEL, build, build_mods, canonical
from .judge import judge


def _loop_steps(n_tiles: int, trim: int = 0) -> int:
    """The bf16 kernel's lazy decisions for a block of this KV length (N - 4)."""
    t = math.ceil(max(1, 64 * n_tiles - trim) / 64)
    return max(4, t + t % 2) - 4


def _simpler(c: Candidate):
    """Candidate simplifications, most valuable first (each a new Candidate): fewer KV
    tiles (also with the per-tile fall scaled up so the total drop is kept), fewer rows,
    each score modifier off (then a plainer one), then simpler structure, then rounder
    numbers."""
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
                     budget_s: float = 30.0) -> tuple[Candidate, int]:
    """Greedy shrinking: keep any simplification (``_simpler``) under which ``policy``
    still fails, then bisect the magnitudes (fall, start, v_log2, k_scale, and a padding
    mask's length) down, until a pass changes nothing or the budget is spent. Returns
    (candidate, model runs)."""
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
        if c.mask in ("pad_left", "pad_right") and time.perf_counter() - t0 <= budget_s:
            c = canonical(_bisect_down(c, "mask_len", fails, lo=1))
        if c == before:
            break
    return c, n


def trace_rows(c: Candidate, policy, rows, *, threshold=None) -> list[dict]:
    """The step-by-step trace (``fa_lab.trace``) of the given rows of candidate ``c``, as
    plain records (step, phase, m, mt, vote, fire, dragged, corr, l, o_finite)."""
    from fa_lab import api

    if not rows:
        return []
    q, k, v = build(c)
    tr = api.trace(q, k, v, rows=list(rows), causal=c.causal, rescale=policy,
                   rescale_threshold=threshold, backend="emulator", kernel=KERNEL,
                   **build_mods(c))
    cols = ["lane", "row", "step", "phase", "m", "mt", "vote", "fire", "dragged", "corr", "l",
            "o_finite", "l_finite"]
    return tr.steps[[x for x in cols if x in tr.steps.columns]].to_dict("records")
