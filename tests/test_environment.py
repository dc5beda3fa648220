"""environment.yml stays consistent with pyproject.toml, and the install pins hold."""

import re
import tomllib
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent


def norm(req: str) -> str:
    return re.sub(r"\s+", "", req).lower()


def test_environment_yml_matches_pyproject():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = {norm(r) for r in project["dependencies"] + project["optional-dependencies"]["dev"]}
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    deps = env["dependencies"]
    assert "python=3.11" in deps
    pip = next(d["pip"] for d in deps if isinstance(d, dict) and "pip" in d)
    listed = {norm(r) for r in pip if not r.startswith("-e")}
    assert listed == wanted
    assert "-e ." in pip


def test_torch_is_pinned_everywhere():
    # Any looser torch spec pulls a multi-GB CUDA build on the CPU-only CI machine.
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert "torch==2.13.0" in project["dependencies"]
    assert 'pip install -q "torch==2.13.0"' in (ROOT / "Makefile").read_text()


def test_ci_runs_make_test():
    assert "make test" in (ROOT / ".ci" / "run").read_text()


def test_the_triton_floor_is_the_one_make_test_runs_against():
    """pyproject's lowest Triton is the version ``make test-triton-floor`` installs and the
    one the kernels refuse to run below, and ``make test`` runs that target: the floor is a
    tested claim, not a guess."""
    from fa_lab import kernels

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    floor = next(re.fullmatch(r"triton>=([\d.]+)", norm(r)).group(1)
                 for r in project["dependencies"] if norm(r).startswith("triton"))
    makefile = (ROOT / "Makefile").read_text()
    pinned = re.search(r"^TRITON_FLOOR\s*:=\s*(\S+)$", makefile, re.M).group(1)
    assert pinned.split(".")[:2] == floor.split(".") and pinned.count(".") == 2
    assert kernels.TRITON_FLOOR == tuple(int(x) for x in floor.split("."))
    assert kernels.INSTALL == f"pip install 'triton>={floor}'"
    test_recipe = re.search(r"^test: setup\n((?:\t.*\n)+)", makefile, re.M).group(1)
    assert "$(MAKE) test-triton-floor" in test_recipe
