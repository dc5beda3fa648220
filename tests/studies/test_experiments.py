"""The seed's tables at a small size, result files, and the CLI."""

import json
import math

import pytest
import torch

from fa_lab import cli, results
from fa_lab.studies import experiments as ex


def test_bf16_table_small():
    t = ex.bf16_table((8, 64), B=1, S=512, H=2, D=64, progress=False)
    assert set(t.policy) == {"lazy_unfixed", "lazy", "eager"} and len(t) == 6
    by = t.set_index(["k_scale", "policy"])
    assert by.loc[(64, "lazy_unfixed"), "nan_frac"] > 0
    assert math.isnan(by.loc[(64, "lazy_unfixed"), "rel_l2"])
    for p in ("lazy", "eager"):
        assert by.loc[(64, p), "nan_frac"] == 0 and by.loc[(64, p), "rel_l2"] < 2e-2
    # accuracy degrades with the score range (more mass on fewer columns)
    assert by.loc[(64, "eager"), "rel_l2"] > by.loc[(8, "eager"), "rel_l2"]
    wide = ex.bf16_versus_seed(t)
    assert wide.set_index("k_scale").loc[64, "seed_unfixed_nan_pct"] == 100.0


def test_fp8_table_small():
    t = ex.fp8_table((20000,), B=1, S=1024, H=1, progress=False)
    assert list(t.variant) == [v[0] for v in ex.FP8_VARIANTS]
    by = t.set_index("variant")
    assert by.loc["unfixed", "nan"] > 0 and by.loc["bound 16", "nan"] == 0
    assert by.loc["eager", "mean_abs_dev"] < 1e-2


def test_inputs_follow_the_seed_recipe():
    q, k, v = ex.bf16_inputs(1, 4096, 2, 64, 32.0, seed=0)
    assert q.dtype == k.dtype == torch.bfloat16
    assert k.float().std().item() == pytest.approx(32.0, rel=0.02)
    (q8, k8, v8), (qd, kd, vd) = ex.fp8_inputs(1, 256, 1, 1000.0)
    assert q8.dtype == torch.float8_e4m3fn
    assert q8.float().abs().max().item() == 448.0  # amax maps to the e4m3 max
    assert (v8.float() * vd == 1.0).all()
    assert kd / qd == pytest.approx(1000.0, rel=0.3)


def test_drag_case_rejects_short_walks():
    with pytest.raises(ValueError, match="n_tiles"):
        ex.drag_case(n_tiles=3)


def test_size_arguments_checked():
    with pytest.raises(ValueError, match="S must be a positive int"):
        ex.bf16_table((8,), S=0, progress=False)
    for table in (ex.bf16_table, ex.fp8_table):
        with pytest.raises(ValueError, match="k_scales"):
            table((), progress=False)
        # the seed as given, before any work (it once said "got 0" for -1)
        with pytest.raises(ValueError, match=r"^seed must be >= 0, got -1$"):
            table((8,), seed=-1, progress=False)
        with pytest.raises(TypeError, match=r"^seed must be an int, got bool$"):
            table((8,), seed=True, progress=False)
        with pytest.raises(TypeError, match=r"^seed must be an int, got str$"):
            table((8,), seed="0", progress=False)
    with pytest.raises(ValueError, match=r"^seed must be >= 0, got -3$"):
        ex.bf16_inputs(1, 64, 1, 64, 8.0, seed=-3)


def test_save_result_is_atomic_json_with_provenance(tmp_path):
    t = ex.bf16_table((64,), B=1, S=256, H=1, D=64, progress=False)
    path = ex.save_result("probe", t, params={"S": 256}, directory=tmp_path)
    obj = json.loads(path.read_text())  # NaN became null: standard JSON
    assert obj["params"] == {"S": 256}
    for key in ("device", "torch", "triton", "python", "date", "command"):
        assert obj["provenance"][key]
    assert len(obj["rows"]) == 3
    assert [p.name for p in tmp_path.iterdir()] == ["probe.json"]  # no temp file left


def test_atomic_write_leaves_old_file_on_failure(tmp_path):
    path = ex.atomic_write_json(tmp_path / "x.json", {"a": 1})
    with pytest.raises(TypeError):
        ex.atomic_write_json(path, {"a": object()})
    assert json.loads(path.read_text()) == {"a": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["x.json"]


def test_cli_table_prints_beside_the_seed(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv(results.ENV_VAR, str(tmp_path))
    assert cli.main(["table", "--which", "bf16", "--S", "512", "--H", "1", "--B", "1"]) == 0
    text = capsys.readouterr().out
    assert "unfixed rel-L2" in text and "(seed)" in text and "9.20%" in text
    assert "sizes differ from the seed's" in text
    saved = list(tmp_path.glob("table_bf16_cpu_S512_H1.json"))  # H away from the CPU size
    assert saved and json.loads(saved[0].read_text())["params"]["S"] == 512


def test_committed_h200_results_reproduce_the_seed():
    """The committed full-size H200 run of the models (data/results) against the seed."""
    seed = {r["k_scale"]: r for r in ex.seed_table("bf16")["rows"]}
    res = json.loads((ex.REFERENCE_DIR / "seed_bf16_h200.json").read_text())
    assert res["params"]["S"] == 8192 and "H200" in res["provenance"]["device"]
    for r in res["rows"]:
        s = seed[r["k_scale"]]
        if r["policy"] == "lazy_unfixed":
            assert abs(100 * r["nan_frac"] - s["lazy_unfixed_nan_pct"]) <= 0.5
        else:
            assert abs(r["rel_l2"] / s[r["policy"]] - 1) <= 0.02
    k32 = next(r for r in res["rows"] if r["k_scale"] == 32 and r["policy"] == "lazy_unfixed")
    assert k32["nan_rows_lse_posinf"] >= 0.95 * k32["nan_rows"]
