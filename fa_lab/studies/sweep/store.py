"""Where a sweep's rows go: Parquet parts, one per batch of points, written atomically
into the sweep's folder beside its grid; which points are done; loading and compacting.

A user's sweep ``name`` lives in ``<results folder>/atlas/<name>/`` (``out``: the results
folder, default ``$FA_LAB_RESULTS`` or ./fa_lab_results, as ``fa_lab.results``); the lab's
reference sweeps in ``data/atlas/<name>/``, read with ``reference(name)``. A sweep folder
holds ``part-*.parquet`` files and, beside them, files whose names start with ``_``
(``_grid-<hash>.json``: the grid as run), which Parquet readers skip, so
``pandas.read_parquet(folder)`` reads the parts alone. Each kind of grid has its
``Layout`` (``POLICY``: ``SCHEMA``; ``DECODE``: ``DECODE_SCHEMA``); a folder's kind is told
by its parts' columns, and a grid of one kind never runs in a folder of the other."""

from __future__ import annotations

import math
import uuid
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.dataset as pads
import pyarrow.parquet as pq

from fa_lab import results

from .grid import ATLAS, REFERENCE_ATLAS_DIR, check_name


_I, _F, _S, _B = pa.int64(), pa.float64(), pa.string(), pa.bool_()


#: Where and how a row was computed: the same columns in every kind of sweep.
_PROVENANCE = [
    ("fa_lab_version", _S), ("torch_version", _S), ("triton_version", _S),
    ("python_version", _S), ("device_name", _S), ("hostname", _S), ("worker", _S), ("pid", _I),
    ("torch_threads", _I), ("git_commit", _S), ("timestamp", _S),
    ("kernel_s", _F), ("ref_s", _F), ("wall_s", _F),
]


#: Every column of the results table, in order.
SCHEMA = pa.schema([
    ("point_id", _S), ("sweep", _S), ("run_id", _S),
    ("policy", _S), ("dtype", _S), ("backend", _S), ("device", _S), ("B", _I), ("S", _I),
    ("H", _I), ("D", _I), ("causal", _B), ("k_scale", _F), ("threshold", _F),
    ("threshold_asked", _S), ("seed", _I),
    ("kernel", _S), ("policy_resolved", _S), ("threshold_used", _F),
    ("elements", _I), ("rows", _I), ("nan", _I), ("inf", _I), ("nan_frac", _F), ("inf_frac", _F),
    ("nan_rows", _I), ("inf_rows", _I), ("bad_rows", _I), ("bad_row_frac", _F),
    ("rel_l2", _F), ("rel_l2_finite_rows", _F), ("mean_abs_dev", _F),
    ("bad_rows_lse_posinf", _I), ("bad_rows_lse_neginf", _I), ("bad_rows_lse_finite", _I),
    ("bad_rows_lse_nan", _I), ("nan_rows_lse_posinf", _I), ("nan_rows_lse_nan", _I),
    ("nan_rows_lse_finite", _I), ("good_lse_min", _F), ("good_lse_max", _F),
    ("ref_nonfinite_rows", _I),
    ("loop_wave_steps", _I), ("o_multiplies", _I), ("o_rescale_skip_frac", _F),
    ("rows_swept", _I), ("rows_scaled_up", _I), ("row_steps", _I), ("counts_source", _S),
    *_PROVENANCE,
])


#: Every column of a decode sweep's table (``decode_point.compute_decode_point``), in order.
DECODE_SCHEMA = pa.schema([
    ("point_id", _S), ("sweep", _S), ("run_id", _S),
    ("kernel", _S), ("upstream", _S), ("backend", _S), ("device", _S), ("page_size", _I),
    ("num_partitions", _I), ("num_partitions_used", _I), ("query_length", _I), ("scales", _S),
    ("window", _I), ("group", _I), ("head_dim", _I), ("p_headroom", _F), ("context", _I),
    ("spread", _F), ("seed", _I),
    ("rows", _I), ("undefined", _I), ("nan_rows", _I), ("nan", _I), ("inf", _I),
    ("nan_frac", _F), ("max_err", _F), ("rel_l2", _F), ("mass_loss", _F), ("violated", _S),
    *_PROVENANCE,
])


@dataclass(frozen=True)
class Layout:
    """What a kind of sweep stores: its ``schema``, the columns its table sorts by and the
    columns that name a point (``name_key``) with their Python types."""

    kind: str
    schema: pa.Schema
    sort: tuple
    name_key: tuple
    types: dict


