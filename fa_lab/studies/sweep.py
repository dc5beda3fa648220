"""Sweeps over (policy × K scale × threshold × S × causal × dtype × H × seed × backend) on Dask.

    from fa_lab.studies import sweep
    grid = sweep.Grid({"policy": ["lazy", "lazy_unfixed"], "k_scale": [8, 16, 32],
                       "threshold": [4, 8], "S": [2048], "H": [4]})
    table = sweep.run(grid, name="bf16_cpu")        # a LocalCluster: 2 processes, 1 thread each
    table = sweep.load("bf16_cpu")                  # the tidy table, one row per point

    fa-lab sweep GRID.yaml [--scheduler tcp://host:8786] [--name N] [--workers 2]

**The grid** is a product of named axes (``AXES``; ``seqlen``/``heads``/``batch``/
``head_dim`` are accepted for S/H/B/D). ``policy``, ``k_scale`` and ``S`` are required; the
others default to ``DEFAULTS``. A policy is a name, or any object that
``flash_attn_func(rescale=obj)`` takes (the table records ``getattr(p, "name", p)``).
Everything is checked before any task starts, and a bad grid raises ``GridError`` (a
ValueError) naming the axis: an unknown axis, an empty axis, a bad value, or a (policy,
dtype, backend) that fa_lab refuses. The check is fa_lab's own, with no work done:
``api.check_call`` on uninitialised CPU tensors of each distinct call, then
``dispatch.plan`` (routing and the chosen kernel's capabilities: dtypes, head dims, the
policy's vote and rebase, Python rules); ``triton`` points are planned as ``interpret``,
the same kernels with the same capabilities on CPU tensors. A threshold on a policy that
has none (eager) is dropped and such points run once (``threshold_asked`` reads "n/a").

**Each point is one Dask task** (``client.submit``, collected with ``as_completed``), so
Dask reschedules the points of a worker that dies. Points that run on a GPU (``triton``
and ``fast`` by default, or ``device: cuda``) ask for the worker resource ``GPU=1``. With
``client=None`` the sweep starts a ``LocalCluster(n_workers=2, threads_per_worker=1,
processes=True)`` whose workers run one torch thread each (``OMP_NUM_THREADS=1`` in their
environment and a worker plugin calling ``torch.set_num_threads(1)``).

**A point** builds the seed's inputs for its seed (``experiments.bf16_inputs``: K =
round(N(0,1) * k_scale); ``experiments.fp8_inputs``: k = 0.1 k_scale N(0,1), V = ones,
quantised per tensor), runs ``flash_attn_func(..., return_lse=True)`` (bf16 on the
emulator: ``count_rescales``, the same checked call through the model with a counter, so
the rescale counts come free), the fp32 reference, and ``compute_point`` returns one row:
NaN / inf / bad-row fractions, rel-L2 against fp32, the LSE state of the bad rows, rescale
counts, wall times and provenance (``SCHEMA`` lists every column).

**Results** are Parquet parts under ``data/atlas/<name>/``: one ``part-<point_id>.parquet``
per completed point (or per ``batch`` points), written by the client as each task
completes, to a temp file renamed into place. A rerun skips the points whose rows exist;
a killed sweep loses only the points in flight. ``load`` returns the pandas view and
``compact`` merges the parts into one file (for committing a finished grid).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import functools
import hashlib
import itertools
import json
import math
import numbers
import os
import platform
import re
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.dataset as pads
import pyarrow.parquet as pq
import torch

from fa_lab import results
from fa_lab.checks import parse_bool

ROOT = results.ROOT  # the checkout: its data/ holds the lab's reference data
ATLAS_DIR = ROOT / "data" / "atlas"

#: The grid's axes, in the order points are expanded (the first varies slowest).
AXES = ("policy", "dtype", "backend", "device", "B", "S", "H", "D", "causal", "k_scale",
        "threshold", "seed")
ALIASES = {"seqlen": "S", "heads": "H", "batch": "B", "head_dim": "D"}
REQUIRED = ("policy", "k_scale", "S")
#: Values of the axes a grid leaves out. ``threshold`` None: the policy's default;
#: ``device`` None: "cuda" for the GPU backends (triton, fast), else "cpu".
DEFAULTS = {"threshold": [None], "causal": [False], "dtype": ["bf16"], "H": [1], "seed": [0],
            "backend": ["emulator"], "B": [1], "D": [128], "device": [None]}
DTYPES = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}
#: Backends a sweep runs (``auto`` is refused: a table row names what ran; ``flydsl``
#: records no counts and needs an MI355X worker, which the sweep does not model).
BACKENDS = ("emulator", "interpret", "triton", "fast")
#: Backends whose points default to device "cuda" (and so ask for a GPU worker).
GPU_BACKENDS = ("triton", "fast")
#: The backend a point is checked as on the client's CPU tensors (same kernels and
#: capabilities): ``_plan``.
CPU_PROXY = {"triton": "interpret"}
DEVICES = ("cpu", "cuda")
BY_KV_LEN = "by_kv_len"
_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")

#: Columns that differ between two runs of the same point (times, who, when).
VOLATILE = ("sweep", "run_id", "wall_s", "kernel_s", "ref_s", "hostname", "worker", "pid",
            "timestamp")


class GridError(ValueError):
    """A grid refused before any task starts; ``axis`` names the axis at fault."""

    def __init__(self, axis: str, message: str):
        self.axis = axis
        super().__init__(f"axis {axis!r}: {message}")


class SweepError(RuntimeError):
    """Some points raised on their workers; ``failures`` maps point_id -> error text. The
    other points' rows were written."""

    def __init__(self, failures: dict, table: pd.DataFrame):
        self.failures = failures
        self.table = table
        first = "\n".join(f"  {k}: {v}" for k, v in list(failures.items())[:5])
        super().__init__(f"{len(failures)} point(s) failed (their rows are not written; a "
                         f"rerun retries them):\n{first}")


