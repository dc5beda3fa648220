"""Dashboards: sliders and dropdowns that rerun the kernels and redraw fa_lab.viz figures.

Each dashboard is two layers:

* a plain ``compute_*_view(...)`` function of the widget values that checks them, runs
  ``fa_lab.flash_attn_func`` / ``fa_lab.trace`` (backend ``auto``: the exact model on CPU,
  the Triton kernels on a GPU) and returns a dict of data and ``viz`` figures. It needs
  no browser and is what the tests call;
* the widget wiring (``rescale_dashboard``, ``fp8_dashboard``, ``compare_dashboard``), which
  reads the controls, calls that function and copies the new figures into
  ``plotly.graph_objects.FigureWidget``s in place.

Inputs, the fp32 reference and outputs are cached by their parameters, so moving the
threshold, the policy or the row reruns only what depends on it; a K-scale move reruns
everything. ``benchmark(...)`` measures the redraw latency of a dashboard.
"""

from __future__ import annotations

import html
import math
import statistics
import time
from collections import OrderedDict

import numpy as np
import pandas as pd
import plotly.graph_objects as go
import torch

from . import metrics, policies, reference, viz
from .api import flash_attn_func, trace
from .experiments import bf16_inputs, fp8_inputs, quantize_e4m3
from .models.geometry import WAVE_ROWS

#: The bf16 policies a dashboard compares, in display order.
BF16_POLICIES = ("lazy_unfixed", "lazy", "eager")
FP8_POLICIES = ("lazy_unfixed", "lazy_capped", "lazy", "eager")
#: Sizes that redraw within 0.3 s on 2 CPU cores (see benchmarks/bench_widgets.py).
CPU_DEFAULTS = dict(S=1024, H=1, D=128)
FP8_CPU_DEFAULTS = dict(S=1024, H=1)


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


def _figure(make, source, *extra):
    """``make()``, memoised on the identity of ``source`` (a cached trace or output) and
    ``extra``: when a control leaves a figure's data alone, the same figure object comes
    back, and the dashboard skips redrawing it."""
    key = (make.__name__ if hasattr(make, "__name__") else "", id(source), *extra)
    src, fig = _FIGURES.get(key, lambda: (source, make()))
    if src is not source:  # an id reused after its object was dropped
        fig = make()
        _FIGURES._d[key] = (source, fig)
    return fig


def _trace_figures(tr, out, lane: int, heat_value: str) -> dict:
    """The figures every dashboard shows: the running-max heat map, one lane's trace, the
    output's non-finite map (each memoised, see ``_figure``)."""
    return {
        "heatmap": _figure(lambda: viz.running_max_heatmap(tr, heat_value), tr, "heat",
                           heat_value),
        "lane": _figure(lambda: viz.lane_lines(tr, lane), tr, "lane", lane),
        "nonfinite": _figure(lambda: viz.nonfinite_map(out), out, "nonfinite"),
    }


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


# ---- bf16: the lazy rescale ------------------------------------------------------------

