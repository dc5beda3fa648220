"""``fa-lab``: the lab's command line.

    fa-lab table [--which bf16|fp8|both] [--full] [--device cuda] [--B .. --S .. --H ..]
    fa-lab bench [--suite dense,splitk,varlen] [--shapes 0,1,..] [--impls a,b,..] [--sweep]
                 [--out-dir DIR] [--no-save]
    fa-lab lab                       JupyterLab on notebooks/
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import pandas as pd

from . import experiments as ex


def _fmt_rel(x):
    return "—" if x is None or pd.isna(x) else f"{x:.3e}"


def _fmt_pct(x):
    return "—" if x is None or pd.isna(x) else f"{x:.2f}%"


def format_bf16(table: pd.DataFrame) -> str:
    """The bf16 table beside the seed's figures, as text."""
    wide = ex.bf16_versus_seed(table)
    lines = [f"{'K':>4} | {'unfixed rel-L2':>14} {'NaN':>8} {'(seed)':>8} | "
             f"{'lazy rel-L2':>11} {'(seed)':>9} | {'eager rel-L2':>12} {'(seed)':>9}"]
    for _, r in wide.iterrows():
        lines.append(
            f"{int(r.k_scale):>4} | {_fmt_rel(r.get('lazy_unfixed_rel_l2')):>14} "
            f"{_fmt_pct(r.get('lazy_unfixed_nan_pct')):>8} {_fmt_pct(r.get('seed_unfixed_nan_pct')):>8} | "
            f"{_fmt_rel(r.get('lazy_rel_l2')):>11} {_fmt_rel(r.get('seed_lazy_rel_l2')):>9} | "
            f"{_fmt_rel(r.get('eager_rel_l2')):>12} {_fmt_rel(r.get('seed_eager_rel_l2')):>9}")
    unf = table[(table.policy == "lazy_unfixed") & (table.nan_rows > 0)]
    for _, r in unf.iterrows():
        lines.append(f"K x{int(r.k_scale)}: {r.nan_rows} NaN rows, LSE +inf on "
                     f"{r.nan_rows_lse_posinf}, NaN on {r.nan_rows_lse_nan}, finite on "
                     f"{r.nan_rows_lse_finite}; good rows' LSE in "
                     f"[{r.good_lse_min:.1f}, {r.good_lse_max:.1f}]")
    return "\n".join(lines)


def format_fp8(table: pd.DataFrame) -> str:
    wide = ex.fp8_versus_seed(table)
    lines = [f"{'k':>6} {'variant':>10} | {'mean|o-1|':>9} {'(seed)':>7} | {'NaN':>12} {'(seed)':>10}"]
    for _, r in wide.iterrows():
        sm = "" if r.seed_mean_abs_dev is None or pd.isna(r.seed_mean_abs_dev) else f"{r.seed_mean_abs_dev:.4f}"
        sn = "" if r.seed_nan is None or pd.isna(r.seed_nan) else f"{r.seed_nan:,.0f}"
        mad = "nan" if pd.isna(r.mean_abs_dev) else f"{r.mean_abs_dev:.4f}"
        lines.append(f"{int(r.k_scale):>6} {r.variant:>10} | {mad:>9} {sm:>7} | {int(r.nan):>12,} {sn:>10}")
    return "\n".join(lines)


def _table(args) -> int:
    which = ["bf16", "fp8"] if args.which == "both" else [args.which]
    for kind in which:
        sizes = dict(ex.SEED_SIZES[kind] if args.full else ex.CPU_SIZES[kind])
        for key in ("B", "S", "H"):
            if getattr(args, key) is not None:
                sizes[key] = getattr(args, key)
        common = dict(causal=args.causal, seed=args.seed, device=args.device, backend=args.backend)
        print(f"\n== {kind} table: {sizes}, causal={args.causal}, seed={args.seed}, device={args.device}")
        if kind == "bf16":
            table = ex.bf16_table(**sizes, **common)
            print(format_bf16(table))
            seed = ex.SEED_SIZES["bf16"]
        else:
            table = ex.fp8_table(**sizes, **common, saturate=args.fp8_saturate)
            print(format_fp8(table))
            seed = ex.SEED_SIZES["fp8"]
        if {k: sizes[k] for k in seed} != seed:
            print("(sizes differ from the seed's: NaN onset and counts scale with S, "
                  "since a longer KV walk gives more chances to be dragged)")
        if not args.no_save:
            name = args.name or f"table_{kind}_{args.device.split(':')[0]}_S{sizes['S']}"
            path = ex.save_result(name, table, device=args.device,
                                  params={**sizes, "causal": args.causal, "seed": args.seed,
                                          "backend": args.backend,
                                          **({"fp8_saturate": args.fp8_saturate} if kind == "fp8" else {})})
            print(f"saved {path}")
    return 0