# ---- the grid ---------------------------------------------------------------------------

def _policy_name(p) -> str:
    return str(getattr(p, "name", p))


def _is_int(x) -> bool:  # numpy integers too
    return isinstance(x, numbers.Integral) and not isinstance(x, (bool, np.bool_))


def _is_number(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, (bool, np.bool_))


def _check_values(axis: str, spelled: str, values: list) -> list:
    """Axis-level checks of the values alone (types, ranges); returns canonical values."""
    def bad(msg):
        raise GridError(spelled, msg)

    out = []
    for x in values:
        if axis == "policy":
            if isinstance(x, str):
                if not x.strip():
                    bad("a policy name is empty")
            elif x is None or isinstance(x, (bool, int, float, list, dict, tuple)):
                bad(f"{x!r} is not a policy: give a policy name or a policy object")
        elif axis == "k_scale":
            if not _is_number(x) or not math.isfinite(x) or x <= 0:
                bad(f"{x!r} is not a finite number > 0")
            x = float(x)
        elif axis == "threshold":
            if x is None or x == BY_KV_LEN:
                pass
            elif not _is_number(x) or not math.isfinite(x) or x < 0:
                bad(f"{x!r} is not a finite number >= 0, None (the policy's default) "
                    f"or {BY_KV_LEN!r}")
            else:
                x = float(x)
        elif axis in ("S", "H", "B", "D"):
            if not _is_int(x) or x < 1:
                bad(f"{x!r} is not a positive int")
            x = int(x)
        elif axis == "seed":
            if not _is_int(x) or x < 0:
                bad(f"{x!r} is not an int >= 0")
            x = int(x)
        elif axis == "causal":
            if not isinstance(x, (bool, np.bool_)):
                bad(f"{x!r} is not a bool")
            x = bool(x)
        elif axis == "dtype":
            if x not in DTYPES:
                bad(f"{x!r} is not a dtype; choose one of {tuple(DTYPES)}")
        elif axis == "backend":
            if x not in BACKENDS:
                bad(f"{x!r} is not a backend a sweep runs; choose one of {BACKENDS}")
        elif axis == "device":
            if x is not None and x not in DEVICES:
                bad(f"{x!r} is not a device; choose one of {DEVICES} (or leave it out)")
        out.append(x)
    keys = [(_policy_name(x) if axis == "policy" else repr(x)) for x in out]
    dup = sorted({k for k in keys if keys.count(k) > 1})
    if dup:
        bad(f"repeated value(s) {', '.join(dup)}")
    return out


