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

ROOT = Path(__file__).resolve().parents[2]
#: what ``ruff check`` reads (the project's Python and its lessons)
LINTED = ("fa_lab", "kernels", "tests", "benchmarks", "notebooks")
#: files whose module attributes are followed: the benchmark scripts and the tests (the
#: package's own modules use relative imports and run on the CPU)
FOLLOWED = sorted((ROOT / "benchmarks").glob("*.py")) + sorted((ROOT / "tests").rglob("*.py"))
_ModuleType = type(ast)
#: A comment that marks an import of a module the file itself writes at run time.
RUNTIME = "# made at run time"


class Sibling:
    """A script beside the one checked (``import helper``), read, not run (importing one may
    start its measurement): its top-level names, and what those it imports are bound to."""

    def __init__(self, path: Path):
        self.name, self.names, self.imports = path.stem, set(), {}
        body = list(ast.parse(path.read_text()).body)
        while body:
            node = body.pop(0)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                self.names.add(node.name)
            elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                self.names |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
            elif isinstance(node, ast.Import):
                for a in node.names:
                    self.names.add(a.asname or a.name.split(".")[0])
                    if a.asname:
                        self.imports[a.asname] = a.name
            elif isinstance(node, ast.ImportFrom) and not node.level:
                for a in node.names:
                    self.names.add(a.asname or a.name)
                    self.imports[a.asname or a.name] = f"{node.module}.{a.name}"
            elif isinstance(node, (ast.If, ast.Try, ast.With, ast.For, ast.While)):
                body += [n for f in ("body", "orelse", "finalbody") for n in getattr(node, f, [])]
                body += [n for h in getattr(node, "handlers", []) for n in h.body]


_FRESH: dict[tuple[str, str], bool] = {}


def _fresh_has(module: str, attrs) -> dict[str, bool]:
    """Whether each of ``attrs`` is an attribute of ``module`` right after ``import module``
    in a fresh interpreter (a lazy ``__getattr__`` included): a submodule that its package's
    import does not provide is reachable only through an import of its own, whatever this
    test process has imported. Asked once per module and name."""
    ask = sorted({a for a in attrs if (module, a) not in _FRESH})
    if ask:
        code = (f"import importlib; m = importlib.import_module({module!r}); "
                f"print(' '.join(n for n in {ask!r} if hasattr(m, n)))")
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
        assert r.returncode == 0, r.stderr
        found = set(r.stdout.split())
        _FRESH.update({(module, a): a in found for a in ask})
    return {a: _FRESH[module, a] for a in attrs}


def _import_guarded(tree) -> set[int]:
    """ids of the import statements inside ``try`` blocks that catch ImportError: an import
    that may fail on purpose."""
    guarded = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Try) and any(
                isinstance(h.type, ast.Name) and h.type.id in ("ImportError", "ModuleNotFoundError")
                or isinstance(h.type, ast.Tuple) and any(
                    getattr(e, "id", None) in ("ImportError", "ModuleNotFoundError") for e in h.type.elts)
                for h in node.handlers):
            guarded |= {id(n) for b in node.body for n in ast.walk(b)}
    return guarded


def _stored(node) -> set[str]:
    """Names ``node``'s subtree binds other than by import: assignments, loop and ``with``
    targets, parameters."""
    names = {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and not isinstance(n.ctx, ast.Load)}
    return names | {a.arg for n in ast.walk(node) if isinstance(n, ast.arguments)
                    for a in n.posonlyargs + n.args + n.kwonlyargs + [n.vararg, n.kwarg] if a}


def _shadowed(tree) -> dict:
    """For each node inside a function, the names that function (or one around it) binds
    other than by import; under None, the names the module itself rebinds so."""
    functions = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)
    inside = {id(n) for f in ast.walk(tree) if isinstance(f, functions) for n in ast.walk(f)}
    top = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)
           and not isinstance(n.ctx, ast.Load) and id(n) not in inside}
    shadowed = {None: top}
    for f in ast.walk(tree):
        if isinstance(f, functions):
            local = _stored(f)
            for n in ast.walk(f):
                shadowed[id(n)] = shadowed.get(id(n), top) | local
    return shadowed


