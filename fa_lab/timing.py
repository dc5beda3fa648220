"""Timing calls on the CPU or a CUDA device: the timers, and the medians of calls timed
one after another or in alternation.

A timer has ``probe(fn)`` (ms of one call; it also records the host's time for it in
``host_ms``), ``times(fn, n)`` and ``cycle(fns, n)`` (n cycles through fns, one call of
each per cycle: the ms of every call). ``CpuTimer`` reads a wall clock around each call;
``CudaTimer`` records CUDA events around each call with the L2 flushed before it.

``measure`` times one callable; ``measure_cycle`` times several in alternation, so that
neighbouring calls run under the same GPU clocks (under a power cap the SM clock moves
within a fraction of a second); ``time_alternated`` repeats that in rounds, the
leading callable moving from round to round. The benchmark (``fa_lab.studies.bench``) and the
kernels' own tuners (``fa_lab.kernels``) both time with these.
"""

from __future__ import annotations

import math
import statistics
import time

import torch


class CpuTimer:
    """Wall-clock time of each call: ``now()`` (seconds; ``time.perf_counter`` by default)
    read before and after it. The benchmark's timer on the CPU; a test passes its own
    ``now`` to make the clock's readings exact."""

    name = "perf_counter per call"

    def __init__(self, now=time.perf_counter):
        self.now = now
        self.host_ms = 0.0

    def probe(self, fn) -> float:
        """ms of one call (on the CPU, also its host time: ``host_ms``)."""
        self.host_ms = self.times(fn, 1)[0]
        return self.host_ms

    def times(self, fn, n: int) -> list[float]:
        """ms of each of ``n`` calls."""
        return self.cycle([fn], n)[0]

    def cycle(self, fns, n: int, host_ms: float | None = None) -> list[list[float]]:
        """``n`` cycles through ``fns``, one call of each per cycle: per fn, the ms of each
        of its calls. ``host_ms`` keeps ``CudaTimer.cycle``'s signature; on the CPU there is
        no queue to keep ahead of, so it is not used."""
        out = [[] for _ in fns]
        for _ in range(n):
            for j, fn in enumerate(fns):
                t0 = self.now()
                fn()
                out[j].append((self.now() - t0) * 1e3)
        return out


class CudaTimer:
    """GPU time of each call: CUDA events just before and after it, on the current stream.

    Before each call the L2 is flushed (a memset of a 256 MB buffer, as
    ``triton.testing.do_bench``: a call never finds its inputs in the 60 MB L2 left warm
    by the call before). Before each chunk of ``chunk`` calls a spin kernel
    (``torch.cuda._sleep``) holds the GPU for ``host_margin`` times the host's enqueue
    time of those calls (measured by ``probe``), so the host is ahead when the GPU starts
    them and launch overhead stays out of every call's time. ``probe`` itself spins for
    ``probe_spin_ms`` first. The memsets and spins fall outside the events."""

    name = "cuda events per call, L2 flushed, host kept ahead"
    #: spin-kernel cycles per ms: above the top SM clock of the Hopper GPUs (1980 MHz); at a
    #: lower clock the spin only lasts longer
    CYCLES_PER_MS = 2_000_000

    def __init__(self, device="cuda", *, chunk: int = 32, host_margin: float = 1.5,
                 probe_spin_ms: float = 1.0, max_spin_ms: float = 200.0, flush_mb: int = 256):
        self.device = torch.device(device)
        self.chunk, self.host_margin, self.probe_spin_ms = chunk, host_margin, probe_spin_ms
        self.max_spin_ms = max_spin_ms  # a host hiccup in the probe must not stall a round
        self.cache = torch.empty(flush_mb * 2**20 // 4, dtype=torch.int32, device=self.device)
        self.host_ms = 0.0
        self._spin = getattr(torch.cuda, "_sleep", None)

    def _spin_ms(self, ms: float) -> None:
        if self._spin is not None and ms > 0:
            self._spin(int(ms * self.CYCLES_PER_MS))

    def _event(self):
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        return e

    def probe(self, fn) -> float:
        """ms of one call, which also measures the host's enqueue time (``host_ms``)."""
        with torch.cuda.device(self.device):
            torch.cuda.synchronize()
            self._spin_ms(self.probe_spin_ms)
            self.cache.zero_()
            start = self._event()
            t0 = time.perf_counter()
            fn()
            self.host_ms = (time.perf_counter() - t0) * 1e3
            end = self._event()
            torch.cuda.synchronize()
            return start.elapsed_time(end)

    def times(self, fn, n: int) -> list[float]:
        """ms of each of ``n`` calls."""
        return self.cycle([fn], n)[0]

    def cycle(self, fns, n: int, host_ms: float | None = None) -> list[list[float]]:
        """``n`` cycles through ``fns``, one call of each per cycle (each flushed and timed
        on its own): per fn, the ms of each of its calls. ``host_ms``: the host's enqueue
        time of one cycle (default: the last probe's, of one call), which sizes the spin."""
        host = self.host_ms if host_ms is None else host_ms
        with torch.cuda.device(self.device):
            pairs = [[] for _ in fns]
            for c0 in range(0, n, self.chunk):
                k = min(self.chunk, n - c0)
                # the memset and two event records cost the host some tens of microseconds too
                self._spin_ms(min(self.max_spin_ms, self.host_margin * k * (host + 0.05 * len(fns))))
                for _ in range(k):
                    for j, fn in enumerate(fns):
                        self.cache.zero_()
                        start = self._event()
                        fn()
                        pairs[j].append((start, self._event()))
            torch.cuda.synchronize()
            return [[s.elapsed_time(e) for s, e in p] for p in pairs]


def _calls(probe_ms: float, min_calls: int, min_ms: float, max_calls: int) -> int:
    """How many calls (or cycles) to time, given one probe of ``probe_ms``: at least
    ``min_calls``, about ``min_ms`` ms in all, at most ``max_calls`` (unless ``min_calls``
    asks for more), at least one."""
    n = max(min_calls, math.ceil(min_ms / probe_ms) if probe_ms > 0 else max_calls)
    return max(1, min(n, max(max_calls, min_calls)))


def _check_sizes(min_calls, min_ms, max_calls) -> None:
    """``min_calls`` and ``max_calls`` ints >= 1, ``min_ms`` a finite number >= 0."""
    for name, x in (("min_calls", min_calls), ("max_calls", max_calls)):
        if isinstance(x, bool) or not isinstance(x, int) or x < 1:
            raise ValueError(f"{name} must be an int >= 1, got {x!r}")
    if isinstance(min_ms, bool) or not isinstance(min_ms, (int, float)) or not 0 <= min_ms < math.inf:
        raise ValueError(f"min_ms must be a finite number >= 0, got {min_ms!r}")


def _check_callables(fns) -> list:
    fns = list(fns)
    if not fns:
        raise ValueError("fns must name at least one callable")
    for i, fn in enumerate(fns):
        if not callable(fn):
            raise TypeError(f"fns[{i}] must be callable, got {type(fn).__name__}")
    return fns


def measure(fn, timer, *, min_calls: int = 10, min_ms: float = 100.0,
            max_calls: int = 10_000) -> tuple[float, int]:
    """(median ms per call, calls) of ``fn`` over at least ``min_calls`` calls and about
    ``min_ms`` ms of them (at most ``max_calls``): one probe call, which sizes the rest and
    counts among them."""
    _check_sizes(min_calls, min_ms, max_calls)
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}")
    first = timer.probe(fn)
    n = _calls(first, min_calls, min_ms, max_calls)
    times = [first, *timer.times(fn, n - 1)] if n > 1 else [first]
    return statistics.median(times), n