class Grid:
    """A product of named axes. ``Grid(dict)``, ``Grid.from_yaml(path)``; the mapping
    holds the axes, either at its top level or under ``axes:``, with an optional
    ``name:``. A scalar is a one-value axis. Values are checked here; ``points()`` asks
    fa_lab whether each point can run and expands the grid (cached)."""

    def __init__(self, spec, *, name: str | None = None):
        if isinstance(spec, Grid):
            spec, name = spec.spec, name or spec.name
        if not isinstance(spec, dict):
            raise TypeError(f"a grid is a mapping of axis -> values, got {type(spec).__name__}")
        spec = dict(spec)
        if "axes" in spec:
            extra = sorted(set(spec) - {"axes", "name"})
            if extra:
                raise GridError(extra[0], "next to 'axes:' a grid takes only 'name:'")
            name = name or spec.get("name")
            spec = spec["axes"]
            if not isinstance(spec, dict):
                raise TypeError(f"'axes' must be a mapping of axis -> values, got {type(spec).__name__}")
        else:
            given = spec.pop("name", None)
            name = name or given
        if name is not None:
            check_name(name)
        self.name = name
        self.spec = dict(spec)
        self.spelled = {}
        axes = {}
        for key, values in spec.items():
            if not isinstance(key, str):
                raise GridError(str(key), "axis names are strings")
            axis = ALIASES.get(key, key)
            if axis not in AXES:
                known = ", ".join(AXES) + "; aliases " + ", ".join(f"{a}={b}" for a, b in ALIASES.items())
                raise GridError(key, f"unknown axis; the axes are {known}")
            if axis in axes:
                raise GridError(key, f"given twice (as {self.spelled[axis]!r} and {key!r})")
            if isinstance(values, (list, tuple, range, np.ndarray)):
                values = list(values)
            elif isinstance(values, (set, frozenset, dict)) or values is None and axis != "threshold":
                raise GridError(key, f"give a list of values, got {values!r}")
            else:
                values = [values]
            if not values:
                raise GridError(key, "empty: an axis needs at least one value")
            self.spelled[axis] = key
            axes[axis] = _check_values(axis, key, values)
        for axis in REQUIRED:
            if axis not in axes:
                raise GridError(axis, "missing: a grid names its " + ", ".join(REQUIRED))
        for axis in AXES:
            if axis not in axes:
                self.spelled[axis] = axis
                axes[axis] = list(DEFAULTS[axis])
        self.axes = {a: tuple(axes[a]) for a in AXES}
        self._points = None

    @classmethod
    def from_yaml(cls, path, *, name: str | None = None) -> "Grid":
        import yaml

        path = Path(path)
        with open(path) as f:
            spec = yaml.safe_load(f)
        if not isinstance(spec, dict):
            raise TypeError(f"{path}: a grid file holds a mapping of axis -> values")
        return cls(spec, name=name or spec.get("name") or path.stem)

    def __len__(self) -> int:
        return len(self.points())

    def __repr__(self) -> str:
        sizes = " × ".join(f"{a}[{len(v)}]" for a, v in self.axes.items() if len(v) > 1)
        return f"Grid({self.name!r}: {sizes or 'one point'})"

    def to_dict(self) -> dict:
        """The axes as plain data (policies by name), for the sweep's record."""
        return {"name": self.name,
                "axes": {a: [_policy_name(x) if a == "policy" else x for x in v]
                         for a, v in self.axes.items()}}

    def points(self) -> list[dict]:
        """The grid's points after fa_lab's checks (raises GridError naming the axis)."""
        if self._points is None:
            self._points = _expand(self)
        return list(self._points)


def check_name(name) -> str:
    if not isinstance(name, str) or not _NAME.match(name) or name in (".", ".."):
        raise ValueError(f"a sweep name is letters, digits, '_', '.', '-' (a directory name), "
                         f"got {name!r}")
    return name


def _point_id(p: dict) -> str:
    key = {a: (_policy_name(p[a]) if a == "policy" else p[a]) for a in AXES}
    key["threshold"] = p["threshold_asked"]
    blob = json.dumps(key, sort_keys=True, default=str)
    return hashlib.sha1(blob.encode()).hexdigest()[:16]


def _device_of(backend: str, device) -> str:
    return device or ("cuda" if backend in GPU_BACKENDS else "cpu")


def _call_kwargs(point: dict) -> dict:
    kw = {"causal": point["causal"], "rescale": point["policy"], "backend": point["backend"]}
    if point["threshold"] is not None:
        kw["rescale_threshold"] = point["threshold"]
    return kw


