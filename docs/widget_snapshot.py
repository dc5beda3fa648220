"""A lesson's saved dashboard as static HTML, for the docs site (conf.py uses it; not part
of the package).

A dashboard needs a running kernel to answer its controls, so on the site it is a
snapshot. Drawn by ipywidgets' page runtime, its sliders would move while nothing answered
them, and the runtime (with require.js and a copy of plotly.js inside plotly's widget
bundle) would more than double the page's weight. Each saved widget view becomes plain HTML
instead, from the widget state the build saved:

- boxes (HBox, VBox) are flex boxes with their saved layout, and keep their CSS classes; a
  box the lab sized wider than the site's text column takes the column's width, and a row
  wraps, so the controls sit above the figures rather than squeezing them;
- controls are disabled form fields set to their saved values, so they show what the
  figures were drawn with and do not move;
- a Tab's panels all show, one under the other, each under its title;
- an HTML widget's value is shown as it was;
- a plotly FigureWidget becomes a plain plotly figure (the div and ``Plotly.newPlot`` call
  that plotly writes for a lesson's other figures), drawn by the page's plotly.js from the
  data and layout in the widget's state: numpy arrays, which the widget sends as binary
  buffers, go to plotly.js as typed arrays ({dtype, bdata}); like the site's other figures
  it takes its column's width (``layout.width`` dropped, ``responsive``) and keeps its
  height, 360 px where the layout sets none, as the widget's own view does.

A widget of any other kind raises ValueError, so a page never ships a dashboard half drawn.
"""

from __future__ import annotations

import copy
import html
import math
import re
from pathlib import Path

import plotly
import plotly.io as pio

#: plotly's FigureWidget module (an anywidget ``_esm``): a widget whose ``_esm`` is this is
#: a plotly figure.
PLOTLY_WIDGET_ESM = Path(plotly.__file__).parent / "package_data" / "widgetbundle.js"
#: numpy dtype names (as plotly's widget serializer sends them) -> plotly.js's typed-array
#: codes.
_DTYPES = {"float64": "f8", "float32": "f4", "int8": "i1", "int16": "i2", "int32": "i4",
           "uint8": "u1", "uint16": "u2", "uint32": "u4"}
#: The book theme's text column at 1440 px and wider, less a margin (px): a box that the lab
#: sized wider than this takes the column's width on the site.
COLUMN_PX = 760
#: the widget layout traits that become CSS (the rest are unset or have no meaning here)
_CSS = ("width", "height", "min_height", "max_width", "flex", "flex_flow", "align_items",
        "justify_content", "padding", "margin")


def render(model_id: str, state: dict) -> str:
    """The static HTML of the widget view ``model_id``, from ``state`` (the ``state`` map of
    a saved ``application/vnd.jupyter.widget-state+json``)."""
    return _Snapshot(state).node(model_id)


