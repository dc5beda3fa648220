"""On a GPU: the fast bf16 kernel's ``lazy``, ``lazy_unfixed`` and ``eager`` policies timed
against each other in interleaved rounds, at every dense benchmark shape (fa_lab.bench.SHAPES).

``fa-lab bench`` times each implementation once, one after another, with 100 ms of
``do_bench``: a ~1 % drift between implementations, or a 60 ms kernel timed once, can flip
a comparison that close. Here each round times every (tiling, policy) pair once, in an
order rotated from round to round, each with at least ``--min-calls`` calls, and the
result keeps every round: per pair the median ms, and per round the ratios eager/lazy and
lazy_unfixed/lazy (> 1: lazy is faster), so their spread is the noise.

Tilings: ``autotuned`` (each policy with its own pick, as the benchmark runs them) and each
of fast_bf16.CONFIGS pinned for all three (lazy with the row-sum filter, its autotuned
default), which compares the policies at equal tiles.

    pip install --no-deps -e . && python3 benchmarks/lazy_vs_eager_gpu.py --out result.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
from tqdm.auto import tqdm
from triton.testing import do_bench

from fa_lab import bench
from fa_lab.experiments import atomic_write_json, provenance
from fa_lab.kernels.swp_bf16 import fast as fast_bf16

POLICIES = ("lazy", "lazy_unfixed", "eager")


def tilings():
    """{name: Config or None (autotuned)}."""
    out = {"autotuned": None}
    for c in fast_bf16.CONFIGS:
        out[c.describe(lazy=False)] = c
    return out


def runner(shape, inp, policy, config):
    pol = bench._bf16_policy(policy, shape)
    return lambda: fast_bf16.forward(inp.q, inp.k, inp.v, causal=shape.causal, policy=pol,
                                     config=config)[0]


def time_ms(fn, min_calls: int) -> float:
    """Median ms of ``fn`` over at least ``min_calls`` calls (do_bench's repetition time
    sized from one timed probe call)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    rep = max(100.0, min_calls * start.elapsed_time(end))
    return do_bench(fn, warmup=25, rep=rep, return_mode="median")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--shapes", default=None, help="comma-separated indices into fa_lab.bench.SHAPES")
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
    pairs = [(t, p) for t in tilings() for p in POLICIES]
    rows, summary = [], []
    bar = tqdm(total=len(shapes) * args.rounds * len(pairs), desc="lazy vs eager")
    for shape in shapes:
        inp = bench._inputs(shape, dev, args.seed)
        fns = {(t, p): runner(shape, inp, p, cfg) for t, cfg in tilings().items() for p in POLICIES}
        for fn in fns.values():  # compile and autotune outside the rounds
            fn()
        ms = {pair: [] for pair in pairs}
        for r in range(args.rounds):
            k = r % len(pairs)
            for pair in pairs[k:] + pairs[:k]:
                bar.set_postfix_str(f"{shape.name}: {pair[0]} {pair[1]}")
                ms[pair].append(time_ms(fns[pair], args.min_calls))
                bar.update()
        for (t, p), times in ms.items():
            rows.append({"shape": shape.name, "tiling": t, "policy": p, "ms_rounds": times,
                         "ms_median": statistics.median(times),
                         "tflops": shape.flops() / statistics.median(times) / 1e9})
        for t in tilings():
            lazy = ms[(t, "lazy")]
            for other in ("eager", "lazy_unfixed"):
                ratios = [o / l for o, l in zip(ms[(t, other)], lazy)]
                summary.append({"shape": shape.name, "tiling": t, "ratio": f"{other}_ms / lazy_ms",
                                "median": statistics.median(ratios), "min": min(ratios),
                                "max": max(ratios), "rounds": ratios})
    bar.close()
    for s in summary:
        print(f"{s['shape']:28s} {s['tiling']:22s} {s['ratio']:22s} median {s['median']:.4f} "
              f"[{s['min']:.4f} .. {s['max']:.4f}]")
    obj = {"name": "lazy_vs_eager_h200", "provenance": provenance(dev),
           "params": {"rounds": args.rounds, "min_calls": args.min_calls, "seed": args.seed,
                      "shapes": [s.name for s in shapes], "policies": list(POLICIES),
                      "tilings": list(tilings())},
           "summary": summary, "rows": rows}
    print("saved", atomic_write_json(Path(args.out), obj))


if __name__ == "__main__":
    sys.exit(main())
