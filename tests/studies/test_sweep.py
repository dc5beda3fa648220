"""fa_lab.studies.sweep on a real LocalCluster (2 worker processes, one torch thread each).

Nothing is mocked: the cluster is Dask's own, workers are killed with SIGKILL, a whole
sweep is run as `python -m fa_lab.studies.sweep` in a subprocess and killed midway.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pandas as pd
import psutil
import pytest
import torch
import yaml

import fa_lab
from fa_lab.studies import experiments as ex
from fa_lab import metrics, reference
from fa_lab.studies import sweep

pytestmark = pytest.mark.slow  # a real Dask LocalCluster per module


@pytest.fixture(scope="module")
def client():
    c = sweep.local_client(2, gpu=False)  # no GPU resource, even on a GPU machine
    yield c
    sweep.close_local(c)


@pytest.fixture
def one_thread():
    """In-process runs use one torch thread, as the workers do."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _same(a, b) -> bool:
    """Equal bit for bit (floats as float64 bits; NaN only equals NaN)."""
    if a is None or b is None or isinstance(a, str) or isinstance(b, str):
        return (None if _isnan(a) else a) == (None if _isnan(b) else b)
    if isinstance(a, (bool, np.bool_)) or isinstance(b, (bool, np.bool_)):
        return bool(a) == bool(b)
    fa, fb = np.float64(a), np.float64(b)
    if np.isnan(fa) or np.isnan(fb):
        return bool(np.isnan(fa) and np.isnan(fb))
    return fa.tobytes() == fb.tobytes()


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.view(ints[a.element_size()]), b.view(ints[b.element_size()]))


def _isnan(x) -> bool:
    return isinstance(x, float) and math.isnan(x)


def _compare_rows(table: pd.DataFrame, points: list[dict]) -> int:
    """Each point recomputed here with compute_point: every column but the volatile ones
    equals the cluster's row bit for bit. Returns the number of values compared."""
    rows = table.set_index("point_id")
    # git_commit is the code's provenance, read once per process: a test that writes a
    # tracked file in between makes a fresh worker say "-dirty" where this process did not
    skip = set(sweep.VOLATILE) | {"torch_threads", "git_commit"}
    n = 0
    for p in points:
        mine = sweep.compute_point(p)
        theirs = rows.loc[p["point_id"]]
        for col in sweep.SCHEMA.names:
            if col in skip or col == "point_id":
                continue
            assert _same(mine.get(col), theirs[col]), (p["point_id"], col, mine.get(col), theirs[col])
            n += 1
    return n


def _direct(p: dict) -> dict:
    """The point computed through the public API alone (flash_attn_func, count_rescales,
    reference, metrics), independent of compute_point."""
    if p["dtype"] == "fp8":
        (q, k, v), (qd, kd, vd) = ex.fp8_inputs(p["B"], p["S"], p["H"], p["k_scale"],
                                                seed=p["seed"], D=p["D"])
        desc = {"q_descale": qd, "k_descale": kd, "v_descale": vd}
    else:
        q, k, v = ex.bf16_inputs(p["B"], p["S"], p["H"], p["D"], p["k_scale"], seed=p["seed"])
        desc = {}
    kw = dict(causal=p["causal"], rescale=p["policy"], backend=p["backend"], **desc)
    if p["threshold"] is not None:
        kw["rescale_threshold"] = p["threshold"]
    out, lse = fa_lab.flash_attn_func(q, k, v, return_lse=True, **kw)
    ref, _ = reference.attention(q, k, v, causal=p["causal"], **desc)
    stats = metrics.summarize(out, ref, lse)
    if p["dtype"] == "bf16":
        c = fa_lab.count_rescales(q, k, v, **kw)
        assert _bits_equal(c.pop("out"), out) and _bits_equal(c.pop("lse"), lse)
        stats.update(c)
    return stats


def _scheduler_keys(client, name: str) -> list:
    prefix = f"fa-lab-sweep-{name}-"
    return client.run_on_scheduler(
        lambda dask_scheduler: [str(k) for k in dask_scheduler.tasks if str(k).startswith(prefix)])


# ---- (a) the cluster's rows equal in-process runs bit for bit ----------------------------

