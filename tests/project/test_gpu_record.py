"""tests/gpu_record.py (``make test-gpu``): its tree hashes are git's, its junit reading and
its check of a record against a checkout."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("gpu_record", ROOT / "tests" / "gpu_record.py")
gpu_record = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpu_record)


def git(repo, *args):
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t"}
    return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True,
                          check=True, env=env).stdout.rstrip()


@pytest.fixture
def repo(tmp_path):
    """A git repository with the shapes a tree hash must get right: nested and sibling
    directories whose names sort differently with a trailing slash (``a`` vs ``a.py`` vs
    ``a-b``), an executable file, ignored build output, an empty directory."""
    git(tmp_path, "init", "-q")
    (tmp_path / ".gitignore").write_text("__pycache__/\n*.pyc\n/build/\n*.egg-info/\n")
    pkg = tmp_path / "pkg"
    for rel, text in {"a/x.py": "x = 1\n", "a.py": "a = 2\n", "a-b.txt": "ab\n", "z/y/deep.py": "",
                      "run.sh": "#!/bin/sh\necho\n"}.items():
        (pkg / rel).parent.mkdir(parents=True, exist_ok=True)
        (pkg / rel).write_text(text)
    (pkg / "run.sh").chmod(0o755)
    git(tmp_path, "add", "-A")
    git(tmp_path, "commit", "-qm", "init")
    (pkg / "__pycache__").mkdir()
    (pkg / "__pycache__" / "a.cpython-311.pyc").write_bytes(b"\0junk")
    (pkg / "empty").mkdir()
    (pkg / "pkg.egg-info").mkdir()
    (pkg / "pkg.egg-info" / "PKG-INFO").write_text("x")
    return tmp_path


def test_tree_hash_is_gits(repo):
    patterns = gpu_record.ignore_patterns(repo)
    assert gpu_record.tree_hash(repo / "pkg", patterns) == git(repo, "rev-parse", "HEAD:pkg")
    assert gpu_record.tree_hash(repo / "pkg" / "z", patterns) == git(repo, "rev-parse", "HEAD:pkg/z")
    (repo / "pkg" / "a.py").write_text("a = 3\n")  # an edit changes the hash
    assert gpu_record.tree_hash(repo / "pkg", patterns) != git(repo, "rev-parse", "HEAD:pkg")


def test_tree_hash_of_this_checkout_matches_head_where_clean():
    state = gpu_record.git_state()
    if state is None:
        pytest.skip("not a git checkout")  # an sdist or a copy: nothing to compare with
    dirty = git(ROOT, "status", "--porcelain", "--untracked-files=all", "--", *gpu_record.TREES)
    for name in gpu_record.TREES:
        changed = any(line[3:].startswith(name + "/") for line in dirty.splitlines())
        assert (gpu_record.tree_hash(ROOT / name) == state["trees"][name]) != changed, name


def test_tree_hash_refuses_a_directory_with_nothing_to_track(tmp_path):
    (tmp_path / ".gitignore").write_text("*.pyc\n")
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "x.pyc").write_bytes(b"")
    with pytest.raises(ValueError, match="holds no file"):
        gpu_record.tree_hash(tmp_path / "d", gpu_record.ignore_patterns(tmp_path))


JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">
<testcase classname="tests.api.test_numerics" name="test_a[cuda]" time="0.25"/>
<testcase classname="tests.project.test_gpu_record.TestX" name="test_b" time="1.5">
  <failure message="AssertionError: 2 != 3&#10;more">trace</failure></testcase>
<testcase classname="tests.api.test_numerics" name="test_c" time="0"><skipped message="no"/></testcase>
<testcase classname="tests.api.test_numerics" name="test_d" time="0.1"><error message="boom"/></testcase>
</testsuite></testsuites>"""


def test_junit_rows_name_tests_as_pytest_does(tmp_path):
    path = tmp_path / "j.xml"
    path.write_text(JUNIT)
    rows = gpu_record.junit_rows(path, phase=2)
    assert [(r["test"], r["outcome"], r["seconds"]) for r in rows] == [
        ("tests/api/test_numerics.py::test_a[cuda]", "passed", 0.25),
        ("tests/project/test_gpu_record.py::TestX::test_b", "failed", 1.5),
        ("tests/api/test_numerics.py::test_c", "skipped", 0.0),
        ("tests/api/test_numerics.py::test_d", "error", 0.1)]
    assert rows[1]["message"] == "AssertionError: 2 != 3" and all(r["phase"] == 2 for r in rows)
    assert gpu_record.summarize(rows) == {"error": 1, "failed": 1, "passed": 1, "skipped": 1}


def _record(trees, passed=True, unchanged=True):
    return {"trees": trees, "passed": passed, "summary": {"passed": 3},
            "trees_unchanged_during_run": unchanged}


