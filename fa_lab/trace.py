"""The per-step, per-row record of a forward run, and its tidy pandas view.

A model (or a traced Triton kernel) fills a ``TraceRecorder`` for the rows the user chose;
``Trace`` is what comes back: one row per (lane, step) in ``Trace.steps`` with the running
max m, the tile max mt, the row's own vote, whether its wave fired, whether it was swept
(its wave fired while its tile max sat below its running max), the correction factor, l,
and whether O and l are still finite; plus each lane's final output and LSE.

A step is one KV tile of 64 columns for the bf16 kernel and one tile pair (128 columns)
for the fp8 kernel. m, mt and the threshold are in the kernel's own units: log2 units for
bf16, raw fp8-product units for fp8 (multiply by ``Trace.log2_per_unit`` for log2 units).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pandas as pd
import torch

#: Columns of Trace.steps, in order.
STEP_FIELDS = ("m", "mt", "vote", "fire", "swept", "corr", "l", "o_finite", "l_finite")


def normalize_rows(rows, batch, head, shape_bhs) -> list[tuple[int, int, int]]:
    """Turn ``fa_lab.trace``'s ``rows`` (with ``batch`` and ``head``) into checked
    (batch, head, query row) triples, one per traced lane, in the order given.

    ``shape_bhs`` is (B, H, Sq) of q. ``rows`` takes exactly these forms:

    * an integer, e.g. ``5``: that query row of (``batch``, ``head``);
    * a ``range``, e.g. ``range(0, 32)``: those query rows of (``batch``, ``head``);
    * a list or tuple of integers, e.g. ``[0, 1, 5]``: those query rows of (``batch``,
      ``head``);
    * a list or tuple of (batch, head, row) 3-tuples, e.g. ``[(0, 1, 5), (1, 0, 7)]``: one
      lane each; ``batch`` and ``head`` are then not used (but still checked).

    An integer is a Python ``int``, a numpy integer scalar or a 0-d integer torch tensor
    (anything ``operator.index`` takes, except bools); ``batch`` and ``head`` are integers
    in the same sense. A bare 3-tuple of integers such as ``rows=(0, 1, 5)`` is refused as
    ambiguous (three rows, or one lane?): write ``[0, 1, 5]`` for rows 0, 1 and 5 of
    (``batch``, ``head``), or ``[(0, 1, 5)]`` for the lane (batch 0, head 1, row 5). Rows
    and lanes do not mix in one list. Duplicates are kept (each is its own lane).

    Raises TypeError naming ``rows`` (``rows[i]`` for one entry), ``batch`` or ``head`` for
    a value that is not an integer (a float, a bool, a string, a tensor of more than zero
    dimensions) and for a ``rows`` of another type (a str, a set, a generator, an array:
    pass ``list(...)`` or ``.tolist()``); ValueError naming the argument for an index out of
    range (0 <= batch < B, 0 <= head < H, 0 <= row < Sq), an empty or missing ``rows``, a
    tuple in ``rows`` that is not 3 long, rows mixed with lanes, or the bare 3-tuple.
    """
    import operator

    forms = ("an int, a range, a list of ints (rows of (batch, head)), or a list of "
             "(batch, head, row) tuples (one lane each)")

    def index(name, x) -> int:
        if isinstance(x, (bool, np.bool_)):
            raise TypeError(f"{name} must be an integer, got the bool {x!r}")
        if isinstance(x, torch.Tensor) and (x.dim() != 0 or x.dtype == torch.bool):
            what = f"a {x.dim()}-D tensor" if x.dim() else "a bool tensor"
            raise TypeError(f"{name} must be an integer (or a 0-d integer tensor), got {what}")
        try:
            return operator.index(x)
        except TypeError:
            raise TypeError(f"{name} must be an integer (int, numpy integer or 0-d integer "
                            f"tensor), got {type(x).__name__} {x!r}") from None

    def is_index(x) -> bool:
        try:
            index("", x)
        except TypeError:
            return False
        return True

    B, H, S = shape_bhs
    b0, h0 = index("batch", batch), index("head", head)
    if not 0 <= b0 < B:
        raise ValueError(f"batch={b0} out of range [0, {B})")
    if not 0 <= h0 < H:
        raise ValueError(f"head={h0} out of range [0, {H}) (q's heads)")
    if rows is None:
        raise ValueError(f"rows must name the query rows to trace: {forms}")
    if is_index(rows) or isinstance(rows, (int, float, np.generic)) or (
            isinstance(rows, torch.Tensor) and rows.dim() == 0):
        rows = [index("rows", rows)]  # one row; a bool, float or 0-d float tensor raises here
    elif isinstance(rows, range):
        bad = _first_outside(rows, S)  # before the list is built: a range may be huge
        if bad is not None:
            raise ValueError(f"rows[{bad}]: query row {rows[bad]} out of range [0, {S})")
        rows = list(rows)
    elif isinstance(rows, tuple) and len(rows) == 3 and all(is_index(r) for r in rows):
        r = tuple(index("rows", x) for x in rows)
        raise ValueError(f"rows={rows!r} is ambiguous: write rows={list(r)} for query rows "
                         f"{r[0]}, {r[1]} and {r[2]} of (batch, head), or rows=[{r!r}] for "
                         f"the one lane (batch {r[0]}, head {r[1]}, row {r[2]})")
    elif not isinstance(rows, (list, tuple)):
        hint = "; pass .tolist()" if isinstance(rows, (np.ndarray, torch.Tensor)) else ""
        raise TypeError(f"rows must be {forms}; got {type(rows).__name__}{hint}")
    if not rows:
        raise ValueError("rows is empty: name at least one query row to trace")
    lanes = [isinstance(r, tuple) for r in rows]
    if any(lanes) and not all(lanes):
        raise ValueError("rows mixes query rows (ints) and (batch, head, row) tuples; give "
                         "one form: a list of ints for rows of (batch, head), or a list of "
                         "3-tuples")
    triples = []
    for i, r in enumerate(rows):
        if isinstance(r, tuple):
            if len(r) != 3:
                raise ValueError(f"rows[{i}]: a tuple must be (batch, head, row), got {r!r}")
            b, h, s = (index(f"rows[{i}]", x) for x in r)
        elif isinstance(r, list):
            raise TypeError(f"rows[{i}] is a list {r!r}: a lane is a (batch, head, row) tuple")
        else:
            b, h, s = b0, h0, index(f"rows[{i}]", r)
        if not 0 <= b < B:
            raise ValueError(f"rows[{i}]: batch {b} out of range [0, {B})")
        if not 0 <= h < H:
            raise ValueError(f"rows[{i}]: head {h} out of range [0, {H}) (q's heads)")
        if not 0 <= s < S:
            raise ValueError(f"rows[{i}]: query row {s} out of range [0, {S})")
        triples.append((b, h, s))
    return triples


def _first_outside(r: range, n: int) -> int | None:
    """The index of ``r``'s first value outside [0, n), or None; O(1) for any length."""
    if not r:
        return None
    if not 0 <= r[0] < n:
        return 0
    i = -(-(n - r.start) // r.step) if r.step > 0 else r.start // -r.step + 1
    return i if i < len(r) else None


class TraceRecorder:
    """Collects the state of chosen lanes at every step of a model run.

    The model's per-row state lives in tensors of shape [B, Hkv, G, R] for the rows R of
    the block group it is running; ``bind_group`` tells the recorder which global rows
    those are, ``record`` gathers the chosen lanes' values once per step.
    """

    def __init__(self, triples, group_size: int):
        self.triples = list(triples)
        self.group_size = group_size  # q heads per kv head
        self._chunks: list[dict] = []
        self._final: dict[int, tuple[np.ndarray, float]] = {}
        self._sel = None

    def bind_group(self, group_rows: torch.Tensor):
        pos = {int(r): i for i, r in enumerate(group_rows.tolist())}
        sel = [(k, b, h, pos[s]) for k, (b, h, s) in enumerate(self.triples) if s in pos]
        if not sel:
            self._sel = None
            return
        dev = group_rows.device
        lane, b, h, p = zip(*sel)
        g = self.group_size
        self._sel = (
            list(lane),
            torch.tensor(b, device=dev),
            torch.tensor([x // g for x in h], device=dev),
            torch.tensor([x % g for x in h], device=dev),
            torch.tensor(p, device=dev),
        )

    @property
    def active(self) -> bool:
        return self._sel is not None

    def _pick(self, x: torch.Tensor) -> np.ndarray:
        _, b, hk, g, p = self._sel
        if x.dim() == 4:  # [B, Hkv, G, R]
            return x[b, hk, g, p].detach().float().cpu().numpy()
        return x[b, hk, g, p].detach().cpu().numpy()  # [B, Hkv, G, R, D]

    def record(self, step: int, col0: int, phase: str, *, m, mt, vote, fire, swept, corr, l, O):
        if self._sel is None:
            return
        lanes = self._sel[0]
        o_fin = torch.isfinite(O).all(-1)
        vals = {
            "m": m, "mt": mt, "vote": vote, "fire": fire, "swept": swept, "corr": corr,
            "l": l, "o_finite": o_fin, "l_finite": torch.isfinite(l),
        }
        self.add_steps(lanes, step, col0, phase, {k: self._pick(vals[k]) for k in STEP_FIELDS})

    def add_steps(self, lanes, step: int, col0: int, phase: str, values: dict):
        """Record one step for ``lanes`` (indices into the traced triples); ``values`` maps
        every name in STEP_FIELDS to an array with one entry per lane. Used by the models
        through ``record`` and by the traced Triton kernels directly."""
        missing = set(STEP_FIELDS) - set(values)
        if missing:
            raise ValueError(f"add_steps: missing fields {sorted(missing)}")
        chunk = {"lane": list(lanes), "step": step, "col0": col0, "phase": phase}
        for k in STEP_FIELDS:
            chunk[k] = np.asarray(values[k])
        self._chunks.append(chunk)

    def set_final(self, lane: int, out, lse: float):
        """A lane's final output row [D] and LSE."""
        self._final[lane] = (np.asarray(out, dtype=np.float32), float(lse))

    def finish_group(self, out_rows: torch.Tensor, lse_rows: torch.Tensor):
        """out_rows [B, Hkv, G, R, D] and lse_rows [B, Hkv, G, R] of the bound group."""
        if self._sel is None:
            return
        outs = self._pick(out_rows)
        lses = self._pick(lse_rows)
        for i, lane in enumerate(self._sel[0]):
            self.set_final(lane, outs[i], lses[i])

    def _steps_frame(self) -> pd.DataFrame:
        """One row per recorded (lane, step), in recording order: the chunks joined. When
        every chunk holds the same types (what a model or kernel records), the columns are
        joined first and the frame is built once; otherwise one frame per chunk, joined
        by pandas, whose type rules then decide each column's dtype."""
        chunks = self._chunks
        if not chunks:
            return pd.DataFrame(columns=["lane", "step", "col0", "phase", *STEP_FIELDS])
        c0 = chunks[0]
        uniform = all(
            all(type(c[k]) is type(c0[k]) for k in ("step", "col0", "phase"))
            and all(c[k].dtype == c0[k].dtype and c[k].shape == (len(c["lane"]),)
                    for k in STEP_FIELDS)
            for c in chunks)
        if uniform:
            sizes = [len(c["lane"]) for c in chunks]
            cols = {"lane": [x for c in chunks for x in c["lane"]]}
            for k in ("step", "col0", "phase"):
                cols[k] = [c[k] for c, n in zip(chunks, sizes) for _ in range(n)]
            for k in STEP_FIELDS:
                cols[k] = np.concatenate([c[k] for c in chunks])
            return pd.DataFrame(cols)
        frames = []
        for c in chunks:
            n = len(c["lane"])
            d = {"lane": c["lane"], "step": [c["step"]] * n, "col0": [c["col0"]] * n,
                 "phase": [c["phase"]] * n}
            d.update({k: c[k] for k in STEP_FIELDS})
            frames.append(pd.DataFrame(d))
        return pd.concat(frames, ignore_index=True)

    def build(self, *, kernel: str, policy, log2_per_unit: float, threshold_units: float) -> "Trace":
        steps = self._steps_frame()
        for k in ("vote", "fire", "swept", "o_finite", "l_finite"):
            steps[k] = steps[k].astype(bool)
        lanes = pd.DataFrame(self.triples, columns=["batch", "head", "row"])
        lanes.index.name = "lane"
        steps = steps.merge(lanes.reset_index(), on="lane").sort_values(["lane", "step"])
        steps = steps.reset_index(drop=True)
        out = np.stack([self._final[i][0] for i in range(len(self.triples))])
        lanes["lse"] = [self._final[i][1] for i in range(len(self.triples))]
        bad = steps[~(steps.o_finite & steps.l_finite)]
        first = bad.groupby("lane").step.min()
        lanes["first_nonfinite_step"] = first.reindex(lanes.index).astype("Int64")
        lanes["n_swept"] = steps.groupby("lane").swept.sum().reindex(lanes.index).fillna(0).astype(int)
        lanes["out_finite"] = np.isfinite(out).all(-1)
        return Trace(kernel=kernel, policy=policy, steps=steps, lanes=lanes,
                     out=torch.from_numpy(out), log2_per_unit=log2_per_unit,
                     threshold_units=threshold_units)


@dataclass
class Trace:
    """What ``fa_lab.trace`` returns. ``steps`` is tidy (one row per lane and step);
    ``lanes`` has one row per traced lane (batch, head, row, lse, first_nonfinite_step,
    n_swept, out_finite); ``out`` is [lanes, D] fp32 (bf16 values)."""

    kernel: str
    policy: object
    steps: pd.DataFrame
    lanes: pd.DataFrame
    out: torch.Tensor
    log2_per_unit: float = 1.0
    threshold_units: float = float("nan")
    meta: dict = field(default_factory=dict)

    def lane(self, lane: int) -> pd.DataFrame:
        """The step-by-step record of one traced lane."""
        return self.steps[self.steps.lane == lane].reset_index(drop=True)

    def matrix(self, column: str) -> pd.DataFrame:
        """Lanes x steps table of one column (for heatmaps); NaN where a lane has no step."""
        return self.steps.pivot(index="lane", columns="step", values=column)

    @property
    def n_steps(self) -> int:
        return int(self.steps.step.max()) + 1 if len(self.steps) else 0
