"""``fa-lab sweep`` as a user meets it (issue 31): every error one line and exit 2; Ctrl-C at
a terminal (SIGINT to the whole process group, workers included) stops it with what was
saved kept, says so and that rerunning resumes, and exits 130; it prints the address of
the Dask dashboard of its real LocalCluster, which answers. Real subprocesses throughout."""

import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pandas as pd
import pytest
import yaml

from fa_lab import results
from fa_lab.studies import sweep


def _env(**extra):
    env = {k: v for k, v in os.environ.items() if k not in (results.ENV_VAR, "FA_LAB_TRACEBACK")}
    return {**env, "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE",
            "CUDA_VISIBLE_DEVICES": "", **extra}


def fa_lab(cwd, *args, timeout=180):
    return subprocess.run([sys.executable, "-m", "fa_lab", *args], capture_output=True,
                          text=True, cwd=cwd, env=_env(), timeout=timeout)


def _one_line_error(r, *needles):
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    err = r.stderr.strip()
    assert "Traceback" not in r.stderr and len(err.splitlines()) == 1, r.stderr
    for n in needles:
        assert n in err, (n, err)
    return err


GRID = {"policy": ["lazy"], "k_scale": [8], "S": [512], "D": [64]}


@pytest.mark.parametrize("case", ["yaml_syntax", "yaml_indent", "not_a_mapping", "missing_file",
                                  "a_directory", "bad_axis_value", "unknown_axis", "bad_workers",
                                  "out_dir_is_a_file", "bad_name"])
@pytest.mark.slow
def test_every_sweep_error_is_one_line_and_exit_2(tmp_path, case):
    grid = tmp_path / "g.yaml"
    grid.write_text(yaml.safe_dump(GRID))
    args, needles = [str(grid)], []
    if case == "yaml_syntax":
        grid.write_text("policy: [lazy\nk_scale: [8]\nS: [512]\n")
        needles = [str(grid), "not valid YAML at line"]
    elif case == "yaml_indent":
        grid.write_text("policy: [lazy]\n  k_scale: [8]\nS: [512]\n")
        needles = [str(grid), "not valid YAML at line 2"]
    elif case == "not_a_mapping":
        grid.write_text("- lazy\n- 8\n")
        needles = [str(grid), "a mapping of axis"]
    elif case == "missing_file":
        args, needles = [str(tmp_path / "nope.yaml")], ["no grid file", "nope.yaml"]
    elif case == "a_directory":
        args, needles = [str(tmp_path)], ["no grid file", "(a directory)"]
    elif case == "bad_axis_value":
        grid.write_text(yaml.safe_dump({**GRID, "k_scale": [-1]}))
        needles = ["axis 'k_scale'", "-1"]
    elif case == "unknown_axis":
        grid.write_text(yaml.safe_dump({**GRID, "seqlen_k": [512]}))
        needles = ["axis 'seqlen_k'", "unknown axis"]
    elif case == "bad_workers":
        args, needles = [str(grid), "--workers", "0"], ["--workers", "positive integer"]
    elif case == "out_dir_is_a_file":
        (tmp_path / "afile").write_text("x")
        args, needles = [str(grid), "--out-dir", str(tmp_path / "afile"), "--no-progress"], \
            ["afile"]
    elif case == "bad_name":
        args, needles = [str(grid), "--name", "../up"], ["sweep name", "'../up'"]
    _one_line_error(fa_lab(tmp_path, "sweep", *args), *needles)
    assert not (tmp_path / "fa_lab_results").exists()


