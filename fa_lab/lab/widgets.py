"""Dashboards: sliders and dropdowns that rerun the kernels and redraw fa_lab.lab.viz figures.

Each dashboard is two layers:

* a plain ``compute_*_view(...)`` function of the widget values that checks them, runs
  ``fa_lab.flash_attn_func`` / ``fa_lab.trace`` (backend ``auto``: the exact model on CPU,
  the Triton kernels on a GPU) and returns a dict of data and ``viz`` figures. It needs
  no browser and is what the tests call;
* the widget wiring (``rescale_dashboard``, ``fp8_dashboard``, ``compare_dashboard``), which
  reads the controls, calls that function and copies the new figures into
  ``plotly.graph_objects.FigureWidget``s (``DashboardFigure``) in place.

The dashboards fit a 1600 x 1000 screen: the controls and a compact summary in a column on
the left, the main figure (the chosen row, under its policy beside the fix) on the right,
the secondary figures in tabs under it. Only the figures on screen are redrawn when a
control moves; a tab's figure is drawn when the tab is opened.

A redraw goes in the reader's order (``Dashboard.update``): the traces and the main figure
first, then the open tab's figure, then the whole outputs and the fp32 reference that the
summary's numbers need. A figure goes to the browser as one message holding only the
properties that changed (``assign_figure``). After a move made in the browser the kernel
waits until the browser has drawn the main figure before it computes the rest, so that on
a small machine the two do not share the CPU; a newer move supersedes the rest of an
older one.

Inputs, the fp32 reference, outputs and traces are cached by their parameters, so moving the
threshold, the policy or the row reruns only what depends on it; a K-scale move reruns
everything. A trace runs the chosen row's 256-row block only (blocks never interact), not
the whole problem. ``benchmark(...)`` measures the redraw latency of a dashboard.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import html
import math
import statistics
import time
from collections import OrderedDict

import numpy as np
import pandas as pd
import plotly.graph_objects as go
import torch
import traitlets

from fa_lab import metrics, policies, reference
from fa_lab.lab import viz
from fa_lab.api import flash_attn_func, trace
from fa_lab.studies.experiments import bf16_inputs, fp8_inputs, quantize_e4m3
from fa_lab.kernels._common.geometry import BLOCK_M, WAVE_ROWS

#: The built-in policies a dashboard compares, in display order; registered user policies
#: join them (``compared``), and every registered policy is in the dropdowns.
BF16_POLICIES = ("lazy_unfixed", "lazy", "eager")
FP8_POLICIES = ("lazy_unfixed", "lazy_capped", "lazy", "eager")
#: Sizes that redraw within 0.3 s on 2 CPU cores (see benchmarks/bench_widgets.py).
CPU_DEFAULTS = dict(S=1024, H=1, D=128)
FP8_CPU_DEFAULTS = dict(S=1024, H=1)
#: Figure sizes (px): the main figure and the tabs' figures share the right column; with
#: the control column (LEFT_WIDTH) they fit a 1600 x 1000 screen with JupyterLab's file
#: browser open.
LEFT_WIDTH = 320
FIGURE_WIDTH = 860
MAIN_HEIGHT = 430
TAB_HEIGHT = 370
#: The heatmap's choices, by label.
HEAT_VALUES = (("deficit", "deficit"), ("running max m", "m"), ("tile max", "mt"),
               ("log2(l)", "l"), ("log2(corr)", "corr"), ("dragged", "dragged"),
               ("voted", "vote"), ("wave fired", "fire"))


def compared(base: tuple, selected: str) -> tuple:
    """``base``, then every registered user policy, then ``selected`` if still missing."""
    names = [*base, *(n for n in policies.names() if n not in policies.BUILTIN_NAMES and n not in base)]
    return tuple(names) + (() if selected in names else (selected,))


def _lazy(name: str) -> bool:
    return policies.get(name).lazy


def fix_of(policy: str) -> str:
    """The policy a row is drawn beside: the fix (``lazy``), or for ``lazy`` itself the
    unfixed rule it replaced."""
    return "lazy_unfixed" if policy == "lazy" else "lazy"


def default_device() -> str:
    """Where the dashboards run: a GPU when there is one (Triton kernels), else the CPU
    (the exact model)."""
    return "cuda" if torch.cuda.is_available() else "cpu"


# ---- argument checks -------------------------------------------------------------------

def _positive_number(name, x):
    if isinstance(x, bool) or not isinstance(x, (int, float, np.integer, np.floating)):
        raise TypeError(f"{name} must be a number, got {type(x).__name__}")
    x = float(x)
    if not math.isfinite(x) or x <= 0:
        raise ValueError(f"{name} must be finite and > 0, got {x!r}")
    return x


def _nonneg_number(name, x):
    if isinstance(x, bool) or not isinstance(x, (int, float, np.integer, np.floating)):
        raise TypeError(f"{name} must be a number, got {type(x).__name__}")
    x = float(x)
    if not math.isfinite(x) or x < 0:
        raise ValueError(f"{name} must be finite and >= 0, got {x!r}")
    return x


def _int(name, x, lo, hi=None):
    if isinstance(x, bool) or not isinstance(x, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(x).__name__}")
    x = int(x)
    if x < lo or (hi is not None and x >= hi):
        rng = f"[{lo}, {hi})" if hi is not None else f">= {lo}"
        raise ValueError(f"{name}={x} out of range {rng}")
    return x


def _bool(name, x):
    if not isinstance(x, (bool, np.bool_)):
        raise TypeError(f"{name} must be a bool, got {type(x).__name__}")
    return bool(x)


def _choice(name, x, options):
    if x not in options:
        raise ValueError(f"{name}={x!r}; choose one of {list(options)}")
    return x


# ---- cache -----------------------------------------------------------------------------

class _LRU:
    """A small least-recently-used cache: dashboards revisit the same few settings."""

    def __init__(self, size: int):
        self.size = size
        self._d: OrderedDict = OrderedDict()

    def get(self, key, make):
        if key in self._d:
            self._d.move_to_end(key)
            return self._d[key]
        val = make()
        self._d[key] = val
        while len(self._d) > self.size:
            self._d.popitem(last=False)
        return val

    def clear(self):
        self._d.clear()


_CACHE = _LRU(24)


_FIGURES = _LRU(24)


def clear_cache():
    """Forget cached inputs, references, outputs and figures (frees their memory)."""
    _CACHE.clear()
    _FIGURES.clear()


def _figure(make, sources, *extra):
    """``make()``, memoised on the identity of ``sources`` (cached traces or outputs) and
    ``extra``: when a control leaves a figure's data alone, the same figure object comes
    back, and the dashboard skips redrawing it."""
    sources = sources if isinstance(sources, tuple) else (sources,)
    key = (tuple(id(s) for s in sources), *extra)
    srcs, fig = _FIGURES.get(key, lambda: (sources, make()))
    if any(a is not b for a, b in zip(srcs, sources)):  # an id reused after its object died
        fig = make()
        _FIGURES._d[key] = (sources, fig)
    return fig


def block_trace(q, k, v, rows: range, *, head: int = 0, causal: bool = False, **options):
    """``fa_lab.trace`` of ``rows`` run on their 256-row blocks only. Query blocks never
    interact, so this is the full run's trace, bit for bit, at a fraction of its cost.
    Non-causal: the blocks that hold ``rows``. Causal masks are bottom-right aligned, so
    the run keeps every row from the first block on (the mask of each row is unchanged)."""
    S = q.shape[1]
    b0 = (rows.start // BLOCK_M) * BLOCK_M
    b1 = S if causal else min(S, -(-rows.stop // BLOCK_M) * BLOCK_M)
    if (b0, b1) == (0, S):
        return trace(q, k, v, rows=rows, head=head, causal=causal, **options)
    tr = trace(q[:, b0:b1].contiguous(), k, v, rows=range(rows.start - b0, rows.stop - b0),
               head=head, causal=causal, **options)
    tr.lanes["row"] = tr.lanes["row"] + b0
    tr.steps["row"] = tr.steps["row"] + b0
    return tr


def _auto_tile(tr, lane: int) -> int:
    """The step a wave figure opens on: where the lane first went non-finite, else its
    first drag, else the first loop step."""
    first = tr.lanes.loc[lane, "first_nonfinite_step"]
    if not pd.isna(first):
        return int(first)
    d = tr.lane(lane)
    drags = d.step[d.dragged]
    return int(drags.iloc[0]) if len(drags) else min(1, tr.n_steps - 1)


def _lane_figures(view, names, heat_value, tile) -> dict:
    """The figures of a lane dashboard, by name (each memoised, see ``_figure``):
    ``row`` (the row under its policy beside the fix), ``wave`` (its wave at one step),
    ``heatmap`` (its wave, step by step) and ``nonfinite`` (every bad row)."""
    tr, other, lane, p = view["trace"], view.get("trace_fix"), view["lane"], view["params"]
    out, lse = view["out"], view.get("lse")
    row = p["row"]
    makers = {
        "row": lambda: _figure(
            lambda: viz.row_compare({p["policy"]: tr, other.policy.name: other}, lane,
                                    height=MAIN_HEIGHT) if other is not None
            else viz.lane_lines(tr, lane), (tr, other), "row", lane),
        "wave": lambda: _figure(lambda: viz.wave_ballot(tr, tile, wave=row, highlight=lane),
                                tr, "wave", tile, lane),
        "heatmap": lambda: _figure(lambda: viz.running_max_heatmap(tr, heat_value,
                                                                   highlight=lane), tr, "heat",
                                   heat_value, lane),
        "nonfinite": lambda: _figure(lambda: viz.nonfinite_map(
            out, lse=lse, highlight=(row, p["head"]), height=TAB_HEIGHT), out, "nonfinite",
            row, p["head"]),
    }
    return {n: makers[n]() for n in names}


LANE_FIGURES = ("row", "wave", "heatmap", "nonfinite")


def _which(figures) -> tuple:
    if figures is True:
        return LANE_FIGURES
    if figures is False or figures is None:
        return ()
    bad = [f for f in figures if f not in LANE_FIGURES]
    if bad:
        raise ValueError(f"figures={list(figures)}: choose among {LANE_FIGURES}")
    return tuple(figures)


def _bf16_inputs(S, H, D, k_scale, seed, device):
    return _CACHE.get(("bf16", S, H, D, k_scale, seed, str(device)),
                      lambda: bf16_inputs(1, S, H, D, k_scale, seed=seed, device=device))


def wave_rows(row: int, S: int, n_waves: int = 1) -> range:
    """The query rows of the ``n_waves`` 32-row waves starting at ``row``'s wave."""
    w0 = (row // WAVE_ROWS) * WAVE_ROWS
    return range(w0, min(S, w0 + n_waves * WAVE_ROWS))


def _stats_row(name, out, ref=None):
    fin = metrics.finiteness(out)
    row = {"policy": name, "nan_pct": 100 * fin["nan_frac"], "inf_pct": 100 * fin["inf_frac"],
           "nan_rows": fin["nan_rows"], "rows": fin["rows"]}
    if ref is not None:
        row["rel_l2"] = metrics.rel_l2(out, ref)
    return row


def _tile_arg(tile, n_steps):
    if tile is None:
        return None
    return _int("tile", tile, 0, n_steps)


# ---- bf16: the lazy rescale ------------------------------------------------------------

def _finish_view(view: dict, tile, names, heat_value, run_policy, summary) -> dict:
    """The shared tail of the bf16 and fp8 views: the step shown (``tile``, or the followed
    row's own), the summary, and ``make_figures(which)``, which first runs the policy over
    the whole input (``run_policy() -> (out, lse)``) when a partial view needs it."""
    view["tile"] = _tile_arg(tile, view["trace"].n_steps)
    if view["tile"] is None:
        view["tile"] = _auto_tile(view["trace"], view["lane"])
    view["params"]["tile"] = view["tile"]
    view["summary"] = summary(view)

    def make_figures(which):
        if "nonfinite" in which and view["out"] is None:   # a partial view: run policy now
            view["out"], view["lse"] = run_policy()
        return _lane_figures(view, which, heat_value, view["tile"])

    view["figures"] = make_figures(names)
    view["make_figures"] = make_figures
    return view


def compute_rescale_view(k_scale=32, threshold=8.0, policy="lazy_unfixed", causal=False,
                         S=CPU_DEFAULTS["S"], seed=0, row=0, *, H=CPU_DEFAULTS["H"],
                         D=CPU_DEFAULTS["D"], head=0, n_waves=1, heat_value="deficit",
                         tile=None, device=None, backend="auto", figures=True,
                         with_trace=True, all_policies=True) -> dict:
    """Everything the bf16 dashboard shows for one setting of its controls.

    Inputs are the seed's (q, v ~ N(0,1), k = N(0,1) x ``k_scale``, bf16, batch 1, from
    ``experiments.bf16_inputs`` with ``seed``). Runs every policy of BF16_POLICIES (lazy
    ones with ``threshold``) and the fp32 reference, and traces the ``n_waves`` waves from
    ``row``'s wave under ``policy`` and under the fix (``fix_of``), on the row's block.

    Returns a dict: ``stats`` (DataFrame: NaN %, inf %, NaN rows, rel-L2 per policy),
    ``out`` and ``lse`` of ``policy``, ``outputs`` (all policies), ``reference``, ``trace``,
    ``trace_fix``, ``lane`` (``row``'s lane in the trace), ``tile`` (the wave figure's step:
    ``tile``, or where the row breaks), ``summary`` (HTML) and ``figures``: all of
    ``LANE_FIGURES`` (``figures=True``), none (False) or the names given;
    ``make_figures(names)`` builds others from the same view later.
    ``all_policies=False`` runs only what the figures asked for need (the traces; the output
    of ``policy`` for the bad-row map, also when ``make_figures`` asks for that map), without
    the reference (``partial`` is True): what a dashboard draws first, before the summary's
    numbers.
    """
    k_scale = _positive_number("k_scale", k_scale)
    threshold = _nonneg_number("threshold", threshold)
    policy = _choice("policy", policy, policies.names())
    causal = _bool("causal", causal)
    S = _int("S", S, 1)
    H = _int("H", H, 1)
    D = _choice("D", D, (64, 128))
    seed = _int("seed", seed, 0)
    row = _int("row", row, 0, S)
    head = _int("head", head, 0, H)
    n_waves = _int("n_waves", n_waves, 1)
    _choice("heat_value", heat_value, tuple(viz.TRACE_VALUES))
    names = _which(figures)
    device = default_device() if device is None else device

    key = ("bf16", S, H, D, k_scale, seed, str(device))
    q, k, v = _bf16_inputs(S, H, D, k_scale, seed, device)
    ref = (_CACHE.get(key + ("ref", causal), lambda: reference.attention(q, k, v, causal=causal)[0])
           if all_policies else None)

    def run(pol):
        thr = threshold if _lazy(pol) else None
        return _CACHE.get(key + (pol, thr, causal, backend), lambda: flash_attn_func(
            q, k, v, causal=causal, rescale=pol, rescale_threshold=thr, return_lse=True,
            backend=backend))

    # all_policies=False: only what the figures asked for need run (a trace runs its block)
    runs = (compared(BF16_POLICIES, policy) if all_policies else
            (policy,) if "nonfinite" in names else ())
    outputs = {pol: run(pol) for pol in runs}
    stats = pd.DataFrame([_stats_row(p, o, ref) for p, (o, _) in outputs.items()],
                         columns=["policy", "nan_pct", "inf_pct", "nan_rows", "rows", "rel_l2"])
    if ref is None:
        stats["rel_l2"] = math.nan
    out, lse = outputs.get(policy, (None, None))
    view = {
        "params": dict(k_scale=k_scale, threshold=threshold, policy=policy, causal=causal, S=S,
                       seed=seed, row=row, H=H, D=D, head=head, device=str(device)),
        "stats": stats, "out": out, "lse": lse, "reference": ref,
        "outputs": {p: o for p, (o, _) in outputs.items()}, "partial": not all_policies,
    }
    if not with_trace:
        view["summary"] = _rescale_summary(view)
        return view
    rows = wave_rows(row, S, n_waves)

    def traced(pol):
        thr = threshold if _lazy(pol) else None
        return _CACHE.get(key + ("trace", pol, thr, causal, backend, head, rows.start, rows.stop),
                          lambda: block_trace(q, k, v, rows, head=head, causal=causal, rescale=pol,
                                              rescale_threshold=thr, backend=backend))

    tr = traced(policy)
    view["trace"], view["trace_fix"] = tr, traced(fix_of(policy))
    view["lane"] = row - rows.start
    return _finish_view(view, tile, names, heat_value, lambda: run(policy), _rescale_summary)


def _stats_html(stats: pd.DataFrame, highlight: str, columns) -> str:
    head = "".join(f"<th style='padding:1px 5px;white-space:nowrap'>{html.escape(c)}</th>"
                   for c, _ in columns)
    body = []
    for _, r in stats.iterrows():
        color = viz.policy_color(r["policy"])
        weight = "bold" if r["policy"] == highlight else "normal"
        cells = "".join(f"<td style='padding:1px 5px;text-align:right;white-space:nowrap'>"
                        f"{fmt(r)}</td>" for _, fmt in columns[1:])
        body.append(f"<tr style='font-weight:{weight}'><td style='padding:1px 5px;"
                    f"white-space:nowrap;color:{color}'>&#9632; {html.escape(str(r['policy']))}"
                    f"</td>{cells}</tr>")
    return f"<table style='font-size:12px'><tr>{head}</tr>{''.join(body)}</table>"


def _row_sentence(view) -> str:
    p = view["params"]
    if "trace" not in view:
        return ""
    lane = view["trace"].lanes.loc[view["lane"]]
    first = lane["first_nonfinite_step"]
    where = ("stays finite" if pd.isna(first) else
             f"goes non-finite at KV step {int(first)}")
    return (f"<div style='margin-top:4px'>Row <b>{p['row']}</b> (head {p['head']}) under "
            f"<b>{html.escape(p['policy'])}</b> {where}; LSE = "
            f"{viz.fmt_number(float(lane['lse']), 6)}; dragged {int(lane['n_dragged'])} times. "
            f"The wave tab shows step {view.get('tile', 0)}.</div>")


def _rescale_summary(view) -> str:
    p = view["params"]
    pending = view.get("partial", False)
    cols = [("policy", None),
            ("NaN %", lambda r: f"{r['nan_pct']:.3f}"),
            ("NaN rows", lambda r: f"{int(r['nan_rows'])}"),
            ("rel-L2", lambda r: "..." if pending else "NaN" if math.isnan(r["rel_l2"])
             else f"{r['rel_l2']:.2e}")]
    return (f"<div class='fa-lab-summary' style='font-size:12px;line-height:1.35'>"
            f"<b>bf16, K x{p['k_scale']:g}, threshold {p['threshold']:g}, "
            f"{'causal' if p['causal'] else 'non-causal'}</b><br>S={p['S']}, H={p['H']}, "
            f"D={p['D']}, seed {p['seed']}, {p['device']}; rel-L2 against fp32"
            + _stats_html(view["stats"], p["policy"], cols)
            + ("<div style='color:#777'>the policies' numbers against fp32: "
               "computing...</div>" if pending else "") + _row_sentence(view) + "</div>")


# ---- fp8: the rebase rules -------------------------------------------------------------

def compute_fp8_view(k_scale=5000.0, threshold=8.0, policy="lazy_unfixed", rebase_bound=16.0,
                     headroom=False, causal=False, S=FP8_CPU_DEFAULTS["S"], seed=0, row=0, *,
                     H=FP8_CPU_DEFAULTS["H"], head=0, n_waves=1, heat_value="deficit",
                     tile=None, device=None, backend="auto", figures=True,
                     all_policies=True) -> dict:
    """Everything the fp8 dashboard shows: the seed's fp8 inputs (q = 0.1 N, k = 0.1 k_scale
    N, V = ones, per-tensor e4m3) through the fp8 kernel under ``policy``, and the chosen
    row's wave traced under it and under the fix.

    ``threshold``: a number (log2 units) or ``"by_kv_len"`` (PR #1020's rule);
    ``rebase_bound``: used by capped policies only; ``headroom``: PR #1020's P lift.
    Returns a dict with ``stats`` (mean |o - 1| over finite elements, NaN and inf counts),
    ``out``, ``lse``, ``trace``, ``trace_fix``, ``lane``, ``tile``, ``summary``, ``figures``
    and ``make_figures`` (as ``compute_rescale_view``). ``all_policies=False`` (the name
    ``compute_rescale_view`` gives it) runs only the traces, without the whole output and
    its statistics (``stats`` is None, ``partial`` True) unless the bad-row map is asked
    for: what the dashboard draws first.
    """
    k_scale = _positive_number("k_scale", k_scale)
    if threshold != "by_kv_len":
        threshold = _nonneg_number("threshold", threshold)
    policy = _choice("policy", policy, policies.names())
    rebase_bound = _nonneg_number("rebase_bound", rebase_bound)
    headroom = _bool("headroom", headroom)
    causal = _bool("causal", causal)
    S = _int("S", S, 1)
    H = _int("H", H, 1)
    seed = _int("seed", seed, 0)
    row = _int("row", row, 0, S)
    head = _int("head", head, 0, H)
    n_waves = _int("n_waves", n_waves, 1)
    _choice("heat_value", heat_value, tuple(viz.TRACE_VALUES))
    names = _which(figures)
    device = default_device() if device is None else device

    key = ("fp8", S, H, k_scale, seed, str(device))
    (q8, k8, v8), (qd, kd, vd) = _CACHE.get(key, lambda: fp8_inputs(1, S, H, k_scale, seed=seed,
                                                                      device=device))

    def args_for(pol):
        lazy = _lazy(pol)
        return dict(q_descale=qd, k_descale=kd, v_descale=vd, causal=causal, rescale=pol,
                    rescale_threshold=threshold if lazy else None,
                    rebase_bound=rebase_bound if policies.get(pol).rebase == "capped" else None,
                    p_headroom=True if headroom else None, backend=backend)

    def pkey(args):
        return key + tuple(sorted((k, str(v)) for k, v in args.items() if "descale" not in k))

    args = args_for(policy)

    def run_policy():
        return _CACHE.get(pkey(args), lambda: flash_attn_func(q8, k8, v8, return_lse=True,
                                                              **args))

    out, lse = run_policy() if all_policies or "nonfinite" in names else (None, None)
    rows = wave_rows(row, S, n_waves)

    def traced(pol):
        a = args_for(pol)
        return _CACHE.get(pkey(a) + ("trace", head, rows.start, rows.stop),
                          lambda: block_trace(q8, k8, v8, rows, head=head, **a))

    tr = traced(policy)
    stats = None
    if all_policies:
        fin = metrics.finiteness(out)
        dev = (out.double() - 1.0).abs()
        ok = torch.isfinite(dev)
        mad = float(dev[ok].mean()) if bool(ok.any()) else math.nan
        stats = {"mean_abs_dev": mad, "nan": fin["nan"], "inf": fin["inf"],
                 "elements": fin["elements"], "nan_rows": fin["nan_rows"], "rows": fin["rows"]}
    lane = row - rows.start
    view = {
        "params": dict(k_scale=k_scale, threshold=threshold, policy=policy,
                       rebase_bound=rebase_bound, headroom=headroom, causal=causal, S=S,
                       seed=seed, row=row, H=H, head=head, device=str(device)),
        "policy": tr.policy, "stats": stats, "out": out, "lse": lse, "trace": tr,
        "trace_fix": traced(fix_of(policy)), "lane": lane, "partial": stats is None,
    }
    return _finish_view(view, tile, names, heat_value, run_policy, _fp8_summary)


def _fp8_summary(view) -> str:
    p, s, pol = view["params"], view["stats"], view["policy"]
    color = viz.policy_color(p["policy"])
    return (f"<div class='fa-lab-summary' style='font-size:12px;line-height:1.35'>"
            f"<b>fp8, k x{p['k_scale']:.6g}, {'causal' if p['causal'] else 'non-causal'}</b>"
            f"<br>S={p['S']}, H={p['H']}, seed {p['seed']}, {p['device']}<br>"
            f"<span style='color:{color}'>&#9632;</span> <b>{html.escape(pol.describe())}</b> "
            f"(threshold {pol.threshold:g} log2 units"
            + (f", P headroom {pol.p_headroom:.3f}" if pol.p_headroom else "") + ")<br>"
            + ("<span style='color:#777'>mean |o - 1| and NaN counts of the whole output: "
               "computing...</span>" if s is None else
               f"mean |o - 1| over finite elements: <b>{viz.fmt_number(s['mean_abs_dev'], 4)}</b><br>"
               f"NaN elements: <b>{s['nan']}</b> of {s['elements']} "
               f"({100 * s['nan'] / s['elements']:.3f} %), inf: {s['inf']}; "
               f"{s['nan_rows']} of {s['rows']} rows NaN")
            + _row_sentence(view) + "</div>")


# ---- lazy vs eager vs fp8 --------------------------------------------------------------

def compute_compare_view(k_scale=32, threshold=8.0, fp8_policy="lazy", causal=False,
                         S=CPU_DEFAULTS["S"], seed=0, head=0, *, H=CPU_DEFAULTS["H"],
                         D=128, device=None, backend="auto", figures=True) -> dict:
    """The bf16 repro inputs through the unfixed lazy, fixed lazy and eager bf16 kernels
    and, quantised per tensor to e4m3, through the fp8 kernel (``fp8_policy``); each output
    against the fp32 reference of the bf16 inputs. Returns ``stats``, ``outputs``,
    ``reference``, ``summary`` and ``figures`` (difference)."""
    k_scale = _positive_number("k_scale", k_scale)
    threshold = _nonneg_number("threshold", threshold)
    fp8_policy = _choice("fp8_policy", fp8_policy, policies.names())
    causal = _bool("causal", causal)
    S = _int("S", S, 1)
    H = _int("H", H, 1)
    D = _choice("D", D, (128,))
    seed = _int("seed", seed, 0)
    head = _int("head", head, 0, H)
    device = default_device() if device is None else device
    base = compute_rescale_view(k_scale, threshold, "lazy", causal, S, seed, 0, H=H, D=D,
                                head=head, device=device, backend=backend, figures=False,
                                with_trace=False)
    q, k, v = _bf16_inputs(S, H, D, k_scale, seed, device)
    key = ("fp8-of-bf16", S, H, D, k_scale, seed, str(device))
    (q8, qd), (k8, kd), (v8, vd) = _CACHE.get(key, lambda: tuple(quantize_e4m3(x) for x in (q, k, v)))
    thr = threshold if _lazy(fp8_policy) else None
    o8 = _CACHE.get(key + (fp8_policy, thr, causal, backend), lambda: flash_attn_func(
        q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd, causal=causal, rescale=fp8_policy,
        rescale_threshold=thr, backend=backend))
    ref = base["reference"]
    outputs = dict(base["outputs"])
    outputs["fp8"] = o8
    stats = pd.concat([base["stats"], pd.DataFrame([_stats_row("fp8", o8, ref)])],
                      ignore_index=True)
    view = {"params": dict(base["params"], fp8_policy=fp8_policy), "stats": stats,
            "outputs": outputs, "reference": ref}
    p = view["params"]
    cols = [("output", None),
            ("NaN %", lambda r: f"{r['nan_pct']:.3f}"),
            ("rel-L2", lambda r: "NaN" if math.isnan(r["rel_l2"]) else f"{r['rel_l2']:.3e}")]
    view["summary"] = (f"<div class='fa-lab-summary' style='font-size:12px'><b>K x{p['k_scale']:g}, "
                       f"threshold {p['threshold']:g}</b><br>S={p['S']}, H={p['H']}; fp8 = e4m3 "
                       f"per tensor under {html.escape(fp8_policy)}; rel-L2 against fp32"
                       + _stats_html(stats, "", cols) + "</div>")

    def make(which):
        if "difference" not in which:
            return {}
        fig = _figure(lambda: viz.output_difference_rows(outputs, ref, head=head),
                      (o8, *(o for o in outputs.values())), "difference", head)
        return {"difference": fig}

    view["figures"] = make(("difference",) if figures else ())
    view["make_figures"] = make
    return view


# ---- widget wiring ---------------------------------------------------------------------

def _same(a, b) -> bool:
    """Whether two JSON-like plotly values (dicts, lists, numpy arrays, scalars) are equal,
    NaN equal to NaN: a value that compares equal is not sent to the browser again."""
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        if not (isinstance(a, np.ndarray) and isinstance(b, np.ndarray)):
            return False
        if a.shape != b.shape or a.dtype != b.dtype:
            return False
        try:
            return bool(np.array_equal(a, b, equal_nan=True))
        except TypeError:      # object or string arrays have no NaN to match
            return bool(np.array_equal(a, b))
    if isinstance(a, dict) or isinstance(b, dict):
        return (isinstance(a, dict) and isinstance(b, dict) and a.keys() == b.keys()
                and all(_same(a[k], b[k]) for k in a))
    if isinstance(a, (list, tuple)) or isinstance(b, (list, tuple)):
        return (isinstance(a, (list, tuple)) and isinstance(b, (list, tuple))
                and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b)))
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return type(a) is type(b) and a == b


