"""Where the commands write (issue 36): the results folder is checked before any work, and
a run never silently overwrites another run's file (names carry the options that change the
result; what they do not carry is refused)."""

import json

import pandas as pd
import pytest

from fa_lab import cli, results
import fa_lab.cli.attack  # noqa: F401
import fa_lab.cli.table  # noqa: F401
from fa_lab.studies import experiments as ex


def _no_work(*a, **k):
    raise AssertionError("the command worked before checking where its results go")


def _fail_line(argv, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Errno" not in err, err
    return err


@pytest.fixture
def no_work(monkeypatch):
    from fa_lab.studies import adversary, bench, sweep

    monkeypatch.setattr(ex, "bf16_table", _no_work)
    monkeypatch.setattr(ex, "fp8_table", _no_work)
    monkeypatch.setattr(adversary, "search", _no_work)
    monkeypatch.setattr(sweep.Grid, "points", _no_work)
    monkeypatch.setattr(bench, "run", _no_work)


@pytest.mark.parametrize("argv", [
    ["table", "--which", "bf16"],
    ["attack", "lazy_unfixed", "--budget", "1"],
    ["bench", "--device", "cpu"],
])
@pytest.mark.parametrize("how", ["--out-dir", "FA_LAB_RESULTS"])
def test_a_results_folder_that_is_a_file_is_refused_before_any_work(
        tmp_path, monkeypatch, capsys, no_work, argv, how):
    blocker = tmp_path / "afile"
    blocker.write_text("not a folder")
    for target, at_fault in ((blocker, "it"), (blocker / "sub", str(blocker))):
        if how == "--out-dir":
            args = [*argv, "--out-dir", str(target)]
        else:
            monkeypatch.setenv(results.ENV_VAR, str(target))
            args = argv
        err = _fail_line(args, capsys)
        origin = " (from $FA_LAB_RESULTS)" if how != "--out-dir" else ""
        assert err == (f"fa-lab: error: the results folder {target}{origin} cannot be made: "
                       f"{at_fault} is a file, not a folder\n"), err


def test_a_sweep_folder_under_a_file_is_refused_before_planning(tmp_path, capsys, no_work):
    grid = tmp_path / "g.yaml"
    grid.write_text("policy: [lazy]\nk_scale: [8]\nS: [256]\n")
    blocker = tmp_path / "afile"
    blocker.write_text("")
    err = _fail_line(["sweep", str(grid), "--out-dir", str(blocker)], capsys)
    assert err == (f"fa-lab: error: the sweep's folder {blocker}/atlas/g cannot be made: "
                   f"{blocker} is a file, not a folder\n")


def test_the_library_save_names_a_results_folder_that_is_a_file(tmp_path):
    (tmp_path / "afile").write_text("")
    with pytest.raises(NotADirectoryError, match=r"results folder .*afile cannot be made: it is a file"):
        results.save("x", {"a": 1}, root=tmp_path / "afile")


def _fake_tables(monkeypatch, seen):
    def table(**kw):
        seen.append(kw)
        return pd.DataFrame([{"k_scale": 8, "policy": "lazy", "variant": "x", "bound": None}])
    monkeypatch.setattr(ex, "bf16_table", lambda **kw: table(**kw))
    monkeypatch.setattr(cli.table, "format_bf16", lambda t: "")


@pytest.mark.parametrize("extra, name", [
    ([], "table_bf16_cpu_S2048"),
    (["--causal"], "table_bf16_cpu_S2048_causal"),
    (["--seed", "3"], "table_bf16_cpu_S2048_seed3"),
    (["--policies", "lazy,eager"], "table_bf16_cpu_S2048_lazy-eager"),
    (["--H", "2", "--backend", "interpret"], "table_bf16_cpu_S2048_H2_interpret"),
    (["--upstream", "main-11c4174d"], "table_bf16_cpu_S2048_main-11c4174d"),
])
def test_table_names_carry_the_options_that_change_the_table(tmp_path, monkeypatch, extra, name):
    monkeypatch.setenv(results.ENV_VAR, str(tmp_path))
    _fake_tables(monkeypatch, [])
    assert cli.main(["table", "--which", "bf16", *extra]) == 0
    assert results.list(root=tmp_path) == [name]


def test_table_refuses_to_overwrite_another_runs_file_before_the_work(tmp_path, monkeypatch, capsys):
    """Options a name does not carry (here --B under --name) make another run: refused
    before the table runs, naming the file and the option; the same run overwrites."""
    monkeypatch.setenv(results.ENV_VAR, str(tmp_path))
    seen = []
    _fake_tables(monkeypatch, seen)
    assert cli.main(["table", "--which", "bf16", "--name", "mine"]) == 0
    assert cli.main(["table", "--which", "bf16", "--name", "mine"]) == 0   # a rerun: fine
    assert len(seen) == 2
    err = _fail_line(["table", "--which", "bf16", "--name", "mine", "--B", "2"], capsys)
    assert err.startswith(f"fa-lab: error: {tmp_path / 'mine.json'} holds a run with other "
                          "options (B: 1 there, 2 now): not overwritten; pass another name")
    assert len(seen) == 2
    assert json.loads((tmp_path / "mine.json").read_text())["params"]["B"] == 1


def test_attack_names_carry_threshold_and_seed(tmp_path, monkeypatch):
    args = cli.build_parser().parse_args(["attack", "lazy_unfixed", "--threshold", "4",
                                          "--seed", "2"])
    assert cli.attack.default_name("lazy_unfixed", args) == "attack_lazy_unfixed_thr4_seed2"
    args = cli.build_parser().parse_args(["attack", "a:before"])
    assert cli.attack.default_name("a:before", args) == "attack_a-before"


def test_attack_refuses_to_overwrite_a_record_of_other_options(tmp_path, monkeypatch, capsys,
                                                               no_work):
    monkeypatch.setenv(results.ENV_VAR, str(tmp_path))
    results.save("mine", {"params": {
        "seed": 0, "budget_s": 5.0, "space": None, "optimizer": "cma", "structured": True,
        "baseline": None, "threshold": None, "tolerance": None, "max_evals": None,
        "mods_asked": None, "classes_asked": None}}, root=tmp_path)
    err = _fail_line(["attack", "lazy_unfixed", "--budget", "5", "--threshold", "4",
                      "--name", "mine"], capsys)
    assert "holds a run with other options (threshold: None there, 4.0 now)" in err
