"""The decode grid kind of the sweep (``sweep.DecodeGrid``, ``kind: decode``), in process:
its points (each kernel's axes, its versions, what it fixes), their identity, the entry
points' own checks naming the axis of a bad value before any work, each row against the
kernel called here and the fp64 reference, and its store. On a real Dask cluster:
``test_sweep_decode_cluster.py``."""

from __future__ import annotations

import dataclasses
import math

import pandas as pd
import pytest
import torch

from fa_lab import decode, mla, upstream
from fa_lab.kernels import mla_decode, pa_decode
from fa_lab.studies import decode_table, mla_mass_loss, sweep
from fa_lab.studies.sweep import decode_grid, store

MAIN, BEFORE = "main-11c4174d", "flydsl-985c653a^"
BASE = {"kind": "decode", "kernel": ["pa_decode_tile"], "context": [257], "spread": [1.0]}


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_each_kernel_runs_its_own_axes_and_versions():
    g = sweep.open_grid({**BASE, "kernel": ["pa_decode_tile", "pa_decode_swa", "mla_decode"],
                         "upstream": [MAIN, BEFORE], "page_size": [16, 64], "window": [300],
                         "query_len": [1, 4], "scales": ["per_tensor", "per_token"]})
    assert isinstance(g, sweep.DecodeGrid) and g.kind == "decode"
    pts = g.points()
    by = {k: [p for p in pts if p["kernel"] == k] for k in decode_grid.KERNELS}
    assert len(by["pa_decode_tile"]) == 2 * 2 * 2 * 2   # versions x pages x QL x scales
    assert len(by["pa_decode_swa"]) == 2 * 2 * 2        # its page is fixed at 1024
    assert len(by["mla_decode"]) == 1                   # one version, none of the paged axes
    assert {p["page_size"] for p in by["pa_decode_swa"]} == {1024}
    assert {p["window"] for p in by["pa_decode_tile"]} == {0}
    (m,) = by["mla_decode"]
    assert (m["upstream"], m["page_size"], m["query_length"], m["scales"], m["group"],
            m["head_dim"]) == (MAIN, 1, 1, "n/a", 128, 576)
    assert math.isnan(by["pa_decode_tile"][0]["p_headroom"])
    assert len({p["point_id"] for p in pts}) == len(pts)
    # ids depend on what is computed, not on spelling
    again = sweep.DecodeGrid({"kernel": "pa_decode_tile", "contexts": 257, "spread": 1,
                              "query_length": [4], "upstream": [BEFORE], "page_size": [64],
                              "scales": ["per_token"], "partitions": [1]})
    (p,) = again.points()
    assert p["point_id"] in {q["point_id"] for q in by["pa_decode_tile"]}


def test_the_point_id_covers_the_resolved_definition(monkeypatch):
    def one(**kw):
        (p,) = sweep.DecodeGrid({**BASE, **kw}).points()
        return p

    a = one(num_partitions=[0])              # 0: upstream's recommended count
    assert a["num_partitions_used"] == decode.recommended_splits(1, 1, 16)
    assert a["point_id"] != one(num_partitions=[a["num_partitions_used"]])["point_id"]
    # a kernel's version redefined under its name makes new points
    changed = dataclasses.replace(upstream.DECODE_VERSIONS[MAIN], remask_p=False)
    base_id = one()["point_id"]
    monkeypatch.setitem(upstream.DECODE_VERSIONS, MAIN, changed)
    assert one()["point_id"] != base_id
    monkeypatch.undo()
    assert one()["point_id"] == base_id
    monkeypatch.setitem(decode_grid.INPUTS, "paged", "another recipe")
    assert one()["point_id"] != base_id


