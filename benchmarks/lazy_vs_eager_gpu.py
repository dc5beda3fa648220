"""On a GPU: the fast bf16 kernel's ``lazy``, ``lazy_unfixed`` and ``eager`` policies timed
against each other in interleaved rounds, at every dense benchmark shape
(fa_lab.studies.bench.SHAPES), autotuned and at each pinned tiling.

``fa-lab bench`` already times the autotuned policies in interleaved rounds (its
``fast_lazy / fast_eager`` and ``fast_lazy / fast_lazy_unfixed`` per-round ratios). What
this adds is the pinned tilings: each of fast_bf16.CONFIGS for all three policies (lazy
with the row-sum filter, its autotuned default), which compares the policies at equal
tiles. It uses the benchmark's machinery (``bench.time_rounds``: each round times every
(tiling, policy) pair once, for at least ``--min-calls`` calls and 100 ms, in an order
rotated from round to round; ``timing.CudaTimer``; ``bench.gpu_clocks``), and keeps every
round: per pair the median ms, and per round the ratios eager/lazy and lazy_unfixed/lazy
(time over time: > 1, lazy is faster), so their spread is the noise.

    pip install --no-deps -e . && python3 benchmarks/lazy_vs_eager_gpu.py --out result.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

from tqdm.auto import tqdm

from fa_lab import timing
from fa_lab.studies import bench
from fa_lab.studies.experiments import atomic_write_json, provenance
from fa_lab.kernels.swp_bf16 import fast as fast_bf16

POLICIES = ("lazy", "lazy_unfixed", "eager")


def tilings():
    """{name: Config or None (autotuned)}."""
    out = {"autotuned": None}
    for c in fast_bf16.CONFIGS:
        out[c.describe(lazy=False)] = c
    return out


def runner(shape, inp, policy, config):
    pol = bench.impls._bf16_policy(policy, shape)
    return lambda: fast_bf16.forward(inp.q, inp.k, inp.v, causal=shape.causal, policy=pol,
                                     config=config)[0]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--shapes", default=None, help="comma-separated indices into fa_lab.studies.bench.SHAPES")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--min-calls", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.rounds < 1:
        raise ValueError(f"--rounds must be >= 1, got {args.rounds}")
    if args.min_calls < 1:
        raise ValueError(f"--min-calls must be >= 1, got {args.min_calls}")
    shapes = bench.SHAPES if args.shapes is None else [bench.SHAPES[int(i)] for i in args.shapes.split(",")]
    dev = "cuda"
    timer = timing.CudaTimer(dev)
    names = {(t, p): f"{t} | {p}" for t in tilings() for p in POLICIES}
    rows, summary, clocks = [], [], []
    bar = tqdm(total=len(shapes) * (args.rounds + 1) * len(names), desc="lazy vs eager")
    for shape in shapes:
        inp = bench.impls._inputs(shape, dev, args.seed)
        fns = {names[(t, p)]: runner(shape, inp, p, cfg) for t, cfg in tilings().items() for p in POLICIES}
        for fn in fns.values():  # compile and autotune outside the rounds
            fn()
        start = bench.gpu_clocks(dev)

        def step(r, name, shape_name=shape.name):
            bar.set_postfix_str(f"{shape_name}: {name}")
            bar.update()
        res = bench.time_rounds(fns, rounds=args.rounds, min_calls=args.min_calls, min_ms=100.0,
                                warmup_ms=25.0, timer=timer, on_step=step)
        clocks.append({"shape": shape.name, "start": start, "end": bench.gpu_clocks(dev)})
        if res.errors:
            raise RuntimeError(f"{shape.name}: {res.errors}")
        ms = {pair: res.ms[name] for pair, name in names.items()}
        for (t, p), times in ms.items():
            rows.append({"shape": shape.name, "tiling": t, "policy": p, "ms_rounds": times,
                         "ms_median": statistics.median(times),
                         "tflops": shape.flops() / statistics.median(times) / 1e9})
        for t in tilings():
            for other in ("eager", "lazy_unfixed"):
                ratios = bench.ratio_rounds(ms, (t, "lazy"), (t, other))  # other's ms / lazy's
                summary.append({"shape": shape.name, "tiling": t, "ratio": f"{other}_ms / lazy_ms",
                                "median": statistics.median(ratios), "min": min(ratios),
                                "max": max(ratios), "rounds": ratios})
    bar.close()
    for s in summary:
        print(f"{s['shape']:32s} {s['tiling']:22s} {s['ratio']:22s} median {s['median']:.4f} "
              f"[{s['min']:.4f} .. {s['max']:.4f}]")
    obj = {"name": "lazy_vs_eager_h200", "provenance": provenance(dev),
           "params": {"rounds": args.rounds, "min_calls": args.min_calls, "seed": args.seed,
                      "shapes": [s.name for s in shapes], "policies": list(POLICIES),
                      "tilings": list(tilings()), "timer": timer.name},
           "clocks": clocks, "summary": summary, "rows": rows}
    print("saved", atomic_write_json(Path(args.out), obj))


if __name__ == "__main__":
    sys.exit(main())
