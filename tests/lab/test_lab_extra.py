"""``import fa_lab.lab`` without the ``[lab]`` extra says which extra to install."""

import importlib
import sys

import pytest


@pytest.mark.parametrize("absent", ["plotly", "ipywidgets"])
def test_importing_the_lab_without_its_extra_names_the_extra(monkeypatch, absent):
    for name in [m for m in sys.modules if m == "fa_lab.lab" or m.startswith("fa_lab.lab.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, absent, None)   # as if not installed
    with pytest.raises(ImportError, match=rf"fa_lab\.lab needs {absent}\b.*"
                                          r"pip install 'fa_lab\[lab\]'"):
        importlib.import_module("fa_lab.lab")
