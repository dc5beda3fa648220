"""Timing in interleaved rounds: the rotated orders, the rounds of every implementation,
the call-alternated pairs, per-round ratios and their spread, and the host time per call."""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field


from fa_lab.timing import CpuTimer, measure, measure_cycle
from .suites import EXTRA_RATIO_PAIRS, headline


def round_orders(impls, rounds: int) -> list[list[str]]:
    """The order of each round: ``impls`` rotated to start at offset ``r * n // rounds``
    in round r (n implementations), so that over the rounds the starting points spread
    evenly through the list (with more rounds than implementations: offset r mod n)."""
    impls = list(impls)
    n = len(impls)
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    if n == 0:
        return [[] for _ in range(rounds)]
    orders = []
    for r in range(rounds):
        k = (r * n // rounds) % n if rounds <= n else r % n
        orders.append(impls[k:] + impls[:k])
    return orders


@dataclass
class Rounds:
    """What ``time_rounds`` measured: per implementation and round, the median ms of that
    round's calls and their number (None where it was not timed: it failed, in that round
    or before); each round's order and its (start, end) ``time.perf_counter`` readings;
    the error of each implementation that failed."""

    impls: list[str]
    orders: list[list[str]]
    ms: dict[str, list[float | None]]
    calls: dict[str, list[int | None]]
    spans: list[tuple[float, float]] = field(default_factory=list)
    errors: dict[str, str] = field(default_factory=dict)


def _err(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"


def time_rounds(fns: dict, *, rounds: int = 5, min_calls: int = 10, min_ms: float = 100.0,
                warmup_ms: float = 25.0, timer=None, max_calls: int = 10_000,
                on_step=None) -> Rounds:
    """Time each of ``fns`` ({name: no-argument callable}) in ``rounds`` interleaved rounds:
    first ``warmup_ms`` ms of untimed calls each (at least one), then in each round every
    implementation once, in ``round_orders``' rotated order, by ``measure`` (at least
    ``min_calls`` calls and ``min_ms`` ms). An implementation that raises is left out of
    the rounds after (its error in ``errors``). ``timer``: ``CpuTimer()`` by default.
    ``on_step(round, impl)`` is called after each timing (round -1: warm-up)."""
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    if min_calls < 1:
        raise ValueError(f"min_calls must be >= 1, got {min_calls}")
    if min_ms < 0 or warmup_ms < 0:
        raise ValueError(f"min_ms and warmup_ms must be >= 0, got {min_ms}, {warmup_ms}")
    timer = CpuTimer() if timer is None else timer
    impls = list(fns)
    res = Rounds(impls, round_orders(impls, rounds), {i: [None] * rounds for i in impls},
                 {i: [None] * rounds for i in impls})
    for impl in impls:
        try:
            first = timer.probe(fns[impl])
            more = math.ceil(warmup_ms / first) - 1 if first > 0 else 0
            if more > 0:
                timer.times(fns[impl], min(more, max_calls))
        except Exception as e:  # an OOM, a kernel that fails at this shape ...
            res.errors[impl] = f"warm-up: {_err(e)}"
        if on_step is not None:
            on_step(-1, impl)
    for r, order in enumerate(res.orders):
        t0 = time.perf_counter()
        for impl in order:
            if impl not in res.errors:
                try:
                    res.ms[impl][r], res.calls[impl][r] = measure(
                        fns[impl], timer, min_calls=min_calls, min_ms=min_ms, max_calls=max_calls)
                except Exception as e:
                    res.errors[impl] = f"round {r + 1}: {_err(e)}"
            if on_step is not None:
                on_step(r, impl)
        res.spans.append((t0, time.perf_counter()))
    return res


def time_paired(fns: dict, pairs, *, rounds: int = 5, min_calls: int = 10, min_ms: float = 100.0,
                timer=None, max_calls: int = 10_000, on_step=None) -> dict:
    """``a / b`` for each (a, b) of ``pairs`` (names in ``fns``) in ``rounds`` rounds of
    ``measure_cycle`` of (a, b) (b's median ms over a's, each round; b leads the cycles in rounds
    2, 4, ...): {(a, b): {"rounds": [ratio or None], "calls": [cycles or None], "error":
    text or None}}. A pair whose call raises, or whose a takes 0 ms (no ratio), is left out
    of the rounds after, with the reason in "error".
    ``on_step(round, pair)`` is called after each measurement."""
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    if min_calls < 1:
        raise ValueError(f"min_calls must be >= 1, got {min_calls}")
    pairs = [tuple(p) for p in pairs]
    unknown = sorted({i for p in pairs for i in p} - set(fns))
    if unknown:
        raise ValueError(f"pairs name implementations not in fns: {unknown}")
    if any(len(p) != 2 or p[0] == p[1] for p in pairs):
        raise ValueError(f"each pair must name two different implementations, got {pairs}")
    timer = CpuTimer() if timer is None else timer
    out = {p: {"rounds": [None] * rounds, "calls": [None] * rounds, "error": None} for p in pairs}
    for r in range(rounds):
        for p in pairs:
            res = out[p]
            if res["error"] is None:
                try:
                    (ma, mb), n = measure_cycle([fns[p[0]], fns[p[1]]], timer, min_calls=min_calls,
                                                min_ms=min_ms, max_calls=max_calls, lead=r % 2)
                except Exception as e:
                    res["error"] = f"round {r + 1}: {_err(e)}"
                else:
                    res["calls"][r] = n
                    if ma > 0:
                        res["rounds"][r] = mb / ma
                    else:
                        res["error"] = f"round {r + 1}: {p[0]} took 0 ms, no ratio"
            if on_step is not None:
                on_step(r, p)
    return out


def spread(values) -> dict:
    """median, min, max and count of the values that are not None (all None when none is)."""
    v = [x for x in values if x is not None]
    if not v:
        return {"median": None, "min": None, "max": None, "n": 0}
    return {"median": statistics.median(v), "min": min(v), "max": max(v), "n": len(v)}


#: Probes behind each row's host time.
HOST_PROBES = 7


def host_time(fn, timer, probes: int = HOST_PROBES) -> float:
    """The median host time of one call of ``fn`` in ms: the wall time of the Python call
    alone, measured by ``timer.probe`` (on a GPU, with a spin kernel holding the GPU so the
    call never waits for the queue: a sync inside the call shows as waiting for the spin).
    In a loop of calls without gaps, a call whose host time exceeds its GPU time leaves the
    GPU idle: the host, not the kernel, then sets the pace."""
    out = []
    for _ in range(probes):
        timer.probe(fn)
        out.append(timer.host_ms)
    return statistics.median(out)


def ratio_rounds(ms: dict, a: str, b: str) -> list[float | None]:
    """``a / b`` in each round: b's ms over a's ms (a's speed over b's), None where either
    was not timed."""
    return [None if x is None or y is None or x == 0 else y / x for x, y in zip(ms[a], ms[b])]


def ratio_pairs(impls) -> list[tuple[str, str]]:
    """The (a, b) pairs whose per-round ratio ``a / b`` is reported: ``HEADLINE`` against
    every other implementation, then ``EXTRA_RATIO_PAIRS``, where both are present."""
    impls = list(impls)
    base = headline(impls)
    pairs = [(base, i) for i in impls if i != base] if base else []
    pairs += [p for p in EXTRA_RATIO_PAIRS if p[0] in impls and p[1] in impls and p not in pairs]
    return pairs