def _plan(point: dict, **shape):
    """fa_lab's own check of the point's call, with no work done: ``api.check_call`` on
    uninitialised CPU tensors of the point's shape (it reads no data), then
    ``dispatch.plan`` (routing, backend, and every capability of the chosen kernel:
    dtypes, head dims, the policy's vote and rebase, Python rules). ``triton`` needs CUDA
    tensors, so its points are planned as ``interpret``: the same faithful kernels, with
    the same capabilities, on CPU tensors. Returns (kernel family, resolved policy)."""
    from fa_lab import api

    B, S, H, D = (shape.get(a, point[a]) for a in ("B", "S", "H", "D"))
    t = torch.empty((B, S, H, D), dtype=DTYPES[point["dtype"]])
    desc = {"q_descale": 1.0, "k_descale": 1.0, "v_descale": 1.0} if point["dtype"] == "fp8" else {}
    kw = _call_kwargs(point)
    kw["backend"] = CPU_PROXY.get(kw["backend"], kw["backend"])
    call = api.check_call(t, t, t, **desc, **kw)
    try:
        from fa_lab.dispatch import plan
    except ImportError:  # an fa_lab without the dispatch table: check_call routes
        return getattr(call, "kernel", None), call.policy
    planned = plan(call)
    return planned.family, planned.call.policy


_REFUSED = (ValueError, TypeError, NotImplementedError)


def _expand(grid: Grid) -> list[dict]:
    axes, spelled = grid.axes, grid.spelled
    # 1. (policy, dtype, backend): does fa_lab run the policy there at all?
    resolved = {}
    for pol, dtype, backend in itertools.product(axes["policy"], axes["dtype"], axes["backend"]):
        probe = {"policy": pol, "dtype": dtype, "backend": backend, "threshold": None,
                 "causal": False, "B": 1, "S": 256, "H": 1, "D": 128}
        try:
            _, resolved[(_policy_name(pol), dtype, backend)] = _plan(probe)
        except _REFUSED as e:
            raise GridError(spelled["policy"], f"policy {_policy_name(pol)!r} cannot run with "
                            f"dtype={dtype!r} on backend={backend!r}: {e}") from None
        except RuntimeError as e:  # the backend itself is missing (Triton not installed)
            raise GridError(spelled["backend"], f"backend={backend!r}: {e}") from None
    # 2. devices: triton runs on CUDA tensors, interpret on CPU ones
    for backend, device in itertools.product(axes["backend"], axes["device"]):
        if backend == "triton" and device == "cpu":
            raise GridError(spelled["device"], "backend 'triton' runs on device 'cuda', not 'cpu' "
                            "(backend 'interpret' runs its kernels on the CPU)")
        if backend == "interpret" and device == "cuda":
            raise GridError(spelled["device"], "backend 'interpret' runs on device 'cpu'")
    # 3. every point: its threshold, then its shape (once per distinct call)
    points, seen, planned = [], set(), {}
    for values in itertools.product(*(axes[a] for a in AXES)):
        p = dict(zip(AXES, values))
        p["device"] = _device_of(p["backend"], p["device"])
        pol = resolved[(_policy_name(p["policy"]), p["dtype"], p["backend"])]
        p["threshold_asked"] = "default" if p["threshold"] is None else str(p["threshold"])
        if not getattr(pol, "lazy", True):
            p["threshold"], p["threshold_asked"] = None, "n/a"  # eager has no threshold
        key = (_policy_name(p["policy"]), p["dtype"], p["backend"], p["threshold_asked"],
               p["B"], p["S"], p["H"], p["D"], p["causal"])
        if key not in planned:
            if p["threshold"] is not None:
                try:
                    _plan(p, B=1, S=256, H=1, D=128)
                except _REFUSED as e:
                    raise GridError(spelled["threshold"], f"threshold {p['threshold']!r} with policy "
                                    f"{_policy_name(p['policy'])!r}, dtype={p['dtype']!r}: {e}") from None
            try:
                planned[key] = _plan(p)
            except _REFUSED as e:
                raise GridError(spelled[_blame_shape(p)], f"{_describe(p)}: {e}") from None
        family, policy = planned[key]
        p["kernel"] = family
        p["policy_resolved"] = policy.describe() if hasattr(policy, "describe") else str(policy)
        p["threshold_used"] = float(policy.threshold) if getattr(policy, "lazy", False) else math.nan
        p["point_id"] = _point_id(p)
        if p["point_id"] not in seen:
            seen.add(p["point_id"])
            points.append(p)
    return points


def _blame_shape(p: dict) -> str:
    """The shape axis whose value fa_lab refuses (each tried at a known-good value)."""
    good = {"S": 256, "H": 1, "B": 1, "D": 128}
    for axis in ("S", "H", "B", "D"):
        try:
            _plan(p, **{axis: good[axis]})
            return axis
        except _REFUSED:
            continue
    return "causal"