@pytest.mark.parametrize("change, axis, words", [
    ({"page_size": [16, 32]}, "page_size", "page size 32 is not supported by pa_decode_tile"),
    ({"query_len": [1, 17]}, "query_len", "query_length 17 must be 1..16"),
    ({"num_partitions": [99]}, "num_partitions", "num_partitions must be an int in 1.."),
    ({"head_dim": [96]}, "head_dim", "head_dim 96 is not supported"),
    ({"kernel": ["pa_decode_swa"], "window": [0]}, "window", "sliding_window must be a positive"),
    ({"kernel": ["pa_decode_swa"], "head_dim": [256]}, "head_dim", "pa_decode_swa"),
    ({"kernel": ["pa_decode_swa"], "num_partitions": [0]}, "num_partitions",
     "max_context_partition_num"),
    ({"kernel": ["mla_decode"], "p_headroom": [9.0]}, "p_headroom", "p_headroom must be"),
    ({"kernel": ["mla_decode"], "num_kv_splits": [0]}, "num_kv_splits", "num_kv_splits must be >= 1"),
    ({"kernel": ["mla_decode"], "upstream": [BEFORE]}, "upstream", "none of the grid's kernels"),
    ({"kernel": ["pa_decode_tile", "mla_decode"], "upstream": [BEFORE]}, "upstream",
     "kernel 'mla_decode' has none of the versions"),
    ({"upstream": ["fixed"]}, "upstream", "'fixed'"),
    ({"kernel": ["flash"]}, "kernel", "not a decode kernel"),
    ({"backend": ["auto"]}, "backend", "not a backend"),
    ({"scales": ["per_block"]}, "scales", "not a scale mode"),
    ({"spread": [-1.0]}, "spread", ">= 0"),
    ({"context": [True]}, "context", "not an int"),
    ({"seed": [0, 0]}, "seed", "repeated"),
    ({"group": []}, "group", "empty"),
    ({"page": [16]}, "page", "unknown axis"),
])
def test_a_bad_value_is_refused_naming_the_axis(change, axis, words):
    with pytest.raises(sweep.GridError, match=f"axis '{axis}'") as e:
        sweep.open_grid({**BASE, **change}).points()
    assert e.value.axis == axis and words in str(e.value), str(e.value)


def test_the_checks_are_the_entry_points_own_each_distinct_call_once(monkeypatch):
    calls = []
    for mod, name in ((decode, "check_call"), (decode, "check_sw_call"), (mla, "check_call")):
        real = getattr(mod, name)

        def counting(*a, _real=real, _name=name, _mod=mod.__name__, **kw):
            calls.append(f"{_mod}.{_name}")
            return _real(*a, **kw)
        monkeypatch.setattr(mod, name, counting)
    g = sweep.DecodeGrid({**BASE, "kernel": ["pa_decode_tile", "pa_decode_swa", "mla_decode"],
                          "spread": [0.5, 1, 4], "seed": [0, 1]})
    assert len(g.points()) == 3 * 3 * 2
    assert sorted(calls) == ["fa_lab.decode.check_call", "fa_lab.decode.check_sw_call",
                             "fa_lab.mla.check_call"]


def test_a_grid_of_too_many_points_is_refused_before_planning(monkeypatch):
    monkeypatch.setattr(decode_grid, "_plan", lambda *a, **k: pytest.fail("planned"))
    with pytest.raises(sweep.GridError, match=r"^axis 'context': the grid has 1,000,000 points "
                                              r"\(context\[1000\] × spread\[1000\]\), more than "
                                              r"a sweep takes \(100,000\)"):
        sweep.DecodeGrid({"kernel": ["pa_decode_tile"], "context": list(range(1000)),
                          "spread": [i / 10 for i in range(1000)]})


def test_the_kind_is_the_files_or_the_callers_and_they_must_agree(tmp_path):
    path = tmp_path / "d.yaml"
    path.write_text("kernel: [pa_decode_tile]\ncontext: [64]\nspread: [1]\n")
    assert sweep.open_grid(path, kind="decode").name == "d"
    with pytest.raises(sweep.GridError, match="axis 'kernel': unknown axis .*kind: decode"):
        sweep.open_grid(path)
    path.write_text("kind: decode\nname: mine\nkernel: [pa_decode_tile]\ncontext: [64]\nspread: [1]\n")
    assert sweep.open_grid(path).name == "mine" and len(sweep.open_grid(path)) == 1
    with pytest.raises(sweep.GridError, match="axis 'kind'.*says kind 'decode'"):
        sweep.open_grid(path, kind="policy")
    with pytest.raises(sweep.GridError, match="axis 'kind'"):
        sweep.Grid.from_yaml(path)
    with pytest.raises(sweep.GridError, match="axis 'kind'.*not a kind"):
        sweep.open_grid({"kind": "prefill", "policy": ["lazy"]})
    assert sweep.open_grid({"policy": ["lazy"], "k_scale": [8], "S": [256]}).kind == "policy"


