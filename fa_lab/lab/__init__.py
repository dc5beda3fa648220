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


def _skip_iri_grammar():
    """Keep jsonschema from importing the optional ``rfc3987_syntax``. Plotly imports nbformat
    for notebook output, nbformat imports jsonschema, and jsonschema imports
    ``rfc3987_syntax``, where installed, only to check the "iri" and "iri-reference" string
    formats; that package compiles a grammar at import, the slowest step of a lesson
    kernel's imports on a busy CPU. The lab checks no such format, so, unless jsonschema is
    in already, the lab's process marks the package absent (``sys.modules`` entry None):
    jsonschema then leaves those two formats unchecked, as it does where the package is not
    installed, and nothing else changes."""
    import sys

    if "jsonschema" not in sys.modules:
        sys.modules.setdefault("rfc3987_syntax", None)


_skip_iri_grammar()
