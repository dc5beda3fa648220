"""The attack on the failure zoo's presets: the zoo's space (scores of a given spread,
outliers, logits far below zero, KV caches with a NaN tail, masked rows and tiles), the
classes of failure the judge counts (each on a constructed case), and the search finding
every entry's reported failure."""

import dataclasses
import json
import math
import subprocess
import sys

import numpy as np
import pytest
import torch

from fa_lab import Policy, policies
from fa_lab.kernels.swp_bf16.model import softmax_scale_log2
from fa_lab.semantics import Semantics
from fa_lab.studies import adversary as A
from fa_lab.zoo import ENTRIES

C = A.Candidate


def test_the_old_spaces_draw_what_they_drew():
    """The zoo's fields and choices are pinned in 'scores' and 'values': their draws, and so
    the FlyDSL policies' attack, are what they were."""
    for name in ("scores", "values"):
        sp = A.SPACES[name]
        assert not sp.zoo and sp.range("family") == ("onehot", "random")
        assert "pad_rows" not in sp.with_mods("bias").range("mask")
        for f in A.ZOO_FIELDS:
            assert sp.range(f) in ((getattr(C(), f),), (getattr(C(), f),) * 2)
        fields = A.optimize._fields(sp)
        assert not set(A.ZOO_FIELDS) & set(fields)
        rng = np.random.default_rng(0)
        for _ in range(20):
            c = A.random_candidate(sp, rng)
            assert c.family in ("onehot", "random")
            assert all(getattr(c, f) == getattr(C(), f) for f in A.ZOO_FIELDS)
    zoo = A.SPACES["zoo"]
    assert zoo.zoo and zoo.mods == ("bias",) and "scores" in zoo.range("family")
    assert set(A.ZOO_FIELDS) <= set(A.optimize._fields(zoo))


def test_the_scores_family_builds_the_scores_it_names():
    """Row r reads its own dimension: its log2-unit score of key j is spread * N(0, 1) up
    to one bf16 rounding of K; ``shift`` moves every raw logit q.k by itself (rounded once,
    as K holds shift / 8 in bf16) and ``jump`` lifts key ``jump_col`` by that many log2
    units."""
    c = C(family="scores", spread=4.0, n_rows=3, n_tiles=1, trim=0, seed=7)
    q, k, v = A.build(c)
    cl = softmax_scale_log2(64)
    s = (q.double()[0, :, 0] @ k.double()[0, :, 0].T) * cl
    g = torch.Generator().manual_seed(7)
    want = 4.0 * torch.randn(64, 62, generator=g)
    assert torch.allclose(s.float(), want[:, :3].T, rtol=2 ** -8, atol=1e-6)
    shifted = A.build(C(**{**c.to_dict(), "shift": -1e5, "jump": 20.0, "jump_col": 5}))
    s2 = shifted[0].double()[0, :, 0] @ shifted[1].double()[0, :, 0].T
    lift = torch.zeros(64, dtype=torch.float64)
    lift[5] = 20.0 / cl
    shift = float(torch.tensor(-1e5 / 8).to(torch.bfloat16)) * 8      # -99840
    assert torch.allclose(s2 - s / cl, torch.full_like(s2, shift) + lift, rtol=0, atol=0.5)


def test_a_kv_cache_tail_holds_nan_past_the_length():
    c = C(family="scores", spread=1.0, n_tiles=2, trim=28, seqused=0.25, cache="nan")
    assert c.seqlen_kv == 100 and c.kv_used == 25 and c.size["seqlen_kv"] == 25
    q, k, v = A.build(c)
    assert torch.isnan(k[0, 25:].float()).all() and torch.isnan(v[0, 25:].float()).all()
    assert torch.isfinite(k[0, :25].float()).all()
    assert C(seqused=0.0, n_tiles=1).kv_used == 0
    # canonical drops a cache that has no tail
    assert A.canonical(C(cache="nan")).cache == "finite"


def test_visibility_and_first_tiles():
    c = C(n_rows=4, n_tiles=3, trim=0, mask="pad_left", mask_len=130)
    assert A.first_tile_visible(c, 128).tolist() == [False] * 4
    assert A.first_tile_visible(c, 128, "descending").tolist() == [True] * 4
    c = C(n_rows=4, n_tiles=1, trim=62, causal=True)             # 2 keys, 4 rows
    assert A.visible(c).sum(-1).tolist() == [0, 0, 1, 2]
    assert A.visible(C(n_rows=3, mask="pad_rows", mask_len=2)).any(-1).tolist() == [False, False, True]


