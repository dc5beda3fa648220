"""``fa-lab sweep``: a grid of points on Dask (``fa_lab.studies.sweep``).

``--kind decode`` (or ``kind: decode`` in the grid file) runs a grid of the serving decode
kernels (``sweep.DecodeGrid``: kernel, upstream, page size, partitions, query length,
scales, window, context, score spread). Its rows go to ``<results folder>/atlas/<name>/``
(``--out-dir``, else ``$FA_LAB_RESULTS``, else ./fa_lab_results). Ctrl-C stops it with what was saved kept: it says how many points
are saved and that rerunning the same command resumes, and exits with status 130."""

from __future__ import annotations

import sys

from fa_lab import results

from .args import (INTERRUPTED, UsageError, add_bool_flag, add_import_flag, add_out_dir_flag,
                   import_policies, positive_int)

HELP = "run a grid of points on Dask (results in <results folder>/atlas/<name>/)"


def add_arguments(s) -> None:
    """The ``fa-lab sweep`` arguments, on parser ``s``."""
    s.add_argument("grid", help="the grid, a YAML file of axis: [values]")
    s.add_argument("--kind", choices=("policy", "decode"), default=None,
                   help="the grid's kind: policy (flash_attn_func under rescale policies) or "
                        "decode (the decode kernels' axes); default: the file's kind:, else policy")
    s.add_argument("--scheduler", help="an existing Dask scheduler (tcp://host:8786); default: "
                   "a LocalCluster on this machine")
    s.add_argument("--name", help="results in <out-dir>/atlas/<name>/ (default: the grid's "
                   "name: or file stem)")
    s.add_argument("--workers", type=positive_int, default=2,
                   help="LocalCluster worker processes (default 2)")
    add_out_dir_flag(s, "the sweep (its rows go to <out-dir>/atlas/<name>/)")
    s.add_argument("--batch", type=positive_int, default=1, help="points per Parquet part (default 1)")
    s.add_argument("--counts", choices=("auto", "always", "never"), default="auto",
                   help="rescale counts of a policy grid: where free (auto), always (bf16), never")
    add_bool_flag(s, "--no-progress", dest="no_progress", help="no progress bar")
    add_import_flag(s)


def run(args) -> int:
    """Run ``fa-lab sweep`` from parsed arguments; returns the exit status."""
    from fa_lab.studies import sweep

    import_policies(args.imports)
    try:
        grid = sweep.open_grid(args.grid, kind=args.kind)
    except FileNotFoundError as e:
        raise UsageError(str(e)) from None
    name = sweep.check_name(args.name or grid.name)
    folder = sweep.sweep_dir(name, args.out_dir)
    results.check_writable(folder, f"the sweep's folder {folder}")  # before the grid's planning
    total = len(grid.points())  # every check of the grid, before any work
    client = None
    try:
        if args.scheduler:
            from distributed import Client
            client = Client(args.scheduler)
        table = sweep.run(grid, client=client, out=args.out_dir, name=name,
                          workers=args.workers, progress=not args.no_progress,
                          counts=args.counts, batch=args.batch, raise_errors=False)
    except KeyboardInterrupt:
        saved = len(sweep.done_points(name, out=args.out_dir) & {
            p["point_id"] for p in grid.points()})
        print(f"\nfa-lab sweep: interrupted: {saved} of {total} points are saved in {folder}; "
              f"rerun the same command to resume (the saved points are skipped)",
              file=sys.stderr, flush=True)
        return INTERRUPTED
    finally:
        if client is not None:
            client.close()
    a = table.attrs
    print(f"{a['points']} points: {a['skipped']} already done, {a['computed']} computed, "
          f"{a['failed']} failed -> {folder}")
    return 1 if a["failed"] else 0
