"""A sweep's grid: its axes, their values checked and expanded into points (each one
planned as a call, so a point the API would refuse is refused before the sweep starts)."""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import itertools
import json
import math
import numbers
import re
import warnings
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from fa_lab import results


ROOT = results.ROOT  # the checkout: its data/ holds the lab's reference data


#: A sweep's folder is ``<results folder>/ATLAS/<name>/``; the lab's reference sweeps
#: are ``REFERENCE_ATLAS_DIR/<name>/`` (data/atlas).
ATLAS = "atlas"
REFERENCE_ATLAS_DIR = ROOT / "data" / ATLAS


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


#: The most points a grid may have: each is planned on the client and run as one Dask task
#: with a Parquet part, so a grid past this is a mistake (a range too wide) more often than
#: a plan; a real campaign runs as several sweeps.
MAX_POINTS = 100_000


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


def read_axes(spec: dict, spelled: dict, *, axes, aliases, required, defaults, check_values,
              what: str, none_ok=(), unknown_hint=lambda key: "") -> dict:
    """A grid's axes from its ``spec`` (axis or alias -> a value or a list of values), in
    ``axes``' order, each checked by ``check_values(axis, key, values)``; the ones the spec
    leaves out take ``defaults``. ``spelled`` receives each axis's name as the user wrote it.
    GridError naming the key for an unknown, repeated, empty or missing axis, and for a grid
    of more than ``MAX_POINTS`` points, before any point is planned. Both grid kinds read
    their axes here (``Grid``, ``decode_grid.DecodeGrid``)."""
    out: dict = {}
    for key, values in spec.items():
        if not isinstance(key, str):
            raise GridError(str(key), "axis names are strings")
        axis = aliases.get(key, key)
        if axis not in axes:
            known = ", ".join(axes) + "; aliases " + ", ".join(f"{a}={b}" for a, b in aliases.items())
            raise GridError(key, f"unknown axis{unknown_hint(key)}; the axes are {known}")
        if axis in out:
            raise GridError(key, f"given twice (as {spelled[axis]!r} and {key!r})")
        if isinstance(values, (list, tuple, range, np.ndarray)):
            values = list(values)
        elif isinstance(values, (set, frozenset, dict)) or values is None and axis not in none_ok:
            raise GridError(key, f"give a list of values, got {values!r}")
        else:
            values = [values]
        if not values:
            raise GridError(key, "empty: an axis needs at least one value")
        spelled[axis] = key
        out[axis] = check_values(axis, key, values)
    for axis in required:
        if axis not in out:
            raise GridError(axis, f"missing: {what} names its " + ", ".join(required))
    for axis in axes:
        if axis not in out:
            spelled[axis] = axis
            out[axis] = list(defaults[axis])
    out = {a: tuple(out[a]) for a in axes}
    size = math.prod(len(v) for v in out.values())
    if size > MAX_POINTS:
        big = max(axes, key=lambda a: len(out[a]))
        sizes = " × ".join(f"{spelled[a]}[{len(v)}]" for a, v in out.items() if len(v) > 1)
        raise GridError(spelled[big], f"the grid has {size:,} points ({sizes}), more than a "
                        f"sweep takes ({MAX_POINTS:,}): split it into sweeps of fewer points")
    return out


class Grid:
    """A product of named axes. ``Grid(dict)``, ``Grid.from_yaml(path)``; the mapping
    holds the axes, either at its top level or under ``axes:``, with an optional
    ``name:``. A scalar is a one-value axis. Values are checked here; ``points()`` asks
    fa_lab whether each point can run and expands the grid (cached)."""

    kind = "policy"

    def __init__(self, spec, *, name: str | None = None):
        if isinstance(spec, Grid):
            spec, name = spec.spec, name or spec.name
        if not isinstance(spec, dict):
            raise TypeError(f"a grid is a mapping of axis -> values, got {type(spec).__name__}")
        spec = dict(spec)
        kind = spec.pop("kind", "policy")
        if kind != "policy":
            raise GridError("kind", f"{kind!r}: a Grid is kind 'policy' (sweep.open_grid "
                            "reads a grid of any kind)")
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
        self.axes = read_axes(
            spec, self.spelled, axes=AXES, aliases=ALIASES, required=REQUIRED, defaults=DEFAULTS,
            check_values=_check_values, none_ok=("threshold",), what="a grid",
            unknown_hint=lambda key: (" (an axis of a decode grid: give kind: decode, or --kind "
                                      "decode)" if key in ("kernel", "context", "spread",
                                                           "page_size", "query_length") else ""))
        self._points = None

    @classmethod
    def from_yaml(cls, path, *, name: str | None = None) -> "Grid":
        """The grid in a YAML file (``read_yaml``)."""
        spec, stem = read_yaml(path)
        return cls(spec, name=name or spec.get("name") or stem)

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