def compute_rescale_view(k_scale=32, threshold=8.0, policy="lazy_unfixed", causal=False,
                         S=CPU_DEFAULTS["S"], seed=0, row=0, *, H=CPU_DEFAULTS["H"],
                         D=CPU_DEFAULTS["D"], head=0, n_waves=1, heat_value="m",
                         device=None, backend="auto", figures=True) -> dict:
    """Everything the bf16 dashboard shows for one setting of its controls.

    Inputs are the seed's (q, v ~ N(0,1), k = N(0,1) x ``k_scale``, bf16, batch 1).
    Runs every policy of BF16_POLICIES (lazy ones with ``threshold``) and the fp32
    reference, and traces the ``n_waves`` waves from ``row``'s wave under ``policy``.

    Returns a dict: ``stats`` (DataFrame: NaN %, inf %, NaN rows, rel-L2 per policy),
    ``out`` and ``lse`` of ``policy``, ``outputs`` (all policies), ``reference``, ``trace``,
    ``lane`` (``row``'s lane in the trace), ``summary`` (HTML) and, unless
    ``figures=False``, ``figures``: heatmap, lane, nonfinite.
    """
    k_scale = _positive_number("k_scale", k_scale)
    threshold = _nonneg_number("threshold", threshold)
    policy = _choice("policy", policy, BF16_POLICIES)
    causal = _bool("causal", causal)
    S = _int("S", S, 1)
    H = _int("H", H, 1)
    D = _choice("D", D, (64, 128))
    seed = _int("seed", seed, 0)
    row = _int("row", row, 0, S)
    head = _int("head", head, 0, H)
    n_waves = _int("n_waves", n_waves, 1)
    _choice("heat_value", heat_value, tuple(viz._TRACE_VALUES))
    device = default_device() if device is None else device

    key = ("bf16", S, H, D, k_scale, seed, str(device))
    q, k, v = _bf16_inputs(S, H, D, k_scale, seed, device)
    ref = _CACHE.get(key + ("ref", causal), lambda: reference.attention(q, k, v, causal=causal)[0])

    def run(pol):
        thr = threshold if pol != "eager" else None
        return _CACHE.get(key + (pol, thr, causal, backend), lambda: flash_attn_func(
            q, k, v, causal=causal, rescale=pol, rescale_threshold=thr, return_lse=True,
            backend=backend))

    outputs = {pol: run(pol) for pol in BF16_POLICIES}
    stats = pd.DataFrame([_stats_row(p, o, ref) for p, (o, _) in outputs.items()])
    rows = wave_rows(row, S, n_waves)
    thr = threshold if policy != "eager" else None
    tr = _CACHE.get(key + ("trace", policy, thr, causal, backend, head, rows.start, rows.stop),
                    lambda: trace(q, k, v, rows=rows, head=head, causal=causal, rescale=policy,
                                  rescale_threshold=thr, backend=backend))
    lane = row - rows.start
    out, lse = outputs[policy]
    view = {
        "params": dict(k_scale=k_scale, threshold=threshold, policy=policy, causal=causal, S=S,
                       seed=seed, row=row, H=H, D=D, head=head, device=str(device)),
        "stats": stats, "out": out, "lse": lse, "reference": ref,
        "outputs": {p: o for p, (o, _) in outputs.items()}, "trace": tr, "lane": lane,
    }
    view["summary"] = _rescale_summary(view)
    if figures:
        view["figures"] = _trace_figures(tr, out, lane, heat_value)
    return view


def _stats_html(stats: pd.DataFrame, highlight: str, columns) -> str:
    head = "".join(f"<th style='padding:2px 8px'>{html.escape(c)}</th>" for c, _ in columns)
    body = []
    for _, r in stats.iterrows():
        color = viz.policy_color(r["policy"])
        weight = "bold" if r["policy"] == highlight else "normal"
        cells = "".join(f"<td style='padding:2px 8px;text-align:right'>{fmt(r)}</td>"
                        for _, fmt in columns[1:])
        body.append(f"<tr style='font-weight:{weight}'><td style='padding:2px 8px;"
                    f"color:{color}'>&#9632; {html.escape(str(r['policy']))}</td>{cells}</tr>")
    return f"<table><tr>{head}</tr>{''.join(body)}</table>"


