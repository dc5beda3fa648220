"""Setup shared by the lesson notebooks (``notebooks/``), so that each lesson opens on its
story rather than on a wall of helpers.

* ``setup(full)``: the device, whether the full (bug-report-sized) run applies, display
  options.
* the online softmax (lesson 01): ``flash_forward``, the tiled loop with the eager or lazy
  rescale that logs every tile, and ``stacked`` (one logged field over tiles and rows).
* bf16 (lessons 00, 01 and 02): ``with_m_before``, ``with_deficit``, ``row_fate_table``;
  ``l_lag_dip`` (where a trace's one-tile lag of l shows); ``largest_p_exact`` and
  ``largest_p_exact_rows`` (whether a row's largest score got P = 1 exactly);
  ``rows_rel_l2`` (rel-L2 over a set of rows); ``row_story`` (one row's base and l under
  several policies: the tour's figure); ``threshold_figure`` (NaN and ballot rates against
  the threshold: lesson 02's figure).
* fp8 (lesson 03): ``Fp8Lesson`` holds the bug report's fp8 inputs at its KV length and
  runs or traces the fp8 kernel on them (``run_fp8`` / ``trace_fp8`` on any fp8 inputs);
  ``seed_fp8`` reads one figure of the bug report's table (data/seed/); ``mean_abs_dev`` is
  the bug report's metric; ``e4m3_error_parts`` splits the error of P's e4m3 cast.
* timings (lesson 04): ``round_verdict`` says what interleaved rounds support.

Every function is plain: it computes, it does not print, and it can be called from a
script as well as from a notebook.
"""

from __future__ import annotations

import functools
import math
import os
import sys
import warnings

import numpy as np
import pandas as pd
import torch

def setup(full: bool = False, *, device: str | None = None, precision: int = 4):
    """(device, big): the device the lesson runs on (a GPU when there is one) and whether
    the full, bug-report-sized run applies (``full`` and a CUDA GPU). Warns when ``full`` is
    asked for without a GPU. Sets pandas' display precision.

    On the CPU, torch computes on one thread unless ``OMP_NUM_THREADS`` says otherwise, as
    ``make lab`` runs it, whatever started the kernel (``jupyter nbconvert --execute``,
    nbval, the docs build): the lessons' tensors are small, and on a machine whose cores are
    busy, threads that wait for each other spin and cost many times the work.

    A lesson's figures go through plotly's renderers, which import nbformat, whose validator
    imports jsonschema, which builds rfc3987_syntax's IRI grammar at import where that
    package is installed: seconds of CPU per lesson kernel, for jsonschema's "iri" formats,
    which no schema a lesson validates uses. Unless something imported it already, the
    lesson's process runs as if it were not installed (jsonschema leaves those two formats
    unchecked)."""
    sys.modules.setdefault("rfc3987_syntax", None)
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)
    if full and device != "cuda":
        warnings.warn("FULL = True needs a GPU (DEVICE = 'cuda'); this run keeps the default "
                      "CPU sizes", stacklevel=2)
    pd.set_option("display.precision", precision)
    return device, bool(full and device == "cuda")


def to_device(device, *tensors):
    return tuple(t.to(device) for t in tensors)


# ---- the online softmax (lesson 01) -------------------------------------------------------