def read_yaml(path) -> tuple[dict, str]:
    """(the mapping in a grid's YAML file, the file's stem). A missing file raises
    ``FileNotFoundError`` naming it; a file that is not valid YAML, or not a mapping of
    axes, ``ValueError`` naming it (and the line, for a syntax error)."""
    import yaml

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no grid file {str(path)!r}"
                                + (" (a directory)" if path.is_dir() else ""))
    try:
        spec = yaml.safe_load(path.read_bytes())
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1} column {mark.column + 1}" if mark else ""
        what = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ValueError(f"{path}: not valid YAML{where}: {what}") from None
    if not isinstance(spec, dict):
        raise ValueError(f"{path}: a grid file holds a mapping of axis: [values], this one "
                         f"holds {type(spec).__name__ if spec is not None else 'nothing'}")
    return spec, path.stem


def check_name(name) -> str:
    if not isinstance(name, str) or not _NAME.match(name) or name in (".", ".."):
        raise ValueError(f"a sweep name is letters, digits, '_', '.', '-' (a directory name), "
                         f"got {name!r}")
    return name


def _point_id(p: dict, policy) -> str:
    """A point's identity: what it computes. Its axes (the policy by name), and the
    resolved ``policy``'s whole definition (``policy_definition``), so a policy
    redefined under the same name makes new points, which a rerun computes."""
    key = {a: (_policy_name(p[a]) if a == "policy" else p[a]) for a in AXES}
    key["threshold"] = p["threshold_asked"]
    key["definition"] = policy_definition(policy)
    blob = json.dumps(key, sort_keys=True, default=str)
    return hashlib.sha1(blob.encode()).hexdigest()[:16]


#: The Policy fields that name and show a policy, and change nothing it computes.
_LABELS = ("name", "description", "color")


def policy_definition(policy) -> str:
    """What ``policy`` computes, as text: every field but its labels (``_LABELS``), the
    semantics field by field, and a rule by its source, the values it closes over and its
    defaults (or, where no source is found, its bytecode and constants)."""
    if not dataclasses.is_dataclass(policy):
        return repr(policy)
    fields = {}
    for f in dataclasses.fields(policy):
        value = getattr(policy, f.name)
        if f.name in _LABELS:
            continue
        if dataclasses.is_dataclass(value):
            value = dataclasses.asdict(value)
        elif callable(value):
            value = _rule_text(value)
        fields[f.name] = value
    return json.dumps(fields, sort_keys=True, default=repr)


def _rule_text(rule) -> str:
    code = getattr(rule, "__code__", None)
    try:
        text = inspect.getsource(rule)
    except (OSError, TypeError):
        text = repr(rule) if code is None else f"{code.co_code.hex()} {code.co_consts!r}"
    cells = [_stable(c.cell_contents) for c in (getattr(rule, "__closure__", None) or ())]
    defaults = [_stable(d) for d in (getattr(rule, "__defaults__", None) or ())]
    return f"{text}\nclosure {cells!r} defaults {defaults!r}"


def _stable(x) -> str:
    """``repr`` of a value, a function by its qualified name (a function's repr holds its
    address, which differs from run to run)."""
    if callable(x) and hasattr(x, "__qualname__"):
        return f"{getattr(x, '__module__', '')}.{x.__qualname__}"
    return repr(x)


def _device_of(backend: str, device) -> str:
    return device or ("cuda" if backend in GPU_BACKENDS else "cpu")


def _call_kwargs(point: dict) -> dict:
    kw = {"causal": point["causal"], "rescale": point["policy"], "backend": point["backend"]}
    if point["threshold"] is not None:
        kw["rescale_threshold"] = point["threshold"]
    return kw


def _plan(point: dict, *, quiet: bool = False, **shape):
    """fa_lab's own check of the point's call, with no work done: ``api.plan`` on
    uninitialised CPU tensors of the point's shape (it reads no data), then
    ``dispatch.plan`` (routing, backend, and every capability of the chosen kernel:
    dtypes, head dims, the policy's vote and rebase, Python rules). ``triton`` needs CUDA
    tensors, so its points are planned as ``interpret``: the same faithful kernels, with
    the same capabilities, on CPU tensors. Returns (kernel family, resolved policy).
    ``quiet``: a probe at a stand-in shape, whose warnings (a policy that a call of that
    shape never consults) are not the user's; the point's own shape gives them."""
    from fa_lab import api

    if quiet:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return _plan(point, **shape)
    B, S, H, D = (shape.get(a, point[a]) for a in ("B", "S", "H", "D"))
    t = torch.empty((B, S, H, D), dtype=DTYPES[point["dtype"]])
    desc = {"q_descale": 1.0, "k_descale": 1.0, "v_descale": 1.0} if point["dtype"] == "fp8" else {}
    kw = _call_kwargs(point)
    kw["backend"] = CPU_PROXY.get(kw["backend"], kw["backend"])
    planned = api.plan(t, t, t, **desc, **kw)
    return planned.family, planned.call.policy


