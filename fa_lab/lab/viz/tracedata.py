"""A trace's values as tables, for the figures: checks of their arguments, lane labels,
the names of what a wave's vote did to a swept row, the true row max and the deficit, and
per-step values with their titles."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import torch

from .style import EVENT_COLORS, NONFINITE_COLOR, TRACE_VALUES


#: What the rescale body did to a swept row (its wave fired while its tile max sat below
#: its base: ``Trace.steps.swept``), by the correction it got, as every figure names it:
#: key -> (name, colour). Only a base moved down, a correction above 1 that scales ``l``
#: and ``O`` up (the unfixed rule's rebase to the tile max), is a drag; the fix leaves the
#: row alone (corr = 1); a rule of one's own may move it up (corr < 1). The glossary's
#: "swept" and "drag" entries and ``count_rescales``'s ``rows_scaled_up`` say the same.
SWEEP_OUTCOMES = {
    "dragged": ("dragged (base moved down)", EVENT_COLORS["dragged"]),
    "left_alone": ("swept: left alone", EVENT_COLORS["left_alone"]),
    "rebased_up": ("swept: rebased up", EVENT_COLORS["rebased_up"]),
    "corr_nan": ("swept: correction NaN", NONFINITE_COLOR),
}


def sweep_outcomes(steps: pd.DataFrame) -> dict:
    """Each ``SWEEP_OUTCOMES`` key -> a bool array over the rows of ``steps`` (a Trace's
    ``steps``, or some of its rows): the swept row-steps with that outcome. Every swept
    row-step is in exactly one; a row-step not swept is in none."""
    swept = steps["swept"].to_numpy(bool)
    corr = steps["corr"].to_numpy(float)
    with np.errstate(invalid="ignore"):
        return {"dragged": swept & (corr > 1), "left_alone": swept & (corr == 1),
                "rebased_up": swept & (corr < 1), "corr_nan": swept & np.isnan(corr)}


def sweep_words(steps: pd.DataFrame) -> str:
    """What the swept row-steps among ``steps`` went through, in words, each outcome that
    happened with its count ("dragged (base moved down) 12 times"); "never swept" when
    none was."""
    counts = {k: int(m.sum()) for k, m in sweep_outcomes(steps).items()}
    said = [f"{SWEEP_OUTCOMES[k][0]} {n} time{'s' if n != 1 else ''}"
            for k, n in counts.items() if n]
    return ", ".join(said) if said else "never swept"


def _check_trace(trace):
    for attr in ("steps", "lanes", "matrix", "log2_per_unit", "kernel"):
        if not hasattr(trace, attr):
            raise TypeError(f"trace must be a fa_lab.Trace (from fa_lab.trace(...)), "
                            f"got {type(trace).__name__}")
    if len(trace.steps) == 0:
        raise ValueError("trace has no recorded steps")


def _check_tensor(name, x, dim):
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != dim:
        raise ValueError(f"{name} must be {dim}-D, got shape {tuple(x.shape)}")


def _check_index(name, i, n):
    if isinstance(i, bool) or not isinstance(i, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(i).__name__}")
    if not 0 <= int(i) < n:
        raise ValueError(f"{name}={i} out of range [0, {n})")
    return int(i)


def _is_fp8(trace) -> bool:
    return trace.kernel == "swp_fp8"


def step_axis_title(trace) -> str:
    if _is_fp8(trace):
        return "KV step (tile pair of 128 columns)"
    return "KV step (tile of 64 columns)"


def _finite_or_none(a) -> np.ndarray:
    """Plotly cannot draw inf: non-finite entries become gaps (NaN). Numpy arrays go to
    plotly without per-element validation, which keeps a dashboard redraw fast."""
    a = np.asarray(a, dtype=float)
    return np.where(np.isfinite(a), a, np.nan)


def _grid(a) -> list:
    """A 2-D array as nested lists with None for the non-finite entries: a FigureWidget
    sends 2-D data as JSON, where NaN is not allowed (1-D float arrays travel as binary
    buffers and may hold NaN)."""
    a = np.asarray(a, dtype=float)
    return [[float(v) if math.isfinite(v) else None for v in row] for row in a]


def fmt_number(x: float, digits=4) -> str:
    if isinstance(x, (bool, np.bool_)):
        return str(bool(x))
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "NaN"
    if math.isinf(x):
        return "+inf" if x > 0 else "-inf"
    return f"{x:.{digits}g}"


def _policy_label(trace) -> str:
    pol = trace.policy
    return pol.describe() if hasattr(pol, "describe") else str(pol)


def _lane_labels(trace) -> dict:
    """lane -> 'row r (batch b, head h)'."""
    ln = trace.lanes
    return {int(i): f"row {int(r)} (batch {int(b)}, head {int(h)})"
            for i, b, h, r in zip(ln.index, ln["batch"], ln["head"], ln["row"])}


def _lane_label(trace, lane) -> str:
    return _lane_labels(trace)[int(lane)]


def _true_max(trace) -> pd.DataFrame:
    """Lanes x steps: the largest tile max each lane has seen so far (log2 units), the
    running max an eager rescale would hold."""
    mt = trace.matrix("mt").to_numpy(dtype=float) * float(trace.log2_per_unit)
    with np.errstate(invalid="ignore"):
        best = np.fmax.accumulate(np.where(np.isnan(mt), -np.inf, mt), axis=1)
    return pd.DataFrame(best, index=trace.matrix("mt").index, columns=trace.matrix("mt").columns)


def deficit(trace) -> pd.DataFrame:
    """Lanes x steps of the deficit (``docs/semantics.md`` section 7.1): the lane's true
    running max (its largest tile max so far) minus its base m, in log2 units. Eager keeps
    it at 0, the fixed lazy rescale at most the threshold; every P, l and O carries a
    factor 2**deficit, and fp32 overflows once it nears 128."""
    m = trace.matrix("m").to_numpy(dtype=float) * float(trace.log2_per_unit)
    best = _true_max(trace).to_numpy()
    with np.errstate(invalid="ignore"):
        d = best - m
    return pd.DataFrame(d, index=trace.matrix("m").index, columns=trace.matrix("m").columns)


def trace_values(trace, value: str) -> pd.DataFrame:
    """Lanes x steps table of ``value`` in plotting units: m, mt and the deficit in log2
    units, l and corr as log2(.), flags as 0/1. Non-finite entries stay (as inf/NaN)."""
    _check_trace(trace)
    if value not in TRACE_VALUES:
        raise ValueError(f"value={value!r}; choose one of {sorted(TRACE_VALUES)}")
    if value == "deficit":
        return deficit(trace)
    mat = trace.matrix(value)
    if value in ("m", "mt"):
        return mat.astype(float) * float(trace.log2_per_unit)
    if value in ("l", "corr"):
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.log2(mat.astype(float))
    return mat.astype(float)


def value_title(trace, value: str) -> str:
    label = TRACE_VALUES[value]
    if value in ("m", "mt", "l", "corr", "deficit"):
        unit = "log2 units"
        if _is_fp8(trace) and value in ("m", "mt"):
            unit = "log2 units = raw fp8 units x log2_per_unit"
        return f"{label} ({unit})"
    return label