def flash_forward(q, k, v, *, block_n=64, threshold=None, round_p=None, exact=None):
    """Tiled attention for one head, as lesson 01 builds it: q [Sq, D], k and v [Skv, D], no
    mask. Returns out [Sq, D] and a log of every tile (a dict of per-row tensors: the base
    ``m`` after it, its tile max ``mt``, the correction ``corr`` and the largest ``p_max``).

    ``threshold=None`` rebases every row at every tile (the eager rescale: lesson 01's
    update, exercise 1); a number keeps a row's base until its tile max exceeds it by more
    than ``threshold`` (the lazy rule, one row at a time). ``round_p`` rounds P before the
    P @ V product while l sums the unrounded P, as the kernel does; ``exact`` [Sq, Skv] bool
    names the scores whose P is left unrounded. It lives here rather than in the lesson
    because its loop body is the answer to the lesson's first exercise."""
    c = math.log2(math.e) / math.sqrt(q.shape[1])
    m = torch.full((q.shape[0],), -math.inf, dtype=q.dtype)      # before any tile: no base,
    l = torch.zeros(q.shape[0], dtype=q.dtype)                    # nothing summed
    O = torch.zeros(q.shape[0], v.shape[1], dtype=q.dtype)
    steps = []
    for j in range(0, k.shape[0], block_n):
        s = (q @ k[j:j + block_n].T) * c
        mt = s.amax(-1)
        m_new = torch.maximum(m, mt)
        if threshold is not None:     # lazy: keep the base unless the tile max got far ahead
            m_new = torch.where(mt - m > threshold, m_new, m)
        corr = torch.exp2(m - m_new)
        p = torch.exp2(s - m_new[:, None])
        l = l * corr + p.sum(-1)
        p_v = p if round_p is None else round_p(p)
        if exact is not None:
            p_v = torch.where(exact[:, j:j + block_n], p, p_v)
        O = O * corr[:, None] + p_v @ v[j:j + block_n]
        steps.append({"tile": j // block_n, "m": m_new, "mt": mt, "corr": corr,
                      "p_max": p.amax(-1)})
        m = m_new
    return O / l[:, None], steps


def stacked(steps, key) -> torch.Tensor:
    """One field of ``flash_forward``'s log as a [tiles, rows] tensor."""
    return torch.stack([st[key] for st in steps])


# ---- bf16 traces -----------------------------------------------------------------------

def with_m_before(steps: pd.DataFrame) -> pd.DataFrame:
    """Trace steps plus ``m_before``, the running max before each step (a trace records m
    after it)."""
    s = steps.copy()
    s["m_before"] = s.groupby("lane").m.shift()
    return s


def with_deficit(trace) -> pd.DataFrame:
    """A trace's steps with ``m_before``, ``true_max`` (the largest tile max so far) and
    ``deficit`` (true_max - m), all in log2 units (``docs/semantics.md`` section 7.1)."""
    s = with_m_before(trace.steps)
    per = float(trace.log2_per_unit)
    for c in ("m", "mt", "m_before"):
        s[c] = s[c] * per
    s["true_max"] = s.groupby("lane").mt.cummax()
    s["deficit"] = s.true_max - s.m
    return s


#: How a row dies, by its LSE (docs/semantics.md section 7.2), in the order of the spec.
FATES = ("+-inf output, finite LSE", "NaN output, LSE = +inf", "LSE = NaN")


def row_fate_table(out: torch.Tensor, lse: torch.Tensor) -> pd.DataFrame:
    """One line per non-finite row of ``out`` [B, S, H, D] (``lse`` [B, H, S]): batch, row,
    head, its NaN / +inf / -inf element counts, its LSE and its fate (``FATES``; a row whose
    LSE is -inf, no visible key, is "LSE = -inf")."""
    bad = ~torch.isfinite(out).all(-1)                       # [B, S, H]
    idx = bad.nonzero().cpu()
    rows = []
    L = lse.permute(0, 2, 1)
    for b, s, h in idx.tolist():
        o = out[b, s, h]
        x = float(L[b, s, h])
        fate = (FATES[1] if x == math.inf else FATES[2] if math.isnan(x) else
                "LSE = -inf" if x == -math.inf else FATES[0])
        rows.append({"batch": b, "row": s, "head": h, "NaN": int(torch.isnan(o).sum()),
                     "+inf": int((o == math.inf).sum()), "-inf": int((o == -math.inf).sum()),
                     "LSE": x, "fate": fate})
    return pd.DataFrame(rows, columns=["batch", "row", "head", "NaN", "+inf", "-inf", "LSE",
                                       "fate"])