def test_each_class_on_a_constructed_case():
    """One input per class, with the numbers by hand."""
    # empty: 2 causal rows over 1 key: row 0 sees nothing; TensorRT-LLM's finite mask gives
    # it weight 1 on every visited column: 1 real key and 63 zero-filled ones, V = ones
    c = C(family="scores", causal=True, n_rows=2, n_tiles=1, trim=63)
    v = A.judge(c, "trtllm_neg_inf:before")
    assert v.failed and v.classes == ["empty"] and v.bad_rows == [0] and v.undefined_rows == [0]
    out, *_ = A.run_online(c, "trtllm_neg_inf:before")
    assert out[0, 0, 0].float().tolist() == [1 / 64] * 64
    assert not A.judge(c, "trtllm_neg_inf:after").failed
    # silent: every raw logit at -1e5, below flashinfer's -5e4 sentinel: P = 2^((s - m) c)
    # with m = -5e4 underflows, output 0 where the reference is 1 (V = ones)
    c = C(family="scores", n_rows=1, n_tiles=1, trim=0, shift=-1e5)
    v = A.judge(c, "flashinfer_sentinel:before")
    assert v.classes == ["silent"] and v.max_err == pytest.approx(1.0, abs=1e-9)  # out 0, ref 1
    assert not A.judge(c, "flashinfer_sentinel:after").failed
    # saturation: FA4 visits columns 128..191 first (scores 0), then tile 0 whose key 0 is
    # 3 log2 units up, within the threshold 4: P = 2^(8 + 3) > 448
    c = C(family="scores", n_rows=1, n_tiles=3, trim=0, jump=3.0, jump_col=0)
    v = A.judge(c, "fa4_fp8_saturation:before", classes="saturation")
    assert v.classes == ["saturation"]
    out, lse, recs, *_ = A.run_online(c, "fa4_fp8_saturation:before")
    assert [int(r.saturated[0, 0, 0]) for r in recs] == [0, 1]
    assert float(recs[1].p_max[0, 0, 0]) == pytest.approx(2.0 ** 11, rel=2 ** -7)
    assert not A.judge(c, "fa4_fp8_saturation:after", classes="saturation").failed
    # nan_factor: row 0 sees nothing (its factor is exp2(-inf + inf)); row 1's key 64 jumps
    # 20 log2 units past the threshold 8, so the 16-row warp's vote multiplies row 0's O
    c = C(family="scores", n_rows=2, n_tiles=2, trim=0, mask="pad_rows", mask_len=1,
          jump=20.0, jump_col=64)
    assert A.judge(c, "ffpa_vote_nan:before").classes == ["nan_factor"]
    assert not A.judge(c, "ffpa_vote_nan:after").failed
    # nonfinite: 576 keys of left padding: PyTorch's first 512-key block is all masked
    c = C(family="scores", spread=2.0, n_rows=2, n_tiles=10, trim=0, mask="pad_left",
          mask_len=576)
    v = A.judge(c, "pytorch_cpu_masked_block:before")
    assert v.classes == ["nonfinite"] and v.bad_rows == [0, 1]
    assert not A.judge(c, "pytorch_cpu_masked_block:after").failed


def test_a_finfo_min_bias_masks_its_key_in_the_reference_too():
    """bf16's finfo.min times log2 e overflows fp32 in every kernel: a key masked by it is
    masked in the reference as well (the row sees nothing), not a logit of -3.4e38."""
    c = C(family="scores", causal=True, n_rows=1, n_tiles=1, trim=63, mask="pad_right",
          mask_len=5, mask_value="min")
    q, k, v = A.build(c)
    ref, lse = A.reference_of(c, q, k, v, A.build_mods(c))
    assert lse[0, 0, 0] == -math.inf and (ref == 0).all()
    assert not A.judge(c, "fa4_fp8_saturation:after").failed


