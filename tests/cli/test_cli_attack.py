"""``fa-lab attack`` as a user meets it (issue 31): the repro line it prints runs as printed
in a shell (a built-in policy, and a user's policy from ``--import``); the record it writes
has the schema of the lab's reference ``attack_<policy>.json``, which the lessons read, and
goes to the results folder. Real subprocesses."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from fa_lab import results
from fa_lab.studies import adversary


def _env():
    env = {k: v for k, v in os.environ.items() if k not in (results.ENV_VAR, "FA_LAB_TRACEBACK")}
    # `python` in a printed line is the python that runs these tests
    path = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return {**env, "PATH": path, "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE",
            "CUDA_VISIBLE_DEVICES": ""}


def attack(cwd, *args):
    return subprocess.run([sys.executable, "-m", "fa_lab", "attack", *args], cwd=cwd,
                          env=_env(), capture_output=True, text=True, timeout=300)


def _printed_repro(stdout: str) -> str:
    lines = [line for line in stdout.splitlines() if line.strip().startswith("repro: ")]
    assert len(lines) == 1, stdout
    return lines[0].strip()[len("repro: "):]


@pytest.mark.slow
def test_the_printed_repro_runs_as_printed(tmp_path):
    r = attack(tmp_path, "lazy_unfixed", "--budget", "5")
    assert r.returncode == 0, r.stderr
    line = _printed_repro(r.stdout)
    assert line.startswith('python -c "from fa_lab.studies import adversary; ')
    elsewhere = tmp_path / "elsewhere"  # a fresh shell, in another folder
    elsewhere.mkdir()
    run = subprocess.run(["bash", "-c", line], cwd=elsewhere, env=_env(), capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.strip() == "True", (line, run.stdout, run.stderr)
    # the record it saved carries the same repro, as Python, with the same answer
    rec = json.loads((tmp_path / "fa_lab_results" / "attack_lazy_unfixed.json").read_text())
    run = subprocess.run([sys.executable, "-c", rec["repro"]], cwd=elsewhere, env=_env(),
                         capture_output=True, text=True, timeout=300)
    assert run.stdout.strip() == "True", (rec["repro"], run.stderr)


USER_POLICY = '''
from fa_lab import Policy, policies

policies.register(Policy(vote="wave", rebase="capped", threshold=6.0, rebase_bound=24.0,
                         name="cap24"))
'''


@pytest.mark.slow
def test_a_user_policy_repro_registers_the_policy_first(tmp_path):
    (tmp_path / "mypolicies.py").write_text(USER_POLICY)
    r = attack(tmp_path, "cap24", "--import", "mypolicies.py", "--budget", "5", "--json")
    assert r.returncode == 0, r.stderr
    slim = json.loads(r.stdout.strip().splitlines()[-1])
    assert slim["found"] is True and slim["policy"] == "cap24"
    assert str(tmp_path / "mypolicies.py") in slim["repro_command"]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    run = subprocess.run(["bash", "-c", slim["repro_command"]], cwd=elsewhere, env=_env(),
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.strip() == "True", (slim["repro_command"],
                                                                  run.stderr)
    rec = adversary.load_record("attack_cap24", root=tmp_path / "fa_lab_results")
    assert rec["user_policy"] is True and rec["params"]["imports"] == ["mypolicies.py"]


@pytest.mark.slow
def test_the_record_has_the_reference_schema_the_lesson_reads(tmp_path):
    """A fresh record and the lab's reference one have the same keys, at the top, in each
    run and in each summary row, and the lesson's reads (``rec["runs"][0]`` and the rest)
    work on both; it went to --out-dir, not to data/results."""
    before = {p.name: p.stat().st_mtime_ns for p in results.REFERENCE_DIR.iterdir()}
    out = tmp_path / "mine"
    r = attack(tmp_path, "lazy_unfixed", "--budget", "5", "--out-dir", str(out))
    assert r.returncode == 0, r.stderr
    assert f"saved {out / 'attack_lazy_unfixed.json'}" in r.stdout
    fresh = adversary.load_record("attack_lazy_unfixed", root=out)
    ref = adversary.load_record("attack_lazy_unfixed", reference=True)
    assert set(ref) - {"mods"} <= set(fresh) <= set(adversary.RECORD_KEYS)
    assert set(ref["runs"][0]) <= set(fresh["runs"][0])
    assert set(ref["summary"][0]) <= set(fresh["summary"][0])
    for rec in (fresh, ref):  # what lesson 06 reads
        run = rec["runs"][0]
        assert run["found"] and run["shrunk"]["size"]["Skv"] < 8192
        assert [row["found"] for row in rec["summary"]][0] is True
        assert rec["description"].startswith("lazy_unfixed") and rec["user_policy"] is False
    assert {p.name: p.stat().st_mtime_ns for p in results.REFERENCE_DIR.iterdir()} == before
    assert not (tmp_path / "fa_lab_results").exists()


@pytest.mark.parametrize("damage,needle", [
    ({"drop": "runs"}, "no 'runs'"),
    ({"runs": []}, "'runs' must be a non-empty list"),
    ({"run_drop": "shrunk"}, "run 0 of the record lacks 'shrunk'"),
])
def test_a_malformed_record_names_the_file_and_what_is_wrong(tmp_path, damage, needle):
    rec = dict(results.reference("attack_lazy"))
    if "drop" in damage:
        rec.pop(damage["drop"])
    elif "runs" in damage:
        rec["runs"] = damage["runs"]
    else:
        rec["runs"] = [{k: v for k, v in rec["runs"][0].items() if k != damage["run_drop"]}]
    results.save("attack_broken", rec, root=tmp_path)
    with pytest.raises(ValueError) as e:
        adversary.load_record("attack_broken", root=tmp_path)
    assert str(tmp_path / "attack_broken.json") in str(e.value) and needle in str(e.value)


def test_every_reference_attack_record_has_the_schema():
    names = [n for n in results.references()
             if re.fullmatch(r"attack_(mods_)?[a-z0-9_]+", n) and n != "attack_optimizers"]
    assert len(names) >= 10
    for n in names:
        adversary.load_record(n, reference=True)


@pytest.mark.slow
def test_the_decode_attack_finds_the_sentinel_failure_and_its_repro_runs(tmp_path):
    r = attack(tmp_path, "flydsl-985c653a^", "--budget", "20", "--json", "--name", "dec")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["found"] and out["space"] == "decode" and out["found_classes"] == ["nonfinite"]
    rec = adversary.load_record("dec", root=tmp_path / "fa_lab_results")
    assert rec["policy"] == "flydsl-985c653a^" and rec["runs"][0]["structured"] is False
    run = subprocess.run(out["repro_command"], shell=True, cwd=tmp_path, env=_env(),
                         capture_output=True, text=True, timeout=120)
    assert run.stdout.strip() == "True", run.stderr


@pytest.mark.parametrize("args, needle", [
    (["main-11c4174d", "--mods", "bias"], "--mods"),
    (["main-11c4174d", "--space", "zoo"], "decode"),
    (["lazy", "--space", "decode"], "decode version"),
    (["main-11c4174d", "--classes", "silent"], "classes"),
])
def test_the_decode_attack_refuses_what_does_not_apply(args, needle, capsys):
    from fa_lab.cli import main

    with pytest.raises(SystemExit) as e:
        main(["attack", *args, "--no-save"])
    assert e.value.code != 0 and needle in capsys.readouterr().err


@pytest.mark.parametrize("args, name, space", [
    pytest.param(["main-11c4174d", "--space", "decode_swa"],
                 "attack_main-11c4174d_decode_swa_evals2", "decode_swa", marks=pytest.mark.slow),
    pytest.param(["flydsl-6aeb4321"], "attack_flydsl-6aeb4321_evals2", "paged_fp8",
                 marks=pytest.mark.slow),
    (["mla_decode", "--p-headroom", "8", "--seed", "3"], "attack_mla_decode_h8_seed3_evals2",
     "mla_decode"),
    (["main-11c4174d", "--space", "mla_decode"], "attack_mla_decode_evals2", "mla_decode"),
])
def test_every_kernel_space_runs_from_the_command_line(args, name, space, tmp_path, capsys):
    from fa_lab.cli import main

    assert main(["attack", *args, "--max-evals", "2", "--budget", "30", "--json",
                 "--out-dir", str(tmp_path)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["space"] == space and out["saved"] == str(tmp_path / f"{name}.json")
    rec = adversary.load_record(name, root=tmp_path)
    assert rec["params"]["space"] == space and rec["runs"][0]["space"]["name"] == space
    assert rec["runs"][0]["evals"] <= 2 + rec["runs"][0]["shrink_evals"]
    if space == "mla_decode":
        assert rec["params"]["p_headroom"] == (8.0 if "8" in args else 0.0)


@pytest.mark.parametrize("args, needle", [
    (["lazy", "--p-headroom", "8"], "--p-headroom"),
    (["main-11c4174d", "--p-headroom", "8"], "--p-headroom"),
    (["mla_decode", "--p-headroom", "9"], "p_headroom"),
    (["mla_decode", "--space", "decode"], "decode version"),
    (["mla_decode", "--space", "zoo"], "mla_decode"),
    (["flydsl-6aeb4321", "--space", "decode_swa"], "decode version"),
    (["main-11c4174d", "--space", "paged_fp8"], "paged fp8 version"),
    (["mla_decode", "--classes", "stale_nan"], "classes"),
    (["flydsl-6aeb4321", "--optimizer", "es"], "--optimizer"),
])
def test_the_kernel_spaces_refuse_what_does_not_apply(args, needle, capsys):
    from fa_lab.cli import main

    with pytest.raises(SystemExit) as e:
        main(["attack", *args, "--no-save"])
    assert e.value.code != 0 and needle in capsys.readouterr().err


def test_the_output_folder_is_checked_before_a_kernel_search(tmp_path, capsys):
    from fa_lab.cli import main

    blocked = tmp_path / "file"
    blocked.write_text("")
    with pytest.raises(SystemExit) as e:
        main(["attack", "mla_decode", "--out-dir", str(blocked / "sub"), "--budget", "600"])
    assert e.value.code != 0 and str(blocked) in capsys.readouterr().err