def largest_p_exact(trace) -> pd.Series:
    """Per traced lane of a bf16 trace: whether the row's largest score got ``P = 1``
    exactly, i.e. whether its base equalled its tile max at the first step where the row's
    largest tile max arrived (``P = exp2(S - m)`` is then ``exp2(0)``, which bf16 stores
    without error; a base below it gives a P in (1, 2**THR] that bf16 rounds)."""
    if trace.kernel == "swp_fp8":
        raise ValueError("largest_p_exact reads bf16 traces (the fp8 kernel scales P before "
                         "its cast); got a swp_fp8 trace")
    s = trace.steps
    at = s.loc[s.groupby("lane").mt.idxmax()].set_index("lane")
    return (at.m == at.mt).rename("largest P exactly 1")


def largest_p_exact_rows(q, k, v, **options) -> torch.Tensor:
    """``largest_p_exact`` for every query row of a bf16 call: traces all rows of ``q``
    [B, S, H, D] under ``fa_lab.trace(q, k, v, **options)`` and returns a bool tensor
    [B, S, H] on q's device."""
    from fa_lab.api import trace

    B, S, H, _ = q.shape
    lanes = [(b, h, r) for b in range(B) for h in range(H) for r in range(S)]
    exact = largest_p_exact(trace(q, k, v, rows=lanes, **options)).to_numpy().copy()
    return torch.from_numpy(exact).view(B, H, S).permute(0, 2, 1).to(q.device)


def rows_rel_l2(out: torch.Tensor, ref: torch.Tensor, rows: torch.Tensor) -> float:
    """rel-L2 of ``out`` against ``ref`` ([B, S, H, D]) over the rows where ``rows`` ([B, S,
    H] bool) is true: ||out - ref|| / ||ref|| with both norms taken over those rows only."""
    if rows.shape != out.shape[:-1] or rows.dtype != torch.bool:
        raise ValueError(f"rows must be a bool tensor of shape {tuple(out.shape[:-1])}, got "
                         f"{rows.dtype} {tuple(rows.shape)}")
    d = (out.double() - ref.double())[rows]
    return float(torch.linalg.vector_norm(d) / torch.linalg.vector_norm(ref.double()[rows]))


def l_lag_dip(trace, lane: int) -> dict | None:
    """Where the one-tile lag of l shows in a traced lane. A trace records l at step t
    before tile t's P is added (it covers tiles 0 .. t-1), but against the base after step
    t. So at a step where the base rises by x, log2(l) drops by about x, and one step later,
    with tile t's keys in, it is back. Returns the rise step with the lowest log2(l): its
    ``step``, the base's ``rise``, ``log2_l_before`` (step t - 1), ``log2_l`` (step t) and
    ``log2_l_next`` (step t + 1); None when the base never rises with l finite there."""
    d = trace.lane(lane)
    per = float(trace.log2_per_unit)
    m = d["m"].to_numpy(float) * per
    with np.errstate(divide="ignore", invalid="ignore"):
        log_l = np.log2(d["l"].to_numpy(float))
    best = None
    for t in range(1, len(d) - 1):
        # l = 0 before the first P was added: log2(l) = -inf at step t - 1 is normal
        ok = (np.isfinite(log_l[t:t + 2]).all() and log_l[t - 1] < math.inf
              and np.isfinite(m[t - 1:t + 1]).all())
        if ok and m[t] > m[t - 1] and (best is None or log_l[t] < best["log2_l"]):
            best = {"step": int(d["step"][t]), "rise": float(m[t] - m[t - 1]),
                    "log2_l_before": float(log_l[t - 1]), "log2_l": float(log_l[t]),
                    "log2_l_next": float(log_l[t + 1])}
    return best