def _table(rows: list[dict], schema: pa.Schema = SCHEMA) -> pa.Table:
    extra = set().union(*(r.keys() for r in rows)) - set(schema.names)
    if extra:
        raise ValueError(f"row columns missing from the schema: {sorted(extra)}")
    return pa.Table.from_pylist(rows, schema=schema)


def sweep_dir(name: str, out=None) -> Path:
    """The folder of sweep ``name``: ``<out>/atlas/<name>/``, ``out`` the results folder
    (``fa_lab.results.results_dir``)."""
    return results.results_dir(out) / ATLAS / check_name(name)


def _parts(directory: Path) -> list[Path]:
    return sorted(directory.glob("part-*.parquet"))


def _write_part(directory: Path, fname: str, rows: list[dict], layout: Layout | None = None) -> Path:
    """Write rows to ``directory/fname`` atomically (``fa_lab.results.atomic_write_bytes``)."""
    sink = pa.BufferOutputStream()
    pq.write_table(_table(rows, (layout or POLICY).schema), sink)
    return results.atomic_write_bytes(directory / fname, sink.getvalue().to_pybytes())


def _read(files: list[Path], columns=None, layout: Layout | None = None) -> pa.Table:
    """The parts as one table. Each part's schema is checked first (its footer alone): a
    part that is not Parquet, or lacks a column of the layout's schema (which a dataset read would
    fill with nulls), raises ``ValueError`` naming the file and what is wrong with it."""
    schema = (layout or POLICY).schema
    for f in files:
        try:
            have = pq.read_schema(f)
        except (pa.ArrowException, OSError) as e:
            raise ValueError(f"{f}: not a readable Parquet part of a sweep (truncated or "
                             f"not Parquet: {_first_line(e)})") from None
        missing = [n for n in schema.names if n not in have.names]
        wrong = [n for n in have.names if n in schema.names
                 and not have.field(n).type.equals(schema.field(n).type)
                 and not pa.types.is_null(have.field(n).type)]
        if missing or wrong:
            what = (f"missing column(s) {', '.join(missing)}" if missing else
                    "column(s) of another type: " + ", ".join(
                        f"{n} is {have.field(n).type}, not {schema.field(n).type}" for n in wrong))
            raise ValueError(f"{f}: not a part of a sweep of this fa_lab: {what}")
    try:
        return pads.dataset([str(f) for f in files], format="parquet",
                            schema=schema).to_table(columns=columns)
    except (pa.ArrowException, OSError) as e:  # a footer that reads over a body that does not
        raise ValueError(f"{files[0].parent}: a Parquet part does not read: "
                         f"{_first_line(e)}") from None


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def done_points(name: str, *, out=None, kind: str | None = None) -> set[str]:
    """point_ids that have a row in the sweep's parts. ``kind``: the kind of grid about to
    run there; a folder that holds the other kind's parts raises ``ValueError``."""
    files = _parts(sweep_dir(name, out))
    if not files:
        return set()
    layout = _layout_of(files, kind)
    t = _read(files, columns=["point_id"], layout=layout)
    return set(t.column("point_id").to_pylist())


_SORT = ("policy", "dtype", "backend", "device", "B", "S", "H", "D", "causal", "k_scale",
         "threshold", "seed")


#: The columns that name a point: its axes, the policy by name. A stored row and a point
#: with the same name but another point_id were computed under another definition of the
#: policy (``grid.policy_definition``); the newest row of a name is the current one.
NAME_KEY = ("policy", "dtype", "backend", "device", "B", "S", "H", "D", "causal", "k_scale",
            "threshold_asked", "seed")

POLICY = Layout("policy", SCHEMA, _SORT, NAME_KEY,
                {"B": int, "S": int, "H": int, "D": int, "seed": int, "causal": bool,
                 "k_scale": float})

#: A decode point's name: its axes as run (a kernel's fixed values included). Another
#: point_id under the same name: another definition of the upstream version or the inputs.
_DECODE_AXES = ("kernel", "upstream", "backend", "page_size", "num_partitions", "query_length",
                "scales", "window", "group", "head_dim", "p_headroom", "context", "spread", "seed")
DECODE = Layout("decode", DECODE_SCHEMA, _DECODE_AXES, _DECODE_AXES,
                {**{a: int for a in ("page_size", "num_partitions", "query_length", "window",
                                     "group", "head_dim", "context", "seed")},
                 "p_headroom": repr, "spread": float})

