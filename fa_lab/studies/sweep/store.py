"""Where a sweep's rows go: Parquet parts, one per batch of points, written atomically
into the sweep's folder beside its grid; which points are done; loading and compacting."""

from __future__ import annotations

import math
import os
import tempfile
import uuid
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.dataset as pads
import pyarrow.parquet as pq

from .grid import ATLAS_DIR, check_name


_I, _F, _S, _B = pa.int64(), pa.float64(), pa.string(), pa.bool_()


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
    ("rows_dragged", _I), ("rows_scaled_up", _I), ("row_steps", _I), ("counts_source", _S),
    ("fa_lab_version", _S), ("torch_version", _S), ("triton_version", _S),
    ("python_version", _S), ("device_name", _S), ("hostname", _S), ("worker", _S), ("pid", _I),
    ("torch_threads", _I), ("git_commit", _S), ("timestamp", _S),
    ("kernel_s", _F), ("ref_s", _F), ("wall_s", _F),
])


def _table(rows: list[dict]) -> pa.Table:
    extra = set().union(*(r.keys() for r in rows)) - set(SCHEMA.names)
    if extra:
        raise ValueError(f"row columns missing from SCHEMA: {sorted(extra)}")
    return pa.Table.from_pylist(rows, schema=SCHEMA)


def sweep_dir(name: str, out=None) -> Path:
    return Path(ATLAS_DIR if out is None else out) / check_name(name)


def _parts(directory: Path) -> list[Path]:
    return sorted(directory.glob("part-*.parquet"))


def _write_part(directory: Path, fname: str, rows: list[dict]) -> Path:
    """Write rows to ``directory/fname`` atomically: a hidden temp file, then os.replace."""
    table = _table(rows)
    directory.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-", suffix=".parquet")
    try:
        with os.fdopen(fd, "wb") as f:
            pq.write_table(table, f)
        os.replace(tmp, directory / fname)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return directory / fname


def done_points(name: str, *, out=None) -> set[str]:
    """point_ids that have a row in the sweep's parts."""
    files = _parts(sweep_dir(name, out))
    if not files:
        return set()
    t = pads.dataset([str(f) for f in files], format="parquet", schema=SCHEMA).to_table(columns=["point_id"])
    return set(t.column("point_id").to_pylist())


_SORT = ("policy", "dtype", "backend", "device", "B", "S", "H", "D", "causal", "k_scale",
         "threshold", "seed")


def load(name: str, *, out=None) -> pd.DataFrame:
    """The sweep's table (one row per point; the newest row where a point ran twice),
    sorted by the grid's axes."""
    files = _parts(sweep_dir(name, out))
    if not files:
        return SCHEMA.empty_table().to_pandas()
    df = pads.dataset([str(f) for f in files], format="parquet", schema=SCHEMA).to_table().to_pandas()
    df = df.sort_values("timestamp", kind="stable").drop_duplicates("point_id", keep="last")
    return df.sort_values(list(_SORT), kind="stable").reset_index(drop=True)


def compact(name: str, *, out=None) -> Path | None:
    """Merge the sweep's parts into one part (written before the old ones are removed: a
    crash in between leaves duplicates, which ``load`` drops)."""
    directory = sweep_dir(name, out)
    files = _parts(directory)
    if len(files) <= 1:
        return files[0] if files else None
    df = load(name, out=out)
    rows = df.to_dict("records")
    merged = _write_part(directory, f"part-all-{uuid.uuid4().hex[:8]}.parquet",
                         [_from_pandas(r) for r in rows])
    for f in files:
        f.unlink()
    return merged


def _from_pandas(r: dict) -> dict:
    out = {}
    for field in SCHEMA:
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