def measure_cycle(fns, timer, *, min_calls: int = 10, min_ms: float = 100.0,
                  max_calls: int = 10_000, lead: int = 0) -> tuple[list[float], int]:
    """(median ms of each of ``fns``, cycles): the callables called in alternation, one
    call of each per cycle, ``fns[lead]`` first and the rest in list order after it, for
    at least ``min_calls`` cycles and about ``min_ms`` ms of them (at most ``max_calls``).
    The first cycle is a probe of each, which sizes the rest and counts among them.
    Neighbouring calls run under the same clocks, so a drift of the GPU's clock moves
    every median alike."""
    fns = _check_callables(fns)
    _check_sizes(min_calls, min_ms, max_calls)
    if isinstance(lead, bool) or not isinstance(lead, int) or not 0 <= lead < len(fns):
        raise ValueError(f"lead must be an index into fns (0..{len(fns) - 1}), got {lead!r}")
    order = list(range(lead, len(fns))) + list(range(lead))
    first, host = [], 0.0
    for i in order:
        first.append(timer.probe(fns[i]))
        host += timer.host_ms
    n = _calls(sum(first), min_calls, min_ms, max_calls)
    rest = timer.cycle([fns[i] for i in order], n - 1, host_ms=host) if n > 1 else [[] for _ in order]
    medians = [0.0] * len(fns)
    for i, t0, ts in zip(order, first, rest):
        medians[i] = statistics.median([t0, *ts])
    return medians, n


def time_alternated(fns, timer, *, rounds: int = 3, min_calls: int = 3, min_ms: float = 50.0,
                    max_calls: int = 10_000) -> list[list[float]]:
    """Per callable of ``fns``, its median ms in each of ``rounds`` rounds of
    ``measure_cycle``; the lead moves one place each round (round r starts with
    ``fns[r % len(fns)]``), so no callable always runs first after the previous round's
    last. What a tuner ranks candidates by: every candidate meets the same clocks."""
    fns = _check_callables(fns)
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
        raise ValueError(f"rounds must be an int >= 1, got {rounds!r}")
    _check_sizes(min_calls, min_ms, max_calls)
    out = [[] for _ in fns]
    for r in range(rounds):
        medians, _ = measure_cycle(fns, timer, min_calls=min_calls, min_ms=min_ms,
                                   max_calls=max_calls, lead=r % len(fns))
        for i, ms in enumerate(medians):
            out[i].append(ms)
    return out