def test_check_vouches_only_for_matching_passing_records(tmp_path):
    state = gpu_record.git_state()
    if state is None:
        pytest.skip("not a git checkout")
    path = tmp_path / "r.json"
    path.write_text(json.dumps(_record(state["trees"])))
    assert gpu_record.check(path) == []
    path.write_text(json.dumps(_record({**state["trees"], "kernels": "0" * 40})))
    assert [p.split()[0] for p in gpu_record.check(path)] == ["kernels/"]
    path.write_text(json.dumps(_record(state["trees"], passed=False)))
    assert "did not pass" in gpu_record.check(path)[0]
    path.write_text(json.dumps(_record(state["trees"], unchanged=False)))
    assert "changed while" in gpu_record.check(path)[0]


def _ids(files, per_file=2):
    return [f"{f}::test_{k}" for f in files for k in range(per_file)]


def test_shards_split_the_files_disjointly_and_in_balance():
    files = [f"tests/t{i}.py" for i in range(9)]
    weights = {f: float(10 * (i + 1)) for i, f in enumerate(files[:-1])}  # t8 unknown
    plan = gpu_record.plan_shards(_ids(files), 3, weights, workers=2, alone_seconds=30.0)
    assert [sh["index"] for sh in plan] == [1, 2, 3] and all(sh["of"] == 3 for sh in plan)
    got = [f for sh in plan for f in sh["files"]]
    assert sorted(got) == files and len(got) == len(set(got))
    # the unknown file weighs as the heaviest; the alone phase's 30 s sit in the last shard
    load = [sum(weights.get(f, 80.0) for f in sh["files"]) / 2 for sh in plan]
    load[-1] += 30.0
    assert max(load) - min(load) <= 80.0 / 2
    assert plan == gpu_record.plan_shards(_ids(files), 3, weights, 2, 30.0)


def _shard_record(index, n, files, trees, collected, passed=True, gpu="H100"):
    tests = [{"test": t, "phase": 1, "outcome": "passed" if passed else "failed", "seconds": 1.0}
             for t in _ids(files)]
    return {"name": "make test-gpu", "date": f"2026-12-0{index}T00:00:00+00:00",
            "gpu": {"name": gpu}, "versions": {"torch": "x"}, "trees": trees,
            "trees_unchanged_during_run": True, "git": None, "phases": [{"phase": 1, "ok": passed}],
            "shard": {"index": index, "of": n, "files": files,
                      "collected": gpu_record.collection_digest(collected, []),
                      "collected_ids": collected},
            "seconds": 10.0, "summary": {}, "passed": passed, "tests": tests}


def test_merged_shards_vouch_and_a_lone_shard_does_not(tmp_path):
    state = gpu_record.git_state()
    if state is None:
        pytest.skip("not a git checkout")
    a, b = ["tests/a.py"], ["tests/b.py", "tests/c.py"]
    collected = _ids(a + b)
    parts = []
    for i, files in ((2, b), (1, a)):
        parts.append(tmp_path / f"p{i}.json")
        parts[-1].write_text(json.dumps(_shard_record(i, 2, files, state["trees"], collected)))
    out = tmp_path / "merged.json"
    assert gpu_record.main(["--merge", *map(str, parts), "--record", str(out)]) == 0
    merged = json.loads(out.read_text())
    assert merged["summary"] == {"passed": 6} and [s["index"] for s in merged["shards"]] == [1, 2]
    assert gpu_record.check(out) == []
    assert any("shard 2 of 2" in p for p in gpu_record.check(parts[0]))


@pytest.mark.parametrize("spoil, says", [
    (lambda r: r["shard"].update(index=1), "shards 1..2 once each"),
    (lambda r: r.update(trees={"fa_lab": "0"}), "different trees"),
    (lambda r: r["gpu"].update(name="H200"), "different GPUs"),
    (lambda r: r["shard"].update(collected="0"), "collected different tests"),
    (lambda r: r["shard"].update(files=["tests/a.py"]), "same test file"),
    (lambda r: r.update(tests=r["tests"][:1]), "ran in no shard"),
])
def test_merge_refuses_shards_that_are_not_one_whole_run(tmp_path, spoil, says):
    a, b = ["tests/a.py"], ["tests/b.py"]
    collected = _ids(a + b)
    recs = [_shard_record(1, 2, a, {"fa_lab": "1"}, collected),
            _shard_record(2, 2, b, {"fa_lab": "1"}, collected)]
    spoil(recs[1])
    paths = []
    for k, r in enumerate(recs):
        paths.append(tmp_path / f"{k}.json")
        paths[-1].write_text(json.dumps(r))
    with pytest.raises(ValueError, match=says):
        gpu_record.merge(paths)
    with pytest.raises(ValueError, match="shards 1..2 once each"):
        gpu_record.merge(paths[:1])


