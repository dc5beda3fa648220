"""The atlas's heatmaps, and one cell of them opened in the lane dashboard.

    from fa_lab.lab import atlas
    from fa_lab.studies import sweep
    table = sweep.reference("bf16_seed_h200")            # one row per (policy, K scale, threshold)
    fig = atlas.heatmaps(table, ["lazy_unfixed", "lazy", "eager"])
    c = atlas.pick(table, "lazy_unfixed", 32, 8)     # the cell: its parameters and measurements
    d = atlas.open_cell(c)                           # fa_lab.lab.widgets.rescale_dashboard for it
    atlas.CellPicker(table, ["lazy_unfixed", "lazy"], figure=go.FigureWidget(fig))

A **cell** is one point of a sweep table (``fa_lab.studies.sweep``): a policy, a K scale and a
threshold (a policy without a threshold, eager, has one run per K scale, drawn under every
threshold column). ``pick`` checks that the cell exists, once, for a registered policy and a
dtype a dashboard runs (bf16: ``widgets.rescale_dashboard``; fp8: ``widgets.fp8_dashboard``),
and refuses anything else with a ValueError/TypeError naming the argument.

``open_cell`` opens the cell's dashboard with its policy, K scale, threshold, causal flag,
seed and D: at the cell's own S and H when its S is at most ``max_S`` (the dashboards'
CPU size by default), else on the same recipe at S = ``max_S`` and H = 1. The dashboards
run batch 1, so a cell of batch 1 at its own size is the very same computation
(``Cell.same_inputs``): the dashboard shows its measured NaN share exactly.
"""

from __future__ import annotations

import html
import math
import numbers
from dataclasses import dataclass, field

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from fa_lab import policies

#: The columns a table needs (``fa_lab.studies.sweep``'s results have them all).
COLUMNS = ("policy", "k_scale", "threshold")
#: The NaN share's colour scale: log10 of the percentage, 0.001 % .. 100 %.
PCT_TICKS = {"tickvals": [-3, -2, -1, 0, 1, 2],
             "ticktext": ["0.001 %", "0.01 %", "0.1 %", "1 %", "10 %", "100 %"]}
#: The sweep's columns that identify a point besides the cell's own three.
_AXES = ("dtype", "B", "S", "H", "D", "causal", "seed", "backend")
_DTYPES = ("bf16", "fp8")


def log_pct(frac):
    """A fraction as log10 of its percentage (the heatmaps' colour); an exact 0 is NaN,
    drawn blank."""
    pct = 100 * np.asarray(frac, dtype=float)
    return np.where(pct > 0, np.log10(np.maximum(pct, 1e-3)), np.nan)


def _check_table(table) -> pd.DataFrame:
    if not isinstance(table, pd.DataFrame):
        raise TypeError(f"table must be a pandas DataFrame (a sweep's results), "
                        f"got {type(table).__name__}")
    missing = [c for c in COLUMNS if c not in table.columns]
    if missing:
        raise ValueError(f"table lacks the column(s) {missing}; a sweep table "
                         f"(fa_lab.studies.sweep.load) has {list(COLUMNS)}")
    if table.empty:
        raise ValueError("table is empty: it has no cell to pick")
    return table


def _thresholds(table: pd.DataFrame) -> list:
    return sorted(float(t) for t in table.threshold.dropna().unique())