def _chain(node):
    """(root name, [attr, ...]) of ``a.b.c`` read as a value, or None."""
    attrs = []
    while isinstance(node, ast.Attribute):
        attrs.append(node.attr)
        node = node.value
    return (node.id, attrs[::-1]) if isinstance(node, ast.Name) else None


def unresolved(path: Path) -> list[str]:
    """``line: what`` for each name ``path`` imports and each attribute chain it reads off
    an imported module (``torch.cuda.get_device_name``, ``hopper.HopperConfig.describe``,
    followed through modules and classes) that does not exist. A submodule reached as an
    attribute must be imported by the file or by its package's own import. Names the file
    also binds otherwise (a parameter, an assignment) are not followed; neither are imports
    inside ``try: ... except ImportError`` or marked ``RUNTIME``."""
    tree, where = ast.parse(path.read_text(), filename=str(path)), path.parent
    guarded, missing = _import_guarded(tree), []
    bound: dict[str, object] = {}  # a name -> the module, class or sibling it is bound to
    imported: set[str] = set()  # dotted names of the modules the file imports

    def load(module: str, line: int, what: str):
        if (where / f"{module}.py").is_file():
            return Sibling(where / f"{module}.py")
        try:
            mod = importlib.import_module(module)
        except ImportError as e:
            missing.append(f"{line}: {what} ({e})")
            return None
        parts = module.split(".")
        imported.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
        return mod

    lines = path.read_text().splitlines()
    for node in ast.walk(tree):
        if id(node) in guarded or not isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        if RUNTIME in lines[node.lineno - 1]:
            continue
        if isinstance(node, ast.Import):
            for a in node.names:
                mod = load(a.name, node.lineno, f"import {a.name}")
                if mod is not None:
                    bound[a.asname or a.name.split(".")[0]] = (
                        mod if a.asname or isinstance(mod, Sibling)
                        else importlib.import_module(a.name.split(".")[0]))
        elif node.level:
            missing.append(f"{node.lineno}: a relative import in a script")
        else:
            src = load(node.module, node.lineno, f"from {node.module}")
            for a in node.names if src is not None else ():
                if isinstance(src, Sibling):
                    ok, obj = a.name in src.names, None
                else:  # ``from m import n`` also imports a submodule m.n
                    try:
                        obj = getattr(src, a.name) if hasattr(src, a.name) else \
                            importlib.import_module(f"{node.module}.{a.name}")
                        ok = True
                    except ImportError:
                        ok = False
                if not ok:
                    missing.append(f"{node.lineno}: from {node.module} import {a.name}")
                elif isinstance(obj, (_ModuleType, type)):
                    if isinstance(obj, _ModuleType):
                        imported.add(obj.__name__)
                    bound[a.asname or a.name] = obj
    shadowed = _shadowed(tree)
    inner = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    submodules = []  # (line, text, module, attr): a submodule not imported by the file
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute) or id(node) in inner or not isinstance(node.ctx, ast.Load):
            continue
        root, attrs = _chain(node) or (None, [])
        if root not in bound or root in shadowed.get(id(node), shadowed[None]):
            continue
        obj, text = bound[root], root
        for attr in attrs:
            if isinstance(obj, Sibling):
                if attr not in obj.names:
                    missing.append(f"{node.lineno}: {text}.{attr} ({obj.name} has no {attr})")
                    break
                target = obj.imports.get(attr)
                obj = load(target, node.lineno, target) if target and "." not in target else (
                    _resolve_dotted(target) if target else None)
            elif isinstance(obj, (_ModuleType, type)):
                if not hasattr(obj, attr):
                    owner = obj.__name__ if isinstance(obj, _ModuleType) else obj.__qualname__
                    missing.append(f"{node.lineno}: {text}.{attr} ({owner} has no {attr})")
                    break
                value = getattr(obj, attr)
                if (isinstance(obj, _ModuleType) and isinstance(value, _ModuleType)
                        and value.__name__ == f"{obj.__name__}.{attr}"
                        and value.__name__ not in imported):
                    submodules.append((node.lineno, f"{text}.{attr}", obj.__name__, attr))
                obj = value
            else:
                break
            text = f"{text}.{attr}"
            if not isinstance(obj, (_ModuleType, type, Sibling)):
                break
    by_module: dict[str, set[str]] = {}
    for _, _, module, attr in submodules:
        by_module.setdefault(module, set()).add(attr)
    fresh = {m: _fresh_has(m, attrs) for m, attrs in by_module.items()}
    for line, text, module, attr in submodules:
        if not fresh[module][attr]:
            missing.append(f"{line}: {text} (a submodule that neither the file nor "
                           f"`import {module}` imports)")
    return sorted(missing, key=lambda m: int(m.split(":")[0]))


