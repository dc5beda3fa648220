"""fa_lab.results: load / list / save, names confined to the results directory, errors that
name the file; the seed-table loader's errors (issue 15, finding 5)."""

import json
import math
import os

import pandas as pd
import pytest

from fa_lab.studies import experiments as ex
from fa_lab import results

BAD_NAMES = ["../x", "..", ".", "", "  ", "a/b", "a\\b", "/tmp/x", os.path.abspath("x"),
             ".hidden", "../../etc/passwd", "x/../y"]


def _table():
    return pd.DataFrame([{"k_scale": 8, "policy": "lazy", "rel_l2": 0.01},
                         {"k_scale": 64, "policy": "lazy_unfixed", "rel_l2": math.nan}])


def test_save_load_list_roundtrip(tmp_path):
    p = results.save("run_b", _table(), params={"S": 256}, root=tmp_path)
    assert p == tmp_path / "run_b.json"
    results.save("run_a", {"rows": [1, 2]}, root=tmp_path)
    assert results.list(root=tmp_path) == ["run_a", "run_b"]
    obj = results.load("run_b", root=tmp_path)
    assert obj["name"] == "run_b" and obj["params"] == {"S": 256}
    assert obj["rows"][1]["rel_l2"] is None  # NaN -> null: standard JSON
    for key in ("device", "torch", "python", "date", "command"):  # provenance kept
        assert obj["provenance"][key]
    assert results.load("run_a.json", root=tmp_path)["rows"] == [1, 2]
    assert "provenance" in results.load("run_a", root=tmp_path)  # added to dict payloads
    json.loads(p.read_text(), parse_constant=lambda c: pytest.fail(f"non-standard {c}"))


def test_list_is_sorted_and_skips_other_files(tmp_path):
    for n in ("zeta", "alpha", "Mid"):
        results.save(n, {"x": 1}, root=tmp_path)
    (tmp_path / "notes.txt").write_text("x")
    (tmp_path / "zeta.json12345.tmp").write_text("{")  # a write in flight
    (tmp_path / "sub.json").mkdir()
    assert results.list(root=tmp_path) == sorted(["zeta", "alpha", "Mid"])
    assert results.list(root=tmp_path / "missing") == []


def test_real_results_dir_lists_the_committed_results():
    names = results.references()
    assert "seed_bf16_h200" in names and names == sorted(names)


def test_env_var_points_the_results_dir_elsewhere(tmp_path, monkeypatch):
    monkeypatch.setenv(results.ENV_VAR, str(tmp_path))
    assert results.results_dir() == tmp_path
    results.save("envrun", {"x": 1})
    assert (tmp_path / "envrun.json").is_file() and results.list() == ["envrun"]
    assert results.load("envrun")["x"] == 1
    # experiments.save_result (what the CLI and bench use) follows it too
    ex.save_result("via_ex", _table(), params={}, device="cpu")
    assert results.list() == ["envrun", "via_ex"]


@pytest.mark.parametrize("name", BAD_NAMES)
def test_names_are_confined_to_the_results_dir(tmp_path, name):
    root = tmp_path / "results"
    with pytest.raises(ValueError, match="name"):
        results.save(name, {"x": 1}, root=root)
    with pytest.raises(ValueError, match="name"):
        results.load(name, root=root)
    with pytest.raises(ValueError, match="name"):  # the experiments entry point as well
        ex.save_result(name, _table(), params={}, directory=root)
    written = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert written == [], f"{name!r} wrote {written}"


@pytest.mark.parametrize("name", [None, 3, b"x", ["x"]])
def test_non_string_names_are_type_errors(tmp_path, name):
    with pytest.raises(TypeError, match="name"):
        results.save(name, {"x": 1}, root=tmp_path)


