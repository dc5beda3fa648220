"""``fa-lab show``: the results reader. Without a name it lists the results folder (``--out-dir``,
else ``$FA_LAB_RESULTS``, else ./fa_lab_results): each JSON result with its number of rows,
date and command, then each sweep under ``atlas/``. With a name it prints that result: its
plain fields one a line, and each list of records (``rows``, and any other) as a table.
``--reference`` reads the lab's reference data (``data/results/``) instead.

Reading only: nothing is written, and a missing name is one line that lists what exists."""

from __future__ import annotations

import json

from fa_lab import results

from .args import UsageError, add_bool_flag, add_out_dir_flag

HELP = "list the results folder, or print a stored result as a table"

#: The widest a plain field's value is printed before it is cut (characters).
FIELD_WIDTH = 200


def add_arguments(p) -> None:
    p.add_argument("name", nargs="?", help="a result's name (without .json); none: list them")
    add_out_dir_flag(p, "the results to read")
    add_bool_flag(p, "--reference", dest="reference",
                  help="read the lab's reference data (data/results/) instead")
    p.add_argument("--columns", metavar="A,B,..", default=None,
                   help="the table's columns to print, comma-separated (default: all)")


def _folder(args):
    if args.reference:
        if args.out_dir is not None:
            raise UsageError("--reference and --out-dir name two folders; give one")
        return results.REFERENCE_DIR
    return results.results_dir(args.out_dir)


def _records(value) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(r, dict) for r in value)


def _plain(value) -> str:
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    return text if len(text) <= FIELD_WIDTH else text[:FIELD_WIDTH - 3] + "..."


def listing(folder) -> list[str]:
    """The lines ``fa-lab show`` prints for ``folder``: one per result, then per sweep."""
    names = results.list(root=folder)
    lines = [f"{folder}: {len(names)} result(s)"]
    for name in names:
        try:
            r = results.load(name, root=folder)
        except ValueError as e:                      # a damaged file: say so, list the rest
            lines.append(f"  {name}  (unreadable: {' '.join(str(e).split())})")
            continue
        prov = r.get("provenance") or {}
        rows = r.get("rows")
        size = f"{len(rows)} rows" if isinstance(rows, list) else "no rows"
        when = str(prov.get("date", ""))[:19]
        lines.append(f"  {name:<32} {size:>9}  {when:<19}  {_plain(prov.get('command', ''))}")
    atlas = folder / "atlas"
    sweeps = sorted(p.name for p in atlas.iterdir() if p.is_dir()) if atlas.is_dir() else []
    if sweeps:
        lines.append(f"sweeps in {atlas}: {', '.join(sweeps)} (fa_lab.studies.sweep.load)")
    return lines


def table_of(records, columns=None) -> str:
    """``records`` (a list of dicts) as a text table; ``columns`` picks and orders them."""
    import pandas as pd

    frame = pd.DataFrame.from_records(records)
    if columns:
        missing = [c for c in columns if c not in frame.columns]
        if missing:
            raise UsageError(f"--columns: no column {', '.join(map(repr, missing))}; the "
                             f"table has {', '.join(map(str, frame.columns))}")
        frame = frame[columns]
    with pd.option_context("display.max_rows", None, "display.max_columns", None,
                           "display.width", 200, "display.max_colwidth", 60):
        return frame.to_string(index=False)


def show(result, columns=None) -> list[str]:
    """The lines ``fa-lab show NAME`` prints for a loaded result."""
    lines, tables = [], []
    for key, value in result.items():
        (tables if _records(value) else lines).append((key, value))
    out = [f"{key}: {_plain(value)}" for key, value in lines]
    if not tables:
        return out
    for key, value in tables:
        picked = columns if key == "rows" else None
        out += ["", f"{key} ({len(value)}):", table_of(value, picked)]
    return out


def run(args) -> int:
    folder = _folder(args)
    columns = [c.strip() for c in args.columns.split(",") if c.strip()] if args.columns else None
    if args.name is None:
        if columns:
            raise UsageError("--columns applies to a result: name one")
        print("\n".join(listing(folder)))
        return 0
    result = results.load(args.name, root=folder)
    print("\n".join(show(result, columns)))
    return 0