def row_story(traces: dict, lane: int, *, lag_note: str | None = None,
              title: str | None = None, pad: int = 4):
    """One traced row under several policies (``{"lazy_unfixed": tr_u, "lazy": tr_f}``,
    traces of the same rows), on two panels that share the KV step. Top: the row's largest
    score so far (its largest tile max) and each policy's base m. Bottom: each policy's
    log2(l) against fp32's limit at 2**128, with non-finite values as triangles at the top
    edge and a dashed line where a policy's O or l first went non-finite. ``lag_note``
    names the policy whose one-tile lag of l gets an arrow (``l_lag_dip``). The steps shown
    run to ``pad`` past the latest first failure (all steps when the row stays finite)."""
    from plotly.subplots import make_subplots

    from fa_lab.lab import viz

    if not isinstance(traces, dict) or not traces:
        raise ValueError("traces must be a non-empty dict name -> Trace of the same rows")
    first_tr = next(iter(traces.values()))
    if len({tuple(t.lanes.row) for t in traces.values()}) != 1:
        raise ValueError("traces must trace the same rows (their lanes differ)")
    if lag_note is not None and lag_note not in traces:
        raise ValueError(f"lag_note={lag_note!r} is not one of {list(traces)}")
    window = viz.lanes.break_window(list(traces.values()), lane, pad=pad)
    n = first_tr.n_steps
    last = n - 1 if window is None else window[1]
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, vertical_spacing=0.07,
                        row_heights=[0.5, 0.5])
    per = float(first_tr.log2_per_unit)
    base = first_tr.lane(lane)
    steps = base["step"].to_numpy()
    keep = steps <= last
    best = np.fmax.accumulate(base["mt"].to_numpy(float) * per)
    # a wide grey band under the bases: a base that keeps up with it hides none of it
    fig.add_scatter(x=steps[keep], y=best[keep], row=1, col=1, mode="lines",
                    name="largest score so far", line=dict(color="#bbbbbb", width=7,
                                                           shape="hv"))
    top = viz.heatmap.FP32_LOG2_MAX + 12
    for name, tr in traces.items():
        d = tr.lane(lane)
        color = viz.style.policy_color(getattr(tr.policy, "name", name))
        m = d["m"].to_numpy(float) * per
        with np.errstate(divide="ignore", invalid="ignore"):
            log_l = np.log2(d["l"].to_numpy(float))
        fig.add_scatter(x=steps[keep], y=np.where(np.isfinite(m), m, np.nan)[keep], row=1, col=1,
                        mode="lines+markers", name=f"base m, {name}", legendgroup=name,
                        line=dict(color=color, width=2), marker=dict(size=4))
        fig.add_scatter(x=steps[keep], y=np.where(np.isfinite(log_l), log_l, np.nan)[keep],
                        row=2, col=1, mode="lines+markers", name=f"log2(l), {name}",
                        legendgroup=name, line=dict(color=color, width=2, dash="dot"),
                        marker=dict(size=4))
        bad = keep & (np.isnan(log_l) | (log_l == math.inf))
        fig.add_scatter(x=steps[bad], y=np.full(int(bad.sum()), top), row=2, col=1,
                        mode="markers", name=f"l = inf or NaN, {name}", legendgroup=name,
                        marker=dict(symbol="triangle-up", size=10, color=color))
        first = tr.lanes.loc[lane, "first_nonfinite_step"]
        if not pd.isna(first):
            for r in (1, 2):
                fig.add_vline(x=int(first), row=r, col=1, line=dict(color=color, dash="dash",
                                                                    width=1.5))
            fig.add_annotation(x=int(first), y=1.0, xref="x", yref="y domain", yanchor="bottom",
                               xanchor="right", showarrow=False, font=dict(color=color),
                               text=f"{name}: O or l not finite from step {int(first)} ")
    fig.add_hline(y=viz.heatmap.FP32_LOG2_MAX, row=2, col=1, line=dict(color="#444444", dash="dot",
                                                               width=1))
    fig.add_annotation(x=0, xref="x2 domain", y=viz.heatmap.FP32_LOG2_MAX, yref="y2", xanchor="left",
                       yanchor="bottom", showarrow=False, text="fp32 overflows above 2^128",
                       font=dict(size=11, color="#444444"))
    if lag_note is not None:
        dip = l_lag_dip(traces[lag_note], lane)
        if dip is not None and dip["step"] <= last:
            fig.add_annotation(
                x=dip["step"], y=dip["log2_l"], xref="x2", yref="y2", ax=-60, ay=0,
                showarrow=True, arrowhead=2, xanchor="right", bgcolor="rgba(255,255,255,0.85)",
                text=(f"{lag_note}: base rose {dip['rise']:.0f}; l lags one tile "
                      f"(tile {dip['step']} joins it at step {dip['step'] + 1})"),
                font=dict(size=11))
    fig.update_yaxes(title_text="log2 units", row=1, col=1)
    fig.update_yaxes(title_text="log2(l)", row=2, col=1)
    fig.update_xaxes(range=[-0.5, last + 0.5])
    fig.update_xaxes(title_text=viz.tracedata.step_axis_title(first_tr), row=2, col=1)
    row = int(first_tr.lanes.loc[lane, "row"])
    fig.update_layout(title=title or f"row {row}: its base m and its l, tile by tile",
                      height=560, width=1000, margin=dict(t=60, b=40),
                      legend=dict(orientation="v", x=1.02, y=1))
    return fig