def heatmaps(table, policies_, value: str = "nan_frac", k_label: str = "K",
             title: str = "") -> go.Figure:
    """One heatmap per policy of ``value`` (a fraction: log colour scale; a cell of exactly
    0 is light grey) over K scale (rows) x threshold (columns). A policy without a
    threshold (eager) shows its one run under every threshold column. Each policy's data
    trace carries ``meta = {"policy", "x": {label: threshold}, "y": {label: K}}``, which
    ``CellPicker.connect`` reads to turn a click into a cell."""
    from plotly.subplots import make_subplots

    table = _check_table(table)
    if value not in table.columns:
        raise ValueError(f"value={value!r} is not a column of table")
    policies_ = list(policies_)
    for pol in policies_:
        if not (table.policy == pol).any():
            raise ValueError(f"policies_: {pol!r} has no row in table; it has "
                             f"{sorted(table.policy.unique())}")
    fig = make_subplots(rows=1, cols=len(policies_), shared_yaxes=True, horizontal_spacing=0.015,
                        subplot_titles=[p if p != "eager" else "eager (no threshold)"
                                        for p in policies_])
    thresholds = _thresholds(table)
    for i, pol in enumerate(policies_):
        t = table[table.policy == pol]
        if t.threshold.isna().all():      # no threshold: the one run, under every column
            t = pd.concat([t.assign(threshold=x) for x in thresholds])
        piv = t.pivot_table(index="k_scale", columns="threshold", values=value)
        xs, ys = [f"{x:g}" for x in piv.columns], [f"x{k:g}" for k in piv.index]
        zero = np.where(piv.values == 0, 0.0, np.nan)     # exactly 0: a flat light grey
        fig.add_trace(go.Heatmap(z=zero, x=xs, y=ys, showscale=False, hoverinfo="skip",
                                 colorscale=[[0, "#e6e6e6"], [1, "#e6e6e6"]]), 1, i + 1)
        fig.add_trace(go.Heatmap(
            z=log_pct(piv.values), x=xs, y=ys, coloraxis="coloraxis", name=pol,
            customdata=100 * piv.values,
            meta={"policy": pol, "x": dict(zip(xs, map(float, piv.columns))),
                  "y": dict(zip(ys, map(float, piv.index)))},
            hovertemplate=f"{pol}<br>{k_label} %{{y}}, threshold %{{x}}<br>"
                          "%{customdata:.4f} % NaN<extra></extra>"), 1, i + 1)
        if (piv.values == 0).all():
            fig.add_annotation(text="no NaN<br>in any cell", showarrow=False, font_size=13,
                               x=0.5, y=0.5, xref=f"x{i + 1 if i else ''} domain",
                               yref=f"y{i + 1 if i else ''} domain")
        fig.update_xaxes(title_text="threshold", row=1, col=i + 1, tickfont_size=9)
    fig.update_yaxes(title_text=f"{k_label} scale", row=1, col=1)
    fig.update_layout(title=title, height=430, width=1250, plot_bgcolor="white",
                      coloraxis={"colorscale": "Viridis", "cmin": -3, "cmax": 2,
                                 "colorbar": {"title": "NaN", **PCT_TICKS}},
                      margin={"t": 80, "l": 60, "r": 20, "b": 50})
    return fig


@dataclass(frozen=True)
class Cell:
    """One cell of a sweep table. ``threshold``: the column picked (None: the dashboard's
    default; a policy without a threshold ignores it); ``measured``: the table's row (its
    NaN share, size, device, ...), as a dict."""

    policy: str
    k_scale: float
    threshold: float | None
    dtype: str
    measured: dict = field(repr=False)

    @property
    def has_threshold(self) -> bool:
        t = self.measured.get("threshold")
        return t is not None and not (isinstance(t, float) and math.isnan(t))

    def size(self) -> dict:
        """The cell's own B, S, H, D (where the table has them)."""
        return {a: self.measured[a] for a in ("B", "S", "H", "D") if a in self.measured}

    def dashboard_args(self, *, S=None, H=None, max_S=None) -> dict:
        """The dashboard's keyword arguments for this cell (see the module docstring)."""
        from fa_lab.lab import widgets

        defaults = widgets.CPU_DEFAULTS if self.dtype == "bf16" else widgets.FP8_CPU_DEFAULTS
        max_S = defaults["S"] if max_S is None else max_S
        own = self.size()
        fits = own.get("S", math.inf) <= max_S
        args = {"k_scale": int(self.k_scale) if self.dtype == "bf16" else float(self.k_scale),
                "policy": self.policy,
                "threshold": None if self.threshold is None else float(self.threshold),
                "causal": bool(self.measured.get("causal", False)),
                "seed": int(self.measured.get("seed", 0)),
                "S": int(own["S"]) if S is None and fits else int(max_S if S is None else S),
                "H": int(own.get("H", 1)) if H is None and fits else int(1 if H is None else H)}
        if self.dtype == "bf16":
            args["D"] = int(own.get("D", defaults["D"]))
        else:
            pol = policies.get(self.policy)
            if "rebase_bound" in pol.parameters and pol.rebase_bound is not None:
                args["rebase_bound"] = float(pol.rebase_bound)
        return args

    def same_inputs(self, args: dict) -> bool:
        """Whether a dashboard opened with ``args`` runs this cell's very inputs (batch 1,
        the cell's S, H, D and seed), so it shows the cell's measured NaN share exactly."""
        own = self.size()
        return (own.get("B", 1) == 1 and own.get("S") == args["S"] and own.get("H") == args["H"]
                and ("D" not in args or own.get("D") == args["D"])
                and int(self.measured.get("seed", 0)) == args["seed"])

    def describe(self) -> str:
        """One line: the cell and what the table measured there."""
        thr = "no threshold" if not self.has_threshold else f"threshold {self.threshold:g}"
        m = self.measured
        size = " ".join(f"{a}{v}" for a, v in self.size().items())
        nan = m.get("nan_frac")
        nan = "" if nan is None else f": {100 * nan:.4g} % NaN"
        dev = m.get("device_name") or m.get("device")
        where = f" on {dev}" if dev else ""
        return f"{self.policy}, K x{self.k_scale:g}, {thr}{nan} ({size}{where})"


