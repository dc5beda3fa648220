"""The kernel families: each registered family declares itself and dispatch's table follows
(adding one, the recipe in docs/architecture.md, is tests/kernels/test_recipe.py's)."""

from __future__ import annotations

from pathlib import Path

from fa_lab import capabilities, dispatch
from fa_lab.kernels import FAMILIES

ROOT = Path(__file__).resolve().parents[2]


def test_every_family_folder_is_registered_and_declares_itself():
    folders = {p.name for p in (ROOT / "kernels").iterdir()
               if p.is_dir() and not p.name.startswith("_") and (p / "__init__.py").exists()}
    assert folders == set(FAMILIES)
    for name, fam in FAMILIES.items():
        assert isinstance(fam, capabilities.Family) and fam.name == name
        for kind, impl in fam.implementations.items():
            assert (ROOT / "kernels" / name / f"{impl.module}.py").exists(), (name, kind)


def test_dispatch_table_is_the_families_implementations():
    for (family, backend), e in dispatch.TABLE.items():
        assert e.impl == dispatch.IMPLEMENTATION[backend]
        assert e.impl in FAMILIES[family].implementations
    assert dispatch.ROUTED == tuple(n for n, f in FAMILIES.items() if f.routed)