def _bench(args) -> int:
    from . import bench

    suites = tuple(x for x in args.suite.split(",") if x)
    impls = tuple(args.impls.split(",")) if args.impls else None
    try:
        jobs = bench.suite_jobs(suites, impls)
    except ValueError as e:
        raise SystemExit(f"fa-lab bench: {e}")
    if args.shapes:
        try:
            jobs = [jobs[int(i)] for i in args.shapes.split(",")]
        except (ValueError, IndexError):
            raise SystemExit(f"--shapes takes indices 0..{len(jobs) - 1} into the shapes of "
                             f"--suite {','.join(suites)}, got {args.shapes!r}")
    shapes = [shape for _, shape, _ in jobs]
    params = {"suites": list(suites), "shapes": [s.name for s in shapes],
              "impls": sorted({i for _, _, chosen in jobs for i in chosen},
                              key=bench.ALL_IMPLS.index),
              "warmup_ms": args.warmup, "rep_ms": args.rep, "seed": args.seed}
    if args.sweep:
        table = bench.config_sweep(shapes[0], warmup=args.warmup, rep=args.rep, seed=args.seed)
        print(table.to_string(index=False))
        name = args.name or "bench_sweep"
    else:
        name = args.name or "bench_h200"
        tuning = []

        def save(table):  # after every shape: a cut-short run keeps what it measured
            if not args.no_save:
                done = list(dict.fromkeys(table["shape"]))
                return bench.save(table, name, directory=args.out_dir,
                                  params={**params, "completed_shapes": done,
                                          "autotune_timings": tuning})
        table = bench.run(jobs=jobs, warmup=args.warmup, rep=args.rep, seed=args.seed,
                          on_shape=save, tuning=tuning)
        print(bench.format_table(table))
        if not args.no_save:
            print(f"saved {save(table)}")
        return 0
    if not args.no_save:
        path = bench.save(table, name, directory=args.out_dir, params=params)
        print(f"saved {path}")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="fa-lab", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("table", help="reproduce the seed's bf16 / fp8 tables")
    t.add_argument("--which", choices=["bf16", "fp8", "both"], default="both")
    t.add_argument("--full", action="store_true", help="the seed's sizes (use a GPU)")
    t.add_argument("--B", type=int)
    t.add_argument("--S", type=int)
    t.add_argument("--H", type=int)
    t.add_argument("--causal", action="store_true", help="causal mask (the seed's tables are not)")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--device", default="cpu")
    t.add_argument("--backend", default="auto")
    t.add_argument("--fp8-saturate", dest="fp8_saturate", type=lambda s: s.lower() in ("1", "true", "yes"),
                   default=None, help="fp8 P cast saturates at 448 (true, default) or gives NaN (false)")
    t.add_argument("--name", help="result file name (data/results/<name>.json)")
    t.add_argument("--no-save", action="store_true")
    b = sub.add_parser("bench", help="forward TFLOP/s of the fast kernels beside SDPA and flex (CUDA)")
    b.add_argument("--suite", default="dense",
                   help="comma-separated suites of fa_lab.bench.SUITES: dense (default), splitk, varlen")
    b.add_argument("--shapes", help="comma-separated indices into the suites' shapes (default: all)")
    b.add_argument("--impls", help="comma-separated implementations (default: each suite's own; "
                   "given ones run where they apply)")
    b.add_argument("--sweep", action="store_true",
                   help="time each pinned launch config of the fast kernels at the first shape instead")
    b.add_argument("--warmup", type=int, default=25, help="do_bench warm-up, ms")
    b.add_argument("--rep", type=int, default=100, help="do_bench repetition time, ms")
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--name", help="result file name (default bench_h200, or bench_sweep)")
    b.add_argument("--out-dir", dest="out_dir", help="directory for the JSON (default data/results)")
    b.add_argument("--no-save", action="store_true")
    sub.add_parser("lab", help="JupyterLab on notebooks/")
    args = p.parse_args(argv)
    if args.cmd == "table":
        return _table(args)
    if args.cmd == "bench":
        return _bench(args)
    if args.cmd == "lab":
        root = ["--allow-root"] if hasattr(os, "geteuid") and os.geteuid() == 0 else []
        return subprocess.call([sys.executable, "-m", "jupyter", "lab", *root, str(ex.ROOT / "notebooks")])
    return 2


if __name__ == "__main__":
    sys.exit(main())
