"""The dashboards' layouts and their controls' wiring: the controls and a compact summary in
a column on the left, the chosen row's figure on the right, secondary figures in tabs
under it; a redraw goes in the reader's order, and a newer move supersedes an older one."""

from __future__ import annotations

import gc
import html
import math
import os
import time

import plotly.graph_objects as go
import torch

from fa_lab import policies
from fa_lab.policies import RuleError
from .views import (CPU_DEFAULTS, FIGURE_WIDTH, FP8_CPU_DEFAULTS, HEAT_VALUES, LEFT_WIDTH,
                    TAB_HEIGHT, _bf16_threshold, _choice, _int, _lazy, compute_compare_view,
                    compute_fp8_view, compute_rescale_view, view_threshold)
from .transport import (DRAWN_WAIT_S, DashboardFigure, FIGURE_SIZES, LANE_TABS, _gc_paused,
                        _running_loop, assign_figure)


#: The errors a redraw shows in the summary instead of raising: a bad value, and a user
#: policy's rule that raised.
_SHOWN = (ValueError, TypeError, RuleError)


#: Under ``FA_LAB_LIVE_FIGURES=1`` a dashboard makes its FigureWidgets at once instead of at
#: the first move (``Dashboard``): the docs build sets it, and shares one copy of plotly's
#: widget code among a page's figures.
LIVE_FIGURES_ENV = "FA_LAB_LIVE_FIGURES"


def _plain_output(fig: go.Figure, size: tuple):
    """An ``ipywidgets.Output`` that shows ``fig`` at ``size`` (width, height) as a plain
    figure, in the form the notebook shows any other (plotly's renderer; its JSON mime type
    where none is set)."""
    import ipywidgets as W
    import plotly.io as pio

    fig = go.Figure(fig)
    fig.layout.width, fig.layout.height = size
    bundle = fig._repr_mimebundle_({}, {}) or pio.renderers["plotly_mimetype"].to_mimebundle(
        fig.to_dict())
    out = W.Output()
    out.outputs = ({"output_type": "display_data", "data": bundle, "metadata": {}},)
    return out


