"""How a new figure reaches the browser: only the properties that changed, in one message
(``assign_figure``), into a ``DashboardFigure`` that reports when the browser has drawn it."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import math

import numpy as np
import plotly.graph_objects as go
import traitlets

from .views import FIGURE_WIDTH, MAIN_HEIGHT, TAB_HEIGHT


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
