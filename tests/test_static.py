"""Static checks of names, for code a CPU run never executes: the GPU-only tests and paths,
and the benchmark scripts, most of which run only on a GPU. A renamed function, a name
never defined or a stale import would otherwise first fail on a lent device, in its limited
time.

* pyflakes' rules (``ruff check``, its F rules, as ``[tool.ruff]`` in pyproject.toml sets)
  over the package, the kernels, the tests, the benchmarks and the notebooks;
* for each benchmark script, every name it imports (from fa_lab, a third-party package or a
  sibling script) and every attribute it reads off an imported module, which pyflakes does
  not follow."""

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
#: what ``ruff check`` reads (the project's Python and its lessons)
LINTED = ("fa_lab", "kernels", "tests", "benchmarks", "notebooks")
SCRIPTS = sorted(BENCH.glob("*.py"))


def _sibling_names(name: str, where: Path) -> set[str] | None:
    """The top-level names the script ``name`` in ``where`` defines (read, not run: importing
    one may start its measurement), or None if there is no such script."""
    path = where / f"{name}.py"
    if not path.is_file():
        return None
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return names


class _Module:
    """A module a script binds to a name: a real one, or a sibling script's top-level names."""

    def __init__(self, name: str, where: Path):
        self.name = name
        self.sibling = _sibling_names(name, where)
        self.module = None if self.sibling is not None else importlib.import_module(name)

    def has(self, attr: str) -> bool:
        if self.sibling is not None:
            return attr in self.sibling
        if hasattr(self.module, attr):
            return True
        try:  # a submodule that nothing has imported yet
            importlib.import_module(f"{self.name}.{attr}")
            return True
        except ModuleNotFoundError:
            return False

    def is_module(self, attr: str) -> bool:
        if self.sibling is not None:
            return False
        return isinstance(getattr(self.module, attr, None), type(importlib)) or (
            not hasattr(self.module, attr) and self.has(attr))


def unresolved(path: Path) -> list[str]:
    """``line: what`` for each imported name and module attribute of ``path`` that does not
    exist."""
    tree, where = ast.parse(path.read_text(), filename=str(path)), path.parent
    bound: dict[str, _Module] = {}  # a name -> the module it is bound to
    missing = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                top = a.asname or a.name.split(".")[0]
                try:
                    bound[top] = _Module(a.name if a.asname else top, where)
                    if not a.asname:
                        _Module(a.name, where)  # the dotted module itself must import
                except ModuleNotFoundError as e:
                    missing.append(f"{node.lineno}: import {a.name} ({e})")
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                missing.append(f"{node.lineno}: a relative import in a script")
                continue
            try:
                src = _Module(node.module, where)
            except ModuleNotFoundError as e:
                missing.append(f"{node.lineno}: from {node.module} ({e})")
                continue
            for a in node.names:
                if not src.has(a.name):
                    missing.append(f"{node.lineno}: from {node.module} import {a.name}")
                elif src.is_module(a.name):
                    bound[a.asname or a.name] = _Module(f"{node.module}.{a.name}", where)
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                and node.value.id in bound and not bound[node.value.id].has(node.attr)):
            missing.append(f"{node.lineno}: {node.value.id}.{node.attr} "
                           f"({bound[node.value.id].name} has no {node.attr})")
    return missing


def ruff(*paths) -> subprocess.CompletedProcess:
    """``ruff check`` of ``paths`` (relative to the checkout) with the project's settings."""
    return subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format",
                           "concise", *map(str, paths)], cwd=ROOT, capture_output=True, text=True)


def test_pyflakes_rules_hold_over_the_tree():
    r = ruff(*LINTED)
    assert r.returncode == 0, r.stdout + r.stderr


def test_the_lint_finds_an_undefined_name_and_an_unused_import(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import os\n\ndef f():\n    return undefined_name\n")
    out = ruff(bad).stdout
    assert "F401" in out and "F821" in out and "undefined_name" in out


@pytest.mark.parametrize("path", SCRIPTS, ids=[p.name for p in SCRIPTS])
def test_every_name_a_benchmark_script_reads_exists(path):
    assert unresolved(path) == []


def test_the_check_finds_a_missing_name_an_import_and_a_sibling_name(tmp_path):
    (tmp_path / "helper.py").write_text("def there():\n    pass\nCONST = 1\n")
    script = tmp_path / "s.py"
    script.write_text(
        "import helper\nfrom fa_lab import bench, timing\nfrom fa_lab.kernels.swp_fp8 import fast as f8\n"
        "from fa_lab.timing import measure, no_such_function\nimport fa_lab.no_such_module\n"
        "helper.there(); helper.CONST; helper.gone\nbench.SHAPES; bench.NO_SUCH\n"
        "timing.CudaTimer; f8.forward; f8.TransposedV; f8.no_such\n")
    assert unresolved(script) == [
        "4: from fa_lab.timing import no_such_function",
        "5: import fa_lab.no_such_module (No module named 'fa_lab.no_such_module')",
        "6: helper.gone (helper has no gone)",
        "7: bench.NO_SUCH (fa_lab.bench has no NO_SUCH)",
        "8: f8.no_such (fa_lab.kernels.swp_fp8.fast has no no_such)",
    ]