def _describe(p: dict) -> str:
    return (f"policy={_policy_name(p['policy'])!r} dtype={p['dtype']} backend={p['backend']} "
            f"B={p['B']} S={p['S']} H={p['H']} D={p['D']} causal={p['causal']}")


# ---- one point --------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _static_provenance() -> dict:
    from fa_lab import __version__

    try:
        from importlib.metadata import version
        triton_version = version("triton")
    except Exception:  # noqa: BLE001
        triton_version = None
    commit = os.environ.get("FA_LAB_GIT_COMMIT")
    if commit is None:
        try:
            r = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                               text=True, timeout=10)
            if r.returncode == 0:
                commit = r.stdout.strip()
                d = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                                   cwd=ROOT, capture_output=True, text=True, timeout=10)
                if d.returncode == 0 and d.stdout.strip():
                    commit += "-dirty"
        except (OSError, subprocess.SubprocessError):
            pass
    return {"fa_lab_version": __version__, "torch_version": torch.__version__,
            "triton_version": triton_version, "python_version": platform.python_version(),
            "hostname": socket.gethostname(), "git_commit": commit}


def _device_name(device: str) -> str:
    if device == "cuda":
        return torch.cuda.get_device_name(torch.cuda.current_device())
    return f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"


def _worker_address() -> str | None:
    try:
        from distributed import get_worker
        return get_worker().address
    except (ImportError, ValueError):
        return None


def _bad_row_stats(out: torch.Tensor, lse: torch.Tensor, ref: torch.Tensor) -> dict:
    finite = torch.isfinite(out).all(-1)  # [B, S, H]
    bad = ~finite
    lse_rows = lse.permute(0, 2, 1)  # [B, S, H]
    lb = lse_rows[bad]
    stats = {
        "bad_rows": int(bad.sum()),
        "bad_row_frac": float(bad.sum()) / bad.numel(),
        "bad_rows_lse_posinf": int((lb == math.inf).sum()),
        "bad_rows_lse_neginf": int((lb == -math.inf).sum()),
        "bad_rows_lse_finite": int(torch.isfinite(lb).sum()),
        "bad_rows_lse_nan": int(torch.isnan(lb).sum()),
        "ref_nonfinite_rows": int((~torch.isfinite(ref).all(-1)).sum()),
    }
    o, r = out[finite].double(), ref[finite].double()
    norm = torch.linalg.vector_norm(r)
    stats["rel_l2_finite_rows"] = (float(torch.linalg.vector_norm(o - r) / norm)
                                   if o.numel() and norm > 0 else math.nan)
    return stats


FINITENESS_KEYS = ("elements", "rows", "nan", "inf", "nan_frac", "inf_frac", "nan_rows",
                   "inf_rows", "nan_rows_lse_posinf", "nan_rows_lse_nan", "nan_rows_lse_finite",
                   "good_lse_min", "good_lse_max")
COUNT_KEYS = ("loop_wave_steps", "o_multiplies", "o_rescale_skip_frac", "rows_dragged",
              "rows_scaled_up", "row_steps")