# ---- a point's row against the kernel called here ----------------------------------------

def test_a_paged_row_is_its_call_and_the_decode_tables_row():
    g = sweep.DecodeGrid({**BASE, "upstream": [MAIN, BEFORE], "query_length": [4],
                          "num_partitions": [2], "scales": ["per_token"], "seed": [11]})
    rows = {p["upstream"]: sweep.compute_decode_point(p) for p in g.points()}
    t = decode_table.table(contexts=(257,), query_lengths=(4,), partitions=(2,),
                           scales=("per_token",), versions=(MAIN, BEFORE), seed=11)
    for v, r in rows.items():
        want = t[t.upstream == v].iloc[0]
        assert (r["rows"], r["undefined"], r["nan_rows"], r["violated"]) == (
            want.rows, want.undefined, want.nan_rows, want.violated)
        assert r["max_err"] == want.max_err or (math.isnan(r["max_err"]) and math.isnan(want.max_err))
    assert rows[BEFORE]["nan_rows"] == 8 and rows[BEFORE]["nan_frac"] == 1.0  # 985c653a's NaN
    main = rows[MAIN]
    case = pa_decode.cases.make([257], query_length=4, num_q_heads=2, per_token=True, seed=11)
    out = decode.pa_decode_tile(*case.args(), num_partitions=2, upstream=MAIN).double().reshape(-1, 64)
    ref = pa_decode.cases.reference(case).reshape(-1, 64)
    assert main["rel_l2"] == pytest.approx(float((out - ref).norm() / ref.norm()), rel=1e-12)
    lost = 1 - (out * ref).sum(-1) / (ref * ref).sum(-1)
    assert main["mass_loss"] == pytest.approx(float(lost.mean()), rel=1e-12)
    assert 0 < main["rel_l2"] < 0.1 and main["nan"] == main["inf"] == 0


def test_a_window_row_runs_the_sliding_window_kernel():
    (p,) = sweep.DecodeGrid({**BASE, "kernel": ["pa_decode_swa"], "context": [700],
                             "query_length": [2], "window": [300], "num_partitions": [3],
                             "seed": [3]}).points()
    r = sweep.compute_decode_point(p)
    t = decode_table.table(contexts=(700,), query_lengths=(2,), partitions=(3,),
                           scales=("per_tensor",), versions=(MAIN,), windows=(300,),
                           page_sizes=(1024,), seed=3)
    assert r["violated"] == "no region" and r["page_size"] == 1024
    assert r["max_err"] == t.max_err.iloc[0] and r["nan_rows"] == t.nan_rows.iloc[0] == 0


@pytest.mark.slow  # the MLA model over 512 keys, six times
def test_an_mla_row_measures_the_mass_loss_and_headroom_removes_it():
    """N(0, 3**2) logits over 512 keys: the unlifted P cast loses mass (keys flushed to 0
    leave O but stay in l); a lift of 2**8 keeps it; a spread of 0.5 stays in the region."""
    pts = sweep.DecodeGrid({"kernel": ["mla_decode"], "context": [512], "spread": [3.0],
                            "p_headroom": [0.0, 8.0]}).points()
    pts += sweep.DecodeGrid({"kernel": ["mla_decode"], "context": [512], "spread": [0.5]}).points()
    rows = {(p["spread"], p["p_headroom"]): sweep.compute_decode_point(p) for p in pts}
    M = mla_decode.model
    for (spread, h), r in rows.items():
        query, kv, pages, scale = mla_mass_loss.gaussian_inputs(spread, 512, 0)
        out, _ = mla.mla_decode(query, kv, torch.tensor([0, 512], dtype=torch.int32), pages,
                                scale, p_headroom=h)
        ref, _ = M.reference(query[0].float(), kv.float().reshape(-1, M.QK_HEAD_DIM), scale)
        assert torch.allclose(ref, torch.ones_like(ref), atol=1e-12)  # V = 1: the mass is 1
        deficit = float(1 - out[0].double().mean(-1).mean())
        assert r["mass_loss"] == pytest.approx(deficit, rel=1e-9, abs=1e-15)
        assert r["rows"] == 128 and r["nan_rows"] == 0
    wide, lifted = rows[(3.0, 0.0)], rows[(3.0, 8.0)]
    assert "p_flush" in wide["violated"] and wide["mass_loss"] > 5e-3
    assert abs(lifted["mass_loss"]) < wide["mass_loss"] / 10
    narrow = rows[(0.5, 0.0)]
    assert "p_flush" not in narrow["violated"] and abs(narrow["mass_loss"]) < wide["mass_loss"] / 3