#: Trace properties that stay as the widget has them when a new figure leaves them out:
#: the trace's id, and whether the reader hid it by clicking its legend entry.
_KEPT_TRACE_KEYS = ("uid", "visible")


def figure_changes(widget: go.FigureWidget, fig: go.Figure):
    """What ``assign_figure`` sends to copy ``fig`` into ``widget``: ``(traces, layout)``,
    ``traces`` mapping a trace's index to its changed top-level properties and ``layout``
    the changed top-level layout properties, each to its new value (None: the new figure
    lacks it, so it goes). A property whose value is the widget's already is left out, and
    so is a trace with nothing changed. The layout's template never changes (viz figures
    share one), nor its width or height where the widget fixes them (the dashboard's
    size). None when the two do not have the same trace types in the same order."""
    new_data = [t.to_plotly_json() for t in fig.data]
    old_data = [t.to_plotly_json() for t in widget.data]
    if len(new_data) != len(old_data) or any(
            a.get("type") != b.get("type") for a, b in zip(old_data, new_data)):
        return None
    traces = {}
    for i, (old, new) in enumerate(zip(old_data, new_data)):
        changed = {k: v for k, v in new.items() if k not in old or not _same(old[k], v)}
        changed.update({k: None for k in old if k not in new and k not in _KEPT_TRACE_KEYS})
        if changed:
            traces[i] = changed
    kept = {"template"} | {k for k in ("width", "height") if getattr(widget.layout, k) is not None}
    new_layout = {k: v for k, v in fig.layout.to_plotly_json().items() if k not in kept}
    old_layout = {k: v for k, v in widget.layout.to_plotly_json().items() if k not in kept}
    layout = {k: v for k, v in new_layout.items()
              if k not in old_layout or not _same(old_layout[k], v)}
    layout.update({k: None for k in old_layout if k not in new_layout})
    return traces, layout