def compute_point(point: dict, *, counts: str = "auto") -> dict:
    """Run one grid point and return its table row (see ``SCHEMA``). ``counts``: "auto"
    counts rescales where it is free (bf16 on the emulator: the counted model run is the
    run); "always" also for bf16 on other backends (one more model run); "never"."""
    from fa_lab import api, metrics, reference
    from fa_lab.studies import experiments as ex

    t0 = time.perf_counter()
    device = point["device"]
    B, S, H, D, K, seed = (point[a] for a in ("B", "S", "H", "D", "k_scale", "seed"))
    if point["dtype"] == "fp8":
        (q, k, v), (qd, kd, vd) = ex.fp8_inputs(B, S, H, K, seed=seed, device=device, D=D)
        desc = {"q_descale": qd, "k_descale": kd, "v_descale": vd}
    else:
        q, k, v = ex.bf16_inputs(B, S, H, D, K, seed=seed, device=device)
        desc = {}
    kw = {**_call_kwargs(point), **desc}
    cnt, source = {}, None
    t1 = time.perf_counter()
    if point["dtype"] == "bf16" and point["backend"] == "emulator" and counts != "never":
        c = api.count_rescales(q, k, v, **kw)
        out, lse = c.pop("out"), c.pop("lse")
        cnt, source = c, "model run"
    else:
        out, lse = api.flash_attn_func(q, k, v, return_lse=True, **kw)
    if device == "cuda":
        torch.cuda.synchronize()
    kernel_s = time.perf_counter() - t1
    if point["dtype"] == "bf16" and counts == "always" and source is None:
        c = api.count_rescales(q, k, v, **{**kw, "backend": "emulator"})
        c.pop("out"), c.pop("lse")
        cnt, source = c, "extra model run"
    t2 = time.perf_counter()
    ref, _ = reference.attention(q, k, v, causal=point["causal"], **desc)
    ref_s = time.perf_counter() - t2
    fin = metrics.finiteness(out, lse)
    stats = {key: fin[key] for key in FINITENESS_KEYS}
    stats["rel_l2"] = metrics.rel_l2(out, ref)
    stats.update(_bad_row_stats(out, lse, ref))
    if point["dtype"] == "fp8":  # the seed's fp8 metric: V = ones, mean |o - 1| over finite
        dev = (out.double() - 1.0).abs()
        ok = torch.isfinite(dev)
        stats["mean_abs_dev"] = float(dev[ok].mean()) if bool(ok.any()) else math.nan
    else:
        stats["mean_abs_dev"] = math.nan
    row = {a: point[a] for a in ("k_scale", "S", "H", "B", "D", "seed", "causal", "dtype",
                                 "backend", "device", "point_id", "threshold_asked", "kernel",
                                 "policy_resolved", "threshold_used")}
    row["policy"] = _policy_name(point["policy"])
    row["threshold"] = math.nan if point["threshold"] in (None, BY_KV_LEN) else float(point["threshold"])
    row.update(stats)
    for key in COUNT_KEYS:
        row[key] = cnt.get(key)
    row["counts_source"] = source or ("fp8: count_rescales counts the bf16 loop only"
                                      if point["dtype"] == "fp8" else "not counted")
    row.update(_static_provenance())
    row.update({
        "device_name": _device_name(device),
        "worker": _worker_address(),
        "pid": os.getpid(),
        "torch_threads": torch.get_num_threads(),
        "timestamp": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="milliseconds"),
        "kernel_s": kernel_s,
        "ref_s": ref_s,
        "wall_s": time.perf_counter() - t0,
    })
    return row


# ---- the table --------------------------------------------------------------------------

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


# ---- the cluster ------------------------------------------------------------------------

try:
    from distributed.diagnostics.plugin import WorkerPlugin as _WorkerPlugin
except ImportError:  # pragma: no cover - distributed is a dependency
    _WorkerPlugin = object


class TorchThreads(_WorkerPlugin):
    """Worker plugin: one torch thread per worker, fa_lab imported up front, and a worker
    of a GPU host pinned to GPU (worker name mod GPU count)."""

    name = "fa-lab-torch-threads"

    def __init__(self, threads: int = 1):
        self.threads = threads

    def setup(self, worker):
        torch.set_num_threads(self.threads)
        import fa_lab.api  # noqa: F401 - the first task should not pay the import
        if torch.cuda.is_available():
            try:
                torch.cuda.set_device(int(worker.name) % torch.cuda.device_count())
            except (TypeError, ValueError):
                pass


WORKER_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"}


def local_client(n_workers: int = 2, *, gpu: bool | None = None):
    """A ``Client`` on a new ``LocalCluster(n_workers, threads_per_worker=1,
    processes=True)`` whose workers run one torch thread; with ``gpu`` (default: where
    CUDA is present) each worker offers the resource ``GPU=1``. Close with
    ``close_local(client)``."""
    from distributed import Client, LocalCluster

    if gpu is None:
        gpu = torch.cuda.is_available()
    try:
        import bokeh  # noqa: F401
        dashboard = ":0"
    except ImportError:
        dashboard = None
    cluster = LocalCluster(n_workers=n_workers, threads_per_worker=1, processes=True,
                           dashboard_address=dashboard, env=dict(WORKER_ENV),
                           resources={"GPU": 1} if gpu else None)
    client = Client(cluster)
    client.register_plugin(TorchThreads(1))
    return client


def close_local(client) -> None:
    cluster = client.cluster
    client.close()
    if cluster is not None:
        cluster.close()


def _needs_gpu(point: dict) -> bool:
    return point["device"] == "cuda"