def test_results_equal_in_process_bit_for_bit(client, tmp_path, one_thread):
    bf16 = sweep.Grid({"policy": ["eager", "lazy", "lazy_unfixed", "fa4_row"], "k_scale": [8, 48],
                       "threshold": [None, 4], "seqlen": [200, 512], "causal": [False, True],
                       "head_dim": [64]})
    fp8 = sweep.Grid({"policy": ["eager", "lazy_unfixed", "lazy_capped"], "dtype": ["fp8"],
                      "k_scale": [1000, 20000], "S": [512], "H": [2], "seed": [0, 1]})
    points = bf16.points() + fp8.points()
    # eager has no threshold: its points are not repeated per threshold
    assert len(bf16.points()) == 2 * 2 * 2 + 3 * 2 * 2 * 2 * 2
    assert {p["threshold_asked"] for p in bf16.points() if p["policy"] == "eager"} == {"n/a"}
    sweep.run(bf16, client=client, out=tmp_path, name="a", progress=False)
    table = sweep.run(fp8, client=client, out=tmp_path, name="a", progress=False)
    assert len(table) == len(points) == table.attrs["points"] + len(bf16.points())
    assert table.point_id.is_unique and set(table.point_id) == {p["point_id"] for p in points}
    assert (table.torch_threads == 1).all() and table.worker.str.startswith("tcp://").all()
    assert table.nan_rows.sum() > 0  # the grid reaches the failure region
    assert (table.loop_wave_steps.notna() == (table.dtype == "bf16")).all()

    assert _compare_rows(table, points) > 50 * len(points)
    rows = table.set_index("point_id")
    for p in points:  # and through the public API alone
        direct = _direct(p)
        row = rows.loc[p["point_id"]]
        for key, value in direct.items():
            assert _same(value, row[key]), (p["point_id"], key, value, row[key])


def test_policy_objects_and_registered_names(client, tmp_path, one_thread):
    """A grid takes policy objects (a declarative Policy, a Python rule) and names that only
    this process registered: the workers receive the objects."""
    Policy = fa_lab.policies.Policy
    capped = Policy("wave", "capped", rebase_bound=8.0, name="sweep_capped8")
    rule = Policy.from_rule(lambda m, mt, thr: torch.maximum(m, mt), name="sweep_rule_max")
    fa_lab.policies.register(Policy("wave", "tile", name="sweep_registered"), replace=True)
    try:
        grid = sweep.Grid({"policy": [capped, rule, "sweep_registered"], "k_scale": [8, 64],
                           "S": [512], "D": [64]})
        table = sweep.run(grid, client=client, out=tmp_path, name="objects", progress=False)
        assert sorted(set(table.policy)) == ["sweep_capped8", "sweep_registered", "sweep_rule_max"]
        assert table.attrs["computed"] == 6 and table.attrs["failed"] == 0
        _compare_rows(table, grid.points())
        # the registered name ran as the unfixed rebase it names
        unfixed = sweep.Grid({"policy": ["lazy_unfixed"], "k_scale": [8, 64], "S": [512], "D": [64]})
        mine = {p["k_scale"]: sweep.compute_point(p)["nan_rows"] for p in unfixed.points()}
        got = table[table.policy == "sweep_registered"].set_index("k_scale").nan_rows
        assert {k: got[k] for k in mine} == mine and max(mine.values()) > 0
    finally:
        fa_lab.policies.unregister("sweep_registered")


# ---- (b) + CI size: 200 points, one worker killed mid-sweep -----------------------------