def _rescale_summary(view) -> str:
    p = view["params"]
    cols = [("policy", None),
            ("NaN %", lambda r: f"{r['nan_pct']:.3f}"),
            ("inf %", lambda r: f"{r['inf_pct']:.3f}"),
            ("NaN rows", lambda r: f"{int(r['nan_rows'])} / {int(r['rows'])}"),
            ("rel-L2 vs fp32", lambda r: "NaN (output not finite)" if math.isnan(r["rel_l2"])
             else f"{r['rel_l2']:.4e}")]
    lane = view["trace"].lanes.loc[view["lane"]]
    first = lane["first_nonfinite_step"]
    where = ("stays finite" if pd.isna(first) else
             f"first goes non-finite at KV tile {int(first)}")
    return (f"<div class='fa-lab-summary'><b>bf16, K x{p['k_scale']:g}, threshold "
            f"{p['threshold']:g}, {'causal' if p['causal'] else 'non-causal'}, S={p['S']}, "
            f"H={p['H']}, D={p['D']}, seed {p['seed']}, {p['device']}</b>"
            + _stats_html(view["stats"], p["policy"], cols)
            + f"<div>Row {p['row']} (head {p['head']}) under <b>{p['policy']}</b> "
              f"{where}; LSE = {viz._fmt(float(lane['lse']), 6)}, dragged "
              f"{int(lane['n_dragged'])} times.</div></div>")


# ---- fp8: the rebase rules -------------------------------------------------------------

def compute_fp8_view(k_scale=5000.0, threshold=8.0, policy="lazy_unfixed", rebase_bound=16.0,
                     headroom=False, causal=False, S=FP8_CPU_DEFAULTS["S"], seed=0, row=0, *,
                     H=FP8_CPU_DEFAULTS["H"], head=0, n_waves=1, heat_value="m",
                     device=None, backend="auto", figures=True) -> dict:
    """Everything the fp8 dashboard shows: the seed's fp8 inputs (q = 0.1 N, k = 0.1 k_scale
    N, V = ones, per-tensor e4m3) through the fp8 kernel under ``policy``.

    ``threshold``: a number (log2 units) or ``"by_kv_len"`` (PR #1020's rule);
    ``rebase_bound``: used by ``lazy_capped`` only; ``headroom``: PR #1020's P lift.
    Returns a dict with ``stats`` (mean |o - 1| over finite elements, NaN and inf counts),
    ``out``, ``trace``, ``lane``, ``summary`` and ``figures`` (heatmap, lane, nonfinite).
    """
    k_scale = _positive_number("k_scale", k_scale)
    if threshold != "by_kv_len":
        threshold = _nonneg_number("threshold", threshold)
    policy = _choice("policy", policy, FP8_POLICIES)
    rebase_bound = _nonneg_number("rebase_bound", rebase_bound)
    headroom = _bool("headroom", headroom)
    causal = _bool("causal", causal)
    S = _int("S", S, 1)
    H = _int("H", H, 1)
    seed = _int("seed", seed, 0)
    row = _int("row", row, 0, S)
    head = _int("head", head, 0, H)
    n_waves = _int("n_waves", n_waves, 1)
    _choice("heat_value", heat_value, tuple(viz._TRACE_VALUES))
    device = default_device() if device is None else device

    key = ("fp8", S, H, k_scale, seed, str(device))
    (q8, k8, v8), (qd, kd, vd) = _CACHE.get(key, lambda: fp8_inputs(1, S, H, k_scale, seed=seed,
                                                                      device=device))
    lazy = policy != "eager"
    args = dict(q_descale=qd, k_descale=kd, v_descale=vd, causal=causal, rescale=policy,
                rescale_threshold=threshold if lazy else None,
                rebase_bound=rebase_bound if policy == "lazy_capped" else None,
                p_headroom=True if headroom else None, backend=backend)
    pkey = key + tuple(sorted((k, str(v)) for k, v in args.items() if "descale" not in k))
    out = _CACHE.get(pkey, lambda: flash_attn_func(q8, k8, v8, **args))
    rows = wave_rows(row, S, n_waves)
    tr = _CACHE.get(pkey + ("trace", head, rows.start, rows.stop),
                    lambda: trace(q8, k8, v8, rows=rows, head=head, **args))
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
        "policy": tr.policy, "stats": stats, "out": out, "trace": tr, "lane": lane,
    }
    view["summary"] = _fp8_summary(view)
    if figures:
        view["figures"] = _trace_figures(tr, out, lane, heat_value)
    return view


