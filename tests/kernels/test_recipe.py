"""docs/architecture.md's recipe for a kernel family, followed to the letter.

The recipe's code blocks are taken from the doc itself, so the doc and the code cannot
drift: a toy family is built from them in a temporary folder, registered as the
``_PACKAGES`` line registers a family (``fa_lab.kernels.register``), and must then route
with ``kernel="toy"``, refuse what it lacks by name, and match an fp64 reference under
every policy value its capabilities claim."""

from __future__ import annotations

import math
import re
import sys
from pathlib import Path

import pytest
import torch

import fa_lab
from fa_lab import dispatch, kernels
from fa_lab.policies import DEFAULT_REBASE_BOUND, Policy

ROOT = Path(__file__).resolve().parents[2]


def recipe() -> dict:
    """The recipe's steps: {"count": files it says, "files": {path: code}, "line": the
    ``_PACKAGES`` line}, '<name>' left in."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text.split("**Add a kernel family", 1)[1].split("\n**Add a ", 1)[0]
    count = int(re.match(r": (\d+) files", section).group(1))
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    paths = list(dict.fromkeys(re.findall(r"`(kernels/<name>/\w+\.py)`", section)))
    assert len(blocks) == len(paths) + 1, (paths, len(blocks))
    assert "`_PACKAGES` in `kernels/__init__.py`" in section
    return {"count": count, "files": dict(zip(paths, blocks)), "line": blocks[-1].rstrip("\n")}


def test_the_recipe_counts_its_files():
    r = recipe()
    assert r["count"] == len(r["files"]) + 1  # the new files and kernels/__init__.py
    assert set(r["files"]) == {"kernels/<name>/__init__.py", "kernels/<name>/model.py"}


def test_the_packages_line_is_how_the_families_are_registered():
    """The doc's line, for a family already there, is a line of ``_PACKAGES``; each such
    line registers ``fa_lab.kernels.<name>``."""
    r = recipe()
    source = (ROOT / "kernels" / "__init__.py").read_text()
    packages = source.split("_PACKAGES = (", 1)[1].split(")", 1)[0]
    for name in kernels._PACKAGES:
        assert r["line"].replace("<name>", name) in packages.splitlines(), name
        assert kernels.PACKAGES[name] == f"fa_lab.kernels.{name}"
        assert kernels.FAMILIES[name].name == name


@pytest.fixture
def toy(tmp_path, monkeypatch):
    """The recipe's family, written under ``tmp_path/toy`` and registered; removed after."""
    for path, code in recipe()["files"].items():
        target = tmp_path / path.replace("kernels/<name>/", "toy/")
        target.parent.mkdir(exist_ok=True)
        target.write_text(code.replace("<name>", "toy"))
    monkeypatch.syspath_prepend(str(tmp_path))
    family = kernels.register("toy")
    try:
        yield family
    finally:
        kernels.unregister("toy")
        for name in [m for m in sys.modules if m == "toy" or m.startswith("toy.")]:
            del sys.modules[name]