def threshold_figure(nan_pct: pd.DataFrame, rates: pd.DataFrame, *, k_scale=None):
    """Where the threshold matters. Left: NaN % of the output against the threshold, one line
    per K scale (``nan_pct``: index K scale, columns thresholds). Right: the share of loop
    row-steps whose row voted, whose wave fired and which were swept, against the threshold
    (``rates``: index thresholds, those three columns in %), at ``k_scale``."""
    from plotly.subplots import make_subplots

    from fa_lab.lab import viz

    fig = make_subplots(rows=1, cols=2, horizontal_spacing=0.12, subplot_titles=(
        "NaN % of the output, by K scale", "loop row-steps, %" +
        ("" if k_scale is None else f" (K x{k_scale})")))
    shades = ("#fcae91", "#fb6a4a", "#de2d26", "#a50f15", "#67000d")
    for i, (K, row) in enumerate(nan_pct.iterrows()):
        fig.add_scatter(x=list(row.index), y=row.to_numpy(), name=f"K x{K}", row=1, col=1,
                        mode="lines+markers", line=dict(color=shades[i % len(shades)], width=2))
    events = viz.style.EVENT_COLORS
    for col, color in zip(rates.columns, (events["vote"], events["fire"], events["swept"])):
        fig.add_scatter(x=list(rates.index), y=rates[col].to_numpy(), name=col, row=1, col=2,
                        mode="lines+markers", line=dict(color=color, width=2, dash="dot"))
    fig.update_xaxes(title_text="threshold (log2 units)", type="log", tickvals=list(rates.index))
    fig.update_yaxes(range=[-3, 103])
    fig.update_layout(height=420, width=1000, margin=dict(t=50, b=40),
                      legend=dict(x=1.02, y=1))
    return fig


# ---- fp8 -------------------------------------------------------------------------------

def mean_abs_dev(out: torch.Tensor) -> float:
    """The bug report's metric: mean |o - 1| over the elements that came back finite (V = ones);
    NaN when none did."""
    d = (out.double() - 1).abs()
    ok = torch.isfinite(d)
    return float(d[ok].mean()) if bool(ok.any()) else math.nan


