"""The CLI as a user meets it (issue 15, findings 3, 5, 7 and 8): a bad value exits 2 with
one line naming the flag, never a traceback; GPU-only requests on a CPU say so plainly; a
GPU-size run on a CPU warns with a rough time. Exit codes and messages come from real
subprocesses (``python -m fa_lab``) with CUDA hidden, so they read the same on any
machine; results go to a tmp dir through ``FA_LAB_RESULTS``."""

import argparse
import json
import os
import select
import subprocess
import sys
import time

import pytest

from fa_lab import cli, results
import fa_lab.cli.args  # noqa: F401  (the argument types, as cli.args)
import fa_lab.cli.table  # noqa: F401
from fa_lab.studies import experiments as ex


def _env(results_dir):
    env = dict(os.environ)
    env.update({"OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE",
                "CUDA_VISIBLE_DEVICES": "", "HIP_VISIBLE_DEVICES": "",
                results.ENV_VAR: str(results_dir)})
    env.pop("FA_LAB_TRACEBACK", None)
    return env


def fa_lab(tmp_path, *args, timeout=120):
    return subprocess.run([sys.executable, "-m", "fa_lab", *args], capture_output=True,
                          text=True, env=_env(tmp_path / "results"), cwd=tmp_path,
                          timeout=timeout)


def _one_line_error(r, *needles):
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    err = r.stderr.strip()
    assert "Traceback" not in r.stderr and len(err.splitlines()) == 1, r.stderr
    assert "error:" in err
    for n in needles:
        assert n in err, (n, err)
    return err


# ---- bad values: exit 2, one line, the flag named (subprocess) -------------------------------

# (argv, strings the one-line error must contain, strings it must not): one per finding of
# the issue; the other bad values go through the same code in-process below.
BAD = {
    "fp8_saturate_ture": (["table", "--which", "fp8", "--fp8-saturate", "ture"],
                          ["--fp8-saturate", "'ture'"], []),
    "seed_negative": (["table", "--seed", "-1"], ["--seed", "-1"], ["got 0"]),
    "bench_on_cpu": (["bench", "--no-save"], ["needs a CUDA GPU", "none is available"],
                     ["device='cuda'"]),
    "device_cuda_on_cpu": (["table", "--device", "cuda"], ["--device", "CUDA GPU", "none is available"], []),
    "name_dotdot": (["table", "--which", "fp8", "--name", "../x"], ["--name", "../x"], []),
}
#: in-process, CUDA reported absent: (argv, needles)
BAD_IN_PROCESS = {
    "fp8_saturate_maybe": (["table", "--which", "fp8", "--fp8-saturate", "maybe"],
                           ["--fp8-saturate", "'maybe'"]),
    "device_cuda_index": (["table", "--device", "cuda:1"], ["--device", "none is available"]),
    "device_bogus": (["table", "--device", "tpu9"], ["--device", "'tpu9'"]),
    "device_meta": (["table", "--device", "meta"], ["--device", "'meta'"]),
    "name_absolute": (["table", "--which", "fp8", "--name", "/tmp/fa_lab_cli_abs"],
                      ["--name", "absolute"]),
    "backend_triton_on_cpu": (["table", "--backend", "triton", "--no-save"], ["--backend", "GPU"]),
    "backend_flydsl_on_cpu": (["table", "--backend", "flydsl", "--no-save"], ["--backend", "GPU"]),
    "bench_sweep_on_cpu": (["bench", "--sweep", "--no-save"], ["needs a CUDA GPU"]),
}


@pytest.mark.parametrize("key", list(BAD_IN_PROCESS))
def test_bad_value_in_process(key, monkeypatch, capsys, tmp_path):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv(results.ENV_VAR, str(tmp_path / "results"))
    argv, needles = BAD_IN_PROCESS[key]
    try:
        code = cli.main(argv)
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "error:" in err, err
    for n in needles:
        assert n in err, (n, err)
    assert not (tmp_path / "results").exists()