@pytest.mark.slow
def test_ctrl_c_keeps_what_was_saved_says_how_to_resume_and_exits_130(tmp_path):
    """SIGINT to the sweep's process group, as a terminal's Ctrl-C sends it, once two points
    are saved: exit 130, a last line saying how many points are saved where and that the
    same command resumes, no traceback from the sweep or its workers; the dashboard whose
    address it printed answered while it ran; the rerun computes only the rest."""
    # enough points, each long enough (S 2048), that the sweep is still running when the
    # signal lands after the second part is saved, however fast the machine: 12 points on
    # the default 2 workers leave 8 not yet started then; no more, as the rerun computes
    # every point not saved
    spec = {"name": "ctrlc", "policy": ["lazy_unfixed", "eager"], "k_scale": [32, 64],
            "S": [2048], "D": [64], "seed": [0, 1, 2]}
    grid = tmp_path / "g.yaml"
    grid.write_text(yaml.safe_dump(spec))
    total = len(sweep.Grid.from_yaml(grid))
    folder = tmp_path / "fa_lab_results" / "atlas" / "ctrlc"
    err_file = tmp_path / "stderr.txt"
    with open(err_file, "w") as err:
        # SIGINT at its default in the child, as a terminal's foreground job has it (a test
        # run started in the background, or by a runner that ignores SIGINT, would pass
        # SIG_IGN on, and Python then installs no KeyboardInterrupt handler)
        proc = subprocess.Popen([sys.executable, "-m", "fa_lab", "sweep", str(grid)],
                                cwd=tmp_path, env=_env(), stdout=subprocess.PIPE, stderr=err,
                                text=True, start_new_session=True,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        try:
            deadline, status = time.monotonic() + 180, None
            while time.monotonic() < deadline and proc.poll() is None:
                link = re.search(r"^Dask dashboard: (http://\S+) ", err_file.read_text(), re.M)
                if link and status is None:
                    with urllib.request.urlopen(link.group(1), timeout=30) as page:
                        status = page.status
                if len(list(folder.glob("part-*.parquet"))) >= 2:
                    break
                time.sleep(0.05)
            assert proc.poll() is None, err_file.read_text()[-3000:]
            os.killpg(proc.pid, signal.SIGINT)
            out, _ = proc.communicate(timeout=120)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    text = err_file.read_text()
    assert proc.returncode == 130, (proc.returncode, text[-3000:])
    assert status == 200, text[-3000:]
    assert "Traceback" not in text and "KeyboardInterrupt" not in text, text[-3000:]
    assert "never consulted" not in text  # the grid's checks at a stand-in S=256 keep quiet
    saved = len(sweep.load("ctrlc", out=tmp_path / "fa_lab_results"))
    assert 2 <= saved < total
    last = text.strip().splitlines()[-1]
    assert last == (f"fa-lab sweep: interrupted: {saved} of {total} points are saved in "
                    f"{folder}; rerun the same command to resume (the saved points are "
                    f"skipped)"), last
    again = fa_lab(tmp_path, "sweep", str(grid), "--no-progress")
    assert again.returncode == 0, again.stderr
    assert f"{total} points: {saved} already done, {total - saved} computed, 0 failed" \
        in again.stdout
    assert len(pd.read_parquet(folder)) == total  # a plain Parquet read of the folder


@pytest.mark.slow
def test_the_sweep_writes_to_out_dir_and_files_follow_the_umask(tmp_path):
    grid = tmp_path / "g.yaml"
    grid.write_text(yaml.safe_dump({**GRID, "k_scale": [8, 16]}))
    code = ("import os, sys; os.umask(0o027); from fa_lab.cli import main; "
            "sys.exit(main(sys.argv[1:]))")
    r = subprocess.run([sys.executable, "-c", code, "sweep", str(grid), "--out-dir", "mine",
                        "--name", "u", "--no-progress", "--workers", "1"], cwd=tmp_path,
                       env=_env(), capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr
    folder = tmp_path / "mine" / "atlas" / "u"
    assert f"-> {Path('mine') / 'atlas' / 'u'}" in r.stdout or str(folder) in r.stdout
    files = [f for f in folder.iterdir()]
    assert len(files) == 3  # two parts and the grid
    assert all(f.stat().st_mode & 0o777 == 0o640 for f in files), \
        [(f.name, oct(f.stat().st_mode)) for f in files]
    assert not (tmp_path / "fa_lab_results").exists()


def test_an_interrupted_sweeps_cut_fetches_are_not_logged_other_errors_are():
    """Stopping an interrupted sweep closes connections under fetches still waiting: tornado's
    record of such a fetch is dropped while the sweep stops, any other error is logged, and
    nothing is dropped once the sweep has stopped."""
    import logging

    from distributed.comm.core import CommClosedError

    from fa_lab.studies.sweep import cluster

    def record(exc):
        try:
            raise exc
        except Exception:
            return logging.LogRecord("tornado.application", logging.ERROR, __file__, 1,
                                     "Exception in callback", None, sys.exc_info())

    log = logging.getLogger("tornado.application")
    cut, other = record(CommClosedError("in <TCP (closed)>")), record(ValueError("a bug"))
    cluster._quiet_closed_comms(True)
    try:
        assert not log.filter(cut) and log.filter(other)
    finally:
        cluster._quiet_closed_comms(False)
    assert log.filter(cut) and log.filter(other)
