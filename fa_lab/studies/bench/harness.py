"""The benchmark itself (``run``): every implementation at every shape, checked against
fp32 and timed in interleaved rounds, with the clocks and the autotuner's picks."""

from __future__ import annotations

import time
from dataclasses import asdict

import pandas as pd
import torch
from tqdm.auto import tqdm

from fa_lab.timing import CpuTimer, CudaTimer
from .suites import (ALL_IMPLS, FAITHFUL, FP8_IMPLS, IMPLS, PAIRED_RATIOS, SHAPES, _check_impls,
                     applies)
from .clocks import ClockSampler, gpu_clocks
from .impls import (REF_SCORE_BUDGET, Unavailable, _fast_config, _inputs, _reference, _rel_l2,
                    _runner, _tuning, reference_heads)
from .rounds import _err, host_time, ratio_pairs, ratio_rounds, spread, time_paired, time_rounds


def run(shapes=SHAPES, impls=IMPLS, *, jobs=None, device="cuda", seed=0, rounds=5, min_calls=10,
        warmup=25, rep=100, faithful_shapes=1, progress=True, on_shape=None, tuning=None,
        timer=None, paired=True) -> pd.DataFrame:
    """Time every implementation at every shape in ``rounds`` interleaved rounds
    (``time_rounds``: each round at least ``min_calls`` calls and ``rep`` ms of each, after
    ``warmup`` ms of untimed calls). One row per (shape, impl):
    suite, shape, B, S, H, D, causal, Skv, Hkv, lengths, impl, dtype, flops,
    ms / tflops (median over rounds), ms_min, ms_max, tflops_min, tflops_max, spread_pct
    ((max - min) / median ms, %), rounds (how many timed it), ms_rounds, tflops_rounds,
    calls_rounds, host_ms (``host_time``: the host's time per call), rel_l2 (vs fp32
    attention), rel_l2_dequant (fp8), config, note.

    ``jobs`` (``suite_jobs``: (suite, shape, impls) triples) replaces ``shapes`` x
    ``impls``; there, implementations that do not apply to a shape (``applies``) are left
    out. ``faithful_lazy`` runs at the first ``faithful_shapes`` shapes only (it is slow).
    ``device`` "cuda[:N]" times with ``CudaTimer``, "cpu" with ``CpuTimer`` (``timer``
    replaces either). ``on_shape(table)`` is called after each shape with the table so far
    (to save it); ``tuning``, a list, receives the autotuner's timings of every config.

    With ``paired``, the pairs of ``PAIRED_RATIOS`` that ran are then also timed
    call-alternated (``time_paired``), ``rounds`` rounds of them.

    The table's ``attrs`` hold ``ratios`` (one dict per (shape, pair): median, min, max and
    the per-round values of ``a / b``, see ``ratio_pairs``), ``paired_ratios`` (the same
    for the call-alternated pairs, with each round's cycles and any error), ``shapes``
    (per shape: round orders, GPU clocks at the start and end of its rounds and per round,
    the autotuner's choices, the reference's heads, seconds) and ``timing`` (the method
    and its parameters)."""
    if jobs is None:
        _check_impls(impls)
        if not shapes:
            raise ValueError("shapes is empty")
        jobs = [("varlen" if s.varlen else "dense", s, tuple(i for i in impls if applies(i, s)))
                for s in shapes]
    elif not jobs:
        raise ValueError("jobs is empty")
    for name, value, lo, kinds in (("rounds", rounds, 1, int), ("min_calls", min_calls, 1, int),
                                   ("warmup", warmup, 0, (int, float)), ("rep", rep, 0, (int, float))):
        if isinstance(value, bool) or not isinstance(value, kinds):
            raise TypeError(f"{name} must be a{'n int' if kinds is int else ' number'}, got {value!r}")
        if value < lo:
            raise ValueError(f"{name} must be >= {lo}, got {value!r}")
    if not isinstance(paired, bool):
        raise TypeError(f"paired must be a bool, got {type(paired).__name__}")
    dev = torch.device(device)
    if dev.type not in ("cuda", "cpu"):
        raise ValueError(f"the benchmark runs on a CUDA device or the CPU, got device={device!r}")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"the benchmark needs a CUDA device for device={device!r}, and none is "
                         f"available (torch.cuda.is_available() is False); device='cpu' times on the CPU")
    if timer is None:
        timer = CudaTimer(dev) if dev.type == "cuda" else CpuTimer()
    cuda = dev.type == "cuda"

    def sync():
        if cuda:
            torch.cuda.synchronize(dev)
    jobs = [(suite, shape, tuple(i for i in chosen if i != FAITHFUL or si < faithful_shapes))
            for si, (suite, shape, chosen) in enumerate(jobs)]
    shapes = [shape for _, shape, _ in jobs]
    rows, ratio_rows, paired_rows, shape_info = [], [], [], []
    timing = {"timer": timer.name, "rounds": rounds, "min_calls": min_calls, "rep_ms": rep,
              "warmup_ms": warmup, "order": "rotated each round (round_orders)",
              "paired": ("PAIRED_RATIOS call-alternated (time_paired: one call of each per "
                         "cycle, b leading in rounds 2, 4, ...)" if paired else None),
              "reference": f"fa_lab.reference.attention fp32, heads sub-sampled above "
                           f"{REF_SCORE_BUDGET} (query, key) pairs x heads"}

    def table_so_far():
        t = _ordered(rows, shapes)
        t.attrs.update(ratios=list(ratio_rows), paired_ratios=list(paired_rows),
                       shapes=list(shape_info), timing=dict(timing))
        return t
    bar = tqdm(total=sum(len(i) * (rounds + 2) for _, _, i in jobs), desc="bench", disable=not progress)
    for suite, shape, impls in jobs:
        t_shape = time.perf_counter()
        inp = _inputs(shape, device, seed, fp8=any(i in FP8_IMPLS for i in impls))
        heads = reference_heads(shape)
        info = {"suite": suite, "shape": shape.name, "impls": list(impls),
                "reference_heads": heads, "reference_of": shape.H, "note": None}
        try:
            ref = _reference(shape, inp, heads)
        except Exception as e:  # an OOM ...
            ref, info["note"] = None, f"fp32 reference failed: {_err(e)}"
            if cuda:
                torch.cuda.empty_cache()
        ref8 = {}
        fns, by_impl = {}, {}
        for impl in impls:
            bar.set_postfix_str(f"{shape.name}: {impl} (first call)")
            row = {"suite": suite, **asdict(shape), "Skv": shape.seqlen_kv,
                   "lengths": list(shape.lengths) if shape.varlen else None,
                   "shape": shape.name, "impl": impl,
                   "dtype": "float8_e4m3fn" if impl in FP8_IMPLS else "bfloat16",
                   "flops": shape.flops(), "ms": None, "tflops": None, "ms_min": None,
                   "ms_max": None, "tflops_min": None, "tflops_max": None, "spread_pct": None,
                   "rounds": 0, "ms_rounds": None, "tflops_rounds": None, "calls_rounds": None,
                   "host_ms": None, "rel_l2": None, "rel_l2_dequant": None, "config": None,
                   "note": None}
            try:
                fn = _runner(impl, shape, inp)
                out = fn()  # compile / autotune outside the timing
                sync()
                if tuning is not None and _tuning(impl, shape):
                    tuning.extend({"shape": shape.name, "impl": impl, **t} for t in _tuning(impl, shape))
                row["config"] = _fast_config(impl, shape, inp)
                row["note"] = getattr(fn, "note", None)
                fns[impl] = fn
                try:
                    if ref is not None:
                        row["rel_l2"] = _rel_l2(out, ref, heads)
                    if impl in FP8_IMPLS:
                        if "ref" not in ref8:
                            ref8["ref"] = _reference(shape, inp, heads, fp8=True)
                        row["rel_l2_dequant"] = _rel_l2(out, ref8["ref"], heads)
                except Exception as e:  # the check, not the kernel, failed (an OOM ...)
                    row["note"] = "; ".join(x for x in (row["note"], f"rel-L2 failed: {_err(e)}") if x)
                del out
            except Unavailable as e:
                row["note"] = str(e)
            except Exception as e:  # a peer that has no kernel for this shape, an OOM ...
                row["note"] = _err(e)
                if cuda:
                    torch.cuda.empty_cache()
            rows.append(row)
            by_impl[impl] = row
            bar.update()
        ref8.clear()
        del ref

        def step(r, impl, name=shape.name):
            bar.set_postfix_str(f"{name}: {'warm-up' if r < 0 else f'round {r + 1}'} {impl}")
            bar.update()
        bar.update(len(impls) - len(fns))  # warm-up steps of those that did not run
        clocks_start = gpu_clocks(device)
        with ClockSampler(device) as sampler:
            res = time_rounds(fns, rounds=rounds, min_calls=min_calls, min_ms=rep,
                              warmup_ms=warmup, timer=timer, on_step=step)
            pairs = [p for p in PAIRED_RATIOS
                     if all(i in fns and i not in res.errors for i in p)] if paired else []
            bar.total += len(pairs) * rounds
            paired_res = time_paired(fns, pairs, rounds=rounds, min_calls=min_calls, min_ms=rep,
                                     timer=timer, on_step=lambda r, p: step(r, " / ".join(p)))
        clocks_end = gpu_clocks(device)
        for impl in fns:
            if impl not in res.errors:
                try:
                    by_impl[impl]["host_ms"] = host_time(fns[impl], timer)
                except Exception as e:
                    res.errors[impl] = f"host time: {_err(e)}"
        bar.update((len(impls) - len(fns)) * rounds)
        for impl in fns:
            row, ms = by_impl[impl], res.ms[impl]
            s = spread(ms)
            if s["n"]:
                f = shape.flops()
                row.update(ms=s["median"], tflops=f / (s["median"] * 1e-3) / 1e12,
                           ms_min=s["min"], ms_max=s["max"],
                           tflops_min=f / (s["max"] * 1e-3) / 1e12,
                           tflops_max=f / (s["min"] * 1e-3) / 1e12,
                           spread_pct=100 * (s["max"] - s["min"]) / s["median"], rounds=s["n"],
                           ms_rounds=ms, calls_rounds=res.calls[impl],
                           tflops_rounds=[None if x is None else f / (x * 1e-3) / 1e12 for x in ms])
            if impl in res.errors:
                row["note"] = "; ".join(x for x in (row["note"], res.errors[impl]) if x)
        for a, b in ratio_pairs(list(fns)):
            per_round = ratio_rounds(res.ms, a, b)
            s = spread(per_round)
            if s["n"]:
                ratio_rows.append({"suite": suite, "shape": shape.name, "ratio": f"{a} / {b}",
                                   "a": a, "b": b, **s, "rounds": per_round})
        for (a, b), pr in paired_res.items():
            paired_rows.append({"suite": suite, "shape": shape.name, "ratio": f"{a} / {b}",
                                "a": a, "b": b, **spread(pr["rounds"]), "rounds": pr["rounds"],
                                "calls": pr["calls"], "error": pr["error"]})
        info.update(
            rounds=rounds, orders=res.orders,
            clocks={"start": clocks_start, "end": clocks_end,
                    "rounds_sm_mhz": ([sampler.summary(t0, t1) for t0, t1 in res.spans]
                                      if sampler.active else None),
                    "sampled": "pynvml every 50 ms" if sampler.active else None},
            autotune={i: by_impl[i]["config"] for i in impls if by_impl[i]["config"]},
            round_seconds=[t1 - t0 for t0, t1 in res.spans],
            seconds=time.perf_counter() - t_shape)
        shape_info.append(info)
        del inp, fns
        if cuda:
            torch.cuda.empty_cache()
        if on_shape is not None:
            on_shape(table_so_far())
    bar.close()
    return table_so_far()


def _ordered(rows, shapes) -> pd.DataFrame:
    shape_pos = {s.name: n for n, s in enumerate(shapes)}
    impl_pos = {i: n for n, i in enumerate(ALL_IMPLS)}
    return pd.DataFrame(sorted(rows, key=lambda r: (shape_pos[r["shape"]], impl_pos[r["impl"]])))