def _fp8_summary(view) -> str:
    p, s, pol = view["params"], view["stats"], view["policy"]
    lane = view["trace"].lanes.loc[view["lane"]]
    color = viz.policy_color(p["policy"])
    return (f"<div class='fa-lab-summary'><b>fp8, k x{p['k_scale']:.4g}, S={p['S']}, H={p['H']}, "
            f"{'causal' if p['causal'] else 'non-causal'}, seed {p['seed']}, {p['device']}</b><br>"
            f"<span style='color:{color}'>&#9632;</span> policy <b>{html.escape(pol.describe())}"
            f"</b> (threshold {pol.threshold:g} log2 units"
            + (f", P headroom {pol.p_headroom:.3f}" if pol.p_headroom else "") + ")<br>"
            f"mean |o - 1| over finite elements: <b>{viz._fmt(s['mean_abs_dev'], 4)}</b>; "
            f"NaN elements: <b>{s['nan']}</b>, inf: {s['inf']} of {s['elements']} "
            f"({100 * s['nan'] / s['elements']:.3f} % NaN; {s['nan_rows']} of {s['rows']} rows)"
            f"<br>Row {p['row']}: LSE = {viz._fmt(float(lane['lse']), 6)}, dragged "
            f"{int(lane['n_dragged'])} times.</div>")


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
    fp8_policy = _choice("fp8_policy", fp8_policy, FP8_POLICIES)
    causal = _bool("causal", causal)
    S = _int("S", S, 1)
    H = _int("H", H, 1)
    D = _choice("D", D, (128,))
    seed = _int("seed", seed, 0)
    head = _int("head", head, 0, H)
    device = default_device() if device is None else device
    base = compute_rescale_view(k_scale, threshold, "lazy", causal, S, seed, 0, H=H, D=D,
                                head=head, device=device, backend=backend, figures=False)
    q, k, v = _bf16_inputs(S, H, D, k_scale, seed, device)
    key = ("fp8-of-bf16", S, H, D, k_scale, seed, str(device))
    (q8, qd), (k8, kd), (v8, vd) = _CACHE.get(key, lambda: tuple(quantize_e4m3(x) for x in (q, k, v)))
    thr = threshold if fp8_policy != "eager" else None
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
            ("rel-L2 vs fp32", lambda r: "NaN" if math.isnan(r["rel_l2"]) else f"{r['rel_l2']:.4e}")]
    view["summary"] = (f"<div class='fa-lab-summary'><b>K x{p['k_scale']:g}, threshold "
                       f"{p['threshold']:g}, S={p['S']}, H={p['H']}, fp8 = e4m3 per tensor "
                       f"under {fp8_policy}</b>" + _stats_html(stats, "", cols) + "</div>")
    if figures:
        view["figures"] = {"difference": _figure(
            lambda: viz.output_difference_rows(outputs, ref, head=head), o8, "difference",
            *(id(o) for o in outputs.values()), head)}
    return view


# ---- widget wiring ---------------------------------------------------------------------

def assign_figure(widget: go.FigureWidget, fig: go.Figure):
    """Copy ``fig`` into ``widget`` in place: trace by trace when the two have the same
    traces (what viz keeps), else by replacing the data; layout shapes and annotations
    are replaced, so stale markers do not stay."""
    with widget.batch_update():
        same = len(widget.data) == len(fig.data) and all(
            a.type == b.type for a, b in zip(widget.data, fig.data))
        if same:
            for dst, src in zip(widget.data, fig.data):
                dst.update(src.to_plotly_json(), overwrite=True)
        else:
            widget.data = ()
            widget.add_traces(fig.data)
        layout = fig.layout.to_plotly_json()
        layout.pop("template", None)
        widget.layout.update(layout, overwrite=True)
        widget.layout.shapes = fig.layout.shapes
        widget.layout.annotations = fig.layout.annotations


