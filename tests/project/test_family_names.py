"""``fa_lab/api.py`` and ``fa_lab/dispatch.py`` name no kernel family: what a call needs of
a family is on its ``Family`` (its rule, its ``Caps``, its notes, its entry-point check),
found through the registry by what it declares, so a family is added or renamed without
touching them (docs/architecture.md, "A call, end to end").

The names are the registered families' (``fa_lab.kernels.FAMILIES``), never a list kept
here. A name counts as an import (a module path or an imported name), an attribute, a
variable, or a word in a string literal (f-strings' literal parts included); docstrings
and other bare string statements are documentation and are not read.
"""

import ast
import re
from pathlib import Path

import pytest

from fa_lab.kernels import FAMILIES

ROOT = Path(__file__).resolve().parents[2]
FILES = ("fa_lab/api.py", "fa_lab/dispatch.py")
_WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _docstrings(tree) -> set[int]:
    """ids of the string constants that are documentation: bare string statements."""
    return {id(node.value) for node in ast.walk(tree)
            if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str)}


def family_names(source: str, names) -> list[tuple[int, str, str]]:
    """(line, how, name) for each place ``source`` names one of ``names``."""
    names = set(names)
    tree = ast.parse(source)
    docs = _docstrings(tree)
    found = []
    for node in ast.walk(tree):
        hits = []
        if isinstance(node, ast.Import):
            hits = [("import", n) for a in node.names for n in a.name.split(".") if n in names]
        elif isinstance(node, ast.ImportFrom):
            parts = (node.module or "").split(".") + [a.name for a in node.names]
            hits = [("import", n) for n in parts if n in names]
        elif isinstance(node, ast.Attribute) and node.attr in names:
            hits = [("attribute", node.attr)]
        elif isinstance(node, ast.Name) and node.id in names:
            hits = [("name", node.id)]
        elif (isinstance(node, ast.Constant) and isinstance(node.value, str)
              and id(node) not in docs):
            hits = [("string", w) for w in _WORD.findall(node.value) if w in names]
        found += [(node.lineno, how, n) for how, n in hits]
    return sorted(set(found))


@pytest.mark.parametrize("path", FILES)
def test_the_core_names_no_family(path):
    assert FAMILIES, "no family is registered"
    hits = family_names((ROOT / path).read_text(), FAMILIES)
    assert not hits, f"{path} names kernel families (line, how, name): {hits}"


def test_every_way_of_naming_a_family_is_caught():
    """The scan finds a family named as an import, an attribute, a variable and a string
    (an f-string's literal part too), and passes over docstrings and longer words."""
    source = '''
"""The module's docstring names toy."""
from fa_lab.kernels import toy
import fa_lab.kernels.toy.model
from fa_lab.kernels.toy.model import check
x = kernels.toy
y = toy
z = FAMILIES["toy"]
w = f"kernel='toy' on {x}"
ok = "toy_box and a_toy are other words"


def f():
    """A function's docstring names toy."""
'''
    hits = family_names(source, {"toy"})
    assert [(line, how) for line, how, _ in hits] == [
        (3, "import"), (4, "import"), (5, "import"), (6, "attribute"), (7, "name"),
        (8, "string"), (9, "string")]


def test_an_entry_point_finds_its_family_by_the_feature_it_claims(monkeypatch):
    """``dispatch.serving``: the one unrouted family whose model claims the feature (the
    window: the SWA family); none, or two, is an error naming the feature and the families."""
    import dataclasses

    from fa_lab import dispatch

    fam = dispatch.serving("window")
    assert not fam.routed and "window" in fam.caps("model").features
    assert fam.check_args is not None
    with pytest.raises(ValueError, match=r"no unrouted kernel family claim the 'paged' feature"):
        dispatch.serving("paged")
    monkeypatch.setitem(FAMILIES, "toy", dataclasses.replace(fam, name="toy"))
    with pytest.raises(ValueError, match=rf"2 unrouted kernel families claim the 'window' "
                                         rf"feature \({fam.name}, toy\); exactly one must"):
        dispatch.serving("window")


def test_caps_refuse_an_unknown_feature_and_malformed_modes():
    from fa_lab.capabilities import Caps

    args = (frozenset({"bf16"}), (64,))
    with pytest.raises(ValueError, match=r"Caps.features names \['windows'\], which are not "
                                         r"features"):
        Caps(*args, frozenset({"windows"}), frozenset({"tile"}), frozenset({"max"}))
    with pytest.raises(TypeError, match=r"Caps.modes must be a frozenset of \(choice name, "
                                        r"value\) pairs"):
        Caps(*args, frozenset(), frozenset(), frozenset(), modes=frozenset({"per_token"}))
