"""The API reference (docs/api.md): every public name has a page, and the examples on the
main entry points' pages run and print what they say.

The examples are doctests in the docstrings (a NumPy-style Examples section); the docs
build shows them, and this file runs them at CPU sizes. The pages' Parameters sections
come from the docstrings' Parameters sections or, where a docstring has none, from the
signature (docs/conf.py); a built page is checked by tests/project/test_docs_site.py.
"""

from __future__ import annotations

import doctest
import importlib
import re
from pathlib import Path

import pytest

import fa_lab

REPO = Path(__file__).resolve().parents[2]
API_MD = (REPO / "docs" / "api.md").read_text(encoding="utf-8")
#: The names docs/api.md lists in its autosummary blocks.
LISTED = set(re.findall(r"^   (fa_lab[\w.]*)$", API_MD, flags=re.M))

#: The callables whose pages carry an example, by dotted name.
WITH_EXAMPLES = ["fa_lab.flash_attn_func", "fa_lab.trace", "fa_lab.count_rescales",
                 "fa_lab.compare", "fa_lab.studies.onset.bound", "fa_lab.zoo.get",
                 "fa_lab.studies.experiments.bf16_inputs"]


def _resolve(dotted: str):
    module, _, name = dotted.rpartition(".")
    return getattr(importlib.import_module(module), name)


def test_every_public_name_has_a_page():
    missing = [f"fa_lab.{n}" for n in fa_lab.__all__ if f"fa_lab.{n}" not in LISTED]
    assert not missing, f"docs/api.md lists no page for {missing}"


@pytest.mark.parametrize("dotted", ["fa_lab.zoo", "fa_lab.studies.onset.bound",
                                    "fa_lab.studies.experiments.bf16_inputs", "fa_lab.lab.viz",
                                    "fa_lab.RoutingWarning"])
def test_the_pages_the_issue_names_exist(dotted):
    assert dotted in LISTED


@pytest.mark.slow        # imports the studies and the lab
def test_every_listed_name_imports():
    import importlib.util

    lab = all(importlib.util.find_spec(m) for m in ("plotly", "ipywidgets"))
    for dotted in sorted(LISTED):
        if dotted.startswith("fa_lab.lab") and not lab:   # the lab extra is not installed
            continue
        try:
            importlib.import_module(dotted)
        except ImportError:
            assert _resolve(dotted) is not None, dotted


@pytest.mark.parametrize("dotted", [
    pytest.param(d, marks=pytest.mark.slow) if d == "fa_lab.compare" else d
    for d in WITH_EXAMPLES])
def test_the_example_runs(dotted):
    if dotted == "fa_lab.compare":      # the example compares with the interpreted port
        pytest.importorskip("triton")
    obj = _resolve(dotted)
    assert "Parameters\n    ----------" in obj.__doc__, f"{dotted}: no Parameters section"
    tests = [t for t in doctest.DocTestFinder(recurse=False).find(obj, dotted) if t.examples]
    assert tests, f"{dotted}: no example in its docstring"
    runner = doctest.DocTestRunner(optionflags=doctest.NORMALIZE_WHITESPACE)
    for test in tests:
        runner.run(test)
    result = runner.summarize(verbose=False)
    assert result.failed == 0, f"{dotted}: {result.failed} of {result.attempted} examples failed"


def test_a_wrong_example_fails():
    """The check can fail: an example whose printed value is wrong is counted as failed."""
    parser = doctest.DocTestParser()
    test = parser.get_doctest(">>> 1 + 1\n3\n", {}, "wrong", "wrong", 0)
    runner = doctest.DocTestRunner()
    runner.run(test, out=lambda s: None)
    assert runner.summarize(verbose=False).failed == 1