_REFUSED = (ValueError, TypeError, NotImplementedError)


def _expand(grid: Grid) -> list[dict]:
    """The grid's points, each distinct call planned once (``_plan`` at its own shape); a
    refused call is then probed at stand-in shapes only to name the axis to blame."""
    from fa_lab.policies import as_policy

    axes, spelled = grid.axes, grid.spelled
    # 1. devices: triton runs on CUDA tensors, interpret on CPU ones
    for backend, device in itertools.product(axes["backend"], axes["device"]):
        if backend == "triton" and device == "cpu":
            raise GridError(spelled["device"], "backend 'triton' runs on device 'cuda', not 'cpu' "
                            "(backend 'interpret' runs its kernels on the CPU)")
        if backend == "interpret" and device == "cuda":
            raise GridError(spelled["device"], "backend 'interpret' runs on device 'cpu'")
    # 2. every point: its threshold (none for an eager policy), then its call, planned once
    points, seen, planned = [], set(), {}
    for values in itertools.product(*(axes[a] for a in AXES)):
        p = dict(zip(AXES, values))
        p["device"] = _device_of(p["backend"], p["device"])
        p["threshold_asked"] = "default" if p["threshold"] is None else str(p["threshold"])
        try:
            lazy = as_policy(p["policy"]).lazy
        except _REFUSED as e:
            raise GridError(spelled["policy"], f"policy {_policy_name(p['policy'])!r} cannot run "
                            f"with dtype={p['dtype']!r} on backend={p['backend']!r}: {e}") from None
        if not lazy:
            p["threshold"], p["threshold_asked"] = None, "n/a"  # eager has no threshold
        key = (_policy_name(p["policy"]), p["dtype"], p["backend"], p["threshold_asked"],
               p["B"], p["S"], p["H"], p["D"], p["causal"])
        if key not in planned:
            try:
                planned[key] = _plan(p)
            except _REFUSED as e:
                raise _blame(p, e, spelled) from None
            except RuntimeError as e:  # the backend itself is missing (Triton not installed)
                raise GridError(spelled["backend"], f"backend={p['backend']!r}: {e}") from None
        family, policy = planned[key]
        p["kernel"] = family
        p["policy_planned"] = policy  # the worker runs this decision (``compute_point``)
        p["policy_resolved"] = policy.describe() if hasattr(policy, "describe") else str(policy)
        p["threshold_used"] = float(policy.threshold) if getattr(policy, "lazy", False) else math.nan
        p["point_id"] = _point_id(p, policy)
        if p["point_id"] not in seen:
            seen.add(p["point_id"])
            points.append(p)
    return points


def _blame(p: dict, error: Exception, spelled: dict) -> GridError:
    """The axis a refused point's call is refused for: the policy (it runs nowhere with
    that dtype and backend), its threshold, or the shape axis (``_blame_shape``)."""
    probe = {**p, "threshold": None, "causal": False, "B": 1, "S": 256, "H": 1, "D": 128}
    try:
        _plan(probe, quiet=True)
    except _REFUSED as e:
        return GridError(spelled["policy"], f"policy {_policy_name(p['policy'])!r} cannot run with "
                         f"dtype={p['dtype']!r} on backend={p['backend']!r}: {e}")
    if p["threshold"] is not None:
        try:
            _plan(p, quiet=True, B=1, S=256, H=1, D=128)
        except _REFUSED as e:
            return GridError(spelled["threshold"], f"threshold {p['threshold']!r} with policy "
                             f"{_policy_name(p['policy'])!r}, dtype={p['dtype']!r}: {e}")
    return GridError(spelled[_blame_shape(p)], f"{_describe(p)}: {error}")


def _blame_shape(p: dict) -> str:
    """The shape axis whose value fa_lab refuses (each tried at a known-good value)."""
    good = {"S": 256, "H": 1, "B": 1, "D": 128}
    for axis in ("S", "H", "B", "D"):
        try:
            _plan(p, quiet=True, **{axis: good[axis]})
            return axis
        except _REFUSED:
            continue
    return "causal"


def _describe(p: dict) -> str:
    return (f"policy={_policy_name(p['policy'])!r} dtype={p['dtype']} backend={p['backend']} "
            f"B={p['B']} S={p['S']} H={p['H']} D={p['D']} causal={p['causal']}")