def pick(table, policy, k_scale, threshold=None) -> Cell:
    """The cell of ``table`` at (``policy``, ``k_scale``, ``threshold``). ``threshold`` must
    be one of the table's thresholds for that policy and K scale; for a policy run without
    a threshold (eager) it may be any threshold column of the table, or None. Raises
    TypeError/ValueError naming the argument for a cell that is not in the table, is in it
    more than once, or that a dashboard cannot open (an unregistered policy, a dtype other
    than bf16 or fp8)."""
    table = _check_table(table)
    if not isinstance(policy, str):
        raise TypeError(f"policy must be a str, got {type(policy).__name__}")
    if not (table.policy == policy).any():
        raise ValueError(f"policy={policy!r} has no cell in table; it has "
                         f"{sorted(table.policy.unique())}")
    if policy not in policies.names():
        raise ValueError(f"policy={policy!r} is not registered (fa_lab.policies.register): "
                         "the dashboard picks its policy by name")
    if isinstance(k_scale, bool) or not isinstance(k_scale, numbers.Real):
        raise TypeError(f"k_scale must be a number, got {type(k_scale).__name__}")
    rows = table[table.policy == policy]
    ks = sorted(float(k) for k in rows.k_scale.unique())
    if not any(math.isclose(float(k_scale), k) for k in ks):
        raise ValueError(f"k_scale={k_scale!r} is not a K scale of {policy!r} in table; it has "
                         f"{[f'{k:g}' for k in ks]}")
    rows = rows[np.isclose(rows.k_scale.astype(float), float(k_scale))]
    if threshold is not None:
        if isinstance(threshold, bool) or not isinstance(threshold, numbers.Real):
            raise TypeError(f"threshold must be a number or None, got {type(threshold).__name__}")
        threshold = float(threshold)
    if rows.threshold.isna().all():      # no threshold: any column of the table shows it
        cols = _thresholds(table)
        if threshold is not None and cols and not any(math.isclose(threshold, t) for t in cols):
            raise ValueError(f"threshold={threshold:g} is not a threshold column of table; it "
                             f"has {[f'{t:g}' for t in cols]}")
    else:
        ths = _thresholds(rows)
        if threshold is None or not any(math.isclose(threshold, t) for t in ths):
            raise ValueError(f"threshold={threshold!r}: {policy!r} at K x{float(k_scale):g} has "
                             f"the thresholds {[f'{t:g}' for t in ths]} in table; pick one")
        rows = rows[np.isclose(rows.threshold.astype(float), threshold)]
    if len(rows) != 1:
        differ = [a for a in _AXES if a in rows.columns and rows[a].nunique(dropna=False) > 1]
        raise ValueError(f"table has {len(rows)} rows for this cell ({policy}, K x{float(k_scale):g}"
                         f", threshold {threshold}); they differ in {differ or 'nothing listed'}: "
                         "filter the table to one row per cell")
    measured = {k: (v.item() if hasattr(v, "item") else v) for k, v in rows.iloc[0].items()}
    dtype = str(measured.get("dtype", "bf16"))
    if dtype not in _DTYPES:
        raise ValueError(f"table's dtype is {dtype!r}: the dashboards run {_DTYPES}")
    return Cell(policy, float(k_scale), threshold, dtype, measured)


def open_cell(cell: Cell, *, S=None, H=None, max_S=None, **dashboard_kw):
    """The lane dashboard (``widgets.rescale_dashboard``, fp8: ``widgets.fp8_dashboard``)
    opened on ``cell`` (``Cell.dashboard_args``); ``dashboard_kw`` go to the dashboard
    (``device``, ``backend``, ``row``, ...)."""
    from fa_lab.lab import widgets

    if not isinstance(cell, Cell):
        raise TypeError(f"cell must be a fa_lab.lab.atlas.Cell (atlas.pick), got {type(cell).__name__}")
    args = {**cell.dashboard_args(S=S, H=H, max_S=max_S), **dashboard_kw}
    make = widgets.rescale_dashboard if cell.dtype == "bf16" else widgets.fp8_dashboard
    return make(**args)