def _check_gpu_workers(client, points, spelled) -> None:
    need = [p for p in points if _needs_gpu(p)]
    if not need:
        return
    workers = client.scheduler_info(n_workers=-1)["workers"] if _takes_n_workers(client) \
        else client.scheduler_info()["workers"]
    if not any(w.get("resources", {}).get("GPU", 0) >= 1 for w in workers.values()):
        raise GridError(spelled["backend"], f"{len(need)} point(s) run on CUDA (backend "
                        f"{need[0]['backend']!r}, device 'cuda') and ask for the worker resource "
                        "GPU=1, which no worker of this cluster offers (start workers with "
                        "--resources GPU=1)")


def _takes_n_workers(client) -> bool:
    import inspect

    return "n_workers" in inspect.signature(client.scheduler_info).parameters


# ---- the sweep --------------------------------------------------------------------------

def _as_grid(grid) -> Grid:
    if isinstance(grid, Grid):
        return grid
    if isinstance(grid, (str, Path)):
        return Grid.from_yaml(grid)
    return Grid(grid)


def _ship(policy):
    """What a worker receives for a policy: a built-in name stays a name; a name that
    only this process has registered goes as its object (workers have not registered it)."""
    from fa_lab import policies

    builtin = getattr(policies, "BUILTIN_NAMES", None)
    if isinstance(policy, str) and builtin is not None and policy not in builtin \
            and hasattr(policies, "get"):
        return policies.get(policy)
    return policy


def run(grid, *, client=None, out=None, name: str | None = None, workers: int = 2,
        progress: bool = True, counts: str = "auto", batch: int = 1,
        raise_errors: bool = True) -> pd.DataFrame:
    """Run the grid's points that have no row yet, one Dask task each, and return the
    sweep's whole table (``load``). ``client``: an existing cluster's ``Client`` (None:
    a LocalCluster of ``workers`` processes, closed afterwards). Results go to
    ``out/<name>/`` (``out`` defaults to data/atlas, ``name`` to the grid's). ``batch``:
    points per Parquet part (1: a killed sweep loses only what is in flight).
    ``counts``: see ``compute_point``. A point that raises is not written (a rerun retries
    it); after the others finish, ``SweepError`` lists the failures (``raise_errors``).
    The returned frame's ``attrs`` hold ``points``, ``skipped``, ``computed``, ``failed``
    and ``run_id``."""
    grid = _as_grid(grid)
    name = check_name(name or grid.name or "sweep")
    if counts not in ("auto", "always", "never"):
        raise ValueError(f"counts must be 'auto', 'always' or 'never', got {counts!r}")
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ValueError(f"batch must be a positive int, got {batch!r}")
    points = grid.points()  # every check, before any task
    directory = sweep_dir(name, out)
    done = done_points(name, out=out)
    todo = [p for p in points if p["point_id"] not in done]
    run_id = uuid.uuid4().hex
    failures = {}
    if todo:
        own = client is None
        if own and any(_needs_gpu(p) for p in todo) and not torch.cuda.is_available():
            raise GridError(grid.spelled["backend"], "points on CUDA (backend 'triton' or device "
                            "'cuda') need a GPU; this machine has none: pass client= (or "
                            "--scheduler) for a cluster with GPU workers")
        if own:
            client = local_client(workers)
        try:
            _check_gpu_workers(client, todo, grid.spelled)
            directory.mkdir(parents=True, exist_ok=True)
            _record_grid(directory, grid)
            failures = _submit_and_collect(client, todo, name=name, run_id=run_id,
                                           directory=directory, counts=counts, batch=batch,
                                           progress=progress)
        finally:
            if own:
                close_local(client)
    table = load(name, out=out)
    table.attrs.update(points=len(points), skipped=len(points) - len(todo),
                       computed=len(todo) - len(failures), failed=len(failures), run_id=run_id)
    if failures and raise_errors:
        raise SweepError(failures, table)
    return table


def _record_grid(directory: Path, grid: Grid) -> None:
    blob = json.dumps(grid.to_dict(), sort_keys=True, default=str, indent=1)
    path = directory / f"grid-{hashlib.sha1(blob.encode()).hexdigest()[:12]}.json"
    if not path.exists():
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-", suffix=".json")
        with os.fdopen(fd, "w") as f:
            f.write(blob + "\n")
        os.replace(tmp, path)