def assign_figure(widget: go.FigureWidget, fig: go.Figure):
    """Copy ``fig`` into ``widget`` in place, in one update message that holds only what
    changed (``figure_changes``): the top-level properties of each trace and of the layout
    whose values differ. What did not change is neither validated again nor sent, and the
    browser keeps it. A changed property is replaced whole, so stale shapes, annotations
    and buttons do not stay. When the traces differ in number or type, the widget's traces
    are replaced. The widget keeps its own size, and a trace the reader hid from the legend
    stays hidden."""
    changes = figure_changes(widget, fig)
    with widget.batch_update():
        if changes is None:
            widget.data = ()
            widget.add_traces(fig.data)
            traces, layout = {}, figure_changes(widget, fig)[1]
        else:
            traces, layout = changes
        for i, props in traces.items():
            for key, value in props.items():
                widget.data[i][key] = value
        for key, value in layout.items():
            widget.layout[key] = value


class DashboardFigure(go.FigureWidget):
    """The dashboards' FigureWidget: a plotly FigureWidget that tells when the browser has
    drawn its latest update (``when_drawn``), and does not merge the trace defaults the
    browser reports back into the Python figure.

    After every update plotly's view redraws the figure and then sends back, for every
    trace, each property the figure left unset, as plotly.js filled it in. That report is
    the signal that the update is drawn. Plotly's own handler moves those defaults into
    the Python traces and tells the browser to drop its copies; the dashboards never read
    them (every figure comes whole from ``fa_lab.lab.viz``), and the handler raises on a
    numpy-array property that the browser reports element by element (``if not
    input_val`` on an array), which ipywidgets answers with a formatted traceback. Here
    the report only marks the edit as done, as plotly's handler does last, and runs the
    callbacks waiting for it.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._drawn_callbacks: list = []

    def when_drawn(self, callback):
        """Call ``callback()`` once the browser has drawn the latest update sent, or now
        when no update is on its way."""
        if self._trace_edit_in_process:
            self._drawn_callbacks.append(callback)
        else:
            callback()

    @traitlets.observe("_js2py_traceDeltas")
    def _handler_js2py_traceDeltas(self, change):
        msg = change["new"]
        if not msg:
            return
        if msg.get("trace_edit_id") == self._last_trace_edit_id:
            self._trace_edit_in_process = False
            if not self._layout_edit_in_process:
                while self._waiting_edit_callbacks:
                    self._waiting_edit_callbacks.pop()()
            callbacks, self._drawn_callbacks = self._drawn_callbacks, []
            for callback in callbacks:
                callback()
        self._js2py_traceDeltas = None


#: Sizes (width, height) of the dashboards' figures.
#: A tab's figure is narrower than the main one by the tab panel's border and padding.
FIGURE_SIZES = {"row": (FIGURE_WIDTH, MAIN_HEIGHT), "wave": (FIGURE_WIDTH - 24, TAB_HEIGHT),
                "heatmap": (FIGURE_WIDTH - 24, TAB_HEIGHT),
                "nonfinite": (FIGURE_WIDTH - 24, TAB_HEIGHT), "difference": (FIGURE_WIDTH, 560)}
#: The tabs under a lane dashboard's main figure: (figure name, tab title).
LANE_TABS = (("wave", "wave at one step"), ("heatmap", "wave, step by step"),
             ("nonfinite", "every bad row"))


#: How long a pipelined redraw waits for the browser to report its main figure drawn
#: before it goes on anyway (no browser showing the dashboard, or a very slow one).
DRAWN_WAIT_S = 0.5


def _running_loop():
    """The event loop running this code (the kernel's, in a notebook), or None."""
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


@contextlib.contextmanager
def _gc_paused():
    """No automatic garbage collection inside: a collection that falls due while a redraw
    builds its figures (a full one walks every object of the kernel) runs after them."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


class Dashboard:
    """Controls + FigureWidgets + a summary, redrawn by ``compute(**values)``.

    ``controls`` maps each compute argument to its widget; ``update()`` reads them, calls
    ``compute`` and assigns the figures on screen (``main`` and the open tab; the other
    tabs' figures are drawn when opened); ``last`` is the latest view, ``last_seconds`` how
    long the redraw took and ``figures_seconds`` when its main figure was sent.
    ``figures_first``: ``compute`` takes ``all_policies=False`` for a partial view that
    only the figures need, drawn before the full one. Controls named in ``auto`` (the wave
    figure's step) are passed as None (chosen by the view) when any other control moves,
    and follow the view's choice. A bad value shows its error in the summary instead of a
    figure. Building a dashboard ends with one full garbage collection (see ``__init__``).
    """

    def __init__(self, compute, controls: dict, fixed: dict, *, main=("row",), tabs=LANE_TABS,
                 auto=("tile",), layout=None, figures_first=False):
        import ipywidgets as W

        self.compute = compute
        self.figures_first = figures_first
        self.controls = controls
        self.fixed = fixed
        self.main = tuple(main)
        self.tab_names = tuple(name for name, _ in tabs)
        self.auto = tuple(a for a in auto if a in controls)
        self._auto_values = {a: None for a in self.auto}
        self._silent = False
        self.summary = W.HTML(layout=W.Layout(min_height="3em", width="100%"))
        self.summary.add_class("fa-lab-summary-box")
        self.figures: dict[str, go.FigureWidget] = {}
        self.last = None
        self.last_seconds = math.nan
        self.figures_seconds = math.nan
        self.errors = 0
        self.redraws = 0
        self._drawn: dict = {}
        self._stale: set = set()
        self._generation = 0
        view = self._view()
        for name, fig in view["make_figures"](self.main + self.tab_names).items():
            self.figures[name] = DashboardFigure(fig)
            w, h = FIGURE_SIZES.get(name, (FIGURE_WIDTH, TAB_HEIGHT))
            self.figures[name].layout.width, self.figures[name].layout.height = w, h
            self._drawn[name] = fig
        self.tabs = None
        if self.tab_names:
            self.tabs = W.Tab(children=[self.figures[n] for n in self.tab_names])
            for i, (_, title) in enumerate(tabs):
                self.tabs.set_title(i, title)
            self.tabs.observe(self._on_tab, names="selected_index")
        self._show(view)
        self.widget = (layout or _side_layout)(self)
        for w in controls.values():
            w.observe(self._on_change, names="value")
        # One full collection now, while the cell runs: the collector's deferred full pass
        # over everything the notebook made so far would otherwise fall into one of the
        # first slider moves.
        gc.collect()

    # -- reading and computing
    def values(self) -> dict:
        vals = {name: w.value for name, w in self.controls.items()}
        for a in self.auto:
            vals[a] = self._auto_values[a]
        return vals

    def on_screen(self) -> tuple:
        tab = self.open_tab() if getattr(self, "tabs", None) is not None else None
        return self.main + ((tab,) if tab is not None else ())

    def _view(self, **extra):
        return self.compute(**self.values(), **self.fixed, figures=self.on_screen(), **extra)

    def _show(self, view, timing: str = ""):
        self.last = view
        self.summary.value = view["summary"] + timing
        self._silent = True
        try:   # auto controls follow the view's choice without triggering a redraw
            for a in self.auto:
                w, val = self.controls[a], view["params"].get(a)
                if val is None:
                    continue
                n = getattr(view.get("trace"), "n_steps", None)
                if n is not None and hasattr(w, "max"):
                    w.max = max(n - 1, 0)
                w.value = val
        finally:
            self._silent = False

    def _draw(self, figures: dict):
        for name, fig in figures.items():
            if fig is not self._drawn.get(name):  # unchanged figures stay as they are
                assign_figure(self.figures[name], fig)
                self._drawn[name] = fig
            self._stale.discard(name)

    def open_tab(self) -> str | None:
        """The figure in the open tab, if any."""
        if self.tabs is None or self.tabs.selected_index is None:
            return None
        return self.tab_names[self.tabs.selected_index]

    def update(self, changed: str | None = None, *, pipelined: bool = False):
        """Recompute from the controls and redraw what is on screen; returns the seconds it
        took (NaN when pipelined: the redraw finishes later). ``changed``: the control
        that moved (an ``auto`` control keeps its value only when it is the one that
        moved).

        The order is the reader's: the main figure first, then the open tab's figure, then
        (``figures_first``) the numbers of the summary, which need every policy and the
        fp32 reference. The main figure is sent before anything else is built.
        ``pipelined`` (a move made in the browser, with the kernel's event loop running):
        the rest waits until the browser reports the main figure drawn (at most
        ``DRAWN_WAIT_S``), so that the kernel's work does not take the CPU from the
        browser's drawing on a small machine; a newer move supersedes a redraw still
        waiting. The garbage collector is paused while a figure is built and sent
        (``_gc_paused``)."""
        t0 = time.perf_counter()
        for a in self.auto:
            self._auto_values[a] = self.controls[a].value if changed == a else None
        vals = {**self.values(), **self.fixed}
        self._generation += 1
        generation = self._generation
        try:
            with _gc_paused():
                # figures_first: only what the main figure needs (the traces)
                first = self.compute(**vals, figures=self.main,
                                     **({"all_policies": False} if self.figures_first else {}))
                self._show(first)
                self._draw(first["figures"])
        except (ValueError, TypeError) as e:
            return self._error(e)
        self.figures_seconds = time.perf_counter() - t0

        def finish():
            return self._finish(generation, first, vals, t0)

        loop = _running_loop() if pipelined else None
        if loop is None:
            return finish()
        done, timer = [], []

        def once():
            if not done:
                done.append(True)
                for t in timer:
                    t.cancel()
                try:
                    finish()
                except Exception as e:      # no caller to raise to: the summary says it
                    self._error(e)

        waiting = [self.figures[n] for n in self.main]
        pending = [len(waiting)]

        def drawn():
            pending[0] -= 1
            if pending[0] == 0:
                once()

        timer.append(loop.call_later(DRAWN_WAIT_S, once))
        for fig in waiting:
            fig.when_drawn(drawn)
        return math.nan

    def _finish(self, generation, first, vals, t0):
        """The rest of a redraw: the open tab's figure, then the summary's numbers."""
        if generation != self._generation:      # a newer move redraws everything
            return math.nan
        try:
            tab = self.open_tab()
            if tab is not None:
                with _gc_paused():
                    self._draw(first["make_figures"]((tab,)))
            view = self.compute(**vals, figures=()) if self.figures_first else first
        except (ValueError, TypeError) as e:
            return self._error(e)
        if generation != self._generation:
            return math.nan
        self._stale |= set(self.figures) - set(self.on_screen())
        self.last_seconds = time.perf_counter() - t0
        # the kernel's clock on the redraw, for the reader (and the browser test)
        self._show(view, timing=(
            f"<div class='fa-lab-timing' style='color:#777;font-size:11px;line-height:1.2'>"
            f"redraw {self.redraws + 1}: main figure sent after {self.figures_seconds:.2f} s, "
            f"all {self.last_seconds:.2f} s (kernel clock)</div>"))
        self.redraws += 1
        return self.last_seconds

    def _error(self, e):
        self.errors += 1
        self.last_seconds = math.nan
        self.summary.value = (f"<div class='fa-lab-error' style='color:#b00'>"
                              f"{html.escape(str(e))}</div>")
        return math.nan

    def _on_change(self, change):
        if self._silent:
            return
        name = next((n for n, w in self.controls.items() if w is change["owner"]), None)
        # ipywidgets holds a property lock while it applies a value sent by the browser
        self.update(name, pipelined=bool(getattr(change["owner"], "_property_lock", None)))

    def _on_tab(self, change):
        name = self.tab_names[change["new"]] if change["new"] is not None else None
        if name in self._stale and self.last is not None:
            self._draw(self.last["make_figures"]((name,)))

    def _repr_mimebundle_(self, **kwargs):
        return self.widget._repr_mimebundle_(**kwargs)

    def _ipython_display_(self):
        from IPython.display import display
        display(self.widget)


def _side_layout(d):
    """Controls and summary in a column on the left; on the right the main figure and, under
    it, the tabs. About 1180 x 860 px: one 1600 x 1000 screen."""
    import ipywidgets as W

    left = W.VBox([*d.controls.values(), d.summary],
                  layout=W.Layout(width=f"{LEFT_WIDTH}px", flex=f"0 0 {LEFT_WIDTH}px",
                                  padding="4px 8px 0 0"))
    right = [d.figures[n] for n in d.main] + ([d.tabs] if d.tabs is not None else [])
    return W.HBox([left, W.VBox(right, layout=W.Layout(width=f"{FIGURE_WIDTH + 10}px"))],
                  layout=W.Layout(align_items="flex-start", width=f"{LEFT_WIDTH + FIGURE_WIDTH + 20}px"))


def _style():
    return {"description_width": "95px"}


def _wide():
    import ipywidgets as W

    return W.Layout(width=f"{LEFT_WIDTH - 10}px")


def _policy_control(value):
    import ipywidgets as W

    return W.Dropdown(options=list(policies.names()), value=value, description="policy",
                      style=_style(), layout=_wide())


def _heat_value_control(value="deficit"):
    import ipywidgets as W

    return W.Dropdown(options=list(HEAT_VALUES), value=value, description="heatmap",
                      style=_style(), layout=_wide())


def _row_and_tile(S, row):
    import ipywidgets as W

    return {
        "row": W.IntSlider(value=int(row), min=0, max=S - 1, description="row",
                           continuous_update=False, style=_style(), layout=_wide()),
        "tile": W.IntSlider(value=0, min=0, max=1, description="wave at step",
                            continuous_update=False, style=_style(), layout=_wide()),
    }


def rescale_dashboard(S=CPU_DEFAULTS["S"], H=CPU_DEFAULTS["H"], D=CPU_DEFAULTS["D"], *,
                      k_scale=32, threshold=8.0, policy="lazy_unfixed", causal=False, seed=0,
                      row=None, n_waves=1, device=None, backend="auto") -> Dashboard:
    """bf16 dashboard: K scale, threshold, policy, causal, S, seed, row, the wave figure's
    step and the heatmap's value; shows the row under its policy beside the fix, its wave
    at one step, its wave step by step, the map of every bad row, and a summary of every
    policy against fp32. ``row=None`` picks the first row the unfixed lazy rescale turns
    non-finite (row 0 when there is none)."""
    import ipywidgets as W

    S = _int("S", S, 1)
    if row is None:
        row = first_bad_row(k_scale, threshold, causal, S, seed, H=H, D=D, device=device,
                            backend=backend)
    style, wide = _style(), _wide()
    controls = {
        "k_scale": W.IntSlider(value=int(k_scale), min=1, max=128, description="K scale",
                               continuous_update=False, style=style, layout=wide),
        "threshold": W.FloatSlider(value=float(threshold), min=0, max=32, step=0.5,
                                   description="threshold", continuous_update=False,
                                   style=style, layout=wide),
        "policy": _policy_control(policy),
        **_row_and_tile(S, row),
        "heat_value": _heat_value_control(),
        "S": W.Dropdown(options=sorted({256, 512, 1024, 2048, S}), value=S, description="S",
                        style=style, layout=wide),
        "seed": W.BoundedIntText(value=seed, min=0, max=10**6, description="seed", style=style,
                                 layout=wide),
        "causal": W.Checkbox(value=causal, description="causal", indent=False),
    }

    def keep_row_in_range(change):
        controls["row"].max = change["new"] - 1

    controls["S"].observe(keep_row_in_range, names="value")
    fixed = dict(H=H, D=D, n_waves=n_waves, device=device, backend=backend)
    d = Dashboard(compute_rescale_view, controls, fixed, figures_first=True)
    d.widget.add_class("fa-lab-dashboard")
    d.widget.add_class("fa-lab-rescale-dashboard")
    return d


def first_bad_row(k_scale=32, threshold=8.0, causal=False, S=CPU_DEFAULTS["S"], seed=0, *,
                  H=CPU_DEFAULTS["H"], D=CPU_DEFAULTS["D"], head=0, device=None,
                  backend="auto") -> int:
    """The first query row of ``head`` whose output the unfixed lazy rescale makes
    non-finite, or 0."""
    view = compute_rescale_view(k_scale, threshold, "lazy_unfixed", causal, S, seed, 0, H=H,
                                D=D, head=head, device=device, backend=backend, figures=False,
                                with_trace=False)
    bad = (~torch.isfinite(view["outputs"]["lazy_unfixed"][0, :, head]).all(-1)).nonzero()
    return int(bad[0]) if len(bad) else 0


def fp8_dashboard(S=FP8_CPU_DEFAULTS["S"], H=FP8_CPU_DEFAULTS["H"], *, k_scale=5000.0,
                  threshold=8.0, policy="lazy_unfixed", rebase_bound=16.0, headroom=False,
                  causal=False, seed=0, row=None, n_waves=1, device=None,
                  backend="auto") -> Dashboard:
    """fp8 dashboard: k scale (log slider), threshold (or PR #1020's by-KV-length rule),
    rebase bound (capped policies), P headroom, policy, row and the wave figure's step;
    shows mean |o - 1|, NaN counts, the row under its policy beside the fix, its wave and
    the map of every bad row. ``row=None`` picks the first row the unfixed rule turns
    non-finite at this k scale (row 0 when there is none)."""
    import ipywidgets as W

    S = _int("S", S, 1)
    if row is None:
        first = compute_fp8_view(k_scale, threshold, "lazy_unfixed", rebase_bound, headroom,
                                 causal, S, seed, 0, H=H, device=device, backend=backend,
                                 figures=False)
        bad = (~torch.isfinite(first["out"][0, :, 0]).all(-1)).nonzero()
        row = int(bad[0]) if len(bad) else 0
    style, wide = _style(), _wide()
    thr_options = [("by KV length (PR #1020)", "by_kv_len")] + [(f"{t:g}", float(t)) for t in
                                                               (0, 2, 4, 6, 8, 12, 16, 24, 32)]
    if threshold not in [v for _, v in thr_options]:
        thr_options.append((f"{threshold:g}", float(threshold)))
    controls = {
        "k_scale": W.FloatLogSlider(value=float(k_scale), base=10, min=2, max=5, step=0.05,
                                    description="k scale", continuous_update=False,
                                    style=style, layout=wide, readout_format=".4g"),
        "policy": _policy_control(policy),
        "threshold": W.Dropdown(options=thr_options, value=threshold, description="threshold",
                                style=style, layout=wide),
        "rebase_bound": W.FloatSlider(value=float(rebase_bound), min=1, max=64, step=1,
                                      description="rebase bound", continuous_update=False,
                                      style=style, layout=wide),
        **_row_and_tile(S, row),
        "heat_value": _heat_value_control(),
        "headroom": W.Checkbox(value=headroom, description="P headroom (PR #1020)",
                               indent=False),
        "causal": W.Checkbox(value=causal, description="causal", indent=False),
    }
    fixed = dict(S=S, H=H, seed=seed, n_waves=n_waves, device=device, backend=backend)

    def enable_what_applies(_=None):
        # The eager rescale has no threshold; only capped policies have a rebase bound.
        pol = controls["policy"].value
        controls["threshold"].disabled = not _lazy(pol)
        controls["rebase_bound"].disabled = policies.get(pol).rebase != "capped"

    enable_what_applies()
    controls["policy"].observe(enable_what_applies, names="value")
    d = Dashboard(compute_fp8_view, controls, fixed, figures_first=True)
    d.widget.add_class("fa-lab-dashboard")
    d.widget.add_class("fa-lab-fp8-dashboard")
    return d


def compare_dashboard(S=CPU_DEFAULTS["S"], H=CPU_DEFAULTS["H"], *, k_scale=32, threshold=8.0,
                      fp8_policy="lazy", causal=False, seed=0, head=0, device=None,
                      backend="auto") -> Dashboard:
    """Lazy (unfixed, fixed), eager and fp8 outputs against fp32, row by row, as the K
    scale moves."""
    import ipywidgets as W

    style, wide = _style(), _wide()
    controls = {
        "k_scale": W.IntSlider(value=int(k_scale), min=1, max=128, description="K scale",
                               continuous_update=False, style=style, layout=wide),
        "fp8_policy": W.Dropdown(options=list(policies.names()), value=fp8_policy,
                                 description="fp8 policy", style=style, layout=wide),
        "causal": W.Checkbox(value=causal, description="causal", indent=False),
    }
    fixed = dict(threshold=threshold, S=S, H=H, seed=seed, head=head, device=device,
                 backend=backend)
    d = Dashboard(compute_compare_view, controls, fixed, main=("difference",), tabs=(),
                  auto=())
    d.widget.add_class("fa-lab-dashboard")
    d.widget.add_class("fa-lab-compare-dashboard")
    return d


# ---- latency ---------------------------------------------------------------------------

def benchmark(dashboard: Dashboard, control: str, values, *, repeat: int = 1,
              clock=time.perf_counter) -> dict:
    """Move ``control`` through ``values`` (each a fresh setting, so nothing comes from the
    cache unless a value repeats) and time each redraw (compute + FigureWidget update).
    ``clock``: ``time.perf_counter`` (wall time, default) or ``time.process_time`` (CPU
    time of this process: with one torch thread, what the redraw costs on an idle core,
    whatever else the machine is running). Returns the median, min and max seconds and
    the individual times."""
    if control not in dashboard.controls:
        raise ValueError(f"control={control!r}; the dashboard has {sorted(dashboard.controls)}")
    times, figures = [], []
    w = dashboard.controls[control]
    for _ in range(repeat):
        for v in values:
            t0 = clock()
            w.value = v  # the observer redraws synchronously
            elapsed = clock() - t0
            if math.isnan(dashboard.last_seconds) or dashboard.last["params"].get(control) != v:
                raise RuntimeError(f"redraw failed for {control}={v!r}: {dashboard.summary.value}")
            times.append(elapsed)
            # the share until the main figure was sent (wall time), scaled to this clock
            share = dashboard.figures_seconds / dashboard.last_seconds
            figures.append(elapsed * min(1.0, share))
    return {"control": control, "median_s": statistics.median(times), "min_s": min(times),
            "max_s": max(times), "times_s": times,
            "figures_median_s": statistics.median(figures)}
