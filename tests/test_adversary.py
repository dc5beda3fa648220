"""fa_lab.adversary: the search, the shrinking, the checked-in inputs that broke a policy."""

import json
from pathlib import Path

import pytest
import torch

import fa_lab
from fa_lab import adversary as A
from fa_lab import cli
from fa_lab.models.swp_bf16 import softmax_scale_log2

REGRESSIONS = sorted((Path(__file__).parent / "regressions").glob("*.npz"))


def test_onehot_rows_carry_their_score_sequences():
    c = A.Candidate(n_tiles=6, start=100.0, fall=20.0, rise=7.0, peak_col=3, background=10.0)
    q, k, v = A.build(c)
    qs = (q.float() * softmax_scale_log2(c.D)).to(torch.bfloat16).float()[0, :, 0]
    s = qs @ k.float()[0, :, 0].T                       # [Sq, Skv] in log2 units
    t = torch.arange(c.seqlen_kv) // 64
    col = torch.arange(c.seqlen_kv) % 64
    off = torch.where(col == 3, 0.0, -10.0)
    assert torch.allclose(s[0], 7.0 * t + off, atol=0.5)              # the trigger
    assert torch.allclose(s[1], 100.0 - 20.0 * t + off, atol=1.0)     # the victim
    assert s[2:].abs().max() == 0                                     # everyone else
    assert torch.equal(v.float(), torch.ones_like(v.float()))


def test_judge_sees_the_drag_and_the_fix():
    c = A.Candidate()  # experiments.drag_case's shape: a fall of 40 over 8 tiles
    bad = A.judge(c, "lazy_unfixed")
    assert bad.failed and bad.bad_rows == [1] and bad.ref_finite and bad.fitness > 128
    ok = A.judge(c, "lazy")
    assert not ok.failed and ok.fitness < 20


def test_search_breaks_lazy_unfixed_below_the_seed_size():
    res = A.search("lazy_unfixed", budget_s=30, seed=0)
    assert res.found and res.evals_to_first <= 8
    s = res.shrunk
    assert s.seqlen_kv <= 320 and s.seqlen_q == 32    # the seed needed 8192 keys
    assert A.judge(s, "lazy_unfixed").failed
    assert not A.judge(s, "lazy").failed                     # PR #1033's rule survives it
    assert res.trace and any(r["dragged"] for r in res.trace)
    assert "Candidate(**" in res.repro and eval(res.repro, {"fa_lab": fa_lab}) is True


def test_search_reports_nothing_within_budget():
    res = A.search("lazy", budget_s=60, seed=1, max_evals=30)
    assert not res.found and res.evals == 30 and res.shrunk is None
    assert res.best is not None and res.best_fitness < 128
    d = res.to_dict()
    assert d["found"] is False and d["budget_s"] == 60 and d["space"]["name"] == "scores"


def test_shrinking_keeps_the_failure_and_drops_the_rest():
    big = A.Candidate(n_tiles=30, trim=17, n_rows=64, fall=40.0, rise=10.0, wobble=3.0,
                      n_victims=3, noise=2.0, D=128, v_kind="signed", seed=5)
    assert A.judge(big, "lazy_unfixed").failed
    small, runs = A.shrink_candidate(big, "lazy_unfixed", budget_s=30)
    assert A.judge(small, "lazy_unfixed").failed
    assert small.seqlen_kv < big.seqlen_kv and small.n_rows == 32 and small.D == 64
    assert (small.wobble, small.noise, small.n_victims, small.v_kind) == (0.0, 0.0, 0, "ones")
    assert 0 < runs < 200


def test_baseline_counts_only_the_policys_own_failures():
    # V near 2^121: every kernel's unnormalised fp32 accumulator overflows, eager's too
    c = A.Candidate(n_tiles=4, trim=63, start=0.0, fall=0.0, rise=0.0, v_log2=121.0)
    assert A.judge(c, "eager").failed and A.judge(c, "lazy").failed
    assert not A.judge(c, "lazy", baseline="eager").failed


def test_regression_roundtrip(tmp_path):
    res = A.search("lazy_unfixed", budget_s=10, seed=0, shrink=False)
    path = A.save_regression(res, tmp_path / "x.npz")
    assert path.stat().st_size < 16_000
    r = A.run_regression(path)
    assert r["nonfinite"] and r["ref_finite"] and r["meta"]["expect"] == "nonfinite"
    assert not A.run_regression(path, policy="eager")["nonfinite"]


def test_cli_attack_json(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("FA_LAB_RESULTS_DIR", str(tmp_path))
    assert cli.main(["attack", "lazy_unfixed", "--budget", "10", "--json"]) == 0
    rec = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rec["policy"] == "lazy_unfixed" and rec["found"] is True
    assert rec["size"]["Skv"] < 8192 and "judge" in rec["repro"]
    saved = json.loads((tmp_path / "attack_lazy_unfixed.json").read_text())
    assert saved["found"] and saved["shrunk"]["size"] == rec["size"]
    with pytest.raises(SystemExit):
        cli.main(["attack", "no_such_policy", "--budget", "1"])


@pytest.mark.parametrize("path", REGRESSIONS, ids=[p.stem for p in REGRESSIONS])
def test_checked_in_regressions(path):
    """Every shrunk input the search found still breaks its policy (and every near miss
    of a policy it could not break still does not), with a finite fp64 reference."""
    from fa_lab import policies

    meta = A.load_regression(path)[3]
    user = meta["policy"] not in policies.names()
    if user:  # the attack runs' user policy: the seed's cap at 4 log2 units
        assert meta["policy"] == "capped4"
        policies.register(fa_lab.Policy(vote="wave", rebase="capped", threshold=8.0,
                                        rebase_bound=4.0, name="capped4"))
    try:
        r = A.run_regression(path)
    finally:
        if user:
            policies.unregister("capped4")
    assert r["ref_finite"]
    assert r["nonfinite"] == (meta["expect"] == "nonfinite"), r["bad_rows"]
    assert path.stat().st_size < 16_000
    c = A.Candidate(**meta["candidate"])
    assert torch.equal(A.build(c)[1], A.load_regression(path)[1])   # the file is its candidate
    if meta["expect"] == "nonfinite":
        assert r["bad_rows"] == meta["bad_rows"] and c.seqlen_kv < 8192
        if meta["baseline"]:  # the policy's own failure: the baseline stays finite on it
            assert not A.run_regression(path, policy=meta["baseline"])["nonfinite"]
        if meta["policy"] in ("lazy_unfixed", "lazy_capped", "capped4"):
            assert not A.run_regression(path, policy="lazy")["nonfinite"]   # the fix holds