def test_200_point_grid_survives_a_killed_worker(client, tmp_path, one_thread):
    grid = sweep.Grid({"policy": ["lazy", "lazy_unfixed"],
                       "k_scale": [4, 8, 12, 16, 24, 32, 48, 64, 96, 128],
                       "threshold": [2, 4, 6, 8, 10], "S": [256, 512], "H": [1], "D": [64]})
    assert len(grid) == 200
    name = "ci200"
    outdir = tmp_path / "atlas" / name
    result, error = {}, []

    def go():
        try:
            result["table"] = sweep.run(grid, client=client, out=tmp_path, name=name, progress=False)
        except BaseException as e:  # noqa: BLE001 - reported below
            error.append(e)

    t0 = time.perf_counter()
    thread = threading.Thread(target=go)
    thread.start()
    deadline = time.monotonic() + 120
    victim, keys = None, []
    while time.monotonic() < deadline and thread.is_alive():
        if len(list(outdir.glob("part-*.parquet"))) >= 20:
            busy = {w: [k for k in ks if str(k).startswith(f"fa-lab-sweep-{name}-")]
                    for w, ks in client.processing().items()}
            busy = {w: ks for w, ks in busy.items() if ks}
            if busy:
                victim, keys = next(iter(busy.items()))
                break
        time.sleep(0.02)
    assert victim is not None, "the sweep ended before a worker could be killed mid-sweep"
    pid = client.run(os.getpid, workers=[victim])[victim]
    os.kill(pid, signal.SIGKILL)
    parts_at_kill = len(list(outdir.glob("part-*.parquet")))
    thread.join(300)
    wall = time.perf_counter() - t0
    assert not thread.is_alive() and not error, error
    assert parts_at_kill < 200, "the kill did not land mid-sweep"
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE

    table = result["table"]
    assert table.attrs["computed"] == 200 and table.attrs["failed"] == 0
    assert len(table) == 200 and table.point_id.is_unique
    assert len(list(outdir.glob("part-*.parquet"))) == 200
    # the points the victim held when it was picked are each there once: those it finished
    # before the kill (it may finish some between the pick and the signal) carry its pid,
    # the rest ran again in another worker process
    lost = {k.rsplit("-", 1)[1] for k in keys}
    held = table[table.point_id.isin(lost)]
    assert len(held) == len(lost)
    rerun = held[held.pid != pid]
    assert (rerun.worker != victim).all(), rerun[["point_id", "worker", "pid"]]
    assert (table.torch_threads == 1).all()
    print(f"\n200 points on 2 workers, one killed: {wall:.1f} s wall, "
          f"{table.wall_s.sum():.1f} s of point time")
    client.wait_for_workers(2, timeout=120)  # the nanny restarts it
    # a sample recomputed in-process, bit for bit
    points = {p["point_id"]: p for p in grid.points()}
    sample = [points[i] for i in sorted(points)[::20]] + [points[i] for i in sorted(lost)]
    _compare_rows(table, sample)


# ---- (c) a whole sweep killed midway; the rerun computes only what is missing -----------

def test_a_point_that_raises_is_reported_and_retried(client, tmp_path, monkeypatch):
    grid = sweep.Grid({"policy": ["lazy"], "k_scale": [4, 8, 16], "S": [256], "H": [1], "D": [64]})
    real = sweep.compute_point

    def flaky(point, **kw):  # shipped to the workers by value
        if point["k_scale"] == 8:
            raise ValueError("k_scale 8 breaks")
        return real(point, **kw)

    monkeypatch.setattr(sweep.cluster, "compute_point", flaky)
    with pytest.raises(sweep.SweepError, match=r"(?s)1 point.*ValueError: k_scale 8 breaks") as info:
        sweep.run(grid, client=client, out=tmp_path, name="flaky", progress=False)
    assert len(info.value.failures) == 1
    assert sorted(info.value.table.k_scale) == [4, 16]   # the others' rows were written
    monkeypatch.setattr(sweep.cluster, "compute_point", real)
    again = sweep.run(grid, client=client, out=tmp_path, name="flaky", progress=False)
    assert again.attrs["computed"] == 1 and again.attrs["skipped"] == 2
    assert sorted(again.k_scale) == [4, 8, 16]


