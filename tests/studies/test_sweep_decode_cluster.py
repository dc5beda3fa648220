"""The decode grid kind on a real Dask LocalCluster (2 worker processes, one torch thread
each), as ``test_sweep.py`` runs the policy grid: rows equal in-process runs bit for bit,
a rerun resumes, a redefined point is recomputed, a failing point is reported and retried,
a bad grid starts nothing, the results go to the user's folder, and ``fa-lab sweep --kind
decode`` runs on an existing scheduler."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import yaml

import fa_lab
from fa_lab.studies import sweep
from fa_lab.studies.sweep import decode_grid

pytestmark = pytest.mark.slow  # a real Dask LocalCluster per module

MAIN, BEFORE = "main-11c4174d", "flydsl-985c653a^"
GRID = {"kind": "decode", "kernel": ["pa_decode_tile"], "upstream": [MAIN, BEFORE],
        "context": [257], "spread": [1.0], "query_length": [4], "num_partitions": [2],
        "scales": ["per_tensor", "per_token"]}


@pytest.fixture(scope="module")
def client():
    c = sweep.local_client(2, gpu=False)
    yield c
    sweep.close_local(c)


def _same(a, b) -> bool:
    if isinstance(a, str) or isinstance(b, str) or a is None or b is None:
        return a == b
    fa, fb = np.float64(a), np.float64(b)
    return bool(np.isnan(fa) and np.isnan(fb)) or fa.tobytes() == fb.tobytes()


def _keys(client, name):
    prefix = f"fa-lab-sweep-{name}-"
    return client.run_on_scheduler(
        lambda dask_scheduler: [str(k) for k in dask_scheduler.tasks if str(k).startswith(prefix)])


def test_rows_equal_in_process_runs_and_a_rerun_resumes(client, tmp_path, capsys):
    grid = sweep.open_grid(GRID)
    table = sweep.run(grid, client=client, out=tmp_path, name="dec")
    err = capsys.readouterr().err
    assert "sweep dec: 4 of 4 points to run" in err and "4/4" in err  # the progress bar
    assert len(table) == 4 and table.attrs["computed"] == 4
    assert (table.torch_threads == 1).all() and table.worker.str.startswith("tcp://").all()
    before = table[table.upstream == BEFORE]
    assert (before[before.scales == "per_token"].nan_rows == 8).all()  # 985c653a's NaN
    assert (table[table.upstream == MAIN].nan_rows == 0).all()
    rows = table.set_index("point_id")
    torch.set_num_threads(1)
    skip = set(sweep.VOLATILE) | {"torch_threads", "git_commit", "point_id"}
    for p in grid.points():
        mine = sweep.compute_decode_point(p)
        for col in sweep.DECODE_SCHEMA.names:
            if col not in skip:
                assert _same(mine.get(col), rows.loc[p["point_id"], col]), (col, p["point_id"])
    again = sweep.run(GRID, client=client, out=tmp_path, name="dec", progress=False)
    assert again.attrs["computed"] == 0 and again.attrs["skipped"] == 4
    wider = sweep.run({**GRID, "spread": [1.0, 2.0]}, client=client, out=tmp_path, name="dec",
                      progress=False)
    assert wider.attrs["computed"] == 4 and wider.attrs["skipped"] == 4 and len(wider) == 8


def test_a_redefined_point_is_recomputed_and_the_sweep_says_so(client, tmp_path, capsys,
                                                               monkeypatch):
    grid = {**GRID, "upstream": [MAIN]}
    first = sweep.run(grid, client=client, out=tmp_path, name="redef", progress=False)
    monkeypatch.setitem(decode_grid.INPUTS, "paged", "another recipe of the same name")
    again = sweep.run(grid, client=client, out=tmp_path, name="redef", progress=False)
    assert again.attrs["computed"] == 2 and again.attrs["redefined"] == {"pa_decode_tile": 2}
    assert "kernel 'pa_decode_tile' changed since the stored run: recomputing 2 points" \
        in capsys.readouterr().err
    assert len(again) == 2 and set(again.point_id).isdisjoint(first.point_id)


def test_a_point_that_raises_is_reported_and_retried(client, tmp_path, monkeypatch):
    grid = {**GRID, "upstream": [MAIN], "scales": ["per_token"], "spread": [1.0, 2.0, 4.0]}
    real = sweep.compute_decode_point

    def flaky(point):  # shipped to the workers by value
        if point["spread"] == 2.0:
            raise ValueError("spread 2 breaks")
        return real(point)

    monkeypatch.setattr(sweep.cluster, "compute_decode_point", flaky)
    with pytest.raises(sweep.SweepError, match=r"(?s)1 point.*spread=2.0.*ValueError: spread 2 breaks") as e:
        sweep.run(grid, client=client, out=tmp_path, name="flaky", progress=False)
    assert sorted(e.value.table.spread) == [1.0, 4.0]
    monkeypatch.setattr(sweep.cluster, "compute_decode_point", real)
    again = sweep.run(grid, client=client, out=tmp_path, name="flaky", progress=False)
    assert again.attrs["computed"] == 1 and sorted(again.spread) == [1.0, 2.0, 4.0]


@pytest.mark.parametrize("change, axis", [({"page_size": [16, 32]}, "page_size"),
                                          ({"query_length": [17]}, "query_length"),
                                          ({"backend": ["triton"]}, "backend")])
def test_a_bad_grid_starts_nothing(client, tmp_path, change, axis):
    with pytest.raises(sweep.GridError, match=f"axis '{axis}'"):
        sweep.run({**GRID, **change}, client=client, out=tmp_path, name="bad", progress=False)
    assert not (tmp_path / "atlas" / "bad").exists() and not _keys(client, "bad")


def test_the_rows_go_to_the_users_folder_never_the_reference_data(client, tmp_path, monkeypatch):
    monkeypatch.delenv(fa_lab.results.ENV_VAR, raising=False)
    monkeypatch.chdir(tmp_path)
    reference = sweep.REFERENCE_ATLAS_DIR
    had = sorted(p.relative_to(reference) for p in reference.rglob("*")) if reference.is_dir() else []
    sweep.run({**GRID, "upstream": [MAIN], "scales": ["per_tensor"]}, client=client,
              name="mine", progress=False)
    assert len(sweep.load("mine", out=tmp_path / "fa_lab_results")) == 1
    now = sorted(p.relative_to(reference) for p in reference.rglob("*")) if reference.is_dir() else []
    assert now == had


def test_the_cli_runs_a_decode_grid_on_an_existing_scheduler(client, tmp_path, capsys):
    from fa_lab import cli

    path = tmp_path / "g.yaml"
    path.write_text(yaml.safe_dump({k: v for k, v in GRID.items() if k != "kind"}))
    argv = ["sweep", str(path), "--scheduler", client.scheduler.address, "--out-dir",
            str(tmp_path), "--name", "cli", "--no-progress"]
    assert cli.main([*argv, "--kind", "decode"]) == 0
    assert "4 points: 0 already done, 4 computed, 0 failed" in capsys.readouterr().out
    path.write_text(yaml.safe_dump(GRID))  # kind: decode in the file
    assert cli.main(argv) == 0
    assert "4 points: 4 already done, 0 computed" in capsys.readouterr().out
    t = sweep.load("cli", out=tmp_path)
    assert set(t.kernel) == {"pa_decode_tile"} and not t.max_err[t.nan_rows == 0].apply(math.isnan).any()
    with pytest.raises(SystemExit) as e:
        cli.main([*argv, "--kind", "policy"])
    assert e.value.code == 2 and "says kind 'decode'" in capsys.readouterr().err
