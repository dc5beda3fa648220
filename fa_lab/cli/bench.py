"""``fa-lab bench``: forward TFLOP/s of what users call, the kernels alone and the peers,
in interleaved rounds on a GPU (``fa_lab.studies.bench``)."""

from __future__ import annotations

import sys

from fa_lab import results

from .args import (UsageError, add_bool_flag, add_out_dir_flag, device_arg, nonnegative_int,
                   positive_int, result_name, seed_int)

HELP = "forward TFLOP/s of flash_attn_func(backend='fast'), the kernels alone, SDPA and flex (CUDA)"


def add_arguments(b):
    b.add_argument("--suite", default="dense",
                   help="comma-separated suites of fa_lab.studies.bench.SUITES: dense (default), splitk, varlen")
    b.add_argument("--shapes", help="comma-separated indices into the suites' shapes (default: all)")
    b.add_argument("--impls", help="comma-separated implementations (default: each suite's own; "
                   "given ones run where they apply)")
    add_bool_flag(b, "--sweep",
                  help="time each pinned launch config of the fast kernels at the first shape instead")
    b.add_argument("--rounds", type=positive_int, default=5,
                   help="interleaved rounds per shape: each times every implementation once, in an "
                   "order rotated from round to round (default 5; fewer make the min-max spread "
                   "a weak guide)")
    b.add_argument("--min-calls", dest="min_calls", type=positive_int, default=10,
                   help="calls per implementation per round, at least (default 10)")
    b.add_argument("--rep", type=positive_int, default=100,
                   help="ms of calls per implementation per round, at least (default 100; "
                   "with --sweep: do_bench's repetition time)")
    b.add_argument("--warmup", type=nonnegative_int, default=25,
                   help="ms of untimed calls per implementation before the first round (default 25; "
                   "with --sweep: do_bench's warm-up)")
    b.add_argument("--device", type=device_arg, default=None,
                   help="cuda (default), cuda:N, or cpu (perf_counter timing, for trying the harness "
                   "on small shapes: the fast kernels need a GPU)")
    b.add_argument("--seed", type=seed_int, default=0, help="input seed, 0 .. 2**63 - 1")
    b.add_argument("--name", type=result_name,
                   help="result file name (default bench_h200, or bench_sweep)")
    add_out_dir_flag(b)
    add_bool_flag(b, "--no-save", dest="no_save", help="print only, write no result file")


def run(args) -> int:
    import time

    import torch

    from fa_lab.studies import bench

    suites = tuple(x.strip() for x in args.suite.split(",") if x.strip())
    unknown = [s for s in suites if s not in bench.SUITES]
    if not suites or unknown:
        raise UsageError(f"--suite: unknown suites {unknown or [args.suite]}; "
                         f"choose from {', '.join(bench.SUITES)}")
    impls = None
    if args.impls is not None:
        impls = tuple(x.strip() for x in args.impls.split(",") if x.strip())
        unknown = [i for i in impls if i not in bench.ALL_IMPLS]
        if not impls or unknown:
            raise UsageError(f"--impls: unknown implementations "
                             f"{unknown or [args.impls]}; choose from {', '.join(bench.ALL_IMPLS)}")
    jobs = bench.suite_jobs(suites, impls)
    if not args.no_save:
        results.check_folder(args.out_dir)  # before anything is timed
    if args.shapes is not None:
        try:
            idx = [int(i) for i in args.shapes.split(",")]
            if not idx or any(not 0 <= i < len(jobs) for i in idx):
                raise IndexError
        except (ValueError, IndexError):
            raise UsageError(f"--shapes takes indices 0..{len(jobs) - 1} into the "
                             f"shapes of --suite {','.join(suites)}, got {args.shapes!r}") from None
        jobs = [jobs[i] for i in idx]
    device = args.device or "cuda"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise UsageError("the benchmark times GPU kernels: it needs a CUDA GPU and none is "
                         "available on this machine (torch.cuda.is_available() is False)")
    if args.sweep and not device.startswith("cuda"):
        raise UsageError(f"--sweep times pinned GPU launch configs: it needs a CUDA device, "
                         f"got --device {device}")
    shapes = [shape for _, shape, _ in jobs]
    params = {"suites": list(suites), "shapes": [s.name for s in shapes],
              "impls": sorted({i for _, _, chosen in jobs for i in chosen},
                              key=bench.ALL_IMPLS.index),
              "warmup_ms": args.warmup, "rep_ms": args.rep, "seed": args.seed}
    if args.sweep:
        table = bench.config_sweep(shapes[0], warmup=args.warmup, rep=args.rep, seed=args.seed)
        print(table.to_string(index=False))
        name = args.name if args.name is not None else "bench_sweep"
        if not args.no_save:
            path = bench.save(table, name, directory=args.out_dir, params=params)
            print(f"saved {path}")
        return 0
    name = args.name if args.name is not None else "bench_h200"
    params.update(rounds=args.rounds, min_calls=args.min_calls, device=device)
    if args.rounds < 5:
        print(f"note: {args.rounds} round(s), as asked: with fewer than 5 the min-max spread is "
              f"a weak guide to the noise", file=sys.stderr, flush=True)
    if device == "cpu":
        print("note: --device cpu times the harness with perf_counter; the fast kernels need a GPU "
              "and the suites' shapes are GPU-sized", file=sys.stderr, flush=True)
    tuning = []
    started = time.perf_counter()

    def save(table):  # after every shape: a cut-short run keeps what it measured
        if not args.no_save:
            done = list(dict.fromkeys(table["shape"]))
            return bench.save(table, name, directory=args.out_dir, device=device, tuning=tuning,
                              params={**params, "completed_shapes": done,
                                      "seconds": round(time.perf_counter() - started, 1)})
    table = bench.run(jobs=jobs, device=device, rounds=args.rounds, min_calls=args.min_calls,
                      warmup=args.warmup, rep=args.rep, seed=args.seed, on_shape=save,
                      tuning=tuning)
    print(bench.format_table(table))
    print(f"{len(shapes)} shape(s) in {time.perf_counter() - started:.0f} s")
    if not args.no_save:
        print(f"saved {save(table)}")
    return 0