class Dashboard:
    """Controls + figures + a summary, redrawn by ``compute(**values)``.

    ``controls`` maps each compute argument to its widget; ``update()`` reads them, calls
    ``compute`` and assigns the figures on screen (``main`` and the open tab; the other
    tabs' figures are drawn when opened); ``last`` is the latest view, ``last_seconds`` how
    long the redraw took and ``figures_seconds`` when its main figure was sent.

    Each figure sits in a box of ``slots``. Until the first redraw the boxes hold plain
    figures (an ``Output`` each), and ``figures`` is empty: a plotly ``FigureWidget``
    carries plotly's whole widget code (about 5 MB) in its saved state, once per figure,
    so a lesson saved before anything moved stays small. The first redraw (or
    ``make_live()``) puts a ``DashboardFigure`` in each box, and ``figures`` maps the
    figure names to them; from then on a redraw sends each figure only what changed.
    ``live=True`` (or ``FA_LAB_LIVE_FIGURES=1``) makes them at once.
    ``figures_first``: ``compute`` takes ``all_policies=False`` for a partial view that
    only the figures need, drawn before the full one. Controls named in ``auto`` (the wave
    figure's step) are passed as None (chosen by the view) when any other control moves,
    and follow the view's choice. ``follow`` maps a control to ``f(new value) -> {control:
    value}``: when it moves, those controls take those values first (one redraw for all;
    a new policy brings its own threshold, bound and headroom). ``convert`` maps a control
    to ``f(control value) -> compute's argument``, for a control whose values are not the
    argument's own. A bad value (or a user rule that raises) shows its error in the summary
    instead of a figure.
    Building a dashboard ends with one full garbage collection (see ``__init__``).
    """

    def __init__(self, compute, controls: dict, fixed: dict, *, main=("row",), tabs=LANE_TABS,
                 auto=("tile",), layout=None, figures_first=False, follow=None, convert=None,
                 live=None):
        import ipywidgets as W

        self.compute = compute
        self.figures_first = figures_first
        self.controls = controls
        self.fixed = fixed
        self.follow = dict(follow or {})
        self.convert = dict(convert or {})
        self.main = tuple(main)
        self.tab_names = tuple(name for name, _ in tabs)
        self.auto = tuple(a for a in auto if a in controls)
        self._auto_values = {a: None for a in self.auto}
        self._silent = False
        self.summary = W.HTML(layout=W.Layout(min_height="3em", width="100%"))
        self.summary.add_class("fa-lab-summary-box")
        self.figures: dict[str, DashboardFigure] = {}
        self.slots: dict = {}
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
            self.slots[name] = W.Box([_plain_output(fig, _size(name))])
            self._drawn[name] = fig
        self.tabs = None
        if self.tab_names:
            self.tabs = W.Tab(children=[self.slots[n] for n in self.tab_names])
            for i, (_, title) in enumerate(tabs):
                self.tabs.set_title(i, title)
            self.tabs.observe(self._on_tab, names="selected_index")
        self._show(view)
        self.widget = (layout or _side_layout)(self)
        if live if live is not None else os.environ.get(LIVE_FIGURES_ENV) == "1":
            self.make_live()
        for w in controls.values():
            w.observe(self._on_change, names="value")
        # One full collection now, while the cell runs: the collector's deferred full pass
        # over everything the notebook made so far would otherwise fall into one of the
        # first slider moves.
        gc.collect()

    # -- reading and computing
    def argument(self, name: str, value):
        """What ``compute`` receives for control ``name`` at ``value``."""
        return self.convert[name](value) if name in self.convert else value

    def values(self) -> dict:
        vals = {name: self.argument(name, w.value) for name, w in self.controls.items()}
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

    @property
    def live(self) -> bool:
        """Whether the figures on screen are FigureWidgets (``figures``) yet."""
        return bool(self.figures)

    def make_live(self, figures: dict | None = None):
        """Put a ``DashboardFigure`` in each figure's box: of ``figures`` (name -> new
        figure) where given, else of the figure drawn there. Nothing when already live."""
        if self.live:
            return
        figures = figures or {}
        for name, slot in self.slots.items():
            fig = figures.get(name, self._drawn[name])
            widget = DashboardFigure(fig)
            widget.layout.width, widget.layout.height = _size(name)
            self.figures[name], self._drawn[name] = widget, fig
            slot.children = (widget,)

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
                self.make_live(first["figures"])      # the first move: widgets from here on
                self._draw(first["figures"])
        except _SHOWN as e:
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
        except _SHOWN as e:
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
        if name in self.follow:
            self._silent = True
            try:    # the controls that follow this one move with it, without a redraw each
                for other, value in self.follow[name](change["new"]).items():
                    self.controls[other].value = value
            finally:
                self._silent = False
        # ipywidgets holds a property lock while it applies a value sent by the browser
        self.update(name, pipelined=bool(getattr(change["owner"], "_property_lock", None)))

    def _on_tab(self, change):
        name = self.tab_names[change["new"]] if change["new"] is not None else None
        if name in self._stale and self.last is not None and self.live:
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
    right = [d.slots[n] for n in d.main] + ([d.tabs] if d.tabs is not None else [])
    return W.HBox([left, W.VBox(right, layout=W.Layout(width=f"{FIGURE_WIDTH + 10}px"))],
                  layout=W.Layout(align_items="flex-start", width=f"{LEFT_WIDTH + FIGURE_WIDTH + 20}px"))


def _size(name: str) -> tuple:
    """A dashboard figure's (width, height) in px."""
    return FIGURE_SIZES.get(name, (FIGURE_WIDTH, TAB_HEIGHT))


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


def _threshold_slider_max(threshold) -> float:
    """The bf16 threshold slider's top: 128, where fp32 gives out (the threshold matters
    once it passes the typical tile-max jump, and the fixed rules fail only near 128), or a
    policy's own threshold past it."""
    return max(128.0, float(threshold))


