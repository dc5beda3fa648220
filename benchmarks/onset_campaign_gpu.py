"""The onset predictor's full-size validation runs on a GPU (the H200 campaign behind
data/results/onset_validation.json and data/atlas/): one part at a time, each written to
``OUT/onset_<part>.json`` after every K scale.

    python3 benchmarks/onset_campaign_gpu.py h200 --part bf16 --out DIR
"""

from __future__ import annotations

import time
from pathlib import Path

import pandas as pd

from fa_lab.studies.onset import predict, validate_grid
from fa_lab.studies.onset.validate import _sync


#: The committed grids' axes (data/atlas/*.yaml).
BF16_SEED = {"B": 2, "S": 8192, "H": 32, "D": 128, "k_scales": tuple(range(8, 65, 4)),
             "thresholds": tuple(range(2, 13)),
             "policies": ("lazy_unfixed", "lazy", "fa4_row", "lazy_capped", "eager")}


FP8_SEED = {"B": 2, "S": 12288, "H": 8, "D": 128,
            "k_scales": (500, 1000, 2000, 5000, 10000, 20000), "thresholds": (2, 4, 6, 8, 10, 12),
            "policies": ("lazy_unfixed", "lazy_capped", "lazy", "eager")}


SCURVE = {"B": 2, "H": 32, "S": (512, 1024, 2048, 4096, 8192, 16384, 32768),
          "k_scales": (24, 28, 32, 36, 40)}


COST_S = (2048, 8192)


def _dump(df: pd.DataFrame, path, **extra) -> None:
    from fa_lab import results

    obj = {"rows": results._clean(df.to_dict("records")), **extra,
           "provenance": results.provenance(extra.get("device", "cpu"))}
    results.atomic_write_json(Path(path), obj)


def h200_run(part: str, out_dir, *, device="cuda", backend="triton", k_scales=None,
             thresholds=None) -> None:
    """One part of the full-size validation, written to ``out_dir/onset_<part>.json``
    after every K scale. ``bf16``: the committed bf16 grid, every cell, the model run
    beside the predictor (tile level everywhere, exact at thresholds 2, 8, 12). ``fp8``:
    the fp8 grid by the predictor, with model runs for lazy_unfixed and lazy_capped at
    threshold 8. ``scurve``: NaN onset over S at the seed's B, H, D for K 24..40 (the
    model beside the predictor). ``cost``: the emulator against the predictor, one cell.
    ``k_scales``: a subset of the grid's K scales (to finish a part that was cut short)."""
    from fa_lab import api
    from fa_lab.studies import experiments as ex

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    partial = k_scales is not None or thresholds is not None
    path = out_dir / f"onset_{part}{'_part' if partial else ''}.json"
    t0 = time.perf_counter()
    common = {"device": device, "backend": backend, "chunk_rows": 8192}
    if part == "bf16":
        g = dict(BF16_SEED, **({} if k_scales is None else {"k_scales": tuple(k_scales)}),
                 **({} if thresholds is None else {"thresholds": tuple(thresholds)}))
        validate_grid(**g, levels=("tile", "exact"), exact_thresholds=(2, 8, 12),
                      on_k=lambda df: _dump(df, path, part=part, wall_s=time.perf_counter() - t0,
                                            device=device), **common)
    elif part == "fp8":
        g = dict(FP8_SEED, **({} if k_scales is None else {"k_scales": tuple(k_scales)}))
        done = []  # the finished grids; on_k hands over the running grid's rows so far

        def save(df):
            _dump(pd.concat([*done, df], ignore_index=True), path, part=part,
                  wall_s=time.perf_counter() - t0, device=device)

        done.append(validate_grid(dtype="fp8", **g, levels=("tile",), model=False, on_k=save,
                                  **common))
        for pol in ("lazy_unfixed", "lazy_capped"):
            done.append(validate_grid(dtype="fp8", **{**g, "policies": (pol,), "thresholds": (8,)},
                                      levels=("tile", "exact"), on_k=save, **common))
    elif part == "scurve":
        tabs = []
        for S in SCURVE["S"]:
            tabs.append(validate_grid(B=SCURVE["B"], S=S, H=SCURVE["H"], D=128,
                                      k_scales=SCURVE["k_scales"] if k_scales is None
                                      else tuple(k_scales), thresholds=(8,),
                                      policies=("lazy_unfixed",), levels=("tile",), **common))
            _dump(pd.concat(tabs, ignore_index=True), path, part=part,
                  wall_s=time.perf_counter() - t0, device=device)
    elif part == "cost":
        rows = []
        for S in COST_S:
            q, k, v = ex.bf16_inputs(2, S, 32, 128, 32, device=device)
            kw = {"causal": False, "rescale": "lazy_unfixed", "rescale_threshold": 8.0}
            runs = {"emulator": (api.flash_attn_func, {"backend": "emulator"}),
                    backend: (api.flash_attn_func, {"backend": backend}),
                    "predict_tile": (predict, {"chunk_rows": 8192}),
                    "predict_exact": (predict, {"level": "exact", "chunk_rows": 8192})}
            for name, (fn, extra) in runs.items():
                fn(q, k, v, **kw, **extra)
                _sync(device)
                t1 = time.perf_counter()
                fn(q, k, v, **kw, **extra)
                _sync(device)
                rows.append({"S": S, "what": name, "seconds": time.perf_counter() - t1})
                _dump(pd.DataFrame(rows), path, part=part, device=device)
    else:
        raise ValueError(f"part={part!r}; choose bf16, fp8, scurve or cost")


def main(argv=None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m fa_lab.studies.onset")
    sub = p.add_subparsers(dest="cmd", required=True)
    h = sub.add_parser("h200", help="the full-size validation parts (a CUDA machine)")
    h.add_argument("--part", action="append", required=True)
    h.add_argument("--out", required=True)
    h.add_argument("--device", default="cuda")
    h.add_argument("--backend", default="triton")
    h.add_argument("--k", type=float, action="append", help="K scales (default: the grid's)")
    h.add_argument("--thr", type=float, action="append", help="thresholds (default: the grid's)")
    args = p.parse_args(argv)
    for part in args.part:
        t0 = time.perf_counter()
        h200_run(part, args.out, device=args.device, backend=args.backend, k_scales=args.k,
                 thresholds=args.thr)
        print(f"{part}: {time.perf_counter() - t0:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main())
