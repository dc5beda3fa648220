"""environment.yml stays consistent with pyproject.toml, and the install pins hold."""

import re
import tomllib
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]


def norm(req: str) -> str:
    return re.sub(r"\s+", "", req).lower()


def _project():
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _own(extra: str) -> list[str]:
    """An extra's requirements, less the extras it names (``fa_lab[lab]``)."""
    return [r for r in _project()["optional-dependencies"][extra] if not norm(r).startswith("fa_lab")]


def test_environment_yml_matches_pyproject():
    """environment.yml installs the dependencies and the [lab], [dev] and [docs] extras (what
    make setup installs), with the pinned torch build in place of the library's lower bound."""
    project = _project()
    core = [r for r in project["dependencies"] if not norm(r).startswith("torch")]
    wanted = {norm(r) for r in core + _own("lab") + _own("dev") + _own("docs")} | {"torch==2.13.0"}
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    deps = env["dependencies"]
    assert "python=3.11" in deps
    pip = next(d["pip"] for d in deps if isinstance(d, dict) and "pip" in d)
    listed = {norm(r) for r in pip if not r.startswith("-e")}
    assert listed == wanted
    assert "-e ." in pip


def test_the_extras_split_the_lab_from_the_library():
    """The library installs without JupyterLab, widgets or plotly; [lab] brings them,
    [docs] and [dev] build on [lab]; [docs] has the site's tools."""
    project = _project()
    names = lambda reqs: {re.split(r"[<>=\[ ;]", norm(r))[0] for r in reqs}  # noqa: E731
    core = names(project["dependencies"])
    lab = {"jupyterlab", "ipykernel", "ipywidgets", "anywidget", "plotly"}
    assert not core & lab and lab <= names(_own("lab"))
    extras = project["optional-dependencies"]
    assert "fa_lab[lab]" in map(norm, extras["dev"]) and "fa_lab[lab]" in map(norm, extras["docs"])
    assert {"sphinx", "myst-nb", "sphinx-book-theme", "jupyter-cache", "playwright"} <= \
        names(extras["docs"])
    assert {"pytest", "nbval"} <= names(extras["dev"])


def recipe(target: str) -> list[str]:
    """The command lines of the Makefile rule whose target is ``target`` (continued lines
    joined, leading tab stripped, comment lines dropped)."""
    lines = (ROOT / "Makefile").read_text().replace("\\\n", " ").splitlines()
    start = next(i for i, line in enumerate(lines) if line.split(":")[0] == target)
    cmds = []
    for line in lines[start + 1:]:
        if not line.startswith("\t"):
            break
        if not line.lstrip().startswith("#"):
            cmds.append(line.strip())
    return cmds


def version(spec: str) -> tuple[int, ...]:
    """3.6 and 3.6.0 alike."""
    parts = [int(x) for x in spec.split(".")]
    return tuple(parts + [0] * (3 - len(parts)))


def test_torch_is_a_lower_bound_in_the_library_and_pinned_where_machines_are_set_up():
    """pyproject.toml takes the user's torch (a lower bound: an install never replaces it
    with another build); the Makefile and CI install the CPU build first and exactly (any
    looser spec pulls a multi-GB CUDA build on the CPU-only CI machine)."""
    deps = [norm(r) for r in _project()["dependencies"] if norm(r).startswith("torch")]
    assert deps == ["torch>=2.11"]
    assert 'pip install -q "torch==2.13.0"' in recipe("$(STAMP)")[2]
    assert '"torch==2.13.0"' in recipe("$(FLOOR_BASE)")[1]
    assert "$(FLOOR_BASE)" in prerequisites("$(FLOOR_STAMP)")
    # the wheel's venv gets the pinned torch in a step test-wheel depends on, before the wheel
    assert recipe("$(WHEEL_TORCH)")[1:3] == ["$(PYTHON) -m venv $(WHEEL_DIR)/venv",
                                            '$(WHEEL_DIR)/venv/bin/python -m pip install -q "torch==2.13.0"']
    assert "$(WHEEL_TORCH)" in prerequisites("test-wheel")
    assert any("fa_lab-*.whl" in c and "install" in c for c in recipe("test-wheel"))


def prerequisites(target: str) -> list[str]:
    """The prerequisites on the Makefile's rule line for ``target``."""
    lines = (ROOT / "Makefile").read_text().replace("\\\n", " ").splitlines()
    line = next(line for line in lines if line.split(":")[0] == target)
    return line.split(":", 1)[1].split("|")[0].split()


