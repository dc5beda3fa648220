"""The clean-checkout promise (issue 31): ``fa-lab table``, ``fa-lab attack`` and ``fa-lab
sweep`` run from the checkout itself (its root as the working directory, no
``$FA_LAB_RESULTS``) write their results to the git-ignored ./fa_lab_results/, and leave
``git status`` as it was and the lab's reference data (data/) byte for byte as it was.
``make test`` runs the lessons under nbval after this, in the same checkout: they still
read their reference data. This test removes the files it made, and only those."""

import hashlib
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import yaml

from fa_lab import results

ROOT = Path(__file__).resolve().parents[2]


def _git(*args) -> str:
    r = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return r.stdout


def _data_digest() -> dict:
    return {str(p.relative_to(ROOT)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted((ROOT / "data").rglob("*")) if p.is_file()}


def _fa_lab(*args):
    env = {k: v for k, v in os.environ.items() if k not in (results.ENV_VAR, "FA_LAB_TRACEBACK")}
    env.update(OMP_NUM_THREADS="1", OMP_WAIT_POLICY="PASSIVE", CUDA_VISIBLE_DEVICES="")
    r = subprocess.run([sys.executable, "-m", "fa_lab", *args], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, (args, r.stdout[-2000:], r.stderr[-3000:])
    return r.stdout


@pytest.mark.skipif(not (ROOT / ".git").exists(), reason="needs a git checkout")
@pytest.mark.slow
def test_cli_runs_in_the_checkout_leave_it_clean(tmp_path):
    status, data = _git("status", "--porcelain"), _data_digest()
    folder = ROOT / results.DEFAULT_DIRNAME
    existed = folder.exists()
    tag = f"clean_checkout_{uuid.uuid4().hex[:8]}"
    made = [folder / f"{tag}_table.json", folder / f"{tag}_attack.json",
            folder / "atlas" / f"{tag}_sweep"]
    grid = tmp_path / "grid.yaml"
    grid.write_text(yaml.safe_dump({"policy": ["lazy_unfixed", "eager"], "k_scale": [64],
                                    "S": [512], "D": [64]}))
    try:
        out = _fa_lab("table", "--which", "bf16", "--S", "512", "--H", "1",
                      "--name", f"{tag}_table")
        assert f"saved {made[0]}" in out
        out = _fa_lab("attack", "lazy_unfixed", "--budget", "5", "--name", f"{tag}_attack")
        assert f"saved {made[1]}" in out
        out = _fa_lab("sweep", str(grid), "--name", f"{tag}_sweep", "--workers", "1",
                      "--no-progress")
        assert f"2 points: 0 already done, 2 computed, 0 failed -> {made[2]}" in out
        assert all(p.exists() for p in made)
        assert _git("check-ignore", str(folder)).strip()
        assert _git("status", "--porcelain") == status  # nothing changed, nothing new
        assert _data_digest() == data  # the reference data the lessons read, as it was
    finally:
        for p in made:
            if p.is_dir():
                shutil.rmtree(p)
            elif p.exists():
                p.unlink()
        if not existed:  # the folder this test made, with nothing of anyone else's in it
            for d in (folder / "atlas", folder):
                if d.is_dir() and not any(d.iterdir()):
                    d.rmdir()
