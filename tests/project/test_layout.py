"""The package's shape: imports run one way, a policy is read through its fields, and
fa_lab's kernels cannot be taken for FlyDSL's ``kernels`` package."""

import ast
import io
import re
import tokenize
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def modules() -> dict[str, Path]:
    """Module name -> file, for fa_lab/ and kernels/ (installed as fa_lab.kernels)."""
    out = {}
    for top, pkg in ((ROOT / "fa_lab", "fa_lab"), (ROOT / "kernels", "fa_lab.kernels")):
        for f in top.rglob("*.py"):
            parts = list(f.relative_to(top).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join([pkg, *parts])] = f
    return out


def imports(name: str, path: Path, known) -> set[str]:
    """The fa_lab modules ``name`` imports anywhere in its file (functions included)."""
    is_pkg = path.name == "__init__.py"
    package = name if is_pkg else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package
            for _ in range(node.level - 1):
                base = base.rpartition(".")[0]
            mod = node.module or ""
            root = f"{base}.{mod}".strip(".") if node.level else mod
            subs = [f"{root}.{a.name}" for a in node.names]
            targets = [t for t in subs if t in known] or [root]
        else:
            continue
        for t in targets:
            while t and t not in known:
                t = t.rpartition(".")[0]
            if t and t != name and not name.startswith(t + "."):  # a package's own parents
                found.add(t)
    return found


def test_no_import_cycles():
    mods = modules()
    graph = {m: imports(m, p, mods) for m, p in mods.items()}
    # packages' __init__ re-exports are edges too; a cycle is a path back to the start
    cycles = []

    def visit(node, stack, seen):
        for nxt in graph[node]:
            if nxt == stack[0]:
                cycles.append(stack + [nxt])
            elif nxt not in seen and nxt > stack[0]:
                seen.add(nxt)
                visit(nxt, stack + [nxt], seen)

    for m in sorted(graph):
        visit(m, [m], {m})
    # fa_lab/__init__ is imported by every fa_lab.x (Python imports parents first), so
    # edges into it from its own re-exports are not cycles of the source's making
    cycles = [c for c in cycles if "fa_lab" not in c]
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles[:10])


#: fa_lab's layers, bottom up: a module imports from its own layer and the ones below only.
#: The base is what the kernel families are written in; the core routes and runs calls;
#: studies are built on the core; the lab (figures, dashboards) on the studies; the CLI and
#: the package's own ``__init__`` on everything.
LAYERS = (
    ("base", {"fa_lab.numerics", "fa_lab.checks", "fa_lab.policies", "fa_lab.upstream",
              "fa_lab.trace", "fa_lab.timing", "fa_lab.reference", "fa_lab.metrics",
              "fa_lab.results", "fa_lab.capabilities", "fa_lab.varlen", "fa_lab.paged", "fa_lab.routing",
              "fa_lab.semantics", "fa_lab.values"}),
    ("kernels", {"fa_lab.kernels"}),
    ("core", {"fa_lab.dispatch", "fa_lab.api", "fa_lab.compare", "fa_lab.flydsl", "fa_lab.decode",
              "fa_lab.mla", "fa_lab.counters", "fa_lab.autograd", "fa_lab.sdpa"}),
    ("studies", {"fa_lab.studies", "fa_lab.zoo"}),
    ("lab", {"fa_lab.lab"}),
    ("top", {"fa_lab.cli", "fa_lab.__main__", "fa_lab"}),
)


def layer(module: str) -> int:
    """The index in ``LAYERS`` of the module (a member, or inside a member package)."""
    for i, (_, members) in enumerate(LAYERS):
        if any(module == m or module.startswith(m + ".") for m in members if m != "fa_lab"):
            return i
    if module == "fa_lab":
        return len(LAYERS) - 1
    raise AssertionError(f"{module} belongs to no layer: add it to LAYERS")


def through_faces(m: str, graph: dict) -> set[str]:
    """What importing ``m`` imports, seen through package faces: its own imports; for
    each, the packages above it (their ``__init__`` runs first; not ``m``'s own parents,
    nor the top ``fa_lab``, which every module has) and what those ``__init__`` files
    import, and so on. ``import fa_lab`` (or ``from fa_lab import <a name>``) itself counts
    as importing what ``fa_lab/__init__`` imports."""
    own = {m.rsplit(".", i)[0] for i in range(1, m.count(".") + 1)}
    seen: set[str] = set()
    todo = list(graph[m])
    while todo:
        t = todo.pop()
        if t in seen or t == m:
            continue
        seen.add(t)
        parents = [t.rsplit(".", i)[0] for i in range(1, t.count(".") + 1)]
        for pkg in [t, *parents]:
            if pkg in graph and (pkg == t or pkg not in own and pkg != "fa_lab"):
                if pkg not in seen:
                    todo.append(pkg)
                todo.extend(graph[pkg])
    return seen


def test_imports_run_one_way_through_the_layers():
    mods = modules()
    graph = {m: imports(m, p, mods) for m, p in mods.items()}
    for m in mods:
        for t in through_faces(m, graph):
            assert layer(t) <= layer(m), (f"{m} ({LAYERS[layer(m)][0]}) imports {t} "
                                          f"({LAYERS[layer(t)][0]}), directly or through a "
                                          "package's __init__")
    # the timers the kernels' tuners share with the benchmark import nothing of fa_lab's
    assert not {t for t in imports("fa_lab.timing", mods["fa_lab.timing"], mods)
                if t.startswith("fa_lab")}


