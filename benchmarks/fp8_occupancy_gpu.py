"""Three fp8 programs per multiprocessor against two: the tuned tiling (BM64 BN128, 4 warps,
3 stages, TMA: two programs by registers and by shared memory) against the same tiling at
2 stages with ``maxnreg`` 168 (shared memory and registers for three, as
``fp8_resources_sm90.json`` counts them), lazy with and without the row-sum filter and
eager, at the dense suite's D128 shapes.

Each launch is pinned and given V already transposed (``TransposedV``), so the kernel alone
is timed. Per shape and policy the launches are called in alternation, in rounds whose lead
moves (``fa_lab.timing.time_alternated``, ``CudaTimer``): every launch meets the same
clocks. Recorded: each launch's median ms per round, its speed over the tuned tiling's in
each round, and whether its output is bit-equal to the tuned tiling's (NaN for NaN).

    python3 benchmarks/fp8_occupancy_gpu.py --out $OUT/fp8_occupancy_h200.json
    python3 benchmarks/fp8_occupancy_gpu.py --dry-run   # the CPU interpreter, a tiny shape
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from pathlib import Path

import torch

from fa_lab import policies, timing
from fa_lab.studies import bench
from fa_lab.kernels._triton.fast import Config
from fa_lab.kernels.swp_fp8 import fast as fast_fp8
from fa_lab.results import atomic_write_json, provenance

TUNED = Config(64, 128, 4, 3, True)
#: The launches, by name; the first is the one the others are measured against.
LAUNCHES = {
    "s3": TUNED,
    "s2 r168": Config(64, 128, 4, 2, True, maxnreg=168),
}
#: (policy, row-sum filter) per measured case; eager has no filter.
CASES = (("lazy", True), ("lazy", False), ("eager", False))


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(torch.equal(torch.isnan(a), torch.isnan(b)) and torch.equal(a.nan_to_num(), b.nan_to_num()))


def measure(shape, device, interpret: bool, timer, rounds: int, min_ms: float) -> list[dict]:
    (q8, k8, v8), (qd, kd, vd) = bench.impls._inputs(shape, device, 0, fp8=True).fp8
    vt = fast_fp8.TransposedV.from_v(v8, interpret=interpret)
    rows = []
    for rescale, row_sum in CASES:
        pol = policies.resolve(fp8=True, seqlen_kv=shape.seqlen_kv, rescale=rescale)
        configs = {n: dataclasses.replace(c, row_sum_filter=row_sum) for n, c in LAUNCHES.items()}
        fns = {n: (lambda c=c: fast_fp8.forward(q8, k8, vt, q_descale=qd, k_descale=kd,
                                                 v_descale=vd, causal=shape.causal, policy=pol,
                                                 config=c, interpret=interpret)[0])
               for n, c in configs.items()}
        outs = {n: fn() for n, fn in fns.items()}  # compiled, and the outputs compared
        ms = timing.time_alternated(list(fns.values()), timer, rounds=rounds, min_calls=3,
                                    min_ms=min_ms)
        ms = dict(zip(fns, ms))
        base = next(iter(fns))
        over = {n: [b / t for b, t in zip(ms[base], v)] for n, v in ms.items()}
        row = {"shape": shape.name, "policy": rescale,
               "configs": {n: c.describe(rescale != "eager") for n, c in configs.items()},
               "ms_rounds": ms, "over_first": over,
               "over_first_median": {n: statistics.median(v) for n, v in over.items()},
               "bit_equal_to_first": {n: _same(outs[base], o) for n, o in outs.items()}}
        print(row["shape"], rescale, row["configs"][base],
              {n: round(m, 3) for n, m in row["over_first_median"].items()},
              row["bit_equal_to_first"], flush=True)
        rows.append(row)
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="JSON to write (atomically)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dry-run", action="store_true",
                    help="one tiny shape through the CPU interpreter (checks the script)")
    args = ap.parse_args()
    if args.dry_run:
        shapes, device, timer, min_ms = [bench.Shape(1, 130, 2, 128, True)], "cpu", timing.CpuTimer(), 0.0
    else:
        shapes = [s for s in bench.SHAPES if s.D == 128]
        device, timer, min_ms = "cuda", timing.CudaTimer("cuda"), 50.0
    t0 = time.time()
    rows = []
    for shape in shapes:
        rows += measure(shape, device, args.dry_run, timer, args.rounds, min_ms)
        print(f"{time.time() - t0:.0f} s", flush=True)
    if args.out:
        atomic_write_json(Path(args.out), {
            "name": Path(args.out).stem, "what": " ".join(__doc__.split("\n\n")[:2]).replace("\n", " "),
            "rounds": args.rounds, "rows": rows,
            "provenance": provenance(device, timer=timer.name)})


if __name__ == "__main__":
    main()
