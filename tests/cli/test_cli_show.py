"""``fa-lab show``: the results folder listed, a stored result printed as a table, and every
bad request one line with exit status 2."""

import pandas as pd
import pytest

from fa_lab import cli, results


@pytest.fixture
def folder(tmp_path):
    table = pd.DataFrame({"k_scale": [16, 32], "policy": ["lazy", "lazy_unfixed"],
                          "nan_pct": [0.0, 9.25]})
    results.save("my_table", table, params={"S": 2048}, root=tmp_path)
    results.save("my_attack", {"policy": "lazy", "found": False, "size": {"Sq": 43}},
                 root=tmp_path)
    (tmp_path / "atlas" / "tiny").mkdir(parents=True)
    return tmp_path


def _show(argv, capsys):
    assert cli.main(["show", *argv]) == 0
    return capsys.readouterr().out


def _fails(argv, capsys) -> str:
    with pytest.raises(SystemExit) as e:
        cli.main(["show", *argv])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    return err


def test_lists_the_folder(folder, capsys):
    out = _show(["--out-dir", str(folder)], capsys)
    lines = out.splitlines()
    assert lines[0] == f"{folder}: 2 result(s)"
    assert lines[1].split()[:3] == ["my_attack", "no", "rows"]
    assert lines[2].split()[:3] == ["my_table", "2", "rows"]
    assert lines[-1].startswith(f"sweeps in {folder / 'atlas'}: tiny")


def test_the_folder_comes_from_the_environment(folder, capsys, monkeypatch):
    monkeypatch.setenv(results.ENV_VAR, str(folder))
    assert _show([], capsys).splitlines()[0] == f"{folder}: 2 result(s)"


def test_an_empty_or_missing_folder_lists_nothing(tmp_path, capsys):
    out = _show(["--out-dir", str(tmp_path / "none")], capsys)
    assert out.splitlines() == [f"{tmp_path / 'none'}: 0 result(s)"]


def test_prints_a_result_as_a_table(folder, capsys):
    out = _show(["my_table", "--out-dir", str(folder)], capsys)
    assert "name: my_table" in out and 'params: {"S": 2048}' in out
    table = out.split("rows (2):\n")[1].splitlines()
    assert table[0].split() == ["k_scale", "policy", "nan_pct"]
    assert table[1].split() == ["16", "lazy", "0.00"] and table[2].split() == ["32", "lazy_unfixed", "9.25"]


def test_columns_pick_and_order_the_table(folder, capsys):
    out = _show(["my_table", "--out-dir", str(folder), "--columns", "policy,k_scale"], capsys)
    table = out.split("rows (2):\n")[1].splitlines()
    assert table[0].split() == ["policy", "k_scale"] and table[2].split() == ["lazy_unfixed", "32"]


def test_a_result_without_rows_prints_its_fields(folder, capsys):
    out = _show(["my_attack", "--out-dir", str(folder)], capsys)
    assert "policy: lazy" in out and "found: false" in out and 'size: {"Sq": 43}' in out
    assert "rows (" not in out


def test_reads_the_reference_data(capsys):
    out = _show(["--reference"], capsys)
    assert out.splitlines()[0].startswith(f"{results.REFERENCE_DIR}: ")
    name = results.references()[0]
    assert any(line.split()[:1] == [name] for line in out.splitlines()[1:])


def test_a_damaged_file_is_listed_as_unreadable(folder, capsys):
    (folder / "broken.json").write_text("{not json")
    out = _show(["--out-dir", str(folder)], capsys)
    line = next(ln for ln in out.splitlines() if ln.split()[:1] == ["broken"])
    assert "unreadable" in line


@pytest.mark.parametrize("argv,words", [
    (["nope"], ["no result 'nope'", "my_attack, my_table"]),
    (["my_table", "--columns", "policy,nope"], ["--columns", "'nope'", "k_scale"]),
    (["--columns", "policy"], ["--columns applies to a result"]),
    (["--reference", "--out-dir", "x"], ["--reference and --out-dir"]),
    (["../etc"], ["name"]),
])
def test_a_bad_request_is_one_line(folder, capsys, argv, words):
    if "--out-dir" not in argv and "--reference" not in argv:
        argv = [*argv, "--out-dir", str(folder)]
    err = _fails(argv, capsys)
    assert all(w in err for w in words), err
