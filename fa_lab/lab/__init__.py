"""The interactive lab: figures (``viz``), dashboards (``widgets``), the atlas of sweeps
(``atlas``) and the lessons' helpers (``lessons``). It needs the ``[lab]`` extra
(``pip install 'fa_lab[lab]'``); importing it without says so, naming what is missing."""

import importlib.util

#: The packages of the ``[lab]`` extra that ``fa_lab.lab`` imports (pyproject.toml).
NEEDS = ("plotly", "ipywidgets", "anywidget")

_missing = [m for m in NEEDS if importlib.util.find_spec(m) is None]
if _missing:
    raise ImportError(f"fa_lab.lab needs {', '.join(_missing)}, which this install lacks: "
                      "install the lab extra with pip install 'fa_lab[lab]'")

