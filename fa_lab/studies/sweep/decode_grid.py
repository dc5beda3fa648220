"""A decode sweep's grid (``kind: decode``): points over the serving decode kernels' own
axes, each checked by its kernel's entry point before any task starts.

The kernels are ``pa_decode_tile`` (``fa_lab.decode.pa_decode_tile``: pages of 16 or 64
tokens), ``pa_decode_swa`` (the sliding-window path of ``fa_lab.decode.pa_decode_ps_launch``:
1024-token pages) and ``mla_decode`` (``fa_lab.mla.mla_decode``: fp8 Q and KV, 128 heads,
pages of one token, one query token). A kernel reads the axes in ``READS[kernel]``; an axis
it does not read is set by the kernel itself (``FIXED``: the value the row records, as
``threshold`` is "n/a" for an eager policy) and its points run once. ``upstream``: each
kernel runs the versions it has among those given (``fa_lab.upstream.DECODE_VERSIONS``
for the two paged kernels, ``fa_lab.kernels.mla_decode.VERSIONS`` for MLA); a version no
kernel of the grid has, or a kernel with none of those given, is refused.

Values are checked twice before any work: their types here (``_check_values``), then each
distinct call by its entry point's own check (``decode.check_call``,
``decode.check_sw_call``, ``mla.check_call``) on stand-in tensors of the point's shapes
(uninitialised caches, an all-zero page table: the checks read shapes, dtypes and the
table alone). A refused call is probed with one axis at a time set to a value the kernel
takes, to name the axis at fault (``GridError``, a ValueError).
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import math

import torch

from fa_lab import decode, mla
from fa_lab.kernels import mla_decode, pa_decode
from fa_lab.upstream import DECODE_DEFAULT, DECODE_VERSIONS

from .grid import GridError, _is_int, _is_number, check_name, read_axes, read_yaml

KIND = "decode"

KERNELS = ("pa_decode_tile", "pa_decode_swa", "mla_decode")

#: The grid's axes, in the order points are expanded (the first varies slowest).
AXES = ("kernel", "upstream", "backend", "page_size", "num_partitions", "query_length",
        "scales", "window", "group", "head_dim", "p_headroom", "context", "spread", "seed")

ALIASES = {"query_len": "query_length", "partitions": "num_partitions",
           "num_kv_splits": "num_partitions", "contexts": "context", "versions": "upstream"}

REQUIRED = ("kernel", "context", "spread")

#: Values of the axes a grid leaves out.
DEFAULTS = {"upstream": [DECODE_DEFAULT], "backend": ["emulator"], "page_size": [16],
            "num_partitions": [1], "query_length": [1], "scales": ["per_tensor"],
            "window": [256], "group": [2], "head_dim": [64], "p_headroom": [0.0], "seed": [0]}

#: Backends a decode sweep runs (the entry points' "auto" is refused: a row names what ran).
BACKENDS = ("emulator", "interpret", "triton")

SCALES = ("per_tensor", "per_token")

_COMMON = {"kernel", "upstream", "backend", "num_partitions", "context", "spread", "seed"}
_PAGED = _COMMON | {"query_length", "scales", "group", "head_dim"}

#: The axes each kernel reads.
READS = {"pa_decode_tile": frozenset(_PAGED | {"page_size"}),
         "pa_decode_swa": frozenset(_PAGED | {"window"}),
         "mla_decode": frozenset(_COMMON | {"p_headroom"})}

#: What a kernel sets itself, for the axes it does not read (the row records these).
FIXED = {"pa_decode_tile": {"window": 0, "p_headroom": math.nan},
         "pa_decode_swa": {"page_size": pa_decode.swa.PAGE, "p_headroom": math.nan},
         "mla_decode": {"page_size": 1, "query_length": 1, "scales": "n/a", "window": 0,
                        "group": mla_decode.model.NUM_HEADS,
                        "head_dim": mla_decode.model.QK_HEAD_DIM}}

#: A value of each axis that its kernels take, for naming the axis of a refused call.
_GOOD = {"page_size": 16, "num_partitions": 1, "query_length": 1, "scales": "per_tensor",
         "window": 256, "group": 1, "head_dim": 64, "p_headroom": 0.0, "context": 256,
         "backend": "emulator"}

#: The inputs' recipe, part of every point's identity: a change to it makes new points.
INPUTS = {"paged": "fa_lab.kernels.pa_decode.cases.make(k_mult=spread), q K V ~ N(0, 1)",
          "mla": "fa_lab.studies.mla_mass_loss.gaussian_inputs(sigma=spread), V = 1"}


def versions(kernel: str) -> dict:
    """The upstream versions ``kernel`` has: name -> its definition (what the point id holds)."""
    if kernel == "mla_decode":
        return {v: list(map(str, d)) for v, d in mla_decode.VERSIONS.items()}
    return {v: dataclasses.asdict(d) for v, d in DECODE_VERSIONS.items()}


def _check_values(axis: str, spelled: str, values: list) -> list:
    """The values' types and ranges alone (what the entry points' checks cannot be asked
    about: a tensor dimension must be an int before a stand-in is built)."""
    def bad(msg):
        raise GridError(spelled, msg)

    out = []
    for x in values:
        if axis == "kernel":
            if x not in KERNELS:
                bad(f"{x!r} is not a decode kernel; choose from {KERNELS}")
        elif axis == "upstream":
            if not isinstance(x, str) or not x:
                bad(f"{x!r} is not a version name")
        elif axis == "backend":
            if x not in BACKENDS:
                bad(f"{x!r} is not a backend a decode sweep runs; choose one of {BACKENDS}")
        elif axis == "scales":
            if x not in SCALES:
                bad(f"{x!r} is not a scale mode; choose one of {SCALES}")
        elif axis in ("spread", "p_headroom"):
            if not _is_number(x) or not math.isfinite(x) or (axis == "spread" and x < 0):
                bad(f"{x!r} is not a finite number" + (" >= 0" if axis == "spread" else ""))
            x = float(x)
        else:  # ints: tensor dimensions (>= 1), or counts (>= 0)
            lo = 0 if axis in ("num_partitions", "window", "context", "seed") else 1
            if not _is_int(x) or x < lo:
                bad(f"{x!r} is not an int >= {lo}")
            x = int(x)
        out.append(x)
    keys = [repr(x) for x in out]
    dup = sorted({k for k in keys if keys.count(k) > 1})
    if dup:
        bad(f"repeated value(s) {', '.join(dup)}")
    return out


class DecodeGrid:
    """A product of named decode axes: ``DecodeGrid(dict)`` or ``DecodeGrid.from_yaml(path)``
    (the mapping as ``sweep.Grid``'s, with ``kind: decode``). ``points()`` plans every
    distinct call with its entry point's checks and expands the grid (cached)."""

    kind = KIND

    def __init__(self, spec, *, name: str | None = None):
        if isinstance(spec, DecodeGrid):
            spec, name = spec.spec, name or spec.name
        if not isinstance(spec, dict):
            raise TypeError(f"a grid is a mapping of axis -> values, got {type(spec).__name__}")
        spec = dict(spec)
        kind = spec.pop("kind", KIND)
        if kind != KIND:
            raise GridError("kind", f"{kind!r}: a DecodeGrid is kind {KIND!r}")
        if "axes" in spec:
            extra = sorted(set(spec) - {"axes", "name"})
            if extra:
                raise GridError(extra[0], "next to 'axes:' a grid takes only 'name:' and 'kind:'")
            name = name or spec.get("name")
            spec = dict(spec["axes"]) if isinstance(spec["axes"], dict) else spec["axes"]
            if not isinstance(spec, dict):
                raise TypeError(f"'axes' must be a mapping of axis -> values, got {type(spec).__name__}")
        else:
            given = spec.pop("name", None)
            name = name or given
        if name is not None:
            check_name(name)
        self.name, self.spec, self.spelled = name, dict(spec), {}
        self.axes = read_axes(spec, self.spelled, axes=AXES, aliases=ALIASES, required=REQUIRED,
                              defaults=DEFAULTS, check_values=_check_values, what="a decode grid",
                              unknown_hint=lambda key: " of a decode grid")
        self._points = None

    @classmethod
    def from_yaml(cls, path, *, name: str | None = None) -> "DecodeGrid":
        spec, stem = read_yaml(path)
        return cls(spec, name=name or spec.get("name") or stem)

    def __len__(self) -> int:
        return len(self.points())

    def __repr__(self) -> str:
        sizes = " × ".join(f"{a}[{len(v)}]" for a, v in self.axes.items() if len(v) > 1)
        return f"DecodeGrid({self.name!r}: {sizes or 'one point'})"

    def to_dict(self) -> dict:
        """The axes as plain data, for the sweep's record."""
        return {"name": self.name, "kind": KIND, "axes": {a: list(v) for a, v in self.axes.items()}}

    def points(self) -> list[dict]:
        """The grid's points after the entry points' checks (GridError naming the axis)."""
        if self._points is None:
            self._points = _expand(self)
        return list(self._points)


def describe(p: dict) -> str:
    """A point in words (a failure's line)."""
    return " ".join(f"{a}={p[a]}" for a in AXES if a in READS[p["kernel"]])


def _expand(grid: DecodeGrid) -> list[dict]:
    axes, spelled = grid.axes, grid.spelled
    known = {v for k in axes["kernel"] for v in versions(k)}
    for v in axes["upstream"]:
        if v not in known:
            raise GridError(spelled["upstream"], f"{v!r} is a version of none of the grid's "
                            f"kernels; they have {sorted(known)}")
    for k in axes["kernel"]:
        if not set(axes["upstream"]) & set(versions(k)):
            raise GridError(spelled["upstream"], f"kernel {k!r} has none of the versions "
                            f"{list(axes['upstream'])}; it has {list(versions(k))}")
    points, seen, planned = [], set(), {}
    for values in itertools.product(*(axes[a] for a in AXES)):
        p = dict(zip(AXES, values))
        k = p["kernel"]
        if p["upstream"] not in versions(k):
            continue  # the kernel runs the versions it has among those given
        p.update(FIXED[k])
        call = tuple(p[a] for a in AXES if a not in ("spread", "seed"))
        if call not in planned:
            try:
                planned[call] = _plan(p)
            except (ValueError, TypeError, NotImplementedError) as e:
                raise _blame(p, e, spelled) from None
        p["num_partitions_used"] = planned[call]
        p["device"] = "cuda" if p["backend"] == "triton" else "cpu"
        p["point_id"] = _point_id(p)
        if p["point_id"] not in seen:
            seen.add(p["point_id"])
            points.append(p)
    return points


def _plan(p: dict) -> int:
    """The point's call checked by its entry point on stand-in tensors; returns the
    partition (or kv split) count the call resolves to."""
    k, ctx = p["kernel"], p["context"]
    if k == "mla_decode":
        M = mla_decode.model
        q = torch.empty(1, M.NUM_HEADS, M.QK_HEAD_DIM, dtype=torch.float8_e4m3fn)
        kv = torch.empty(max(ctx, 1), 1, 1, M.QK_HEAD_DIM, dtype=torch.float8_e4m3fn)
        mla.check_call(q, kv, torch.tensor([0, ctx], dtype=torch.int32),
                       torch.arange(ctx, dtype=torch.int32), 0.1,
                       num_kv_splits=p["num_partitions"], backend=p["backend"],
                       p_headroom=p["p_headroom"], upstream=p["upstream"])
        return p["num_partitions"]
    bs, d, ql, g = p["page_size"], p["head_dim"], p["query_length"], p["group"]
    pages = -(-ctx // bs) + 1
    fp8 = torch.float8_e4m3fn
    q = torch.empty(ql, g, d, dtype=torch.bfloat16)
    kc = torch.empty(pages, 1, d // 16, bs, 16, dtype=fp8)
    vc = torch.empty(pages, 1, d, bs, dtype=fp8)
    scale = torch.empty(pages, 1, bs) if p["scales"] == "per_token" else torch.ones(1)
    args = (torch.empty_like(q), q, kc, vc, torch.zeros(1, pages, dtype=torch.int32),
            torch.tensor([ctx], dtype=torch.int32), scale, scale.clone(), None)
    if k == "pa_decode_swa":
        return decode.check_sw_call(*args, p["window"], p["num_partitions"], p["backend"],
                                    p["upstream"])[3]
    return decode.check_call(*args, p["num_partitions"], p["backend"], p["upstream"])[3]


def _blame(p: dict, error: Exception, spelled: dict) -> GridError:
    """The axis a refused call is refused for: the first axis the kernel reads whose value,
    replaced by one the kernel takes, lets the call pass (else ``kernel``)."""
    for axis in AXES:
        if axis not in READS[p["kernel"]] or axis not in _GOOD or p[axis] == _GOOD[axis]:
            continue
        try:
            _plan({**p, axis: _GOOD[axis]})
        except (ValueError, TypeError, NotImplementedError):
            continue
        return GridError(spelled[axis], f"{describe(p)}: {error}")
    return GridError(spelled["kernel"], f"{describe(p)}: {error}")


def _point_id(p: dict) -> str:
    """A point's identity: what it computes. Every axis as the kernel runs it (its fixed
    values included), the partition count it resolves to, the upstream version's whole
    definition and the inputs' recipe; a change to any makes a new point."""
    key = {a: p[a] for a in AXES}
    key["p_headroom"] = None if math.isnan(p["p_headroom"]) else p["p_headroom"]
    key["num_partitions_used"] = p["num_partitions_used"]
    key["definition"] = versions(p["kernel"])[p["upstream"]]
    key["inputs"] = INPUTS["mla" if p["kernel"] == "mla_decode" else "paged"]
    blob = json.dumps(key, sort_keys=True, default=str)
    return hashlib.sha1(blob.encode()).hexdigest()[:16]