def test_classes_default_to_the_entry_and_are_checked():
    for e in ENTRIES.values():
        assert set(e.failure) <= set(A.CLASSES) and e.failure
        assert A.default_classes(e.before) == e.failure
    assert A.default_classes("lazy") == ("nonfinite",)
    own = Policy("tile", "max", name="mine", semantics=Semantics(o_gate="row"))
    assert A.default_classes(own) == A.CLASSES
    assert A.check_classes(own, "silent, empty") == ("empty", "silent")
    with pytest.raises(ValueError, match="classes: unknown class 'nan'"):
        A.check_classes(own, "nan")
    with pytest.raises(TypeError, match="classes"):
        A.check_classes(own, [1])
    with pytest.raises(ValueError, match="classes:.*nonfinite"):
        A.check_classes("lazy", "silent")
    with pytest.raises(ValueError, match="space='zoo'"):
        A.search("lazy", space="zoo", max_evals=1)
    with pytest.raises(ValueError, match="baseline and tolerance"):
        A.judge(C(), "trtllm_neg_inf:before", tolerance=0.1)
    with pytest.raises(TypeError, match="region"):
        A.search("trtllm_neg_inf:before", region=3, max_evals=1)


@pytest.mark.parametrize("name", list(ENTRIES))
def test_the_attack_finds_each_entry_before_its_fix(name):
    """Deterministic for a seed and an evaluation count: each entry's reported class of
    failure is found from the zoo's starting points within a few model runs."""
    e = ENTRIES[name]
    res = A.search(e.before, seed=0, max_evals=40, budget_s=600, shrink=False)
    assert res.found and set(res.found_classes) <= set(e.failure), A.summary(res)
    again = A.judge(res.shrunk, e.before, classes=e.failure)
    assert again.failed and again.classes == res.found_classes


@pytest.mark.slow
def test_a_region_keeps_the_search_inside_it():
    inside = lambda c: not c.causal and c.mask == "none"  # noqa: E731
    res = A.search("trtllm_neg_inf:before", seed=1, max_evals=15, budget_s=600, region=inside,
                   shrink=False)
    assert not res.found and res.evals == 15 and res.outside > 0
    s = A.summary(res)
    assert s.startswith("trtllm_neg_inf:before: nothing in 15 runs inside the region found a failure")
    d = res.to_dict()
    assert d["classes"] == ["empty"] and d["outside_region"] == res.outside
    none = A.search("trtllm_neg_inf:before", max_evals=5, budget_s=2, region=lambda c: False)
    assert none.evals == 0 and none.outside > 0 and not none.found


@pytest.mark.slow
def test_the_command_line_attacks_a_preset(tmp_path):
    r = subprocess.run([sys.executable, "-m", "fa_lab", "attack", "--policy",
                        "sdpa_masked_row:before", "--budget", "20", "--json"],
                       capture_output=True, text=True,
                       env={**__import__("os").environ, "FA_LAB_RESULTS": str(tmp_path),
                            "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr
    rec = json.loads(r.stdout.strip().splitlines()[-1])
    assert rec["found"] and rec["found_classes"] == ["empty"] and rec["space"] == "zoo+bias"
    assert [p.name for p in tmp_path.iterdir()] == ["attack_sdpa_masked_row-before.json"]
    assert "sdpa_masked_row:before" in policies.names()


def test_a_one_hot_input_with_fewer_rows_than_victims_builds():
    """The zoo's space lets Sq go down to 1: the one-hot family then places as many victims
    as there are rows beside the trigger."""
    for n_rows in (1, 2, 3):
        c = C(n_rows=n_rows, n_victims=8, n_tiles=1)
        q, k, v = A.build(c)
        assert q.shape[1] == n_rows and int((q[0, :, 0] != 0).sum()) == n_rows


def test_the_softcap_reference_is_the_capped_softmax():
    """``softcap_reference`` against a direct sum in Python floats (math.tanh, math.exp),
    causal and with a bias; with a cap far above the scores it is the plain reference."""
    from fa_lab import reference

    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, n, 1, 8, generator=g) * 6 for n in (3, 5, 5))
    bias = torch.zeros(3, 5)
    bias[1, 0] = -math.inf
    bias[2, 4] = 0.5
    out, lse = A.softcap_reference(q, k, v, 2.0, causal=True, bias=bias)
    for i in range(3):
        s = [2.0 * math.tanh(float(q[0, i, 0].double() @ k[0, j, 0].double()) / math.sqrt(8)
                             / 2.0) + float(bias[i, j]) for j in range(5) if j <= i + 2]
        top = max(s)
        w = [math.exp(x - top) for x in s]
        want = [sum(wj * float(v[0, j, 0, d]) for j, wj in enumerate(w)) / sum(w)
                for d in range(8)]
        assert out[0, i, 0].tolist() == pytest.approx(want, rel=1e-12, abs=1e-12)
        assert float(lse[0, 0, i]) == pytest.approx(top + math.log(sum(w)), rel=1e-12)
    plain, plse = reference.attention(q, k, v, causal=False, dtype=torch.float64)
    big, blse = A.softcap_reference(q, k, v, 1e9)
    assert torch.allclose(big, plain, rtol=1e-9, atol=1e-9)
    with pytest.raises(ValueError, match="softcap"):
        A.softcap_reference(q, k, v, 0.0)