#: Widths (px) of the dashboards' figures, so that two fit side by side.
FIGURE_WIDTHS = {"heatmap": 900, "difference": 900, "lane": 600, "nonfinite": 400}


class Dashboard:
    """Controls + FigureWidgets + a summary, redrawn by ``compute(**values)``.

    ``controls`` maps each compute argument to its widget; ``update()`` reads them, calls
    ``compute`` and assigns the figures; ``last`` is the latest view, ``last_seconds`` how
    long the redraw took. A bad value shows its error in the summary instead of a figure.
    """

    def __init__(self, compute, controls: dict, fixed: dict, layout):
        import ipywidgets as W

        self.compute = compute
        self.controls = controls
        self.fixed = fixed
        self.summary = W.HTML(layout=W.Layout(min_height="3em"))
        self.summary.add_class("fa-lab-summary-box")
        self.figures: dict[str, go.FigureWidget] = {}
        self.last = None
        self.last_seconds = math.nan
        self.errors = 0
        view = self._view()
        self._drawn = {}
        for name, fig in view["figures"].items():
            self.figures[name] = go.FigureWidget(fig)
            self.figures[name].layout.width = FIGURE_WIDTHS.get(name)
            self._drawn[name] = fig
        self._show(view)
        self.widget = layout(self)
        for w in controls.values():
            w.observe(self._on_change, names="value")

    def values(self) -> dict:
        return {name: w.value for name, w in self.controls.items()}

    def _view(self):
        return self.compute(**self.values(), **self.fixed)

    def _show(self, view):
        self.last = view
        self.summary.value = view["summary"]

    def update(self):
        """Recompute from the controls and redraw; returns the seconds it took."""
        t0 = time.perf_counter()
        try:
            view = self._view()
        except (ValueError, TypeError) as e:
            self.errors += 1
            self.last_seconds = math.nan
            self.summary.value = (f"<div class='fa-lab-error' style='color:#b00'>"
                                  f"{html.escape(str(e))}</div>")
            return math.nan
        for name, fig in view["figures"].items():
            if fig is not self._drawn.get(name):  # unchanged figures stay as they are
                assign_figure(self.figures[name], fig)
                self._drawn[name] = fig
        self._show(view)
        self.last_seconds = time.perf_counter() - t0
        return self.last_seconds

    def _on_change(self, change):
        self.update()

    def _repr_mimebundle_(self, **kwargs):
        return self.widget._repr_mimebundle_(**kwargs)

    def _ipython_display_(self):
        from IPython.display import display
        display(self.widget)


def _slider_style():
    return {"description_width": "110px"}


def _heat_value_control(value="m"):
    import ipywidgets as W

    return W.Dropdown(options=[("running max m", "m"), ("tile max", "mt"), ("log2(l)", "l"),
                               ("log2(corr)", "corr"), ("dragged", "dragged")],
                      value=value, description="heatmap", style=_slider_style(),
                      layout=W.Layout(width="260px"))


def _lane_dashboard_layout(d, first_row, second_row):
    """Two rows of controls (by name), the summary, the heatmap, then the lane and
    non-finite figures side by side (wrapping on narrow screens)."""
    import ipywidgets as W

    c = d.controls
    return W.VBox([
        W.HBox([c[name] for name in first_row]),
        W.HBox([c[name] for name in second_row]),
        d.summary,
        d.figures["heatmap"],
        W.HBox([d.figures["lane"], d.figures["nonfinite"]], layout=W.Layout(flex_flow="row wrap")),
    ])