class _Snapshot:
    def __init__(self, state: dict):
        self.state = state
        self.plotly_esm = PLOTLY_WIDGET_ESM.read_text(encoding="utf-8")

    def model(self, ref: str) -> dict:
        key = ref.removeprefix("IPY_MODEL_")
        if key not in self.state:
            raise ValueError(f"the saved widget state has no model {key}")
        return self.state[key]

    def style(self, s: dict) -> str:
        layout = dict(self.model(s["layout"])["state"]) if s.get("layout") else {}
        if _px(layout.get("width")) > COLUMN_PX:     # sized for JupyterLab: the column's width
            layout["width"] = "100%"
        css = [f"{k.replace('_', '-')}: {layout[k]}" for k in _CSS if layout.get(k)]
        return html.escape("; ".join(css), quote=True)

    def node(self, ref: str) -> str:
        m = self.model(ref)
        name, s = m["model_name"], m["state"]
        classes = " ".join(s.get("_dom_classes") or [])
        if name in ("HBoxModel", "VBoxModel", "BoxModel"):
            row = name == "HBoxModel"
            inner = "".join(self.node(c) for c in s.get("children", []))
            kind = f'fa-lab-snapshot-box fa-lab-snapshot-{"row" if row else "column"} {classes}'
            return f'<div class="{kind.strip()}" style="{self.style(s)}">{inner}</div>'
        if name == "TabModel":
            titles = list(s.get("titles") or [])
            panels = "".join(
                f'<div class="fa-lab-snapshot-tab"><p class="fa-lab-snapshot-tab-title">'
                f'{html.escape(str(titles[i]) if i < len(titles) and titles[i] else f"tab {i + 1}")}'
                f"</p>{self.node(c)}</div>" for i, c in enumerate(s.get("children", [])))
            return f'<div class="{f"fa-lab-snapshot-tabs {classes}".strip()}">{panels}</div>'
        if name == "AnyModel" and s.get("_esm") == self.plotly_esm:
            return self.figure(m)
        control = self.control(name, s)
        if control is None:
            raise ValueError(f"the docs site cannot draw a {m['model_module']} {name} "
                             "statically: add it to docs/widget_snapshot.py")
        label = html.escape(s.get("description") or "")
        return (f'<div class="{f"fa-lab-snapshot-control {classes}".strip()}" style="{self.style(s)}">'
                f"{f'<label>{label}</label>' if label else ''}{control}</div>")

    @staticmethod
    def control(name: str, s: dict) -> str | None:
        """A control's field, or None for a widget that is not one of these."""
        if name in ("IntSliderModel", "FloatSliderModel", "FloatLogSliderModel"):
            value, low, high, step = s["value"], s["min"], s["max"], s["step"]
            if name == "FloatLogSliderModel":         # min and max are exponents of base
                position = math.log(value, s.get("base", 10.0))
            else:
                position = value
            readout = format(value, s.get("readout_format") or "")
            return (f'<input type="range" min="{low}" max="{high}" step="{step}" '
                    f'value="{position}" disabled><output>{html.escape(readout)}</output>')
        if name == "DropdownModel":
            chosen = s.get("index")
            options = "".join(
                f'<option{" selected" if i == chosen else ""}>{html.escape(str(label))}</option>'
                for i, label in enumerate(s.get("_options_labels", [])))
            return f"<select disabled>{options}</select>"
        if name in ("BoundedIntTextModel", "IntTextModel", "BoundedFloatTextModel",
                    "FloatTextModel"):
            return f'<input type="number" value="{s["value"]}" disabled>'
        if name == "CheckboxModel":
            return f'<input type="checkbox"{" checked" if s["value"] else ""} disabled>'
        if name == "HTMLModel":
            return s.get("value", "")
        return None

    def figure(self, m: dict) -> str:
        s = copy.deepcopy(m["state"])
        for buffer in m.get("buffers", []):      # numpy arrays: base64 at their paths
            *where, key = buffer["path"]
            parent = s
            for step in where:
                parent = parent[step]
            parent[key] = buffer["data"]
        data = _typed_arrays(s["_widget_data"])
        layout = {k: v for k, v in _typed_arrays(s["_widget_layout"]).items()
                  if k not in ("width", "autosize")}
        layout.setdefault("height", 360)
        config = {**_typed_arrays(s.get("_config") or {}), "responsive": True}
        return pio.to_html({"data": data, "layout": layout}, include_plotlyjs=False,
                           include_mathjax=False, full_html=False, default_width="100%",
                           default_height=layout["height"], validate=False, config=config)


def _px(width) -> float:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)px\s*", str(width or ""))
    return float(m.group(1)) if m else 0.0


def _typed_arrays(value):
    """plotly's widget serialization undone: ``"_undefined_"`` dropped, and each array sent
    as {buffer, dtype, shape} given to plotly.js as a typed array {dtype, bdata}."""
    if isinstance(value, list):
        return [_typed_arrays(v) for v in value]
    if isinstance(value, dict):
        if {"buffer", "dtype", "shape"} <= value.keys() and isinstance(value["buffer"], str):
            if value["dtype"] not in _DTYPES or len(value["shape"]) != 1:
                raise ValueError(f"a figure array of dtype {value['dtype']} and shape "
                                 f"{value['shape']}: plotly's widget sends 1-d numeric ones")
            return {"dtype": _DTYPES[value["dtype"]], "bdata": value["buffer"]}
        return {k: _typed_arrays(v) for k, v in value.items() if v != "_undefined_"}
    return value