@pytest.mark.parametrize("text", ["2", "0/2", "3/2", "a/b"])
def test_shard_argument_is_checked(text, capsys):
    with pytest.raises(SystemExit):
        gpu_record.main(["--shard", text])
    assert "--shard" in capsys.readouterr().err


def test_record_is_written_atomically_with_the_umask(tmp_path):
    old = os.umask(0o022)
    try:
        gpu_record.atomic_write_json(tmp_path / "sub" / "r.json", {"a": 1})
    finally:
        os.umask(old)
    out = tmp_path / "sub" / "r.json"
    assert json.loads(out.read_text()) == {"a": 1}
    assert out.stat().st_mode & 0o777 == 0o644 and list(out.parent.iterdir()) == [out]


@pytest.mark.slow
def test_a_checkout_that_is_not_installed_runs_through_links(tmp_path):
    """A GPU machine gets the working tree with nothing installed: the runner makes fa_lab
    (and fa_lab.kernels, from kernels/) import from that copy, not from any install."""
    import shutil
    import sys

    for name in ("fa_lab", "kernels"):
        shutil.copytree(ROOT / name, tmp_path / name, ignore=shutil.ignore_patterns("__pycache__"))
    (tmp_path / "tests").mkdir()
    shutil.copy(ROOT / "tests" / "gpu_record.py", tmp_path / "tests")
    shutil.copy(ROOT / ".gitignore", tmp_path)
    spec = importlib.util.spec_from_file_location("copy_gpu_record", tmp_path / "tests" / "gpu_record.py")
    copy = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(copy)
    env, cwd = copy.importable_env(sys.executable)
    probe = [sys.executable, "-c", "import fa_lab.kernels.swp_bf16.model as m, fa_lab.results as r, "
             "pathlib; print(pathlib.Path(m.__file__).resolve()); print(r.ROOT)"]
    out = subprocess.run(probe, env=env, capture_output=True, text=True, cwd=cwd)
    assert out.returncode == 0, out.stderr
    model, root = out.stdout.split()
    assert Path(model) == tmp_path / "kernels" / "swp_bf16" / "model.py" and Path(root) == tmp_path
    # why the runner does not start from the checkout: its fa_lab/, first on sys.path there,
    # has no kernels of its own (they come from an install, if any, else not at all)
    from_root = subprocess.run(probe, env=env, capture_output=True, text=True, cwd=tmp_path)
    assert from_root.returncode != 0 or Path(from_root.stdout.split()[0]) != Path(model)


#: What the lent GPU machines' python3 lacks of fa_lab's dependencies and extras: the lab's
#: figures and notebooks, the sweep's Dask, the attack's CMA-ES, the browser tests.
ABSENT_ON_THE_GPU = ("plotly", "ipywidgets", "IPython", "anywidget", "kaleido", "nbformat",
                     "nbval", "jupyterlab", "dask", "distributed", "bokeh", "cma", "playwright")
#: pytest in a process whose path finder does not find those packages, as where they are
#: not installed (``import`` raises ModuleNotFoundError, ``find_spec`` gives None)
_BLOCK = """
import importlib.machinery, sys
class Absent(importlib.machinery.PathFinder):
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name.split(".")[0] in {absent!r}:
            return None
        return super().find_spec(name, path, target)
sys.meta_path = [Absent if f is importlib.machinery.PathFinder else f for f in sys.meta_path]
import pytest
sys.exit(pytest.main({args!r}))
"""


@pytest.mark.slow
def test_the_gpu_tests_collect_where_the_lab_extra_is_absent(tmp_path):
    """make test-gpu collects every test module on a machine without the packages above: a
    module that needs one skips with a reason, and nothing errors at collection (one error
    stops the whole GPU run, on the lent device's limited time)."""
    args = ["-q", "-p", "no:cacheprovider", "-m", "gpu", "--collect-only", f"--rootdir={ROOT}",
            "-c", str(ROOT / "pyproject.toml"), str(ROOT / "tests")]
    code = _BLOCK.format(absent=set(ABSENT_ON_THE_GPU), args=args)
    # no plugins loaded by entry point: this venv's nbval, say, imports what is blocked
    env = {**os.environ, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}
    run = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                         text=True, timeout=600, env=env)
    out = run.stdout + run.stderr
    assert run.returncode == 0 and "error" not in out.lower().split("collected")[-1], out[-4000:]
    assert "the lab's figures need plotly" in out          # the blocker did block
    assert re.search(r"^(\d+)/\d+ tests collected", out, re.M), out[-2000:]
