"""Picking a kernel's launch configuration per shape by timing the candidates in alternation.

The first call at a new key (the shapes and flags a pick depends on) calls every candidate
once (its compile; a candidate this GPU cannot run, ``CANNOT_RUN``, is left out with its
error on record, and any other error propagates), then times the rest in ``ROUNDS`` rounds of alternated calls
(``fa_lab.timing.time_alternated``: one call of each per cycle, at least ``CALLS`` cycles
and about ``MS`` ms a round, the lead moving from round to round), and keeps the one with
the lowest median over the rounds. Why alternated: under a power cap the SM clock moves
within a fraction of a second, and candidates timed one after another would be ranked
partly by the clock each of them met. Later calls at that key launch the pick.

``rank`` is that ranking for any list of candidates (the Gluon kernel's tuner uses it
too); ``Tuner`` holds the picks of one Triton kernel's fast launches.
"""

from __future__ import annotations

import functools
import statistics
import warnings

import torch
import triton.compiler.errors
import triton.runtime.errors

from fa_lab import timing

from .util import launch

#: Rounds, and per round at least this many cycles through the candidates and about this
#: many ms of them.
ROUNDS, CALLS, MS = 3, 3, 50.0
#: What a candidate's first call may raise to say that this GPU cannot run its tiling
#: (shared memory, registers, a compile-time check): the errors ``triton.autotune`` also
#: takes as "not this one". Any other error is a bug and propagates.
CANNOT_RUN = (triton.runtime.errors.OutOfResources, triton.runtime.errors.PTXASError,
              triton.compiler.errors.CompileTimeAssertionFailure)


def pick_fastest(configs, ms_rounds, lazy: bool = True):
    """(the config with the lowest median over its rounds, one record per config: its
    ``describe(lazy)``, that median ms and the ms of each round); the first listed wins a
    tie."""
    records = [{"config": c.describe(lazy), "ms": float(statistics.median(r)),
                "ms_rounds": [float(x) for x in r]} for c, r in zip(configs, ms_rounds, strict=True)]
    best = min(range(len(records)), key=lambda i: records[i]["ms"])
    return configs[best], records


def rank(configs, fns, timer, lazy: bool = True):
    """(the pick, one record per config in ``configs`` order) for candidates whose launch
    is ``fns[i]`` (no arguments): each called once, then the ones that ran timed with
    ``timer`` in alternated rounds. A candidate whose first call raises one of
    ``CANNOT_RUN`` is not timed (a warning names it; its record holds ``ms`` None and the
    ``error``); RuntimeError if none ran. Any other exception, in the first calls or the
    rounds, propagates: nothing is picked, and the next call ranks again."""
    configs, fns = list(configs), list(fns)
    if len(configs) != len(fns) or not configs:
        raise ValueError(f"rank needs one launch per config and at least one, got "
                         f"{len(configs)} configs and {len(fns)} launches")
    errors, last = {}, None
    for i, fn in enumerate(fns):  # compiled before any timing
        try:
            fn()
        except CANNOT_RUN as e:
            errors[i], last = f"{type(e).__name__}: {e}", e
            warnings.warn(f"{configs[i].describe(lazy)} cannot run here and is not ranked: "
                          f"{errors[i]}", RuntimeWarning, stacklevel=2)
    ran = [i for i in range(len(fns)) if i not in errors]
    if not ran:
        raise RuntimeError("no candidate launch ran: " + "; ".join(
            f"{configs[i].describe(lazy)}: {errors[i]}" for i in sorted(errors))) from last
    ms_rounds = timing.time_alternated([fns[i] for i in ran], timer, rounds=ROUNDS,
                                       min_calls=CALLS, min_ms=MS)
    best, timed = pick_fastest([configs[i] for i in ran], ms_rounds, lazy)
    records = dict(zip(ran, timed))
    for i, err in errors.items():
        records[i] = {"config": configs[i].describe(lazy), "ms": None, "ms_rounds": [], "error": err}
    return best, [records[i] for i in range(len(configs))]


class Tuner:
    """The fast launches of one Triton kernel for one lazy flag: ``configs`` (``Config``)
    to choose from; ``key``, the names of the arguments (runtime or constexpr) a pick
    depends on, to which the tensors' dtypes and device are added; ``pre_hook(nargs)``,
    run before every launch with the arguments and the config's keywords by name (it sets
    the TMA descriptors' tile shape). ``cache``: the pick per key; ``timings``: the records
    behind each pick; ``last_key``: the key tuned last."""

    def __init__(self, kernel, configs, key, pre_hook, lazy: bool):
        self.kernel, self.configs, self.key_names = kernel, tuple(configs), tuple(key)
        self.pre_hook, self.lazy = pre_hook, lazy
        self.cache: dict[tuple, object] = {}
        self.timings: dict[tuple, list[dict]] = {}
        self.last_key: tuple | None = None

    def key(self, args, meta: dict) -> tuple:
        nargs = {**dict(zip(self.kernel.arg_names, args)), **meta}
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        return (*(nargs[k] for k in self.key_names), *(str(t.dtype) for t in tensors),
                str(tensors[0].device))

    def launch(self, config, grid, args, meta: dict, interpret: bool = False) -> None:
        """Launch ``config``: ``grid(block_m)`` programs, the pre-hook first."""
        kw = config.meta(self.lazy)
        if self.pre_hook is not None:
            self.pre_hook({**dict(zip(self.kernel.arg_names, args)), **meta, **kw})
        launch(self.kernel, grid(config.block_m), interpret, *args, **meta, **kw)

    def run(self, grid, args, meta: dict, *, timer=None, interpret: bool = False) -> None:
        """Launch the pick for these arguments, ranking ``configs`` first at a new key
        (``timer``: ``timing.CudaTimer`` on the tensors' device unless given;
        ``interpret``: launches through the CPU interpreter, for tests)."""
        key = self.key(args, meta)
        if key not in self.cache:
            if timer is None:
                timer = timing.CudaTimer(next(a for a in args if isinstance(a, torch.Tensor)).device)
            fns = [functools.partial(self.launch, c, grid, args, meta, interpret) for c in self.configs]
            self.cache[key], self.timings[key] = rank(self.configs, fns, timer, self.lazy)
            self.last_key = key
        self.launch(self.cache[key], grid, args, meta, interpret)
