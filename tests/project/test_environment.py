"""environment.yml stays consistent with pyproject.toml, and the install pins hold."""

import re
import tomllib
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]


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


def test_torch_is_pinned_everywhere():
    # Any looser torch spec pulls a multi-GB CUDA build on the CPU-only CI machine.
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert "torch==2.13.0" in project["dependencies"]
    assert 'pip install -q "torch==2.13.0"' in recipe("$(STAMP)")[2]
    assert '"torch==2.13.0"' in recipe("$(FLOOR_STAMP)")[1]


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
    assert version(pinned) == version(floor)
    assert kernels.TRITON_FLOOR == version(floor)[:2] and version(floor)[2] == 0
    assert kernels.INSTALL == f"pip install 'triton>={floor}'"
    assert "$(MAKE) test-triton-floor" in recipe("test")
    installs = [c for c in recipe("$(FLOOR_STAMP)") if "pip install" in c]
    assert installs and all('"triton==$(TRITON_FLOOR)"' in c for c in installs)
    assert any("pytest" in c and "$(FLOOR_TESTS)" in c for c in recipe("test-triton-floor"))