def _submit_and_collect(client, todo, *, name, run_id, directory, counts, batch, progress):
    from distributed import as_completed
    from tqdm.auto import tqdm

    futures = {}
    for p in todo:
        shipped = {**p, "policy": _ship(p["policy"])}
        kw = {"resources": {"GPU": 1}} if _needs_gpu(p) else {}
        fut = client.submit(compute_point, shipped, counts=counts,
                            key=f"fa-lab-sweep-{name}-{p['point_id']}", **kw)
        futures[fut.key] = (fut, p)
    failures, buffer, nparts = {}, [], 0
    bar = tqdm(total=len(todo), desc=f"sweep {name}", unit="pt", disable=not progress)

    def flush():
        nonlocal nparts
        if not buffer:
            return
        fname = (f"part-{buffer[0]['point_id']}.parquet" if batch == 1 and len(buffer) == 1
                 else f"part-{run_id[:8]}-{nparts:06d}.parquet")
        _write_part(directory, fname, buffer)
        nparts += 1
        buffer.clear()

    try:
        for fut, result in as_completed([f for f, _ in futures.values()], with_results=True,
                                        raise_errors=False):
            _, p = futures.pop(fut.key)
            # A point's row is a dict; raise_errors=False hands an error over as exc_info
            # (or the exception). The future's status is no test: a worker killed after its
            # result was fetched turns a finished future back to pending.
            if not isinstance(result, dict):
                exc = result[1] if isinstance(result, tuple) and len(result) == 3 else result
                failures[p["point_id"]] = f"{_describe(p)} k_scale={p['k_scale']} " \
                                          f"seed={p['seed']}: {type(exc).__name__}: {exc}"
            else:
                buffer.append({**result, "sweep": name, "run_id": run_id})
                if len(buffer) >= batch:
                    flush()
            fut.release()
            bar.update()
    finally:
        flush()
        bar.close()
        if futures:  # interrupted: stop what has not run
            client.cancel([f for f, _ in futures.values()])
    return failures


# ---- command line -----------------------------------------------------------------------

def add_arguments(s: argparse.ArgumentParser) -> None:
    """The ``fa-lab sweep`` arguments, on parser ``s``."""
    s.add_argument("grid", help="the grid, a YAML file of axis: [values]")
    s.add_argument("--scheduler", help="an existing Dask scheduler (tcp://host:8786); default: "
                   "a LocalCluster on this machine")
    s.add_argument("--name", help="results in <out>/<name>/ (default: the grid's name: or file stem)")
    s.add_argument("--workers", type=int, default=2, help="LocalCluster worker processes (default 2)")
    s.add_argument("--out", help=f"results directory (default {ATLAS_DIR})")
    s.add_argument("--batch", type=int, default=1, help="points per Parquet part (default 1)")
    s.add_argument("--counts", choices=("auto", "always", "never"), default="auto",
                   help="rescale counts: where free (auto), always (bf16), never")
    s.add_argument("--no-progress", dest="no_progress", nargs="?", const=True, default=False,
                   type=parse_bool, metavar="BOOL", help="no progress bar")


def add_subparser(subparsers) -> argparse.ArgumentParser:
    """Add ``sweep`` to an ``argparse`` subparsers object; the parser's ``func`` default
    runs it."""
    s = subparsers.add_parser("sweep", help=HELP, description=__doc__.split("\n\n")[0],
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(s)
    s.set_defaults(func=run_cli)
    return s


HELP = "run a grid of points on Dask (results in data/atlas/<name>/)"


def run_cli(args) -> int:
    """Run ``fa-lab sweep`` from parsed arguments; returns the exit status."""
    try:
        grid = Grid.from_yaml(args.grid)
        client = None
        if args.scheduler:
            from distributed import Client
            client = Client(args.scheduler)
        try:
            table = run(grid, client=client, out=args.out, name=args.name, workers=args.workers,
                        progress=not args.no_progress, counts=args.counts, batch=args.batch,
                        raise_errors=False)
        finally:
            if client is not None:
                client.close()
    except (GridError, FileNotFoundError) as e:
        print(f"fa-lab sweep: {e}", file=sys.stderr)
        return 2
    a = table.attrs
    name = args.name or grid.name
    print(f"{a['points']} points: {a['skipped']} already done, {a['computed']} computed, "
          f"{a['failed']} failed -> {sweep_dir(name, args.out)}")
    return 1 if a["failed"] else 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="fa-lab")
    sub = p.add_subparsers(dest="cmd", required=True)
    add_subparser(sub)
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] != "sweep":
        argv = ["sweep", *argv]
    args = p.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    from fa_lab.studies.sweep import main as _main  # the module's own functions, not __main__'s

    sys.exit(_main())
