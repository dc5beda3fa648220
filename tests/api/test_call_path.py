"""One call's path from ``flash_attn_func`` to the model's ``forward``, counted.

A call is checked once, routed once, its policy and upstream version resolved once into a
``dispatch.Plan``, and run as planned: the Python calls on the way stay few, no family is
named in ``api``/``dispatch``, and the path docs/architecture.md shows ("A call, end to
end") is the path the code takes."""

from __future__ import annotations

import re
import sys
import warnings
from pathlib import Path

import pytest
import torch

import fa_lab
from fa_lab.kernels.swp_bf16 import model as swp_bf16_model

ROOT = Path(__file__).resolve().parents[2]
#: The most Python calls (every Python function entered, the standard library's and the
#: dataclasses' generated methods included) from entering ``flash_attn_func`` to entering
#: the model's ``forward``.
MAX_CALLS = 40


def calls_until(fn, target) -> list[tuple[str, str]]:
    """(file, function) of every Python function entered while ``fn()`` runs, from its
    start until ``target`` (a function) is entered; ``fn`` itself excluded."""
    seen: list[tuple[str, str]] = []
    done = []

    def profile(frame, event, arg):
        if done or event != "call":
            return
        if frame.f_code is target.__code__:
            done.append(True)
            return
        seen.append((frame.f_code.co_filename, frame.f_code.co_name))

    old = sys.getprofile()
    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(old)
    assert done, f"{target.__qualname__} was never entered"
    return seen[1:]  # (the lambda)


def _the_call():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 512, 2, 64, generator=g).to(torch.bfloat16) for _ in range(3))
    call = lambda: fa_lab.flash_attn_func(q, k, v, rescale="lazy_unfixed", backend="emulator")  # noqa: E731
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        call()  # the first call imports the model and fills the caches
    return call


def _project(seen):
    """The calls into fa_lab's own modules (fa_lab/, kernels/), as (module path, name)."""
    out = []
    for file, name in seen:
        path = Path(file)
        for top in ("fa_lab", "kernels"):
            if (ROOT / top) in path.parents:
                out.append((path.relative_to(ROOT).as_posix(), name))
    return out


def test_a_call_reaches_the_model_in_at_most_40_python_calls():
    call = _the_call()
    seen = calls_until(call, swp_bf16_model.forward)
    assert len(seen) <= MAX_CALLS, "\n".join(f"{f}:{n}" for f, n in seen)
    names = [n for _, n in _project(seen)]
    # the policy is looked up once, resolved once; the upstream version looked up once
    assert names.count("as_policy") + names.count("get") <= 2, names
    assert names.count("resolve") == 1 and names.count("_route") == 1, names


def test_the_counter_counts():
    """``calls_until`` sees nested Python calls and stops at the target."""
    def leaf():
        return 1

    def middle():
        return leaf() + leaf()

    def top():
        middle()
        return target()

    def target():
        leaf()

    assert [n for _, n in calls_until(lambda: top(), target)] == ["top", "middle", "leaf", "leaf"]


def _doc_path() -> list[str]:
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text.split("## A call, end to end", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```text\n(.*?)```", section, re.S).group(1)
    return [line.split("#")[0].strip() for line in block.splitlines() if line.split("#")[0].strip()]


def test_the_documented_path_is_the_path_taken():
    """Every function docs/architecture.md lists (module:function, in order) is entered in
    that order on the way to the model, and every fa_lab module entered is listed."""
    call = _the_call()
    seen = _project(calls_until(call, swp_bf16_model.forward))
    taken = [f"{path.removesuffix('.py').replace('/', '.')}:{name}" for path, name in seen]
    listed = _doc_path()
    assert listed, "docs/architecture.md lists no path"
    i = 0
    for step in listed:
        assert step in taken[i:], f"{step} (docs/architecture.md) is not taken after {taken[:i][-1:]}"
        i = taken.index(step, i) + 1
    modules = {t.split(":")[0] for t in taken}
    assert modules <= {s.split(":")[0] for s in listed}, modules - {s.split(":")[0] for s in listed}


def test_api_and_dispatch_name_no_family():
    pattern = re.compile(r"""["'](swp_bf16|swp_fp8|generic|swa|online)["']""")
    for f in ("fa_lab/api.py", "fa_lab/dispatch.py"):
        hits = [i for i, line in enumerate((ROOT / f).read_text().splitlines(), 1) if pattern.search(line)]
        assert not hits, f"{f}: {hits}"


def test_the_model_runs_the_plan_without_checking_again(monkeypatch):
    """The model's own entry point checks a policy it is handed directly, once; a planned
    call's policy is already checked for that family and implementation."""
    from fa_lab import capabilities, policies

    checked = []
    real = capabilities.semantics_refusal

    def spy(*a, **kw):
        checked.append(a[2])
        return real(*a, **kw)

    monkeypatch.setattr(capabilities, "semantics_refusal", spy)
    q = torch.randn(1, 512, 2, 64).to(torch.bfloat16)
    policy = policies.Policy("wave", "max", name="fresh_for_this_test")
    fa_lab.flash_attn_func(q, q, q, rescale=policy, backend="emulator")
    assert checked == []  # (no semantics field set: the plan checked the fields, not the model)
    planned = fa_lab.api.plan(q, q, q, rescale=policy, backend="emulator")
    assert ("swp_bf16", "model") in capabilities.cleared(planned.call.policy)
    odd = policies.get("trtllm_neg_inf:before")  # semantics fields of its own
    with pytest.raises(ValueError, match="only the online-softmax family runs"):
        swp_bf16_model.forward(q, q, q, causal=True, policy=odd)
    assert len(checked) == 1