def e4m3_error_parts(S: torch.Tensor, ls: float, tr) -> dict:
    """Where the e4m3 cast of P puts a row's error (lesson 03, V = ones, so ``o - 1`` is that
    error alone). ``S`` [rows, keys]: the raw fp8-product scores of one head; ``ls`` the
    kernel's log2 scale; ``tr`` a fp8 trace of all those rows. Recomputes every P from the
    trace's own bases as the kernel does (``exp2(fma(S, ls, -ls * m) + H)``), weights it by
    the corrections that came after its pair, and splits ``sum (e4m3(P) - P) w / l`` in fp64
    into the row's largest term, every other pair's largest term and all other terms (means
    over rows of their absolute values); also the mean |o - 1| before and after the output's
    bf16 rounding, the rows not exactly 1, the share of ``l`` in the other pairs' largest
    terms and the share of row-pairs based at their own best key (%)."""
    from fa_lab.numerics import e4m3, exp2, fma_f32

    n_pairs = S.shape[1] // 128
    top = S.argmax(1, keepdim=True)                                  # each row's best key
    pair_top = S.view(S.shape[0], n_pairs, 128).argmax(-1) + 128 * torch.arange(n_pairs)
    m = torch.tensor(tr.matrix("m").values, dtype=torch.float32)
    corr = torch.tensor(tr.matrix("corr").values, dtype=torch.float64)
    later = torch.flip(torch.cumprod(torch.flip(corr, [1]), 1), [1])    # corrections after a pair
    w = torch.cat([later[:, 1:], torch.ones_like(later[:, :1])], 1).repeat_interleave(128, 1)
    base = m.repeat_interleave(128, 1)
    P = exp2(fma_f32(S, ls, (0.0 - ls * base) + tr.policy.p_headroom)).double()
    err = (e4m3(P.float()).double() - P) * w
    l = (P * w).sum(1)
    e_top = err.gather(1, top)[:, 0]
    e_pairs = err.gather(1, pair_top).sum(1) - e_top
    rest = err.sum(1) - e_top - e_pairs
    return {"largest term": (e_top / l).abs().mean().item(),
            "other pairs' largest terms": (e_pairs / l).abs().mean().item(),
            "all other terms": (rest / l).abs().mean().item(),
            "o - 1 before rounding": (err.sum(1) / l).abs().mean().item(),
            "o - 1, bf16 output": mean_abs_dev(tr.out),
            "rows not exactly 1": int((tr.out != 1).any(-1).sum()),
            "share of l in other pairs' maxima": (((P * w).gather(1, pair_top).sum(1)
                                                   - (P * w).gather(1, top)[:, 0]) / l).mean().item(),
            "pairs based at their own best key %": 100 * (tr.steps.m == tr.steps.mt).mean()}


def seed_fp8(policy: str, k_scale: int, field: str, bound: float | None = None):
    """One figure of the bug report's fp8 table (data/seed/pr1033_fp8.json)."""
    from fa_lab.studies.experiments import seed_table

    for r in seed_table("fp8")["rows"]:
        if r["policy"] == policy and r["k_scale"] == k_scale and r.get("bound") == bound:
            return r[field]
    raise KeyError((policy, k_scale, bound))


def seed_fp8_elements() -> int:
    """Output elements of the bug report's fp8 run (B x S x H x D)."""
    from fa_lab.studies.experiments import seed_table

    setup_ = seed_table("fp8")["setup"]
    return math.prod(int(setup_[k]) for k in ("B", "S", "H", "D"))


def run_fp8(inputs, descales, **kw):
    """``flash_attn_func`` on fp8 ``inputs`` (q8, k8, v8) with their ``descales`` (q, k, v);
    non-causal unless ``causal`` is given."""
    from fa_lab.api import flash_attn_func

    (q8, k8, v8), (qd, kd, vd) = inputs, descales
    kw.setdefault("causal", False)
    return flash_attn_func(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd, **kw)


def trace_fp8(inputs, descales, rows, **kw):
    """``fa_lab.trace`` of ``rows`` on fp8 ``inputs`` with their ``descales``."""
    from fa_lab.api import trace

    (q8, k8, v8), (qd, kd, vd) = inputs, descales
    kw.setdefault("causal", False)
    return trace(q8, k8, v8, rows=rows, q_descale=qd, k_descale=kd, v_descale=vd, **kw)


class Fp8Lesson:
    """The bug report's fp8 problem (q = 0.1 N(0,1), k = 0.1 k_scale N(0,1), V = ones, per-tensor
    e4m3) at its KV length, keeping the first ``rows`` query rows of ``heads`` heads:
    query rows of different 256-row blocks never interact, so those rows come out exactly
    as in the full run. Inputs are generated on the CPU (the same numbers on any device)
    and cached per k scale."""

    def __init__(self, device="cpu", *, rows=256, heads=1, skv=None):
        from fa_lab.studies.experiments import SEED_SIZES

        self.device = device
        self.rows, self.heads = int(rows), int(heads)
        self.skv = int(skv or SEED_SIZES["fp8"]["S"])
        self.inputs = functools.lru_cache(maxsize=None)(self._inputs)

    def _inputs(self, k_scale, heads=None):
        from fa_lab.studies.experiments import fp8_inputs

        (q8, k8, v8), ds = fp8_inputs(1, self.skv, heads or self.heads, k_scale)
        return to_device(self.device, q8[:, :self.rows].contiguous(), k8, v8), ds

    def run(self, k_scale, heads=None, **kw):
        """``flash_attn_func`` on the k scale's inputs (non-causal unless ``causal``)."""
        return run_fp8(*self.inputs(k_scale, heads), **kw)

    def trace(self, k_scale, rows, heads=None, **kw):
        """``fa_lab.trace`` of ``rows`` on the k scale's inputs."""
        return trace_fp8(*self.inputs(k_scale, heads), rows, **kw)