LAYOUTS = {"policy": POLICY, "decode": DECODE}


def _layout_of(files: list[Path], kind: str | None = None) -> Layout:
    """The layout of a sweep's parts, told by the first part's columns (a decode part has
    ``query_length``); with ``kind``, a folder of the other kind raises ``ValueError``."""
    try:
        names = pq.read_schema(files[0]).names
    except (pa.ArrowException, OSError):
        names = []  # _read names the file and what is wrong with it
    found = DECODE if "query_length" in names else POLICY
    if kind is not None and kind != found.kind:
        raise ValueError(f"{files[0].parent} holds a {found.kind} sweep's points; a {kind} "
                         "grid cannot run there: give it another name")
    return found


def name_key(row, layout: Layout = POLICY) -> tuple:
    """A point's or a row's name (the layout's ``name_key``) as plain Python values."""
    def value(c):
        x = row[c]
        if layout.types.get(c) is repr:  # a float that may be NaN (n/a): NaN names alike
            return "n/a" if x is None or x != x else repr(float(x))
        return layout.types.get(c, str)(x)
    return tuple(value(c) for c in layout.name_key)


def stored_names(name: str, *, out=None) -> dict:
    """The sweep's stored rows: name key -> the point_ids stored under it."""
    files = _parts(sweep_dir(name, out))
    if not files:
        return {}
    layout = _layout_of(files)
    t = _read(files, columns=["point_id", *layout.name_key], layout=layout).to_pylist()
    names: dict = {}
    for r in t:
        names.setdefault(name_key(r, layout), set()).add(r["point_id"])
    return names


def load(name: str, *, out=None) -> pd.DataFrame:
    """The table of sweep ``name`` in the results folder ``out`` (one row per point; the
    newest row where a point ran twice), sorted by the grid's axes; a decode sweep's table
    has ``DECODE_SCHEMA``'s columns. A sweep that has no folder raises
    ``FileNotFoundError`` naming the folder and the sweeps there."""
    return _load(sweep_dir(name, out))


def reference(name: str) -> pd.DataFrame:
    """The lab's reference sweep ``name`` (``data/atlas/<name>/``), as ``load``."""
    return _load(REFERENCE_ATLAS_DIR / check_name(name), what="reference sweep")


def references() -> list[str]:
    """Names of the lab's reference sweeps, sorted."""
    return _names(REFERENCE_ATLAS_DIR)


def _names(atlas: Path) -> list[str]:
    return sorted(p.name for p in atlas.iterdir() if p.is_dir()) if atlas.is_dir() else []


def _load(directory: Path, what: str = "sweep") -> pd.DataFrame:
    if not directory.is_dir():
        have = ", ".join(_names(directory.parent)) or "(none)"
        raise FileNotFoundError(f"no {what} {directory.name!r}: {directory} does not exist; "
                                f"sweeps in {directory.parent}: {have}")
    files = _parts(directory)
    if not files:
        return SCHEMA.empty_table().to_pandas()
    layout = _layout_of(files)
    df = _read(files, layout=layout).to_pandas()
    df = df.sort_values("timestamp", kind="stable").drop_duplicates("point_id", keep="last")
    # a definition changed under its name: its newest rows are the current definition's
    df = df.drop_duplicates(list(layout.name_key), keep="last")
    return df.sort_values(list(layout.sort), kind="stable").reset_index(drop=True)


def compact(name: str, *, out=None) -> Path | None:
    """Merge the sweep's parts into one part (written before the old ones are removed: a
    crash in between leaves duplicates, which ``load`` drops)."""
    directory = sweep_dir(name, out)
    files = _parts(directory)
    if len(files) <= 1:
        return files[0] if files else None
    layout = _layout_of(files)
    df = _load(directory)
    rows = df.to_dict("records")
    merged = _write_part(directory, f"part-all-{uuid.uuid4().hex[:8]}.parquet",
                         [_from_pandas(r, layout.schema) for r in rows], layout)
    for f in files:
        f.unlink()
    return merged


def _from_pandas(r: dict, schema: pa.Schema = SCHEMA) -> dict:
    out = {}
    for field in schema:
        x = r.get(field.name)
        if x is None or (isinstance(x, float) and math.isnan(x) and not pa.types.is_floating(field.type)):
            x = None
        elif pa.types.is_integer(field.type):
            x = int(x)
        elif pa.types.is_boolean(field.type):
            x = bool(x)
        elif pa.types.is_floating(field.type):
            x = float(x)
        out[field.name] = x
    return out