def rescale_dashboard(S=CPU_DEFAULTS["S"], H=CPU_DEFAULTS["H"], D=CPU_DEFAULTS["D"], *,
                      k_scale=32, threshold=8.0, policy="lazy_unfixed", causal=False, seed=0,
                      row=None, n_waves=1, device=None, backend="auto") -> Dashboard:
    """bf16 dashboard: K scale, threshold, policy, causal, S, seed and row controls; shows
    the running max of the row's wave, that row's lane, the NaN map of the output and a
    summary of every policy against fp32. ``row=None`` picks the first row the unfixed
    lazy rescale turns non-finite (row 0 when there is none)."""
    import ipywidgets as W

    S = _int("S", S, 1)
    if row is None:
        row = first_bad_row(k_scale, threshold, causal, S, seed, H=H, D=D, device=device,
                            backend=backend)
    style = _slider_style()
    lay = W.Layout(width="360px")
    controls = {
        "k_scale": W.IntSlider(value=int(k_scale), min=1, max=128, description="K scale",
                               continuous_update=False, style=style, layout=lay),
        "threshold": W.FloatSlider(value=float(threshold), min=0, max=32, step=0.5,
                                   description="threshold (log2)", continuous_update=False,
                                   style=style, layout=lay),
        "policy": W.Dropdown(options=[(f"{p}: {policies.POLICIES_BF16[p][:48]}...", p)
                                      for p in BF16_POLICIES], value=policy,
                             description="policy", style=style, layout=W.Layout(width="520px")),
        "causal": W.Checkbox(value=causal, description="causal", indent=False),
        "S": W.Dropdown(options=sorted({256, 512, 1024, 2048, S}), value=S, description="S",
                        style=style, layout=W.Layout(width="220px")),
        "seed": W.BoundedIntText(value=seed, min=0, max=10**6, description="seed", style=style,
                                 layout=W.Layout(width="220px")),
        "row": W.IntSlider(value=int(row), min=0, max=S - 1, description="row (lane)",
                           continuous_update=False, style=style, layout=lay),
        "heat_value": _heat_value_control(),
    }

    def keep_row_in_range(change):
        controls["row"].max = change["new"] - 1

    controls["S"].observe(keep_row_in_range, names="value")
    fixed = dict(H=H, D=D, n_waves=n_waves, device=device, backend=backend)

    def layout(d):
        return _lane_dashboard_layout(d, ["k_scale", "threshold", "row"],
                                      ["policy", "causal", "S", "seed", "heat_value"])

    d = Dashboard(compute_rescale_view, controls, fixed, layout)
    d.widget.add_class("fa-lab-rescale-dashboard")
    return d


def first_bad_row(k_scale=32, threshold=8.0, causal=False, S=CPU_DEFAULTS["S"], seed=0, *,
                  H=CPU_DEFAULTS["H"], D=CPU_DEFAULTS["D"], head=0, device=None,
                  backend="auto") -> int:
    """The first query row of ``head`` whose output the unfixed lazy rescale makes
    non-finite, or 0."""
    view = compute_rescale_view(k_scale, threshold, "lazy_unfixed", causal, S, seed, 0, H=H,
                                D=D, head=head, device=device, backend=backend, figures=False)
    bad = (~torch.isfinite(view["outputs"]["lazy_unfixed"][0, :, head]).all(-1)).nonzero()
    return int(bad[0]) if len(bad) else 0