def test_a_softcap_policy_is_judged_against_the_capped_reference():
    """Scores up to 126 under a cap of 50: the capped output is off the uncapped softmax by
    about 1.9 max|V|, which the judge used to call a silent failure of the fixed preset;
    against the capped reference it is within its fp32 rounding."""
    c = C(family="scores", spread=60.0, n_rows=4, n_tiles=2, v_kind="randn")
    q, k, v = A.build(c)
    mods = A.build_mods(c)
    capped, _ = A.reference_of(c, q, k, v, mods, softcap=50.0)
    plain, _ = A.reference_of(c, q, k, v, mods)
    assert float((capped - plain).abs().max()) > 1.0
    verdict = A.judge(c, "vllm_softcap_exp_ratio:after", classes="silent")
    assert not verdict.failed and verdict.max_err < 5e-3


def test_a_shift_is_stepped_by_decades():
    """Half of a mutation's steps on a number whose range lies below zero scale its
    magnitude: at a small shift the additive steps (sigma x 3e5) leave its scale; the scaled
    ones keep it, whatever sigma, and never cross zero."""
    sp = A.SPACES["zoo"]
    c = C(family="scores", spread=2.0, shift=-10.0)
    got = [A.optimize.mutate(c, sp, np.random.default_rng(i), 0.02).shift for i in range(600)]
    moved = [x for x in got if x != c.shift]
    assert moved and all(-3e5 <= x <= 0 for x in moved)
    assert sum(-12.0 < x < -8.0 for x in moved) > 0.3 * len(moved)


def test_the_unshifted_family_leaves_the_shared_draws_alone():
    """The zoo space's unshifted draws come from a stream of their own: a seed's shared
    draws are those ``random_candidate`` makes from ``default_rng(seed)``, in every space,
    and the family's draws are the zoo's with ``shift`` at 0 (elsewhere a plain draw)."""
    zoo = A.SPACES["zoo"]
    fam_rng = A.optimize._family_rng(3)
    fam = [A.optimize.unshifted_candidate(zoo, fam_rng) for _ in range(40)]
    assert all(c.shift == 0.0 for c in fam)
    assert len({(c.family, c.n_tiles, c.seed) for c in fam}) == 40
    rng = np.random.default_rng(3)
    shared = [A.random_candidate(zoo, rng) for _ in range(40)]
    assert sum(c.shift < -1.0 for c in shared) > 35   # a uniform shift is almost never 0
    rng, fam_rng = np.random.default_rng(5), np.random.default_rng([5, 1])
    first = A.random_candidate(zoo, np.random.default_rng(5))
    restart = A.optimize._fresh_centre(zoo, rng, fam_rng)
    assert dataclasses.replace(restart, shift=first.shift) == first
    scores = A.SPACES["scores"]
    assert A.optimize.unshifted_candidate(scores, np.random.default_rng(1)) == \
        A.random_candidate(scores, np.random.default_rng(1))


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_starts_find_the_fixed_max_overflow(seed):
    """Primus-Turbo a6a16cdc's fixed max (P = exp2 of the raw score) overflows only on
    scores far above zero: the unshifted family reaches it from random starts alone."""
    res = A.search("primus-a6a16cdc", seed=seed, structured=False, max_evals=12,
                   budget_s=600, classes=("nonfinite",), shrink=False)
    assert res.found and res.found_classes == ["nonfinite"], A.summary(res)
    assert res.first.shift == 0.0 and A.judge(res.first, "primus-a6a16cdc",
                                              classes=("nonfinite",)).failed
