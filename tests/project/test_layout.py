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
              "fa_lab.results", "fa_lab.capabilities", "fa_lab.varlen", "fa_lab.routing",
              "fa_lab.semantics"}),
    ("kernels", {"fa_lab.kernels"}),
    ("core", {"fa_lab.dispatch", "fa_lab.api", "fa_lab.compare", "fa_lab.flydsl",
              "fa_lab.counters", "fa_lab.mla"}),
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


def test_imports_run_one_way_through_the_layers():
    mods = modules()
    for m, p in mods.items():
        for t in imports(m, p, mods):
            assert layer(t) <= layer(m), (f"{m} ({LAYERS[layer(m)][0]}) imports {t} "
                                          f"({LAYERS[layer(t)][0]})")
    # the timers the kernels' tuners share with the benchmark import nothing of fa_lab's
    assert not {t for t in imports("fa_lab.timing", mods["fa_lab.timing"], mods)
                if t.startswith("fa_lab")}


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