def rescale_dashboard(S=CPU_DEFAULTS["S"], H=CPU_DEFAULTS["H"], D=CPU_DEFAULTS["D"], *,
                      k_scale=32, threshold=None, policy="lazy_unfixed", causal=False, seed=0,
                      row=None, n_waves=1, device=None, backend="auto") -> Dashboard:
    """bf16 dashboard: K scale, threshold, policy, causal, S, seed, row, the wave figure's
    step and the heatmap's value; shows the row under its policy beside the fix, its wave
    at one step, its wave step by step, the map of every bad row, and a summary of every
    policy against fp32. ``threshold=None`` starts at the policy's own, and choosing a
    policy moves the threshold to its own; a threshold away from a policy's own runs it as
    a variant, named as one (``views.variant``). ``row=None`` picks the first row the
    unfixed lazy rescale turns non-finite (row 0 when there is none)."""
    import ipywidgets as W

    S = _int("S", S, 1)
    policy = _choice("policy", policy, policies.names())
    threshold = _bf16_threshold(policy, threshold)
    if row is None:
        row = first_bad_row(k_scale, threshold, causal, S, seed, H=H, D=D, device=device,
                            backend=backend)
        row = 0 if row is None else row
    style, wide = _style(), _wide()
    controls = {
        "k_scale": W.IntSlider(value=int(k_scale), min=1, max=128, description="K scale",
                               continuous_update=False, style=style, layout=wide),
        "threshold": W.FloatSlider(value=threshold, min=0, max=_threshold_slider_max(threshold),
                                   step=0.5, description="threshold", continuous_update=False,
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

    def own_threshold(name):
        # a lazy policy's own threshold (a number: bf16 has no by-KV-length rule); a policy
        # without one (eager) leaves the threshold of the lazy policies beside it as it is
        own = policies.get(name)
        if not own.lazy or isinstance(own.threshold, str):
            return {}
        slider = controls["threshold"]
        slider.max = _threshold_slider_max(own.threshold)
        return {"threshold": float(own.threshold)}

    controls["S"].observe(keep_row_in_range, names="value")
    fixed = dict(H=H, D=D, n_waves=n_waves, device=device, backend=backend)
    d = Dashboard(compute_rescale_view, controls, fixed, figures_first=True,
                  follow={"policy": own_threshold})
    d.widget.add_class("fa-lab-dashboard")
    d.widget.add_class("fa-lab-rescale-dashboard")
    return d


def first_bad_row(k_scale=32, threshold=None, causal=False, S=CPU_DEFAULTS["S"], seed=0, *,
                  H=CPU_DEFAULTS["H"], D=CPU_DEFAULTS["D"], head=0, device=None,
                  backend="auto") -> int | None:
    """The first query row of ``head`` whose output the unfixed lazy rescale (at
    ``threshold``; None: its own) makes non-finite, or None when every row is finite."""
    view = compute_rescale_view(k_scale, threshold, "lazy_unfixed", causal, S, seed, 0, H=H,
                                D=D, head=head, device=device, backend=backend, figures=False,
                                with_trace=False)
    return _first_nonfinite_row(view["out"], head)


def _first_nonfinite_row(out, head=0) -> int | None:
    """The first query row of batch 0, ``head`` of ``out`` [B, S, H, D] with a non-finite
    element, or None."""
    bad = (~torch.isfinite(out[0, :, head]).all(-1)).nonzero()
    return int(bad[0]) if len(bad) else None


#: The fp8 dashboard's P headroom choices (label, control value); ``_HEADROOM_ARGS`` turns
#: a control value into the view's ``headroom``. A policy's own numeric headroom joins them.
_HEADROOM_CHOICES = (("none", "none"), ("PR #1020 (log2 448 - threshold)", "PR #1020"))
_HEADROOM_ARGS = {"none": False, "PR #1020": True}


def _headroom_value(p_headroom):
    """A policy's own P headroom as the control's value."""
    if isinstance(p_headroom, bool):
        return "PR #1020" if p_headroom else "none"
    return "none" if not p_headroom else float(p_headroom)


def _headroom_argument(value):
    return _HEADROOM_ARGS.get(value, value) if isinstance(value, str) else value


def fp8_dashboard(S=FP8_CPU_DEFAULTS["S"], H=FP8_CPU_DEFAULTS["H"], *, k_scale=5000.0,
                  threshold=None, policy="lazy_unfixed", rebase_bound=None, headroom=None,
                  causal=False, seed=0, row=None, n_waves=1, device=None,
                  backend="auto") -> Dashboard:
    """fp8 dashboard: k scale (log slider), threshold (or PR #1020's by-KV-length rule),
    rebase bound (capped policies), P headroom, policy, row and the wave figure's step;
    shows mean |o - 1|, NaN counts, the row under its policy beside the fix, its wave and
    the map of every bad row. ``threshold``, ``rebase_bound`` and ``headroom`` (True: PR
    #1020's lift, False: none, or a number) start at the policy's own where None, and
    choosing a policy moves them to its own; a setting away from a policy's own runs it as
    a variant, named as one (``views.variant``). ``row=None`` picks the first row the
    unfixed rule turns non-finite at this k scale (row 0 when there is none)."""
    import ipywidgets as W

    S = _int("S", S, 1)
    policy = _choice("policy", policy, policies.names())
    own = policies.get(policy)
    threshold = view_threshold(policy, threshold)
    threshold = threshold if isinstance(threshold, str) else float(threshold)
    if rebase_bound is None:
        rebase_bound = own.rebase_bound if "rebase_bound" in own.parameters else policies.DEFAULT_REBASE_BOUND
    headroom = _headroom_value(own.p_headroom if headroom is None else headroom)
    if row is None:
        first = compute_fp8_view(k_scale, threshold, "lazy_unfixed", rebase_bound,
                                 _headroom_argument(headroom), causal, S, seed, 0, H=H,
                                 device=device, backend=backend, figures=False)
        row = _first_nonfinite_row(first["out"])
        row = 0 if row is None else row
    style, wide = _style(), _wide()
    thr_options = [("by KV length (PR #1020)", policies.BY_KV_LEN)] + [
        (f"{t:g}", float(t)) for t in (0, 2, 4, 6, 8, 12, 16, 24, 32)]
    controls = {
        "k_scale": W.FloatLogSlider(value=float(k_scale), base=10, min=2, max=5, step=0.05,
                                    description="k scale", continuous_update=False,
                                    style=style, layout=wide, readout_format=".4g"),
        "policy": _policy_control(policy),
        "threshold": W.Dropdown(options=_with_option(thr_options, threshold), value=threshold,
                                description="threshold", style=style, layout=wide),
        "rebase_bound": W.FloatSlider(value=float(rebase_bound), min=1,
                                      max=max(64.0, float(rebase_bound)), step=1,
                                      description="rebase bound", continuous_update=False,
                                      style=style, layout=wide),
        **_row_and_tile(S, row),
        "heat_value": _heat_value_control(),
        "headroom": W.Dropdown(options=_with_option(_HEADROOM_CHOICES, headroom),
                               value=headroom, description="P headroom", style=style,
                               layout=wide),
        "causal": W.Checkbox(value=causal, description="causal", indent=False),
    }
    fixed = dict(S=S, H=H, seed=seed, n_waves=n_waves, device=device, backend=backend)

    def enable_what_applies(_=None):
        # The eager rescale has no threshold; only capped policies have a rebase bound.
        pol = controls["policy"].value
        controls["threshold"].disabled = not _lazy(pol)
        controls["rebase_bound"].disabled = "rebase_bound" not in policies.get(pol).parameters

    def own_settings(name):
        # the policy's own threshold (lazy), bound (capped) and headroom, each added to its
        # control's choices or range where it lies outside them
        pol, vals = policies.get(name), {}
        if pol.lazy:
            w = controls["threshold"]
            w.options = _with_option(thr_options, pol.threshold)
            vals["threshold"] = pol.threshold if isinstance(pol.threshold, str) else float(pol.threshold)
        if "rebase_bound" in pol.parameters:
            controls["rebase_bound"].max = max(64.0, float(pol.rebase_bound))
            vals["rebase_bound"] = float(pol.rebase_bound)
        vals["headroom"] = _headroom_value(pol.p_headroom)
        controls["headroom"].options = _with_option(_HEADROOM_CHOICES, vals["headroom"])
        return vals

    enable_what_applies()
    controls["policy"].observe(enable_what_applies, names="value")
    d = Dashboard(compute_fp8_view, controls, fixed, figures_first=True,
                  follow={"policy": own_settings}, convert={"headroom": _headroom_argument})
    d.widget.add_class("fa-lab-dashboard")
    d.widget.add_class("fa-lab-fp8-dashboard")
    return d


def _with_option(options, value) -> list:
    """``options`` ((label, value) pairs), with ``value`` added (labelled by itself) if
    missing. Values compare by type as well as by value: True is no 1.0 here."""
    options = list(options)
    if not any(type(v) is type(value) and v == value for _, v in options):
        options.append((f"{value:g}" if isinstance(value, float) else str(value), value))
    return options


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