def test_killed_sweep_resumes_with_only_the_missing_points(client, tmp_path, one_thread):
    spec = {"name": "resume", "policy": ["lazy_unfixed", "eager"], "k_scale": [32, 64],
            "S": [1536], "D": [64], "seed": [0, 1, 2, 3]}
    grid_file = tmp_path / "grid.yaml"
    grid_file.write_text(yaml.safe_dump(spec))
    total = len(sweep.Grid.from_yaml(grid_file))
    assert total == 16
    outdir = tmp_path / "atlas" / "resume"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"}
    log = open(tmp_path / "sweep.log", "wb")
    # the CLI, with its own LocalCluster (client=None)
    proc = subprocess.Popen([sys.executable, "-m", "fa_lab", "sweep", str(grid_file), "--out-dir",
                             str(tmp_path), "--no-progress"], env=env, stdout=log,
                            stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and proc.poll() is None:
            if len(list(outdir.glob("part-*.parquet"))) >= 2:
                break
            time.sleep(0.02)
        assert proc.poll() is None, (tmp_path / "sweep.log").read_text()[-3000:]
        children = psutil.Process(proc.pid).children(recursive=True)
        proc.send_signal(signal.SIGKILL)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        log.close()
    # its workers exit when their parent is gone
    gone, alive = psutil.wait_procs(children, timeout=60)
    for p in alive:
        p.kill()
    assert not alive, f"workers outlived the killed sweep: {alive}"
    before = sweep.load("resume", out=tmp_path)
    assert 2 <= len(before) < total, "the kill did not land mid-sweep"
    assert (before.torch_threads == 1).all()  # the default LocalCluster's workers
    assert not list(outdir.glob("part-*.tmp"))
    mtimes = {f.name: f.stat().st_mtime_ns for f in outdir.glob("part-*.parquet")}

    table = sweep.run(sweep.Grid.from_yaml(grid_file), client=client, out=tmp_path, progress=False)
    assert table.attrs["skipped"] == len(before)
    assert table.attrs["computed"] == total - len(before)
    assert len(table) == total and table.point_id.is_unique
    first = table[table.point_id.isin(before.point_id)]
    assert (first.run_id == before.run_id.iloc[0]).all()  # not recomputed
    assert (table[~table.point_id.isin(before.point_id)].run_id == table.attrs["run_id"]).all()
    assert all(f.stat().st_mtime_ns == mtimes[f.name] for f in outdir.glob("part-*.parquet")
               if f.name in mtimes)
    # the killed run's rows equal the rerun's computation of the same points
    pts = {p["point_id"]: p for p in sweep.Grid.from_yaml(grid_file).points()}
    _compare_rows(table, [pts[i] for i in before.point_id[:2]])
    # nothing left to do
    again = sweep.run(sweep.Grid.from_yaml(grid_file), client=client, out=tmp_path, progress=False)
    assert again.attrs["computed"] == 0 and again.attrs["skipped"] == total


# ---- (d) a bad grid is refused before any task, naming the axis -------------------------

def _tiny_inputs(dtype: str):
    if dtype == "fp8":
        (q, k, v), (qd, kd, vd) = ex.fp8_inputs(1, 256, 1, 1.0)
        return (q, k, v), {"q_descale": qd, "k_descale": kd, "v_descale": vd}
    return ex.bf16_inputs(1, 256, 1, 128, 1.0), {}


def _unrunnable_pairs() -> list[tuple]:
    """(policy, dtype, backend) that fa_lab itself refuses, found by asking it."""
    candidates = [("fa4_row", "fp8", "interpret"), ("lazy_capped", "bf16", "interpret"),
                  ("fa4_row", "fp8", "emulator"), ("lazy_capped", "bf16", "emulator"),
                  ("no_such_policy", "bf16", "emulator")]
    Policy = getattr(fa_lab.policies, "Policy", None)
    if Policy is not None and hasattr(Policy, "from_rule"):
        rule = Policy.from_rule(lambda m, mt, thr: m, name="keep_m")
        candidates.append((rule, "bf16", "interpret"))
    found = []
    for pol, dtype, backend in candidates:
        inputs, desc = _tiny_inputs(dtype)
        try:
            fa_lab.flash_attn_func(*inputs, **desc, rescale=pol, backend=backend)
        except Exception:  # noqa: BLE001 - refused: that is what we look for
            found.append((pol, dtype, backend))
    return found


BASE = {"policy": ["lazy"], "k_scale": [8], "S": [256], "D": [64]}


@pytest.mark.parametrize("change, axis", [
    ({"kscale": [8]}, "kscale"),                # unknown axis
    ({"threshold": []}, "threshold"),           # empty axis
    ({"seqlen": []}, "seqlen"),                 # empty, spelled by its alias
    ({"S": [256, 0]}, "S"),                     # bad value
    ({"D": [96]}, "D"),                         # a head dim no kernel takes
    ({"threshold": ["by_kv_len"]}, "threshold"),  # the fp8 rule on bf16
    ({"backend": ["auto"]}, "backend"),
    ({"k_scale": [8, 8.0]}, "k_scale"),         # a repeated value
])
def test_bad_grid_is_refused_naming_the_axis(client, tmp_path, change, axis):
    changed = {sweep.ALIASES.get(a, a) for a in change}
    spec = {a: v for a, v in BASE.items() if a not in changed} | change
    with pytest.raises(sweep.GridError, match=f"axis '{axis}'") as e:
        sweep.run(spec, client=client, out=tmp_path, name="bad", progress=False)
    assert e.value.axis == axis
    assert not (tmp_path / "atlas" / "bad").exists() and not _scheduler_keys(client, "bad")


def test_unrunnable_policy_backend_pairs_are_refused(client, tmp_path):
    pairs = _unrunnable_pairs()
    assert len(pairs) >= 2
    for pol, dtype, backend in pairs:
        grid = {"policy": ["lazy", pol], "k_scale": [8], "S": [256], "dtype": [dtype],
                "backend": [backend]}
        with pytest.raises(sweep.GridError, match="axis 'policy'") as e:
            sweep.run(grid, client=client, out=tmp_path, name="bad", progress=False)
        assert str(getattr(pol, "name", pol)) in str(e.value) and backend in str(e.value)
        assert not (tmp_path / "atlas" / "bad").exists() and not _scheduler_keys(client, "bad")


def test_gpu_points_need_a_gpu_worker(client, tmp_path):
    grid = {**BASE, "backend": ["emulator", "triton"]}
    with pytest.raises(sweep.GridError, match="axis 'backend'.*GPU=1"):
        sweep.run(grid, client=client, out=tmp_path, name="bad", progress=False)
    assert not (tmp_path / "atlas" / "bad").exists() and not _scheduler_keys(client, "bad")


# ---- the grid, the table and the command line -------------------------------------------

def test_grid_from_yaml_and_its_points(tmp_path):
    path = tmp_path / "g.yaml"
    path.write_text("axes:\n  policy: [lazy, eager]\n  k_scale: 8\n  seqlen: [256, 512]\n"
                    "  threshold: [4, 8]\nname: mine\n")
    g = sweep.Grid.from_yaml(path)
    assert g.name == "mine" and g.axes["S"] == (256, 512) and g.axes["k_scale"] == (8.0,)
    pts = g.points()
    assert len(pts) == 2 * 2 + 2  # eager: one point per S, its threshold "n/a"
    assert len({p["point_id"] for p in pts}) == len(pts)
    again = sweep.Grid({"policy": ["lazy"], "k_scale": [8.0], "S": [256], "threshold": [4.0]})
    assert again.points()[0]["point_id"] == pts[0]["point_id"]  # ids do not depend on spelling
    with pytest.raises(sweep.GridError, match="axis 'policy': missing"):
        sweep.Grid({"k_scale": [8], "S": [256]})
    with pytest.raises(ValueError, match="sweep name"):
        sweep.run(BASE, name="../x")


def test_load_ignores_temp_files_and_compact_merges(client, tmp_path):
    grid = {**BASE, "k_scale": [8, 16, 32]}
    table = sweep.run(grid, client=client, out=tmp_path, name="small", progress=False)
    (tmp_path / "atlas" / "small" / ".tmp-leftover.parquet").write_bytes(b"half a file")
    assert sweep.load("small", out=tmp_path).equals(table)
    merged = sweep.compact("small", out=tmp_path)
    assert [p.name for p in (tmp_path / "atlas" / "small").glob("part-*.parquet")] == [merged.name]
    assert sweep.load("small", out=tmp_path).equals(table)
    assert sweep.run(grid, client=client, out=tmp_path, name="small", progress=False).attrs["computed"] == 0


def test_the_sweep_command_parses_its_flags(capsys):
    from fa_lab import cli
    import fa_lab.cli.sweep

    args = cli.build_parser().parse_args(["sweep", "g.yaml", "--scheduler", "tcp://h:8786",
                                          "--name", "n", "--workers", "3", "--import", "p.py"])
    assert (args.grid, args.scheduler, args.name, args.workers, args.imports) == (
        "g.yaml", "tcp://h:8786", "n", 3, ["p.py"])
    assert args._run is fa_lab.cli.sweep.run
    with pytest.raises(SystemExit) as e:
        cli.main(["sweep", "/no/such/grid.yaml"])
    assert e.value.code == 2 and len(capsys.readouterr().err.strip().splitlines()) == 1


def test_cli_runs_on_an_existing_scheduler(client, tmp_path, capsys):
    path = tmp_path / "g.yaml"
    path.write_text(yaml.safe_dump({**BASE, "k_scale": [8, 16]}))
    argv = [str(path), "--scheduler", client.scheduler.address, "--out-dir", str(tmp_path),
            "--name", "cli", "--no-progress"]
    from fa_lab import cli

    assert cli.main(["sweep", *argv]) == 0
    assert "2 points: 0 already done, 2 computed, 0 failed" in capsys.readouterr().out
    assert cli.main(["sweep", *argv]) == 0
    assert "2 points: 2 already done, 0 computed" in capsys.readouterr().out
    assert len(sweep.load("cli", out=tmp_path)) == 2


# ---- (e) where a sweep lives, read back (issue 31) --------------------------------------

def test_a_sweep_folder_reads_with_plain_read_parquet(client, tmp_path):
    """The folder holds the parts and, beside them, the grid as _grid-<hash>.json, which
    pyarrow skips: pandas.read_parquet(folder) is the sweep's rows."""
    table = sweep.run({**BASE, "k_scale": [8, 16]}, client=client, out=tmp_path, name="plain",
                      progress=False)
    folder = tmp_path / sweep.ATLAS / "plain"
    assert folder == sweep.sweep_dir("plain", tmp_path)
    grids = list(folder.glob("_grid-*.json"))
    assert len(grids) == 1 and json.loads(grids[0].read_text())["axes"]["k_scale"] == [8, 16]
    plain = pd.read_parquet(folder)
    assert sorted(plain.point_id) == sorted(table.point_id) and list(plain.columns) == \
        list(sweep.SCHEMA.names)


def test_the_reference_atlases_read_through_reference_and_read_parquet():
    assert {"bf16_seed_h200", "fp8_seed_h200"} <= set(sweep.references())
    ref = sweep.reference("fp8_seed_h200")
    assert len(ref) == 114 and set(ref.dtype) == {"fp8"}
    plain = pd.read_parquet(sweep.REFERENCE_ATLAS_DIR / "fp8_seed_h200")
    assert sorted(plain.point_id) == sorted(ref.point_id)
    with pytest.raises(FileNotFoundError, match=r"no reference sweep 'nope'.*bf16_seed_h200"):
        sweep.reference("nope")


def test_load_of_a_missing_sweep_names_the_folder_and_the_sweeps_there(tmp_path):
    (tmp_path / sweep.ATLAS / "have_one").mkdir(parents=True)
    with pytest.raises(FileNotFoundError) as e:
        sweep.load("nope", out=tmp_path)
    assert str(tmp_path / sweep.ATLAS / "nope") in str(e.value) and "have_one" in str(e.value)


def test_a_sweep_goes_to_the_results_folder_by_default(tmp_path, monkeypatch):
    monkeypatch.delenv(fa_lab.results.ENV_VAR, raising=False)
    monkeypatch.chdir(tmp_path)
    assert sweep.sweep_dir("x") == tmp_path / "fa_lab_results" / "atlas" / "x"
    monkeypatch.setenv(fa_lab.results.ENV_VAR, str(tmp_path / "mine"))
    assert sweep.sweep_dir("x") == tmp_path / "mine" / "atlas" / "x"


@pytest.mark.parametrize("damage", ["truncated", "not_parquet", "missing_column"])
def test_a_malformed_part_names_the_file_and_what_is_wrong(client, tmp_path, damage):
    sweep.run({**BASE, "k_scale": [8, 16]}, client=client, out=tmp_path, name="m",
              progress=False)
    folder = sweep.sweep_dir("m", tmp_path)
    victim = sorted(folder.glob("part-*.parquet"))[0]
    if damage == "truncated":
        victim.write_bytes(victim.read_bytes()[:200])
        need = "not a readable Parquet part"
    elif damage == "not_parquet":
        victim.write_text("point_id,policy\n1,lazy\n")
        need = "not a readable Parquet part"
    else:
        pd.read_parquet(victim).drop(columns=["rel_l2", "seed"]).to_parquet(victim)
        need = "missing column(s) seed, rel_l2"  # in SCHEMA's order
    for read in (lambda: sweep.load("m", out=tmp_path), lambda: sweep.done_points("m", out=tmp_path)):
        with pytest.raises(ValueError) as e:
            read()
        assert type(e.value) is ValueError and str(victim) in str(e.value), str(e.value)
        assert need in str(e.value), str(e.value)


@pytest.mark.parametrize("text,needle", [
    ("policy: [lazy\nk_scale: [8]\nS: [256]\n", "not valid YAML at line"),
    ("policy: lazy\n  k_scale: [8]\n", "not valid YAML at line 2"),
    ("- lazy\n- eager\n", "holds list"),
    ("", "holds nothing"),
])
def test_from_yaml_names_the_file_and_what_is_wrong(tmp_path, text, needle):
    path = tmp_path / "g.yaml"
    path.write_text(text)
    with pytest.raises(ValueError) as e:
        sweep.Grid.from_yaml(path)
    assert str(path) in str(e.value) and needle in str(e.value), str(e.value)
    assert len(str(e.value).splitlines()) == 1
    with pytest.raises(FileNotFoundError, match="no grid file"):
        sweep.Grid.from_yaml(tmp_path / "missing.yaml")


# ---- issue 36: a point's identity is what it computes; the dashboard on loopback -------------

def test_a_redefined_policy_is_recomputed_and_the_sweep_says_so(client, tmp_path, capsys):
    """The user's scenario: policy 'mine' (rebase tile, threshold 4) swept, then redefined
    under the same name (rebase max, threshold 5) and swept again. The rerun recomputes the
    point, says so, and the table holds the new definition's numbers only."""
    grid = {"policy": ["mine"], "k_scale": [40], "S": [512], "D": [64]}
    try:
        fa_lab.policies.register(fa_lab.Policy("wave", "tile", threshold=4.0, name="mine"))
        first = sweep.run(grid, client=client, out=tmp_path, name="redef", progress=False)
        assert first.nan_frac[0] > 0
        again = sweep.run(grid, client=client, out=tmp_path, name="redef", progress=False)
        assert again.attrs["computed"] == 0 and again.attrs["skipped"] == 1  # same definition
        fa_lab.policies.register(fa_lab.Policy("wave", "max", threshold=5.0, name="mine"),
                                 replace=True)
        capsys.readouterr()
        table = sweep.run(grid, client=client, out=tmp_path, name="redef", progress=False)
    finally:
        fa_lab.policies.unregister("mine")
    err = capsys.readouterr().err
    assert (table.attrs["computed"], table.attrs["skipped"]) == (1, 0)
    assert len(table) == 1 and table.nan_frac[0] == 0 and table.threshold_used[0] == 5.0
    assert table.point_id[0] != first.point_id[0]
    assert "sweep redef: policy 'mine' changed since the stored run: recomputing 1 point" in err
    assert table.attrs["redefined"] == {"mine": 1} and first.attrs["redefined"] == {}


def test_a_rule_policys_identity_is_its_source_and_what_it_closes_over():
    from fa_lab.numerics import fmax
    from fa_lab.studies.sweep.grid import policy_definition

    def make(cap):
        return fa_lab.Policy.from_rule(lambda m, mt, thr: fmax(m, mt - cap), name="r")
    assert policy_definition(make(1.0)) == policy_definition(make(1.0))
    assert policy_definition(make(1.0)) != policy_definition(make(2.0))
    a = fa_lab.Policy("wave", "tile", name="x", color="#123456", description="one")
    b = fa_lab.Policy("wave", "tile", name="y", color="#654321", description="two")
    assert policy_definition(a) == policy_definition(b)   # labels change nothing computed
    assert policy_definition(a) != policy_definition(
        fa_lab.Policy("wave", "tile", name="x", semantics=fa_lab.semantics.Semantics(block_n=128)))


def test_a_redefined_rule_is_recomputed(client, tmp_path, capsys):
    """A Python rule registered under one name, swept, then registered again under that
    name with another value it closes over: the rerun recomputes the point and says so,
    and an unchanged rule is still resumed."""
    from fa_lab.numerics import fmax

    def make(cap):
        return fa_lab.Policy.from_rule(lambda m, mt, thr: fmax(m, mt - cap), name="rule_redef")
    grid = {"policy": ["rule_redef"], "k_scale": [40], "S": [512], "D": [64]}
    try:
        fa_lab.policies.register(make(0.0))
        first = sweep.run(grid, client=client, out=tmp_path, name="rule_redef", progress=False)
        fa_lab.policies.register(make(0.0), replace=True)  # the same definition, a new object
        same = sweep.run(grid, client=client, out=tmp_path, name="rule_redef", progress=False)
        fa_lab.policies.register(make(30.0), replace=True)
        capsys.readouterr()
        table = sweep.run(grid, client=client, out=tmp_path, name="rule_redef", progress=False)
    finally:
        fa_lab.policies.unregister("rule_redef")
    assert (first.attrs["computed"], same.attrs["computed"], same.attrs["skipped"]) == (1, 0, 1)
    assert (table.attrs["computed"], table.attrs["skipped"]) == (1, 0)
    assert "policy 'rule_redef' changed since the stored run: recomputing 1 point" in \
        capsys.readouterr().err
    assert table.point_id[0] != first.point_id[0]


def test_the_dask_dashboard_listens_on_loopback_only(client):
    """A LocalCluster's dashboard at ":0" listens on every interface (0.0.0.0) while the
    sweep prints http://127.0.0.1:...: every listening socket of the sweep's cluster (this
    process's scheduler and dashboard, and its workers) is on loopback."""
    procs = [psutil.Process(), *psutil.Process().children(recursive=True)]
    listening = []
    for p in procs:
        conns = getattr(p, "net_connections", p.connections)(kind="inet")
        listening += [c.laddr for c in conns if c.status == psutil.CONN_LISTEN]
    port = int(client.dashboard_link.split(":")[-1].split("/")[0])
    assert any(a.port == port for a in listening), (port, listening)
    assert listening and all(a.ip in ("127.0.0.1", "::1") for a in listening), listening


def test_a_grid_of_too_many_points_is_refused_before_planning(monkeypatch):
    monkeypatch.setattr(sweep.grid, "_plan", lambda *a, **k: pytest.fail("planned"))
    with pytest.raises(sweep.GridError, match=r"^axis 'S': the grid has 1,000,000 points "
                                              r"\(S\[1000\] × k_scale\[1000\]\), more than a "
                                              r"sweep takes \(100,000\)"):
        sweep.Grid({"policy": ["lazy"], "k_scale": list(range(1, 1001)),
                    "S": list(range(1, 1001))})


def test_the_workers_run_each_point_as_planned_without_planning_again(client, tmp_path,
                                                                       monkeypatch):
    """Routing runs in this process once per distinct call, when the grid is expanded;
    the workers route nothing (they run the point's decision: ``api.plan_decided``)."""
    from fa_lab import dispatch

    def install(restore=False):  # nested: shipped to the workers by value
        from fa_lab import dispatch as d
        state = vars(d).setdefault("_test_route_counter", {})  # this worker's count
        if restore:
            if "route" in state:
                setattr(d, "route", state.pop("route"))
            return 0
        if "route" not in state:
            state["route"] = d.route

            def counting(*a, **kw):
                state["n"] += 1
                return state["route"](*a, **kw)
            setattr(d, "route", counting)
        state["n"] = 0
        return 0

    def routes():
        from fa_lab import dispatch as d
        return vars(d)["_test_route_counter"]["n"]

    here = [0]
    real = dispatch.route

    def counting(*a, **kw):
        here[0] += 1
        return real(*a, **kw)
    monkeypatch.setattr(dispatch, "route", counting)
    client.run(install)
    try:
        grid = sweep.Grid({"policy": ["lazy_unfixed", "eager"], "k_scale": [4, 8], "S": [512],
                           "H": [1], "threshold": [4]})
        table = sweep.run(grid, client=client, out=tmp_path, name="planned_once", progress=False)
        assert len(table) == 4
        assert here[0] == 2  # two distinct calls
        assert sum(client.run(routes).values()) == 0
    finally:
        client.run(install, restore=True)