def test_ci_builds_the_three_venvs_at_once_and_fails_with_any_of_them():
    """.ci/run starts with make -j ci-venvs: make setup's venv and the first steps of the
    floor's and the wheel's venvs, none of which (but setup's) writes in the checkout; a
    failing one fails make, and set -e stops CI there. The wheel's venv step starts afresh
    and test-wheel takes its stamp away before the wheel goes in."""
    ci = (ROOT / ".ci" / "run").read_text()
    assert "set -euo pipefail" in ci
    assert ci.index("make -j 3 --output-sync=target ci-venvs") < ci.index("make test\n")
    assert prerequisites("ci-venvs") == ["setup", "$(FLOOR_BASE)", "$(WHEEL_TORCH)"]
    assert recipe("$(WHEEL_TORCH)")[0] == "rm -rf $(WHEEL_DIR)/venv"
    wheel = recipe("test-wheel")
    assert wheel.index("rm $(WHEEL_TORCH)") < next(
        i for i, c in enumerate(wheel) if "fa_lab-*.whl" in c and "install" in c)
    assert not any(" -e " in c for c in recipe("$(FLOOR_BASE)") + recipe("$(WHEEL_TORCH)"))


def test_make_test_builds_installs_and_runs_the_wheel_without_the_lab():
    """make test runs test-wheel: the wheel in a fresh venv beside the pinned torch, with no
    extra, then the smoke script, fa-lab table and fa-lab attack there."""
    assert "$(MAKE) test-wheel" in recipe("test")
    wheel = " ; ".join(recipe("test-wheel"))
    assert "pip wheel" in wheel and "-m venv $(WHEEL_DIR)/venv" in " ; ".join(recipe("$(WHEEL_TORCH)"))
    assert "fa_lab-*.whl" in wheel and "fa_lab-*.whl[" not in wheel  # no extra
    for step in ("tests/project/wheel_smoke.py", "fa-lab table", "fa-lab attack lazy_unfixed --budget 5"):
        assert step in wheel, step


def test_ci_checks_for_untracked_files_too():
    ci = (ROOT / ".ci" / "run").read_text()
    assert "git status --porcelain)" in ci and "--untracked-files=no" not in ci


def test_ci_runs_make_test():
    assert "make test" in (ROOT / ".ci" / "run").read_text()


def test_the_triton_floor_is_the_one_make_test_runs_against():
    """pyproject's lowest Triton is the version ``make test-triton-floor`` installs and the
    one the kernels refuse to run below, and ``make test`` runs that target: the floor is a
    tested claim, not a guess."""
    from fa_lab import kernels

    project = _project()
    floor = next(re.fullmatch(r"triton>=([\d.]+)", norm(r)).group(1)
                 for r in project["dependencies"] if norm(r).startswith("triton"))
    makefile = (ROOT / "Makefile").read_text()
    pinned = re.search(r"^TRITON_FLOOR\s*:=\s*(\S+)$", makefile, re.M).group(1)
    assert version(pinned) == version(floor)
    assert kernels.TRITON_FLOOR == version(floor)[:2] and version(floor)[2] == 0
    assert kernels.INSTALL == f"pip install 'triton>={floor}'"
    assert "$(MAKE) test-triton-floor" in recipe("test")
    installs = [c for c in recipe("$(FLOOR_BASE)") + recipe("$(FLOOR_STAMP)") if "pip install" in c]
    assert installs and all('"triton==$(TRITON_FLOOR)"' in c for c in installs)
    assert any("pytest" in c and "$(FLOOR_TESTS)" in c for c in recipe("test-triton-floor"))


def test_the_floors_deselections_name_tests_that_exist():
    """pytest passes over a --deselect that names no test: each one the floor's run leaves
    out names a test function defined in its file."""
    block = re.search(r"^FLOOR_DESELECT := (.*?)\n\n", (ROOT / "Makefile").read_text(),
                      re.M | re.S).group(1).replace("\\\n", " ")
    named = []
    for prefix, names in re.findall(r"\$\(addprefix --deselect ([^,]*),([^)]*)\)", block):
        named += [prefix + n for n in names.split()]
    assert named, block
    for nodeid in named:
        path, func = nodeid.split("::")
        assert re.search(rf"^def {func}\(", (ROOT / path).read_text(), re.M), nodeid


@pytest.mark.slow
def test_the_core_and_its_commands_import_nothing_of_the_lab_extra():
    """What the core install runs (the API, the CLI's table, attack and sweep) imports
    none of the [lab] extra's packages (make test-wheel proves it in a venv without them)."""
    import subprocess
    import sys

    code = ("import sys, fa_lab, fa_lab.cli, fa_lab.studies.sweep, fa_lab.studies.adversary; "
            "fa_lab.cli.build_parser(); "
            "print(sorted({m.split('.')[0] for m in sys.modules} & "
            "{'jupyterlab', 'ipykernel', 'ipywidgets', 'anywidget', 'plotly', 'IPython'}))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]", r.stdout