def fp64_attention(q, k, v, causal: bool):
    """Softmax attention in fp64, bottom-right causal, GQA; [B, S, H, D] in and out."""
    B, Sq, H, D = q.shape
    Skv, Hkv = k.shape[1], k.shape[2]
    qd, kd, vd = (t.double().transpose(1, 2) for t in (q, k, v))
    kd, vd = (t.repeat_interleave(H // Hkv, dim=1) for t in (kd, vd))
    s = qd @ kd.transpose(-1, -2) / math.sqrt(D)
    if causal:
        i = torch.arange(Sq)[:, None] + (Skv - Sq)
        s = s.masked_fill(torch.arange(Skv)[None, :] > i, float("-inf"))
    return (torch.softmax(s, -1) @ vd).transpose(1, 2)


def claimed_policies(caps) -> list[Policy]:
    """One policy per (vote, rebase) pair the capabilities claim."""
    return [Policy(vote, rebase, name=f"claimed_{vote}_{rebase}",
                   rebase_bound=DEFAULT_REBASE_BOUND if rebase == "capped" else None)
            for vote in sorted(caps.votes) for rebase in sorted(caps.rebases)]


def check_conforms(family, *, backend="emulator") -> int:
    """Every policy value the family's model claims, causal and not, through
    ``flash_attn_func(kernel=...)``, against the fp64 reference; returns the runs made."""
    g = torch.Generator().manual_seed(7)
    q = torch.randn(2, 80, 4, 64, generator=g).to(torch.bfloat16)  # (every causal row sees a key)
    k, v = (torch.randn(2, 96, 2, 64, generator=g).to(torch.bfloat16) for _ in range(2))
    runs = 0
    for policy in claimed_policies(family.caps("model")):
        for causal in (False, True):
            out = fa_lab.flash_attn_func(q, k, v, causal=causal, rescale=policy,
                                         kernel=family.name, backend=backend)
            want = fp64_attention(q, k, v, causal)
            err = (out.double() - want).abs().max().item()
            assert err <= 2 ** -7 * want.abs().max().item(), (family.name, policy.describe(), causal, err)
            runs += 1
    return runs


def test_the_recipes_family_routes_and_conforms(toy):
    assert toy.name == "toy" and not toy.upstream
    assert "toy" in dispatch.ROUTED and "toy" not in dispatch.UPSTREAM
    assert ("toy", "emulator") in dispatch.TABLE and ("toy", "interpret") not in dispatch.TABLE
    q = torch.randn(1, 64, 2, 64).to(torch.bfloat16)
    plan = fa_lab.api.plan(q, q, q, kernel="toy")
    assert plan.family == "toy" and plan.backend == "emulator" and plan.call.policy.name == "eager"
    assert check_conforms(toy) == 2
    # upstream's routing never picks it
    assert fa_lab.api.plan(q, q, q).family != "toy"


def test_the_recipes_family_passes_the_conformance_test(toy):
    """The conformance test (``tests/kernels/_conformance.py``) picks the toy family up
    with no edit: every (implementation, value, feature) its Caps claim, checked."""
    sys.path.insert(0, str(Path(__file__).parent))
    import _conformance as C

    claims = C.claims({"toy": toy})
    assert {(c.impl, c.field, c.value, c.feature) for c in claims} == {
        ("model", "vote", "tile", None), ("model", "rebase", "max", None)}
    for claim in claims:
        C.check(claim)


def test_the_recipes_family_refuses_what_it_lacks(toy):
    q = torch.randn(1, 64, 2, 64).to(torch.bfloat16)
    with pytest.raises(ValueError, match="backend='interpret' has no toy kernel"):
        fa_lab.flash_attn_func(q, q, q, kernel="toy", backend="interpret")
    with pytest.raises(ValueError, match=r"kernel='toy' has no rescale='lazy'.*vote='wave'"):
        fa_lab.flash_attn_func(q, q, q, kernel="toy", rescale="lazy")
    with pytest.raises(ValueError, match="kernel='toy' folds in no sink"):
        fa_lab.flash_attn_func(q, q, q, kernel="toy", sink=torch.zeros(2))
    with pytest.raises(ValueError, match="does not take float8_e4m3fn"):
        q8 = torch.zeros(1, 64, 2, 128, dtype=torch.float8_e4m3fn)
        fa_lab.flash_attn_func(q8, q8, q8, kernel="toy", q_descale=1.0, k_descale=1.0, v_descale=1.0)
    # its model's own entry point checks what a direct caller hands it
    model = kernels.module("toy", "model")
    with pytest.raises(ValueError, match="vote='wave'"):
        model.forward(q, q, q, causal=True, policy=fa_lab.policies.get("lazy"))


def test_a_family_that_lies_about_a_value_fails_the_check(toy, monkeypatch):
    """``check_conforms`` fails, naming the family and the policy, on a family whose model
    claims a value it does not run (the toy's model ignores the rebase; claiming a lazy
    vote it runs as eager is still exact, so the lie is a wrong output)."""
    model = kernels.module("toy", "model")
    real = model.forward

    def wrong(q, k, v, *, causal, policy):
        out, lse = real(q, k, v, causal=causal, policy=policy)
        return out * 1.5, lse

    monkeypatch.setattr(model, "forward", wrong)
    with pytest.raises(AssertionError, match="toy"):
        check_conforms(toy)


def test_register_refuses_a_package_that_names_another_family(tmp_path, monkeypatch):
    (tmp_path / "misnamed").mkdir()
    (tmp_path / "misnamed" / "__init__.py").write_text(
        recipe()["files"]["kernels/<name>/__init__.py"].replace("<name>", "other"))
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ImportError, match="declares a family named 'other'"):
        kernels.register("misnamed")
    assert "misnamed" not in kernels.FAMILIES and "other" not in kernels.FAMILIES
    sys.modules.pop("misnamed", None)
