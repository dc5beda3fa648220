"""``fa-lab sweep``: a grid of points on Dask (``fa_lab.studies.sweep``)."""

from __future__ import annotations


from .args import UsageError, add_bool_flag, add_import_flag, import_policies, positive_int

HELP = "run a grid of points on Dask (results in data/atlas/<name>/)"


def add_arguments(s) -> None:
    """The ``fa-lab sweep`` arguments, on parser ``s``."""
    from fa_lab.studies.sweep.grid import ATLAS_DIR

    s.add_argument("grid", help="the grid, a YAML file of axis: [values]")
    s.add_argument("--scheduler", help="an existing Dask scheduler (tcp://host:8786); default: "
                   "a LocalCluster on this machine")
    s.add_argument("--name", help="results in <out>/<name>/ (default: the grid's name: or file stem)")
    s.add_argument("--workers", type=positive_int, default=2,
                   help="LocalCluster worker processes (default 2)")
    s.add_argument("--out", help=f"results directory (default {ATLAS_DIR})")
    s.add_argument("--batch", type=positive_int, default=1, help="points per Parquet part (default 1)")
    s.add_argument("--counts", choices=("auto", "always", "never"), default="auto",
                   help="rescale counts: where free (auto), always (bf16), never")
    add_bool_flag(s, "--no-progress", dest="no_progress", help="no progress bar")
    add_import_flag(s)


def run(args) -> int:
    """Run ``fa-lab sweep`` from parsed arguments; returns the exit status."""
    from fa_lab.studies import sweep

    import_policies(args.imports)
    try:
        grid = sweep.Grid.from_yaml(args.grid)
    except FileNotFoundError as e:
        raise UsageError(str(e)) from None
    client = None
    if args.scheduler:
        from distributed import Client
        client = Client(args.scheduler)
    try:
        table = sweep.run(grid, client=client, out=args.out, name=args.name, workers=args.workers,
                          progress=not args.no_progress, counts=args.counts, batch=args.batch,
                          raise_errors=False)
    finally:
        if client is not None:
            client.close()
    a = table.attrs
    name = args.name or grid.name
    print(f"{a['points']} points: {a['skipped']} already done, {a['computed']} computed, "
          f"{a['failed']} failed -> {sweep.sweep_dir(name, args.out)}")
    return 1 if a["failed"] else 0