def _resolve_dotted(name: str):
    """The object ``a.b.c`` names (a module, or an attribute of one), or None."""
    module, _, attr = name.rpartition(".")
    try:
        return importlib.import_module(name)
    except ImportError:
        try:
            return getattr(importlib.import_module(module), attr, None)
        except ImportError:
            return None


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


@pytest.mark.slow
@pytest.mark.parametrize("path", FOLLOWED, ids=[f"{p.parent.name}/{p.name}" for p in FOLLOWED])
def test_every_name_a_script_or_test_reads_exists(path):
    assert unresolved(path) == []


@pytest.mark.slow
def test_the_check_finds_missing_names_chains_and_unimported_submodules(tmp_path):
    import fa_lab.flydsl  # noqa: F401  (loaded here, as other tests load it: still not imported by the file)

    (tmp_path / "helper.py").write_text(
        "from fa_lab.kernels.swp_bf16 import hopper\ntry:\n    import json\nexcept ImportError:\n"
        "    json = None\nelse:\n    GUARDED = 1\ndef there():\n    pass\nCONST = 1\n")
    script = tmp_path / "s.py"
    script.write_text(
        "import helper\nfrom fa_lab.studies import bench; from fa_lab import timing\nfrom fa_lab.kernels.swp_fp8 import fast as f8\n"
        "from fa_lab.timing import measure, no_such_function\nimport fa_lab.no_such_module\n"
        "helper.there(); helper.CONST; helper.gone; helper.GUARDED; helper.hopper.HopperConfig\n"
        "bench.SHAPES; bench.NO_SUCH; bench.NEW = 1\n"
        "timing.CudaTimer; f8.forward; f8.TransposedV.from_v; f8.TransposedV.nope; f8.no_such\n"
        "import importlib, torch\nimportlib.import_module; torch.cuda.is_available; torch.cuda.nope\n"
        "helper.hopper.nope\nimport fa_lab\nfa_lab.flydsl.forward\n"
        "def f(bench):\n    return bench.anything\n"
        "try:\n    import no_such_package\nexcept ImportError:\n    pass\n")
    assert unresolved(script) == [
        "4: from fa_lab.timing import no_such_function",
        "5: import fa_lab.no_such_module (No module named 'fa_lab.no_such_module')",
        "6: helper.gone (helper has no gone)",
        "7: bench.NO_SUCH (fa_lab.studies.bench has no NO_SUCH)",
        "8: f8.TransposedV.nope (TransposedV has no nope)",
        "8: f8.no_such (fa_lab.kernels.swp_fp8.fast has no no_such)",
        "10: torch.cuda.nope (torch.cuda has no nope)",
        "11: helper.hopper.nope (fa_lab.kernels.swp_bf16.hopper has no nope)",
        "13: fa_lab.flydsl (a submodule that neither the file nor `import fa_lab` imports)",
    ]