# ---- timings ---------------------------------------------------------------------------

def round_verdict(rounds, *, name: str = "lazy") -> str:
    """What interleaved rounds of a time ratio (other's time / ``name``'s time) support:
    "faster in every round", "slower in every round", or "within noise" when the rounds
    disagree on the side of 1."""
    r = np.asarray(list(rounds), dtype=float)
    if r.size == 0 or not np.isfinite(r).all():
        raise ValueError("rounds must be a non-empty list of finite ratios")
    if (r > 1).all():
        return f"{name} faster in every round"
    if (r < 1).all():
        return f"{name} slower in every round"
    return "within noise"


# ---- the attack (lesson 06) --------------------------------------------------------------

#: The name of the lab's record of lesson 06's searches (in its reference results), made by
#: benchmarks/lesson06_attack.py: the lesson reads them back instead of searching again.
LESSON06_RECORD = "attack_lesson06"


def attack_from_run(run: dict):
    """An ``adversary.Attack`` rebuilt from one run of an attack record (``Attack.to_dict()``
    with ``wall_s``; ``fa_lab.studies.adversary.record``)."""
    from fa_lab.studies.adversary import Attack, Candidate

    def candidate(d):
        return None if d is None else Candidate(**{k: x for k, x in d.items() if k != "size"})

    return Attack(
        policy=run["policy"], space=run["space"], budget_s=run["budget_s"], seed=run["seed"],
        threshold=run["threshold"], found=run["found"], evals=run["evals"],
        search_s=run["search_s"], time_to_first_s=run["time_to_first_s"],
        evals_to_first=run["evals_to_first"], first=candidate(run["first"]),
        shrunk=candidate(run["shrunk"]), shrink_evals=run["shrink_evals"],
        shrink_s=run.get("shrink_s", 0.0), best=candidate(run["best"]),
        best_fitness=run["best_fitness"], bad_rows=list(run["bad_rows"]),
        trace=list(run.get("trace", [])), history=list(run["history"]),
        structured=run["structured"], baseline=run["baseline"],
        optimizer=run.get("optimizer", "cma"),
        classes=tuple(run.get("classes", ("nonfinite",))),
        found_classes=list(run.get("found_classes", [])), outside=run.get("outside_region", 0))


def recorded_search(policy: str, *, live: bool = False, record: str = LESSON06_RECORD,
                    **kwargs):
    """``(attack, source)``: ``adversary.search(policy, **kwargs)`` as the lab's attack record
    ``record`` (the lab's reference results) holds it when one of its runs was asked for with exactly this
    policy and these arguments (the record's ``params["calls"]``) and ``live`` is False;
    otherwise the search runs now. ``source`` says which: the record's device, date and
    commit, or "searched now". Nothing here writes a record: a search run here is the
    caller's alone (benchmarks/lesson06_attack.py makes the lab's)."""
    from fa_lab.studies import adversary

    if not isinstance(policy, str):
        raise TypeError(f"policy must be a policy name (str), got {type(policy).__name__}")
    if not live:
        rec = adversary.load_record(record, reference=True)
        call = {"policy": policy, **kwargs}
        for asked, run in zip(rec["params"].get("calls", []), rec["runs"]):
            if asked == call:
                p = rec["provenance"]
                return attack_from_run(run), (f"recorded on {p['device']}, {p['date'][:10]}, "
                                              f"commit {str(p['git_commit'])[:7]}")
    return adversary.search(policy, **kwargs), "searched now"
