"""Record the lessons' heavy computations (``fa_lab.lab.recorded``) at the lessons' CPU
sizes in the lab's reference data, data/results/<name>.json, so that the lessons read them
back instead of computing them for a minute on a busy CPU. A lesson computes a record live
whenever its sizes differ from the ones below (``FULL = True`` on a GPU). Rerun this after a
change to the model, on one torch thread (tests/lab/test_lesson_records.py fails on a stale
record):

    OMP_NUM_THREADS=1 python benchmarks/lesson_records.py [NAME ...]
"""

from __future__ import annotations

import sys
import time

import torch

from fa_lab.lab import recorded

#: The lessons' CPU sizes, as their cells pass them (notebooks/02_lazy_rescale.ipynb,
#: notebooks/03_fp8.ipynb).
PARAMS = {
    "lesson02_sweep": dict(k_grid=(24, 32, 48, 64), thr_grid=(8, 16, 32, 64, 96), rows=256,
                           skv=4096, heads=1, kv_grid=(1024, 2048, 4096, 8192), trace_k=32),
    "lesson02_fates": dict(k_scale=32, rows=256, skv=8192, heads=16),
    "lesson03_table": dict(k_scales=(1000, 5000, 20000), rows=256, heads=1),
    "lesson03_casts": dict(k_scale=1000, rows=256,
                           settings=((8.0, 0.0), (8.84, 0.0), (9.0, 0.0), (12.0, 0.0),
                                     (16.0, 0.0), (8.0, 1.0))),
}


def main(names):
    torch.set_num_threads(1)
    for name in names or PARAMS:
        t0 = time.perf_counter()
        path = recorded.save(name, **PARAMS[name])
        print(f"{name}: {time.perf_counter() - t0:.1f} s -> {path}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
