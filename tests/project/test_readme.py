"""Every fenced block of README.md runs, and does what the text around it says.

* **python** blocks run in order in one fresh interpreter (a later block uses the tensors
  of an earlier one, as a reader pasting them would), each followed by its check below:
  the numbers the prose promises (NaN before the fix and none after, the policy registered
  and usable by name, the prediction close to the model). A block without a check fails
  the test, so a new snippet comes with one.
* **bash** blocks: each command line runs in a scratch directory, with results sent to a
  scratch folder, and the checkout is left as it was. ``fa-lab lab`` and ``make lab`` start
  JupyterLab and must answer with the lessons; ``make setup`` is checked by ``make -n``
  (it builds the venv these tests run in). A line that says it needs a CUDA GPU runs only
  where there is one.
* **yaml** blocks are files the text names (``name: X`` -> ``X.yaml``), written where the
  bash lines run.

The README's links resolve to files of the checkout, and its performance table holds the
numbers of the results file it cites.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import textwrap
import time
import urllib.request
from pathlib import Path

import pytest
import torch
import yaml

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
BIN = Path(sys.executable).parent
GPU_MARK = "needs a CUDA GPU"
HAS_GPU = torch.cuda.is_available()

_FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)


def blocks(lang: str) -> list[str]:
    return [body for kind, body in _FENCE.findall(README.read_text()) if kind == lang]


# ---- python ------------------------------------------------------------------------------

#: a substring that identifies one python block -> the statements that check what its
#: prose says, run right after it in the same namespace
CHECKS = {
    "before = fa_lab.flash_attn_func": """
        nan_before = before.isnan().float().mean().item()
        assert abs(nan_before - 0.092) < 0.01, nan_before   # the bug report's 9.2 % at K x32
        assert torch.isfinite(after).all()
        assert fa_lab.upstream.current() == "fixed"   # the block left the session as it was
    """,
    "fa_lab.trace(": """
        assert len(t.lanes) == 32 and (t.lanes.n_swept > 0).any()
        assert {"m", "mt", "vote", "fire", "swept", "corr", "l"} <= set(t.steps.columns)
    """,
    "fa_lab.compare(": """
        assert c.a == "emulator" and c.b == "interpret" and c.same_masks
        assert c.out.masks[0].kind == "nan" and c.out.masks[0].in_a > 0
    """,
    "Policy.from_rule(capped16": """
        assert {"lazy6", "capped16"} <= set(fa_lab.policies.names())
        assert fa_lab.policies.get("lazy6").threshold == 6 and torch.isfinite(out).all()
        assert mine.rule is capped16
    """,
    "zoo.get(": """
        assert e.shows("before") and not e.shows("after")
        assert {h.kind for h in onset.bound("sdpa_masked_row:before").hazards} >= {"nan"}
    """,
    "decode.pa_decode_tile(": """
        before = decode.pa_decode_tile(*case.args(), num_partitions=2, upstream="flydsl-985c653a^")
        assert before.isnan().any() and not out.isnan().any()   # 985c653a's NaN, gone on main
    """,
    "onset.predict(": """
        assert abs(pred.nan_frac - nan_before) < 0.005, (pred.nan_frac, nan_before)
    """,
}


def _check_for(block: str) -> str:
    found = [check for key, check in CHECKS.items() if key in block]
    assert len(found) == 1, f"README python block needs exactly one check here:\n{block}"
    return textwrap.dedent(found[0])


@contextlib.contextmanager
def scratch_env(tmp_path: Path):
    """Environment for README commands: results into tmp_path, this venv first on PATH."""
    env = dict(os.environ, PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
               FA_LAB_RESULTS=str(tmp_path / "results"),
               OMP_WAIT_POLICY="PASSIVE", BROWSER="true", PYTHONUNBUFFERED="1")
    before = _git_status()
    yield env
    assert _git_status() == before, "a README snippet changed the checkout"


def _git_status() -> str | None:
    try:
        return subprocess.run(["git", "status", "--porcelain"], cwd=REPO, capture_output=True,
                              text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None   # not a git checkout (an sdist): nothing to compare


@pytest.mark.slow
def test_python_blocks_run_and_do_what_the_text_says(tmp_path):
    code = blocks("python")
    assert len(code) >= 5
    gpu = [b for b in code if GPU_MARK in b]
    script = ["import torch"]
    for i, block in enumerate(code):
        if block in gpu and not HAS_GPU:
            continue
        script += [f"print('--- README python block {i}', flush=True)", block, _check_for(block)]
    (tmp_path / "readme_blocks.py").write_text("\n".join(script))
    with scratch_env(tmp_path) as env:
        run = subprocess.run([sys.executable, "readme_blocks.py"], cwd=tmp_path, env=env,
                             capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]
    assert run.stdout.count("--- README python block") == len(code) - (0 if HAS_GPU else len(gpu))


# ---- bash --------------------------------------------------------------------------------

def commands() -> list[str]:
    """Every command line of the bash blocks, comments kept (they mark the GPU lines)."""
    return [line.strip() for b in blocks("bash") for line in b.splitlines()
            if line.strip() and not line.strip().startswith("#")]


def _argv(line: str) -> list[str]:
    return shlex.split(line.split("#")[0])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serves_the_lessons(argv, cwd, env, scratch: Path) -> None:
    """Start the server ``argv`` launches (in ``cwd``) and check that it answers with the
    lessons; its runtime files and log go to ``scratch``."""
    port, token = _free_port(), "readme-test"
    env = dict(env, JUPYTER_PORT=str(port), JUPYTER_TOKEN=token,
               JUPYTER_RUNTIME_DIR=str(scratch / "runtime"),
               JUPYTERLAB_WORKSPACES_DIR=str(scratch / "workspaces"))
    log = open(scratch / "lab.log", "w")
    proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, (scratch / "lab.log").read_text()[-3000:]
            try:
                url = f"http://127.0.0.1:{port}/api/contents?token={token}"
                with urllib.request.urlopen(url, timeout=2) as r:
                    names = {item["name"] for item in json.load(r)["content"]}
                break
            except OSError:
                assert time.monotonic() < deadline, "JupyterLab did not answer within 120 s"
                time.sleep(0.5)
        assert "00_tour.ipynb" in names, names
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=5)
        log.close()


def _parts(folder: Path) -> list:
    import pandas as pd

    return [pd.read_parquet(f) for f in sorted(folder.glob("part-*.parquet"))]


@pytest.mark.parametrize("line", commands(), ids=lambda line: " ".join(_argv(line)))
@pytest.mark.slow
def test_shell_lines_run(line, tmp_path):
    if GPU_MARK in line and not HAS_GPU:
        pytest.skip(f"the README marks it as GPU-only: {line}")
    argv = _argv(line)
    for grid in blocks("yaml"):
        (tmp_path / f"{yaml.safe_load(grid)['name']}.yaml").write_text(grid)
    with scratch_env(tmp_path) as env:
        if argv[:2] == ["make", "setup"]:
            dry = subprocess.run(["make", "-n", "setup", f"VENV={sys.prefix}"], cwd=REPO,
                                 env=env, capture_output=True, text=True)
            assert dry.returncode == 0, dry.stderr
            return
        if argv[:2] == ["make", "lab"]:
            # make lab itself (its environment, its config path), on a port of the test's
            # own; -o setup: the venv these tests run in is already set up
            _serves_the_lessons(["make", "-o", "setup", "lab", f"VENV={sys.prefix}",
                                 "LAB_FLAGS=--no-browser"], REPO, env, tmp_path)
            return
        if argv[:2] == ["fa-lab", "lab"]:
            _serves_the_lessons(argv, tmp_path, env, tmp_path)
            return
        run = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True,
                             timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    out = run.stdout
    if argv[:2] == ["fa-lab", "table"]:
        # the bf16 table, with the unfixed policy's NaN at K x32 beside the report's 9.20 %
        assert re.search(r"^\s+32 \|.*%\s+9\.20% \|", out, re.M), out
        assert not (tmp_path / "results").exists()          # --no-save
    elif argv[:2] == ["fa-lab", "sweep"]:
        out_dir = tmp_path / argv[argv.index("--out-dir") + 1]
        grid = yaml.safe_load((tmp_path / argv[2]).read_text())
        rows = _parts(out_dir / "atlas" / grid["name"])
        assert len(rows) == len(grid["policy"]) * len(grid["k_scale"])
        import pandas as pd
        table = pd.concat(rows)
        assert (table[table.policy == "lazy"].nan_frac == 0).all()
        assert (table[(table.policy == "lazy_unfixed") & (table.k_scale == 64)].nan_frac > 0).all()
    elif argv[:3] == ["fa-lab", "attack", "lazy_unfixed"]:
        assert "FAILS" in out and "repro: " in out, out
        repro = out.split("repro: ")[1].splitlines()[0]
        # the repro line runs as printed, in a shell, with the venv's python first on PATH
        check = subprocess.run(["bash", "-c", repro], cwd=tmp_path, env=env, capture_output=True,
                               text=True)
        assert check.returncode == 0 and check.stdout.split()[-1:] == ["True"], \
            check.stdout[-1000:] + check.stderr[-2000:]
    elif argv[:3] == ["fa-lab", "attack", "sdpa_masked_row:before"]:
        assert "FAILS (empty)" in out and "repro: " in out, out
    elif argv[:3] == ["fa-lab", "attack", "lazy"]:
        assert "found a failure" in out and "FAILS" not in out, out
    elif argv[:2] == ["fa-lab", "bench"]:
        assert "TFLOP" in out or "tflops" in out.lower(), out
    elif argv[:2] == ["fa-lab", "show"]:
        named = len(argv) > 2 and not argv[2].startswith("-")
        assert ("rows (" in out) if named else re.search(r"^\S.*: \d+ result\(s\)$", out, re.M), out
    else:
        pytest.fail(f"no check for the README command {line!r}: add one here")


def test_every_cli_command_is_named_and_shown():
    """fa-lab --help's commands, each named in the text and run in a bash block."""
    from fa_lab.cli import COMMANDS

    text = README.read_text()
    shown = {_argv(line)[1] for line in commands() if _argv(line)[0] == "fa-lab"}
    for name in COMMANDS:
        assert f"`{name}`" in text and name in shown, name