@pytest.fixture(scope="module")
def bad_runs(tmp_path_factory):
    """Every BAD case, started together (each is one interpreter start: ~3 s of CPU)."""
    base = tmp_path_factory.mktemp("cli_bad")
    procs = {}
    for key, (argv, _, _) in BAD.items():
        d = base / key
        d.mkdir()
        procs[key] = (d, subprocess.Popen([sys.executable, "-m", "fa_lab", *argv],
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                          text=True, env=_env(d / "results"), cwd=d))
    out = {}
    for key, (d, p) in procs.items():
        stdout, stderr = p.communicate(timeout=180)
        out[key] = (d, subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("key", list(BAD))
def test_bad_value_exits_2_with_one_line_naming_the_flag(bad_runs, key):
    d, r = bad_runs[key]
    _, needles, absent = BAD[key]
    err = _one_line_error(r, *needles)
    for a in absent:
        assert a not in err, (a, err)
    assert not (d / "results").exists()  # nothing ran, nothing saved


@pytest.mark.slow
def test_name_outside_the_results_dir_writes_nothing(bad_runs):
    d, _ = bad_runs["name_dotdot"]
    assert not (d / "x.json").exists() and not (d.parent / "x.json").exists()


# ---- good values (subprocess): the bool parser's words reach the library ---------------------

@pytest.mark.slow
def test_fp8_saturate_words_are_parsed_and_saved(tmp_path):
    r = fa_lab(tmp_path, "table", "--which", "fp8", "--S", "256", "--H", "1", "--B", "1",
               "--fp8-saturate", "OFF", "--causal", "no", "--name", "sat_off")
    assert r.returncode == 0, r.stderr
    obj = results.load("sat_off", root=tmp_path / "results")
    assert obj["params"]["fp8_saturate"] is False and obj["params"]["causal"] is False
    assert "provenance" in obj and "warning" not in r.stderr  # a small CPU run: no warning


@pytest.mark.slow
def test_full_on_cpu_warns_with_a_rough_time(tmp_path):
    """The seed's full sizes on a CPU: the first thing on stderr is a warning that says it is
    a GPU-size run and roughly how long it will take (the run is stopped there)."""
    p = subprocess.Popen([sys.executable, "-m", "fa_lab", "table", "--full", "--no-save"],
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                         env=_env(tmp_path / "results"), cwd=tmp_path)
    try:
        line, deadline = "", time.monotonic() + 120
        while "warning" not in line and time.monotonic() < deadline:
            ready, _, _ = select.select([p.stderr], [], [], 1.0)
            if ready:
                line = p.stderr.readline()
                if not line and p.poll() is not None:
                    break
    finally:
        p.kill()
        p.wait()
    assert "warning" in line, line
    assert "GPU-size run" in line and "roughly" in line and "hours" in line
    assert "--device cuda" in line


# ---- in-process: the pieces behind those ------------------------------------------------------

@pytest.mark.parametrize("word,value", [
    ("true", True), ("TRUE", True), ("1", True), ("yes", True), ("On", True), (" on ", True),
    ("false", False), ("False", False), ("0", False), ("no", False), ("OFF", False)])
def test_parse_bool_accepts(word, value):
    assert cli.args.parse_bool(word) is value


@pytest.mark.parametrize("word", ["ture", "maybe", "2", "", "y", "n", "none", "-1", "truee"])
def test_parse_bool_refuses(word):
    with pytest.raises(argparse.ArgumentTypeError, match="boolean"):
        cli.args.parse_bool(word)


def _actions(parser):
    for a in parser._actions:
        if isinstance(a, argparse._SubParsersAction):
            for sp in a.choices.values():
                yield from _actions(sp)
        else:
            yield a


def test_every_boolean_flag_goes_through_parse_bool():
    actions = list(_actions(cli.build_parser()))
    flags = [a for a in actions if a.const is True]
    assert {f.option_strings[0] for f in flags} >= {"--full", "--causal", "--no-save", "--sweep",
                                                    "--fp8-saturate"}
    assert all(f.type is cli.args.parse_bool for f in flags)
    stray = [a.option_strings for a in actions
             if isinstance(a, (argparse._StoreTrueAction, argparse._StoreFalseAction))]
    assert stray == []


def test_bool_flag_alone_means_true():
    args = cli.build_parser().parse_args(["table", "--causal", "--fp8-saturate"])
    assert args.causal is True and args.fp8_saturate is True and args.full is False
    args = cli.build_parser().parse_args(["table", "--causal=off"])
    assert args.causal is False and args.fp8_saturate is None


def test_library_value_errors_become_one_line_exit_2(monkeypatch, capsys):
    def refuse(*a, **k):
        raise ValueError("S must be a positive int,\n  got 0")
    monkeypatch.setattr(ex, "fp8_table", refuse)
    with pytest.raises(SystemExit) as e:
        cli.main(["table", "--which", "fp8", "--no-save"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err == "fa-lab: error: S must be a positive int, got 0\n" == str(e.value) + "\n"


@pytest.mark.parametrize("argv,needle", [
    (["bench", "--suite", "nope"], "--suite"),
    (["bench", "--suite", ","], "--suite"),
    (["bench", "--impls", "zz"], "--impls"),
    (["bench", "--shapes", "99"], "--shapes"),
    (["bench", "--shapes", "-1"], "--shapes"),
    (["bench", "--shapes", "a"], "--shapes"),
])
def test_bench_values_checked_before_the_gpu(argv, needle, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("fa-lab bench: error: " + needle) and err.count("\n") == 1


@pytest.mark.parametrize("argv,flag", [
    (["table", "--S", "0"], "--S"), (["table", "--B", "x"], "--B"), (["table", "--H", "-2"], "--H"),
    (["table", "--name", ""], "--name"), (["table", "--seed", str(2**64)], "--seed"),
    (["bench", "--seed", "-3"], "--seed"), (["table", "--name", "a/b"], "--name"),
    (["table", "--backend", "nope"], "--backend"), (["bench", "--rep", "0"], "--rep"),
    (["bench", "--warmup", "-5"], "--warmup"), (["bench", "--name", ".."], "--name"),
    (["bench", "--sweep", "perhaps"], "--sweep"), (["table", "--no-save", "nah"], "--no-save"),
])
def test_parse_errors_exit_2_naming_the_flag(argv, flag, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}" in err and err.count("\n") == 1


def test_full_size_estimate_is_hours_and_the_cpu_size_seconds():
    full = cli.table.cpu_estimate_s([(k, ex.SEED_SIZES[k]) for k in ("bf16", "fp8")])
    small = cli.table.cpu_estimate_s([(k, ex.CPU_SIZES[k]) for k in ("bf16", "fp8")])
    assert 1800 < full < 6 * 3600 and small < 60 and full > cli.table.CPU_WARN_S > small


def test_both_tables_under_one_name_do_not_overwrite(tmp_path, monkeypatch):
    monkeypatch.setenv(results.ENV_VAR, str(tmp_path))
    for kind in ("bf16", "fp8"):
        monkeypatch.setattr(ex, f"{kind}_table", lambda *a, **k: __import__("pandas").DataFrame(
            [{"k_scale": 1, "policy": "eager", "variant": "eager", "bound": None}]))
    monkeypatch.setattr(cli.table, "format_bf16", lambda t: "")
    monkeypatch.setattr(cli.table, "format_fp8", lambda t: "")
    assert cli.main(["table", "--name", "mine"]) == 0
    assert results.list(root=tmp_path) == ["mine_bf16", "mine_fp8"]
    assert json.loads((tmp_path / "mine_fp8.json").read_text())["params"]["fp8_saturate"] is None


def test_a_new_command_is_a_module_and_its_name(monkeypatch, capsys):
    import sys
    import types

    seen = {}
    probe = types.ModuleType("fa_lab.cli.probe")
    probe.HELP = "a test command"

    def add(p):
        p.add_argument("--n", type=cli.args.positive_int, default=1)
        cli.args.add_bool_flag(p, "--dry")

    def run(args):
        seen.update(n=args.n, dry=args.dry)
        return 0
    probe.add_arguments, probe.run = add, run
    monkeypatch.setitem(sys.modules, "fa_lab.cli.probe", probe)
    monkeypatch.setattr(cli, "COMMANDS", (*cli.COMMANDS, "probe"))
    assert cli.main(["probe", "--n", "3", "--dry", "yes"]) == 0 and seen == {"n": 3, "dry": True}
    with pytest.raises(SystemExit) as e:
        cli.main(["probe", "--dry", "ture"])
    assert e.value.code == 2 and "argument --dry" in capsys.readouterr().err


@pytest.mark.slow
def test_table_writes_to_out_dir_else_the_results_folder_never_data(tmp_path):
    """``fa-lab table`` saves in ``--out-dir``, else ``$FA_LAB_RESULTS``, else
    ./fa_lab_results of the working directory; data/results is left as it was."""
    before = {p.name: p.stat().st_mtime_ns for p in results.REFERENCE_DIR.iterdir()}
    small = ["table", "--which", "fp8", "--S", "256", "--H", "1"]
    env = {k: v for k, v in _env(tmp_path).items() if k != results.ENV_VAR}
    for args, where in ((["--out-dir", "mine"], tmp_path / "mine"),
                        ([], tmp_path / "fa_lab_results")):
        r = subprocess.run([sys.executable, "-m", "fa_lab", *small, *args], cwd=tmp_path,
                           env=env, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr
        printed = [line[len("saved "):] for line in r.stdout.splitlines()
                   if line.startswith("saved ")]
        # H=1 is away from the CPU size (H=2): the name says so
        assert [tmp_path / p for p in printed] == [where / "table_fp8_cpu_S256_H1.json"], r.stdout
        assert (where / "table_fp8_cpu_S256_H1.json").is_file()
    assert {p.name: p.stat().st_mtime_ns for p in results.REFERENCE_DIR.iterdir()} == before
