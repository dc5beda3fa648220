"""``fa-lab lab`` from a wheel: the wheel carries the lessons and the data they read
(``fa_lab/_course``), ``fa_lab.results.ROOT`` finds that copy when no checkout holds the
package, and the command copies the lessons into the user's folder, keeping a learner's own
copy, before it opens JupyterLab there. No network: the wheel is built from this checkout
with the build tools already installed."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from fa_lab import cli
from fa_lab.cli import lab
from fa_lab.studies import experiments as ex

REPO = Path(__file__).resolve().parents[2]
LESSONS = sorted(p.name for p in (REPO / "notebooks").glob("*.ipynb"))


class _Server:
    """Stands for the JupyterLab process: records its command and environment."""

    runs: list = []

    def __init__(self, argv, env=None, **_):
        self.argv, self.env, self.pid = argv, env, 0
        _Server.runs.append(self)

    def poll(self):
        return 0

    def wait(self, timeout=None):
        return 0

    def send_signal(self, _sig):
        pass


@pytest.fixture
def installed(tmp_path, monkeypatch):
    """An installed fa_lab's course folder (fa_lab/_course) with two lessons."""
    pytest.importorskip("jupyterlab")
    course = tmp_path / "site" / "fa_lab" / "_course"
    (course / "notebooks").mkdir(parents=True)
    (course / "data" / "results").mkdir(parents=True)
    for name in ("00_tour.ipynb", "glossary.ipynb"):
        (course / "notebooks" / name).write_text(f'{{"lesson": "{name}"}}')
    monkeypatch.setattr(ex, "ROOT", course)
    monkeypatch.setattr(lab.subprocess, "Popen", _Server)
    _Server.runs.clear()
    return course


def test_copies_the_lessons_and_opens_them(installed, tmp_path, monkeypatch):
    monkeypatch.delenv("JUPYTER_CONFIG_PATH", raising=False)
    mine = tmp_path / "mine"
    assert cli.main(["lab", "--dir", str(mine), "--no-browser"]) == 0
    assert sorted(p.name for p in mine.iterdir()) == ["00_tour.ipynb", "glossary.ipynb"]
    (server,) = _Server.runs
    assert server.argv[-1] == str(mine) and "--no-browser" in server.argv
    assert "JUPYTER_CONFIG_PATH" not in server.env        # the checkout's save hook is not there
    assert server.env["OMP_NUM_THREADS"] == "1"


def test_a_learners_copy_is_kept(installed, tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "00_tour.ipynb").write_text("my answers")
    assert cli.main(["lab", "--dir", str(mine), "--no-browser"]) == 0
    assert (mine / "00_tour.ipynb").read_text() == "my answers"
    assert (mine / "glossary.ipynb").exists()


def test_the_default_folder_is_under_the_working_directory(installed, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert cli.main(["lab", "--no-browser"]) == 0
    assert (tmp_path / lab.LESSONS_DIRNAME / "00_tour.ipynb").exists()
    assert _Server.runs[0].argv[-1] == str(tmp_path / lab.LESSONS_DIRNAME)


def test_a_file_in_the_way_is_one_line(installed, tmp_path, capsys):
    (tmp_path / "taken").write_text("")
    with pytest.raises(SystemExit) as e:
        cli.main(["lab", "--dir", str(tmp_path / "taken")])
    assert e.value.code == 2 and "a file, not a folder" in capsys.readouterr().err
    assert not _Server.runs


def test_a_checkout_opens_its_own_notebooks(tmp_path, monkeypatch, capsys):
    pytest.importorskip("jupyterlab")
    monkeypatch.setattr(lab.subprocess, "Popen", _Server)
    assert not lab.installed()
    with pytest.raises(SystemExit) as e:
        cli.main(["lab", "--dir", str(tmp_path)])
    assert e.value.code == 2 and "--dir is for an installed fa_lab" in capsys.readouterr().err


@pytest.mark.slow
def test_the_wheel_carries_the_course(tmp_path):
    """The wheel, built offline from this checkout, holds every lesson and the data they
    read; unpacked, its fa_lab finds them (results.ROOT is its _course folder)."""
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                            "--no-build-isolation", "--no-index", "-w", str(tmp_path), str(REPO)],
                           capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr[-2000:]
    (wheel,) = tmp_path.glob("fa_lab-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for lesson in LESSONS:
        assert f"fa_lab/_course/notebooks/{lesson}" in names, lesson
    for data in ("data/results/attack_lazy_unfixed.json", "data/atlas/bf16_thresholds_cpu.yaml",
                 "data/seed/pr1033_bf16.json"):
        assert f"fa_lab/_course/{data}" in names, data
    parquet = [n for n in names if n.startswith("fa_lab/_course/data/atlas/") and n.endswith(".parquet")]
    assert len(parquet) == len(list((REPO / "data" / "atlas").rglob("*.parquet")))
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    probe = subprocess.run(
        [sys.executable, "-c", "import fa_lab.results as r, fa_lab.cli.lab as lab; "
         "print(r.ROOT); print(lab.installed()); print(len(r.references()))"],
        cwd=tmp_path, env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"},
        capture_output=True, text=True, timeout=120)
    assert probe.returncode == 0, probe.stderr[-2000:]
    root, is_installed, n_refs = probe.stdout.split()
    assert Path(root) == site / "fa_lab" / "_course" and is_installed == "True"
    assert int(n_refs) == len(list((REPO / "data" / "results").glob("*.json")))