def test_names_how_to_verify_on_a_gpu():
    """The GPU section names the make targets that run and check the GPU record, and the
    Makefile has them."""
    section = README.read_text().split("## On a GPU")[1].split("\n## ")[0]
    targets = re.findall(r"^([\w-]+):", (REPO / "Makefile").read_text(), re.M)
    for name in ("test-gpu", "check-gpu-record"):
        assert f"`make {name}`" in section and name in targets, name

# ---- links and numbers -------------------------------------------------------------------

def test_performance_table_holds_the_cited_file():
    text = README.read_text()
    section = text.split("## Performance")[1].split("\n## ")[0]
    cited = re.findall(r"`data/results/(bench_\w+\.json)`", section)
    assert cited, "the performance summary cites no bench file"
    record = json.loads((REPO / "data" / "results" / cited[0]).read_text())
    tflops = {(r["shape"], r["impl"]): r["tflops"] for r in record["rows"]}
    columns = {"fast lazy": "fast_lazy", "fast eager": "fast_eager",
               "fast fp8 lazy": "fast_fp8_lazy", "SDPA flash": "sdpa_flash",
               "SDPA cuDNN": "sdpa_cudnn", "flex": "flex", "API lazy": "api_lazy",
               "API eager": "api_eager", "API fp8 lazy": "api_fp8_lazy"}
    rows = [[c.strip() for c in line.strip("|").split("|")]
            for line in section.splitlines() if line.startswith("| ")]
    header, body = rows[0], rows[1:]
    assert len(body) >= 3
    impls = [columns[h] for h in header[1:]]
    for cells in body:
        for impl, cell in zip(impls, cells[1:]):
            value = tflops.get((cells[0], impl))
            if value is None:
                assert cell == "—", (cells[0], impl, cell)
            else:
                assert cell == f"{value:.1f}", (cells[0], impl, cell, value)
    # once the file holds the API rows (flash_attn_func itself), the summary shows them
    if any(impl.startswith("api_") for _, impl in tflops):
        assert "api_lazy" in impls, "bench file has API rows: add them to the README's table"
