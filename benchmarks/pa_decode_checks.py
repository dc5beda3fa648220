"""The paged-attention decode model against its fp64 reference, and its NaN before and after
985c653a, over random calls: for each version, the largest |out - ref| over finite outputs
(in units of the largest |V|), the NaN outputs where the reference is finite, and how many
calls have any. Calls: per-tensor and per-token scales, QL 1..8, G 1..8, pages of 16 or 64,
NP 1..4, one or two sequences with contexts in 1..1100 (half of them ending one to seven
tokens past a 256-token tile, the sentinel's case).

    python benchmarks/pa_decode_checks.py --out data/results/pa_decode_checks_cpu.json
"""

from __future__ import annotations

import argparse
import random

import torch

from fa_lab import decode
from fa_lab.kernels.pa_decode import cases
from fa_lab.results import atomic_write_json, provenance

VERSIONS = ("main-11c4174d", "flydsl-985c653a^")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--calls", type=int, default=300)
    args = ap.parse_args()
    torch.set_num_threads(1)
    rng = random.Random(0)
    summary = {v: {"per_tensor": {}, "per_token": {}} for v in VERSIONS}
    for v in VERSIONS:
        for mode in ("per_tensor", "per_token"):
            summary[v][mode] = {"calls": 0, "calls_with_nan": 0, "nan_outputs": 0,
                                "outputs": 0, "max_abs_err_over_vmax": 0.0}
    for i in range(args.calls):
        per_token = i % 2 == 1
        ql, group, npart = rng.randint(1, 8), rng.choice([1, 2, 4, 8]), rng.randint(1, 4)
        ctx = [rng.randint(1, 4) * 256 + rng.randint(1, 7) if rng.random() < 0.5
               else rng.randint(1, 1100) for _ in range(rng.randint(1, 2))]
        case = cases.make(ctx, query_length=ql, num_q_heads=group, block_size=rng.choice([16, 64]),
                          per_token=per_token, seed=i)
        ref = cases.reference(case)
        vmax = float(case.value_scale.max()) * 448
        for v in VERSIONS:
            out = decode.pa_decode_tile(*case.args(), num_partitions=npart, upstream=v).double()
            s = summary[v]["per_token" if per_token else "per_tensor"]
            fin = out.isfinite() & ref.isfinite()
            s["calls"] += 1
            s["outputs"] += int(ref.isfinite().sum())
            s["nan_outputs"] += int((out.isnan() & ref.isfinite()).sum())
            s["calls_with_nan"] += int(bool(out.isnan().any()))
            if fin.any():
                err = float((out - ref).abs()[fin].max()) / vmax
                s["max_abs_err_over_vmax"] = max(s["max_abs_err_over_vmax"], err)
    atomic_write_json(args.out, {"name": "pa_decode_checks", "provenance": provenance(),
                                 "params": {"calls": args.calls}, "summary": summary})
    print(summary)


if __name__ == "__main__":
    main()