# ---- the store --------------------------------------------------------------------------

def test_a_decode_folder_keeps_its_kind(tmp_path):
    g = sweep.DecodeGrid({**BASE, "spread": [1.0, 2.0], "context": [64]})
    rows = [{**sweep.compute_decode_point(p), "sweep": "d", "run_id": "r"} for p in g.points()]
    folder = sweep.sweep_dir("d", tmp_path)
    folder.mkdir(parents=True)
    store._write_part(folder, "part-a.parquet", rows[:1], store.DECODE)
    store._write_part(folder, "part-b.parquet", rows[1:], store.DECODE)
    assert not list(folder.glob("*.tmp"))
    t = sweep.load("d", out=tmp_path)
    assert list(t.columns) == list(sweep.DECODE_SCHEMA.names) and list(t.spread) == [1.0, 2.0]
    assert sweep.done_points("d", out=tmp_path, kind="decode") == {p["point_id"] for p in g.points()}
    with pytest.raises(ValueError, match="holds a decode sweep's points; a policy grid"):
        sweep.done_points("d", out=tmp_path, kind="policy")
    with pytest.raises(ValueError, match="holds a decode sweep's points; a policy grid"):
        sweep.run({"policy": ["lazy"], "k_scale": [8], "S": [256]}, out=tmp_path, name="d",
                  progress=False)
    sweep.compact("d", out=tmp_path)
    assert len(list(folder.glob("part-*.parquet"))) == 1
    pd.testing.assert_frame_equal(sweep.load("d", out=tmp_path), t)


def test_the_cli_refuses_a_bad_decode_grid_in_one_line_before_any_work(tmp_path, capsys):
    from fa_lab import cli

    path = tmp_path / "g.yaml"
    path.write_text("kernel: [pa_decode_tile]\ncontext: [64]\nspread: [1]\nquery_len: [4, 17]\n")
    for extra, words in ((["--kind", "decode"], "axis 'query_len': "),
                         ([], "axis 'kernel': unknown axis (an axis of a decode grid"),
                         (["--kind", "decode", "--counts", "always"], "counts='always'")):
        if "--counts" in extra:
            path.write_text("kernel: [pa_decode_tile]\ncontext: [64]\nspread: [1]\n")
        with pytest.raises(SystemExit) as e:
            cli.main(["sweep", str(path), "--out-dir", str(tmp_path), *extra])
        err = capsys.readouterr().err.strip()
        assert e.value.code == 2 and len(err.splitlines()) == 1 and words in err, err
    assert not (tmp_path / "atlas").exists()


@pytest.mark.slow  # Triton's interpreter
def test_an_interpret_point_runs_the_port_and_agrees_with_the_model():
    g = sweep.DecodeGrid({**BASE, "context": [64], "scales": ["per_token"],
                          "backend": ["emulator", "interpret"]})
    rows = {p["backend"]: sweep.compute_decode_point(p) for p in g.points()}
    assert rows["interpret"]["point_id"] != rows["emulator"]["point_id"]
    for key in ("rows", "nan_rows", "nan", "max_err", "rel_l2", "mass_loss", "violated"):
        assert rows["interpret"][key] == rows["emulator"][key], key