def test_faces_count(tmp_path):
    """``through_faces`` sees an import through a package's ``__init__`` and through
    ``import fa_lab``: the layer check cannot be dodged that way."""
    graph = {"fa_lab": {"fa_lab.api", "fa_lab.zoo"}, "fa_lab.api": set(), "fa_lab.zoo": set(),
             "fa_lab.studies": {"fa_lab.zoo"}, "fa_lab.studies.x": set(),
             "fa_lab.dispatch": {"fa_lab"}, "fa_lab.compare": {"fa_lab.studies.x"},
             "fa_lab.counters": {"fa_lab.api"}}
    assert "fa_lab.zoo" in through_faces("fa_lab.dispatch", graph)
    assert "fa_lab.zoo" in through_faces("fa_lab.compare", graph)
    assert through_faces("fa_lab.counters", graph) == {"fa_lab.api"}


def test_the_core_never_imports_the_zoo():
    """The zoo's presets register themselves when the policy registry first needs them
    (``policies.PRESET_MODULES``); nothing below the studies imports the zoo, even through
    a package's ``__init__``, and a fresh interpreter that imports fa_lab and runs a call
    has not loaded it."""
    mods = modules()
    graph = {m: imports(m, p, mods) for m, p in mods.items()}
    for m in mods:
        if layer(m) < layer("fa_lab.studies"):
            assert "fa_lab.zoo" not in through_faces(m, graph), m


@pytest.mark.slow
def test_a_call_does_not_load_the_zoo_until_a_preset_is_named():
    """A fresh interpreter that imports fa_lab and runs a call has not loaded the zoo; naming
    a preset loads it (``policies.PRESET_MODULES``)."""
    script = ("import sys, torch, fa_lab\n"
              "q = torch.zeros(1, 64, 1, 64, dtype=torch.bfloat16)\n"
              "fa_lab.flash_attn_func(q, q, q, backend='emulator')\n"
              "assert 'fa_lab.zoo' not in sys.modules, 'a plain call imported the zoo'\n"
              "fa_lab.flash_attn_func(q, q, q, backend='emulator', rescale='trtllm_neg_inf:before')\n"
              "assert 'fa_lab.zoo' in sys.modules\n"
              "print('ok')")
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


def test_the_ports_are_reached_through_dispatch():
    """Outside a family, only dispatch (and the benchmark, which times kernels alone)
    imports its Triton ports; its model and the shared geometry are free to use."""
    mods = modules()
    free = re.compile(r"fa_lab\.kernels(\.(?!_triton)\w+(\.model)?|\._common\.\w+)?$")
    for m, p in mods.items():
        if m.startswith("fa_lab.kernels"):
            continue
        ports = {t for t in imports(m, p, mods) if t.startswith("fa_lab.kernels") and not free.match(t)}
        assert not ports or m in ("fa_lab.dispatch", "fa_lab.studies.bench"), (m, ports)


def test_no_policy_name_comparisons_outside_policies():
    pattern = re.compile(r"policy\.name *(==|!=|in )|\.get\(policy\.name|POLICY_CODES|REBASE_RULES")
    for f in [*(ROOT / "fa_lab").rglob("*.py"), *(ROOT / "kernels").rglob("*.py")]:
        if f.name == "policies.py":
            continue
        hits = [i for i, line in enumerate(f.read_text().splitlines(), 1) if pattern.search(line)]
        assert not hits, f"{f.relative_to(ROOT)}:{hits}"


def test_no_sys_modules_injection():
    # fa_lab's modules load under their own names only (flydsl.py imports FlyDSL's own
    # ``kernels`` package by its name, which is not an injection of ours)
    for f in (ROOT / "fa_lab").rglob("*.py"):
        assert not re.search(r"sys\.modules\[[^]]*fa_lab", f.read_text()), f


#: What a docstring or comment must not hold: a device measurement (results files, a
#: named GPU's behaviour, throughput or speed-up figures). Numbers live in data/ and
#: docs/performance.md; code states semantics and why.
MEASUREMENT = re.compile(
    r"data/results/\w+\.json|\w+_h[12]00\.json|measured on|\b(on|an|the) H[12]00\b|H[12]00's"
    r"|\d+(\.\d+)? ?TFLOP/s|\d+(\.\d+)? ?% (faster|slower|cost|saving)|\d+(\.\d+)?x (faster|slower)")


def prose(path: Path):
    """(line, text) of every docstring line and comment of a Python file."""
    src = path.read_text()
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc:
                for i, line in enumerate(doc.splitlines()):
                    yield node.body[0].lineno + i, line
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type == tokenize.COMMENT:
            yield tok.start[0], tok.string


def test_docstrings_and_comments_state_semantics_not_measurements():
    hits = [f"{f.relative_to(ROOT)}:{n}: {t.strip()}"
            for f in [*(ROOT / "kernels").rglob("*.py"), *(ROOT / "fa_lab").rglob("*.py")]
            for n, t in prose(f) if MEASUREMENT.search(t)]
    assert not hits, "\n".join(hits)


def test_the_measurement_pattern_catches_what_it_is_for():
    for text in ("(data/results/probe_faithful_h200.json)", "measured on an H200, 19 rows",
                 "on an H200 BLOCK_M 128 spills", "reaches 640 TFLOP/s", "3.5 % faster",
                 "1.4x slower"):
        assert MEASUREMENT.search(text), text
    for text in ("samples the clock every 50 ms", "0.001 % .. 100 % colour scale",
                 "the measured NaN share", "a Hopper GPU's multiprocessors"):
        assert not MEASUREMENT.search(text), text


@pytest.mark.parametrize("stmt", ["import kernels", "import kernels.swp_bf16.faithful"])
def test_the_kernels_folder_is_not_a_top_level_package(stmt):
    r = subprocess.run([sys.executable, "-c", stmt], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode != 0 and "fa_lab.kernels" in r.stderr
