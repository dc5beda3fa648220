"""The interactive lab: figures (``viz``), dashboards (``widgets``), the atlas of sweeps
(``atlas``) and the lessons' helpers (``lessons``). It needs the ``[lab]`` extra
(``pip install 'fa_lab[lab]'``); importing it without says so, naming what is missing."""

import importlib.util
import sys

#: The packages of the ``[lab]`` extra that ``fa_lab.lab`` imports (pyproject.toml).
NEEDS = ("plotly", "ipywidgets", "anywidget")

_missing = [m for m in NEEDS if importlib.util.find_spec(m) is None]
if _missing:
    raise ImportError(f"fa_lab.lab needs {', '.join(_missing)}, which this install lacks: "
                      "install the lab extra with pip install 'fa_lab[lab]'")


# Every figure the lab shows goes through plotly's renderers, which import nbformat; its
# validator imports jsonschema, which, where rfc3987_syntax is installed, builds that
# package's IRI grammar at import: seconds of CPU in every lesson's kernel, for jsonschema's
# "iri" and "iri-reference" string formats, which no schema the lab or nbformat validates
# uses. Unless something imported it first, the lab keeps it out (jsonschema then leaves
# those two formats unchecked, as it does where rfc3987_syntax is not installed).
sys.modules.setdefault("rfc3987_syntax", None)