def test_payload_must_be_a_table_or_dict(tmp_path):
    with pytest.raises(TypeError, match="payload"):
        results.save("x", [1, 2], root=tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_load_missing_names_the_file_and_lists_what_exists(tmp_path):
    results.save("have_one", {"x": 1}, root=tmp_path)
    results.save("have_two", {"x": 1}, root=tmp_path)
    with pytest.raises(FileNotFoundError) as e:
        results.load("nope", root=tmp_path)
    msg = str(e.value)
    assert str(tmp_path / "nope.json") in msg and "have_one, have_two" in msg
    with pytest.raises(FileNotFoundError, match=r"\(none\)"):
        results.load("nope", root=tmp_path / "empty")


@pytest.mark.parametrize("text", ['{"name": "x", "rows": [1, 2', "", "not json", '{"a": 1}}'])
def test_load_invalid_json_is_a_value_error_naming_the_file(tmp_path, text):
    (tmp_path / "broken.json").write_text(text)
    with pytest.raises(ValueError) as e:
        results.load("broken", root=tmp_path)
    assert type(e.value) is ValueError  # not a bare json.JSONDecodeError
    assert str(tmp_path / "broken.json") in str(e.value) and "not valid JSON" in str(e.value)


def test_load_non_utf8_is_a_value_error_naming_the_file(tmp_path):
    (tmp_path / "bin.json").write_bytes(b"\xff\xfe{}")
    with pytest.raises(ValueError, match="bin.json"):
        results.load("bin", root=tmp_path)


def test_atomic_write_keeps_the_old_file_on_failure(tmp_path):
    results.save("keep", {"a": 1}, root=tmp_path)
    with pytest.raises(TypeError):
        results.save("keep", {"a": object()}, root=tmp_path)
    assert results.load("keep", root=tmp_path)["a"] == 1
    assert [p.name for p in tmp_path.iterdir()] == ["keep.json"]  # no temp file left


def test_experiments_reexports_still_work(tmp_path):
    assert ex.atomic_write_json is results.atomic_write_json
    assert ex.provenance is results.provenance
    p = ex.save_result("probe", _table(), params={"S": 1}, directory=tmp_path)
    assert results.load("probe", root=tmp_path)["params"] == {"S": 1} and p.parent == tmp_path


def test_seed_table_names_the_file_on_bad_json(tmp_path, monkeypatch):
    monkeypatch.setattr(ex, "SEED_DIR", tmp_path)
    (tmp_path / "pr1033_bf16.json").write_text('{"rows": [{"k_scale": 8,')
    with pytest.raises(ValueError) as e:
        ex.seed_table("bf16")
    assert type(e.value) is ValueError and str(tmp_path / "pr1033_bf16.json") in str(e.value)
    with pytest.raises(FileNotFoundError, match="pr1033_fp8.json.*bf16"):
        ex.seed_table("fp8")
    with pytest.raises(ValueError, match="name"):
        ex.seed_table("../bf16")


def test_seed_table_still_reads_the_real_files():
    assert ex.seed_table("bf16")["rows"] and ex.seed_table("fp8")["rows"]


# ---- the results folder apart from the lab's reference data (issue 31) ----------------------

def _subprocess_env(**extra):
    env = {k: v for k, v in os.environ.items() if k != results.ENV_VAR}
    return {**env, "OMP_NUM_THREADS": "1", **extra}


@pytest.mark.slow
def test_default_results_folder_is_under_the_working_directory(tmp_path):
    """With neither root= nor $FA_LAB_RESULTS a save lands in ./fa_lab_results of the
    process's working directory, never in data/results."""
    import subprocess
    import sys

    before = sorted(p.name for p in results.REFERENCE_DIR.iterdir())
    code = ("from fa_lab import results; p = results.save('mine', {'x': 1}); print(p); "
            "print(results.list()); print(results.load('mine')['x'])")
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=_subprocess_env(),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == [str(tmp_path / "fa_lab_results" / "mine.json"), "['mine']", "1"]
    assert sorted(p.name for p in results.REFERENCE_DIR.iterdir()) == before


def test_the_env_var_is_fa_lab_results_and_the_old_name_is_gone(tmp_path, monkeypatch):
    assert results.ENV_VAR == "FA_LAB_RESULTS"
    monkeypatch.delenv(results.ENV_VAR)
    monkeypatch.setenv("FA_LAB_RESULTS_DIR", str(tmp_path / "old"))
    monkeypatch.chdir(tmp_path)
    assert results.results_dir() == tmp_path / "fa_lab_results"


def test_reference_reads_data_results_and_load_does_not(tmp_path):
    assert results.REFERENCE_DIR == results.ROOT / "data" / "results"
    names = results.references()
    assert "seed_bf16_h200" in names and names == sorted(names)
    ref = results.reference("seed_bf16_h200")
    assert ref["params"]["S"] == 8192 and ref.path == results.REFERENCE_DIR / "seed_bf16_h200.json"
    with pytest.raises(FileNotFoundError) as e:  # a user's folder without it says where it is
        results.load("seed_bf16_h200", root=tmp_path)
    assert str(tmp_path / "seed_bf16_h200.json") in str(e.value)
    with pytest.raises(FileNotFoundError, match="no result 'nope'"):
        results.reference("nope")


def test_load_hints_at_the_reference_data_when_the_name_is_there(tmp_path, monkeypatch):
    monkeypatch.setenv(results.ENV_VAR, str(tmp_path))
    with pytest.raises(FileNotFoundError, match=r"results.reference\('seed_bf16_h200'\)"):
        results.load("seed_bf16_h200")


def _umask() -> int:
    old = os.umask(0)
    os.umask(old)
    return old


@pytest.mark.parametrize("mask", [0o022, 0o002, 0o077])
def test_written_files_follow_the_umask(tmp_path, mask):
    """Atomic writes used to leave mode 0600 (a temp file's); a result, a sweep part, a
    regression file and a PNG's bytes now get 0666 less the umask, as open() gives."""
    old = os.umask(mask)
    try:
        p = results.save("m", {"x": 1}, root=tmp_path)
        q = results.atomic_write_bytes(tmp_path / "sub" / "b.bin", b"x")
        results.save("m", {"x": 2}, root=tmp_path)  # a replaced file too
    finally:
        os.umask(old)
    for f in (p, q):
        assert f.stat().st_mode & 0o777 == 0o666 & ~mask, (f, oct(f.stat().st_mode))
    assert _umask() == old


def test_a_result_that_is_not_an_object_names_the_file(tmp_path):
    (tmp_path / "alist.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match=r"alist\.json: not a result: .* JSON list"):
        results.load("alist", root=tmp_path)


def test_a_missing_key_names_the_file_and_its_keys(tmp_path):
    results.save("thin", {"rows": []}, root=tmp_path)
    rec = results.load("thin", root=tmp_path)
    with pytest.raises(KeyError) as e:
        rec["runs"]
    msg = str(e.value)
    assert str(tmp_path / "thin.json") in msg and "'runs'" in msg and "rows" in msg
    assert rec.get("runs") is None and json.loads(json.dumps(rec))["rows"] == []


def test_the_package_has_one_atomic_writer():
    """Every file fa_lab writes goes through results.atomic_write_bytes: no other module
    renames temp files into place or writes results files itself."""
    import re

    # a Parquet table or an .npz goes to bytes in memory first (a sink, a buffer)
    pattern = re.compile(r"os\.replace\(|os\.rename\(|mkstemp\(|NamedTemporaryFile\(|"
                         r"np\.savez\w*\((?!buf,)|\.to_parquet\(|pq\.write_table\((?!.*, sink\))")
    hits = []
    for top in ("fa_lab", "kernels"):
        for f in (results.ROOT / top).rglob("*.py"):
            if f == results.ROOT / "fa_lab" / "results.py":
                continue
            for i, line in enumerate(f.read_text().splitlines(), 1):
                if pattern.search(line):
                    hits.append(f"{f.relative_to(results.ROOT)}:{i}: {line.strip()}")
    assert not hits, "\n".join(hits)


# ---- issue 36: a value JSON cannot hold, a name too long, a seed table of another shape ------

@pytest.mark.parametrize("payload, where", [
    ({"a": {"b": __import__("torch").ones(3)}}, r"payload\['a'\]\['b'\]"),
    ({"a": [1, __import__("numpy").zeros((2, 2))]}, r"payload\['a'\]\[1\]"),
])
def test_an_array_inside_a_saved_dict_is_refused_naming_its_key(tmp_path, payload, where):
    with pytest.raises(TypeError, match=rf"^cannot store \w+ of shape .* as JSON at {where}"):
        results.save("arr", payload, root=tmp_path)
    assert list(tmp_path.iterdir()) == []          # refused before any file is touched


def test_an_array_in_a_table_cell_is_refused_naming_row_and_column(tmp_path):
    import torch
    table = pd.DataFrame([{"k_scale": 8, "out": torch.ones(2)}])
    with pytest.raises(TypeError, match=r"as JSON at rows\[0\]\['out'\]"):
        results.save("cell", table, root=tmp_path)


def test_a_name_whose_temp_file_would_be_too_long_is_refused(tmp_path):
    """The atomic write's temp name is TEMP_EXTRA bytes longer than the target's: a name
    that fits NAME_MAX as <name>.json but not as its temp file fails cleanly, before work."""
    for n in (233, 250):      # fit NAME_MAX as <name>.json, not as the temp file
        with pytest.raises(ValueError, match=rf"^name='n+' is {n} bytes long"):
            results.save("n" * n, {"a": 1}, root=tmp_path)
    longest = "n" * results.MAX_NAME_BYTES
    assert results.save(longest, {"a": 1}, root=tmp_path).name == longest + ".json"
    for n in (results.MAX_NAME_BYTES + 1, 240, 250):
        with pytest.raises(ValueError, match=rf"^name='n+' is {n} bytes long: a result name "
                                             rf"takes at most {results.MAX_NAME_BYTES}"):
            results.save("n" * n, {"a": 1}, root=tmp_path)
    assert results.list(root=tmp_path) == [longest]


@pytest.mark.parametrize("text, match", [
    ('{"source": "x"}', r"pr1033_bf16\.json: not a seed table: it holds no list 'rows'"),
    ('{"rows": {"k_scale": 8}}', r"pr1033_bf16\.json: not a seed table"),
    ('{"rows": [{"k_scale": "8", "lazy": 0.1}]}', r"rows\[0\]\['k_scale'\] must be a number, got str"),
    ('{"rows": [3]}', r"rows\[0\] is a int, not an object"),
])
def test_a_seed_table_of_another_shape_names_the_file(tmp_path, monkeypatch, text, match):
    monkeypatch.setattr(ex, "SEED_DIR", tmp_path)
    (tmp_path / "pr1033_bf16.json").write_text(text)
    with pytest.raises((ValueError, TypeError), match=match):
        ex.seed_table("bf16")


def test_a_table_with_string_k_scales_is_refused_not_stripped_of_the_seed():
    table = pd.DataFrame([{"k_scale": "8", "policy": "lazy", "rel_l2": 0.1, "nan_frac": 0.0}])
    with pytest.raises(TypeError, match=r"^table row 0: k_scale must be a number, got str"):
        ex.bf16_versus_seed(table)
    good = ex.bf16_versus_seed(table.assign(k_scale=8))
    assert good.seed_lazy_rel_l2[0] == ex.seed_table("bf16")["rows"][0]["lazy"]
