"""Record how a forward failure reaches dQ, dK and dV under each policy
(``fa_lab.studies.propagation``): data/results/bwd_propagation.json, one row per case and
policy (the forward's non-finite rows and LSE, the backward's recomputed P, each gradient's
non-finite rows), and the counts as a table.

    OMP_NUM_THREADS=1 python benchmarks/bwd_propagation.py --out data/results/bwd_propagation.json
"""

from __future__ import annotations

import argparse
import time

import torch

from fa_lab import results
from fa_lab.studies import propagation as P


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    rows = P.table()
    table = [P.summary(r) for r in rows]
    for r in table:
        print(r, flush=True)
    results.atomic_write_json(args.out, {
        "name": "bwd_propagation", "provenance": results.provenance(threads=1),
        "params": {"cases": list(P.CASES), "policies": list(P.POLICIES), "backend": "emulator",
                   "backward": "fa_lab.kernels.bwd models (FlyDSL's dQ with its LSE floor, dK/dV)"},
        "table": table, "rows": rows, "wall_s": time.perf_counter() - t0})


if __name__ == "__main__":
    main()
