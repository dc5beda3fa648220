"""The kernel families: each registered family declares itself and dispatch's table follows;
adding a family is its folder and one line in ``kernels/__init__.py``."""

from __future__ import annotations

import pytest
import filecmp
import os
import shutil
import subprocess
import sys
import textwrap
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


TOY_INIT = '''\
"""A toy family: the textbook online softmax, eager, exact (a test's)."""

from fa_lab.capabilities import HALF, Caps, Family, Implementation

FAMILY = Family("toy", "the textbook online softmax",
                {"model": Implementation("model", Caps(HALF, (64, 128), frozenset(),
                                                       frozenset({"tile"}), frozenset({"max"})))})
'''
TOY_MODEL = '''\
"""The textbook softmax attention in fp32 (fa_lab's reference), [B, S, H, D] in and out."""

from fa_lab import reference


def forward(q, k, v, *, causal, policy, recorder=None):
    out, lse = reference.attention(q, k, v, causal=causal)
    return out.to(q.dtype), lse
'''


@pytest.mark.slow
def test_a_new_family_is_a_folder_and_one_line(tmp_path):
    """A copy of kernels/ with one folder added and one line in ``_PACKAGES``: fa_lab routes
    ``kernel="toy"`` to it through dispatch, resolves the policy for it (eager: the toy
    runs no other), and gets the reference's answer."""
    kernels = tmp_path / "kernels"
    shutil.copytree(ROOT / "kernels", kernels, ignore=shutil.ignore_patterns("__pycache__"))
    (kernels / "toy").mkdir()
    (kernels / "toy" / "__init__.py").write_text(TOY_INIT)
    (kernels / "toy" / "model.py").write_text(TOY_MODEL)
    init = kernels / "__init__.py"
    text = init.read_text()
    assert text.count('    "swa",\n') == 1
    init.write_text(text.replace('    "swa",\n', '    "swa",\n    "toy",\n'))
    # what changed against kernels/: the folder, and one added line
    cmp = filecmp.dircmp(ROOT / "kernels", kernels, ignore=["__pycache__"])
    assert cmp.right_only == ["toy"] and cmp.diff_files == ["__init__.py"]
    old, new = (p.read_text().splitlines() for p in (ROOT / "kernels" / "__init__.py", init))
    assert len(new) == len(old) + 1 and [x for x in new if x not in old] == ['    "toy",']

    links = tmp_path / "links" / "fa_lab"
    links.mkdir(parents=True)
    for entry in (ROOT / "fa_lab").iterdir():
        if entry.name != "__pycache__":
            (links / entry.name).symlink_to(entry)
    (links / "kernels").symlink_to(kernels)
    script = textwrap.dedent('''
        import torch, fa_lab
        from fa_lab import dispatch, reference
        assert ("toy", "emulator") in dispatch.TABLE and "toy" in dispatch.ROUTED
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(1, 96, 2, 64, generator=g).to(torch.bfloat16) for _ in range(3))
        plan = fa_lab.api.plan(q, k, v, kernel="toy", causal=True)
        assert plan.family == "toy" and plan.call.policy.name == "eager", plan
        out = fa_lab.flash_attn_func(q, k, v, kernel="toy", causal=True)
        ref, _ = reference.attention(q, k, v, causal=True)
        assert torch.equal(out, ref.to(q.dtype))
        try:
            fa_lab.flash_attn_func(q, k, v, kernel="toy", backend="interpret")
        except ValueError as e:
            assert "has no toy kernel" in str(e), e
        else:
            raise AssertionError("a backend the family lacks ran")
        print("ok")
    ''')
    env = {**os.environ, "PYTHONPATH": str(links.parent)}
    r = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                       cwd=tmp_path)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


def test_dispatch_table_is_the_families_implementations():
    for (family, backend), e in dispatch.TABLE.items():
        assert e.impl == dispatch.IMPLEMENTATION[backend]
        assert e.impl in FAMILIES[family].implementations
    assert dispatch.ROUTED == tuple(n for n, f in FAMILIES.items() if f.routed)