class CellPicker:
    """A control that picks one cell of ``table`` (dropdowns: policy, K scale, threshold;
    or a click on a heatmap ``connect``-ed to it) and opens its trace in the lane dashboard
    (``open_cell``) below, with a line on the cell's measured numbers and on what the
    dashboard runs. ``policies_``: the policies offered (default: the table's registered
    ones). ``open``: open the first cell (or ``start``: (policy, K, threshold)) at once.
    ``dashboard_kw``: for ``open_cell``."""

    def __init__(self, table, policies_=None, *, figure=None, start=None, open=True,
                 **dashboard_kw):
        import ipywidgets as W

        self.table = _check_table(table)
        names = list(policies_) if policies_ is not None else [
            p for p in self.table.policy.unique() if p in policies.names()]
        if not names:
            raise ValueError("policies_: no registered policy of table to pick")
        for p in names:
            pick(self.table, p, float(self.table[self.table.policy == p].k_scale.iloc[0]),
                 self._thresholds_of(p)[0])               # every offered policy opens
        self.dashboard_kw = dashboard_kw
        self.dashboard = None
        self.cell = None
        self._silent = False
        style = {"description_width": "70px"}
        self.policy = W.Dropdown(options=names, description="policy", style=style)
        self.k_scale = W.Dropdown(description="K scale", style=style)
        self.threshold = W.Dropdown(description="threshold", style=style)
        self.button = W.Button(description="open its trace", button_style="primary")
        self.status = W.HTML()
        self.output = W.Output()
        self.policy.observe(lambda _: self._refresh(), names="value")
        self.button.on_click(lambda _: self.open())
        self._refresh()
        self.widget = W.VBox([W.HBox([self.policy, self.k_scale, self.threshold, self.button]),
                              self.status, self.output])
        if figure is not None:
            self.connect(figure)
        if start is not None:
            self.select(*start, open=False)
        if open:
            self.open()

    def _thresholds_of(self, policy) -> list:
        rows = self.table[self.table.policy == policy]
        ths = _thresholds(rows) if not rows.threshold.isna().all() else []
        return ths or [None]

    def _refresh(self):
        """The K and threshold options of the chosen policy (keeping the values that exist)."""
        pol = self.policy.value
        ks = sorted(float(k) for k in self.table[self.table.policy == pol].k_scale.unique())
        ths = self._thresholds_of(pol)
        old_k, old_t = self.k_scale.value, self.threshold.value
        self._silent = True
        try:
            self.k_scale.options = [(f"x{k:g}", k) for k in ks]
            self.k_scale.value = old_k if old_k in ks else ks[0]
            self.threshold.options = [("none" if t is None else f"{t:g}", t) for t in ths]
            self.threshold.value = old_t if old_t in ths else ths[0]
            self.threshold.disabled = ths == [None]
        finally:
            self._silent = False

    def select(self, policy, k_scale, threshold=None, *, open=True):
        """Set the controls to a cell (checked by ``pick`` first: a bad cell changes
        nothing and raises), and open it unless ``open`` is False."""
        cell = pick(self.table, policy, k_scale, threshold)
        self.policy.value = cell.policy
        self._refresh()
        self.k_scale.value = cell.k_scale
        if cell.has_threshold:
            self.threshold.value = cell.threshold
        return self.open() if open else cell

    def open(self):
        """Open the chosen cell's dashboard below the controls; returns it."""
        from IPython.display import display

        thr = self.threshold.value
        cell = pick(self.table, self.policy.value, self.k_scale.value, thr)
        args = {**cell.dashboard_args(**{k: self.dashboard_kw[k] for k in ("S", "H", "max_S")
                                         if k in self.dashboard_kw})}
        same = cell.same_inputs(args)
        d = open_cell(cell, **self.dashboard_kw)
        self.cell, self.dashboard = cell, d
        run = (f"the very same inputs (batch 1, S={args['S']}, H={args['H']})" if same else
               f"the same recipe at S={args['S']}, H={args['H']}, batch 1, on this machine")
        self.status.value = (f"<b>cell</b> {html.escape(cell.describe())}<br>"
                             f"<b>dashboard</b>: {run}")
        self.output.clear_output(wait=True)
        with self.output:
            display(d)
        return d

    def connect(self, figure):
        """Open a cell when it is clicked in ``figure`` (a ``plotly.graph_objects.
        FigureWidget`` of ``heatmaps``; its traces of policies this picker offers)."""
        if not isinstance(figure, go.FigureWidget):
            raise TypeError(f"figure must be a plotly FigureWidget (go.FigureWidget(fig)), "
                            f"got {type(figure).__name__}")
        hooked = 0
        for tr in figure.data:
            meta = tr.meta if isinstance(tr.meta, dict) else None
            if meta and meta.get("policy") in self.policy.options:
                tr.on_click(self.on_click)
                hooked += 1
        if not hooked:
            raise ValueError("figure has no heatmap of a policy this picker offers "
                             "(make it with fa_lab.lab.atlas.heatmaps)")
        return hooked

    def on_click(self, trace, points, selector=None):
        """A heatmap click: the clicked cell of ``trace`` (its ``meta``), opened."""
        if not points.xs:
            return None
        meta = trace.meta
        return self.select(meta["policy"], meta["y"][str(points.ys[0])],
                           meta["x"][str(points.xs[0])])

    def _repr_mimebundle_(self, **kwargs):
        return self.widget._repr_mimebundle_(**kwargs)