def fp8_dashboard(S=FP8_CPU_DEFAULTS["S"], H=FP8_CPU_DEFAULTS["H"], *, k_scale=5000.0,
                  threshold=8.0, policy="lazy_unfixed", rebase_bound=16.0, headroom=False,
                  causal=False, seed=0, row=0, n_waves=1, device=None,
                  backend="auto") -> Dashboard:
    """fp8 dashboard: k scale (log slider), threshold (or PR #1020's by-KV-length rule),
    rebase bound (lazy_capped), P headroom, policy; shows mean |o - 1|, NaN counts, the
    running max of the row's wave, that row's lane and the NaN map."""
    import ipywidgets as W

    S = _int("S", S, 1)
    style = _slider_style()
    lay = W.Layout(width="360px")
    thr_options = [("by KV length (PR #1020)", "by_kv_len")] + [(f"{t:g}", float(t)) for t in
                                                               (0, 2, 4, 6, 8, 12, 16, 24, 32)]
    if threshold not in [v for _, v in thr_options]:
        thr_options.append((f"{threshold:g}", float(threshold)))
    controls = {
        "k_scale": W.FloatLogSlider(value=float(k_scale), base=10, min=2, max=5, step=0.05,
                                    description="k scale", continuous_update=False,
                                    style=style, layout=lay, readout_format=".4g"),
        "threshold": W.Dropdown(options=thr_options, value=threshold,
                                description="threshold (log2)", style=style,
                                layout=W.Layout(width="300px")),
        "rebase_bound": W.FloatSlider(value=float(rebase_bound), min=1, max=64, step=1,
                                      description="rebase bound", continuous_update=False,
                                      style=style, layout=lay),
        "headroom": W.Checkbox(value=headroom, description="P headroom (PR #1020)",
                               indent=False),
        "policy": W.Dropdown(options=[(f"{p}: {policies.POLICIES_FP8[p][:44]}...", p)
                                      for p in FP8_POLICIES], value=policy,
                             description="policy", style=style, layout=W.Layout(width="520px")),
        "causal": W.Checkbox(value=causal, description="causal", indent=False),
        "row": W.IntSlider(value=int(row), min=0, max=S - 1, description="row (lane)",
                           continuous_update=False, style=style, layout=lay),
        "heat_value": _heat_value_control(),
    }
    fixed = dict(S=S, H=H, seed=seed, n_waves=n_waves, device=device, backend=backend)

    def enable_what_applies(_=None):
        # The eager rescale has no threshold; only lazy_capped has a rebase bound.
        pol = controls["policy"].value
        controls["threshold"].disabled = pol == "eager"
        controls["rebase_bound"].disabled = pol != "lazy_capped"

    enable_what_applies()
    controls["policy"].observe(enable_what_applies, names="value")

    def layout(d):
        return _lane_dashboard_layout(d, ["k_scale", "rebase_bound", "row"],
                                      ["policy", "threshold", "headroom", "causal", "heat_value"])

    d = Dashboard(compute_fp8_view, controls, fixed, layout)
    d.widget.add_class("fa-lab-fp8-dashboard")
    return d


def compare_dashboard(S=CPU_DEFAULTS["S"], H=CPU_DEFAULTS["H"], *, k_scale=32, threshold=8.0,
                      fp8_policy="lazy", causal=False, seed=0, head=0, device=None,
                      backend="auto") -> Dashboard:
    """Lazy (unfixed, fixed), eager and fp8 outputs against fp32, row by row, as the K
    scale moves."""
    import ipywidgets as W

    style = _slider_style()
    controls = {
        "k_scale": W.IntSlider(value=int(k_scale), min=1, max=128, description="K scale",
                               continuous_update=False, style=style,
                               layout=W.Layout(width="360px")),
        "fp8_policy": W.Dropdown(options=list(FP8_POLICIES), value=fp8_policy,
                                 description="fp8 policy", style=style),
        "causal": W.Checkbox(value=causal, description="causal", indent=False),
    }
    fixed = dict(threshold=threshold, S=S, H=H, seed=seed, head=head, device=device,
                 backend=backend)

    def layout(d):
        c = d.controls
        return W.VBox([W.HBox([c["k_scale"], c["fp8_policy"], c["causal"]]), d.summary,
                       d.figures["difference"]])

    d = Dashboard(compute_compare_view, controls, fixed, layout)
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
    times = []
    w = dashboard.controls[control]
    for _ in range(repeat):
        for v in values:
            t0 = clock()
            w.value = v  # the observer redraws synchronously
            elapsed = clock() - t0
            if math.isnan(dashboard.last_seconds) or dashboard.last["params"].get(control) != v:
                raise RuntimeError(f"redraw failed for {control}={v!r}: {dashboard.summary.value}")
            times.append(elapsed)
    return {"control": control, "median_s": statistics.median(times), "min_s": min(times),
            "max_s": max(times), "times_s": times}
