"""The zoo's second round and the entry checks of issue 39: each report's numbers by hand,
the new semantics fields against constructed rows, and the first round's corrected slips."""

import math

import pytest
import torch

from fa_lab import Policy
from fa_lab.kernels.online.model import LOG2_UNITS, forward, merge_partials, softcap
from fa_lab.semantics import Semantics
from fa_lab.zoo import ENTRIES, Case

INF = math.inf
LN2 = math.log(2)


def run(name, which="before"):
    return ENTRIES[name].run(which)


def test_the_zoo_holds_twenty_entries_each_with_a_colour():
    assert len(ENTRIES) >= 20
    colours = {p.color for e in ENTRIES.values() for p in (e.before,) if p.color}
    assert len(colours) >= 19      # every round-2 entry wears a colour of its own


# -- the new fields on constructed rows ------------------------------------------------------

def test_softcap_forms():
    t = torch.tensor([1.0, 100.0, 4400.0, 5000.0, -10000.0])
    exact = 50 * torch.tanh(t.double() / 50)
    ratio = softcap(t, 50.0, "exp_ratio")
    assert torch.isnan(ratio[3:]).all() and torch.isfinite(ratio[:2]).all()
    assert ratio[2] == 50.0     # e^88 is still finite in fp32 (the PR's GPU exp gave inf)
    fixed = softcap(t, 50.0, "exp_sum")
    assert torch.allclose(fixed.double(), exact, rtol=0, atol=1e-4)
    assert fixed[3] == 50.0 and fixed[4] == -50.0


def test_merge_of_partials_by_hand():
    o = [torch.full((1, 1, 1, 1), -1.0), torch.full((1, 1, 1, 1), 1.0)]
    lse = [torch.full((1, 1, 1), math.log(64)), torch.full((1, 1, 1), math.log(16))]
    out, l = merge_partials(list(zip(o, lse)))
    assert float(out) == pytest.approx(-0.6, abs=1e-6) and float(l) == pytest.approx(math.log(80))
    out2, _ = merge_partials(list(zip(o, lse)), lse_base="2")
    w = 64 ** (1 / LN2), 16 ** (1 / LN2)
    assert float(out2) == pytest.approx((w[1] - w[0]) / sum(w), rel=1e-5)
    empty = [(torch.zeros(1, 1, 1, 1), torch.full((1, 1, 1), -INF))] * 2
    out3, l3 = merge_partials(empty)
    assert float(out3) == 0 and float(l3) == -INF
    out4, l4 = merge_partials(empty, merge_empty="nan")
    assert math.isnan(float(out4)) and math.isnan(float(l4))


def test_a_split_walk_matches_the_whole_walk():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, n, 2, 16, generator=g) for n in (5, 200, 200))
    whole = forward(q, k, v, policy=Policy("tile", "max", name="w"), causal=True)
    split = forward(q, k, v, policy=Policy("tile", "max", name="s",
                                           semantics=Semantics(kv_split=1)), causal=True)
    assert torch.allclose(whole[0], split[0], atol=1e-6) and torch.allclose(whole[1], split[1])


def test_mask_stage_p_lets_a_stale_score_raise_the_max():
    """A stale finite K in the tail scores 200 log2 units: masked after the arithmetic it
    becomes the row's max, the real keys' P underflow and the row returns 0."""
    k = torch.zeros(1, 8, 1, 1)
    k[0, 5:] = 200.0
    v = torch.ones(1, 8, 1, 1)
    case = Case(torch.ones(1, 1, 1, 1), k, v, seqlen_kv=5, softmax_scale=LOG2_UNITS)
    pol = ENTRIES["paged_tail_mask_after"]
    assert float(case.run(pol.before)[0]) == 0.0
    assert float(case.run(pol.after)[0]) == 1.0


def test_exp_floor_turns_nan_into_the_floor():
    e = ENTRIES["ttmetal_exp_clamp"]
    out, lse, case, _ = e.run("before")
    assert float(out) == pytest.approx(31.5)            # mean of 0..63: every weight 1/64
    out_a, lse_a, _, _ = e.run("after")
    assert math.isnan(float(out_a))                     # #56430: NaN, as torch.softmax


# -- the entries' numbers --------------------------------------------------------------------

def test_te_empty_band_merges_to_nan_and_guarded_to_empty():
    out, lse, _, _ = run("te_cp_empty_band")
    assert torch.isnan(out).all() and torch.isnan(lse).all()
    out, lse, _, _ = run("te_cp_empty_band", "after")
    assert (out == 0).all() and (lse == -INF).all()


def test_softcap_entry_numbers():
    out, lse, case, _ = run("vllm_softcap_exp_ratio")
    assert math.isnan(float(out)) and math.isnan(float(lse))
    out, lse, case, _ = run("vllm_softcap_exp_ratio", "after")
    s = 50 * torch.tanh(torch.tensor([1.0, 100.0, 3000.0, 5000.0], dtype=torch.float64) / 50)
    p = torch.softmax(s, 0)
    assert float(out) == pytest.approx(float(p @ torch.arange(4.0).double()), rel=1e-5)


def test_lse_base2_merge_moves_weight_to_the_long_prefix():
    out, lse, case, _ = run("lse_base2_merge")
    w = 64 ** (1 / LN2), 16 ** (1 / LN2)
    assert float(out[0, 0, 0, 0]) == pytest.approx((w[1] - w[0]) / sum(w), rel=1e-5)  # -0.762
    assert abs(float(out[0, 0, 0, 0]) + 0.6) > 0.16
    out, lse, _, _ = run("lse_base2_merge", "after")
    assert float(out[0, 0, 0, 0]) == pytest.approx(-0.6, rel=1e-6)
    assert float(lse) == pytest.approx(math.log(80), rel=1e-6)


def test_stale_tail_nan_only_when_masked_after():
    out, _, case, _ = run("paged_tail_mask_after")
    assert torch.isnan(out).all()
    out, _, case, _ = run("paged_tail_mask_after", "after")
    assert torch.allclose(out.double(), case.reference()[0], atol=1e-6)


def test_flashinfer_merge_empty_numbers():
    out, lse, case, _ = run("flashinfer_merge_empty")
    assert torch.isnan(out[0]).all() and torch.isnan(lse[0]).all()
    assert torch.isfinite(out[1]).all()                 # one empty partial beside a full one
    out, lse, case, _ = run("flashinfer_merge_empty", "after")
    assert (out[0] == 0).all() and (lse[0] == -INF).all()
    assert torch.allclose(out[1].double(), case.reference()[0][1], atol=1e-6)


def test_vllm_merge_attn_states_rows():
    out, lse, case, _ = run("vllm_merge_attn_states_empty")
    assert torch.isnan(out[0, 0]).all() and torch.isfinite(out[0, 1:]).all()
    ref = case.reference()[0]
    assert torch.allclose(out[0, 1:].double(), ref[0, 1:], atol=1e-6)
    out, lse, _, _ = run("vllm_merge_attn_states_empty", "after")
    assert (out[0, 0] == 0).all() and lse[0, 0, 0] == -INF


def test_sparse_mla_leading_chunk_numbers():
    e = ENTRIES["vllm_sparse_mla_leading_chunk"]
    out, lse, case, _ = e.run("before")
    assert torch.isnan(out).all()
    out, lse, case, _ = e.run("after")
    assert torch.allclose(out.double(), case.reference()[0], atol=1e-6)
    # a row with no valid index: every slot loads K = V = 0, so P = exp2(0) = 1 and O = 0
    g = torch.Generator().manual_seed(0)
    empty = Case(torch.randn(1, 1, 1, 8, generator=g), torch.zeros(1, 32, 1, 8),
                 torch.zeros(1, 32, 1, 8), mask=torch.zeros(1, 32, dtype=torch.bool))
    assert torch.isnan(e.run("before", empty)[0]).all()
    assert (e.run("after", empty)[0] == 0).all()


def test_mha_masked_row_numbers():
    out, lse, case, _ = run("pytorch_mha_masked_row")
    assert torch.isnan(out[0, 3]).all() and torch.isfinite(out[0, :3]).all()
    out, lse, case, _ = run("pytorch_mha_masked_row", "after")
    assert (out[0, 3] == 0).all()
    assert torch.allclose(out[0, :3].double(), case.reference()[0][0, :3], atol=1e-6)


def test_mslk_p_before_vote_numbers():
    out, lse, _, _ = run("mslk_p_before_vote")
    assert float(out) == 0.5 and float(lse) == pytest.approx(math.log(2) * LN2 / LN2)
    out, lse, _, _ = run("mslk_p_before_vote", "after")
    assert float(out) == pytest.approx(8 / 9) and float(lse) == pytest.approx(math.log(9))


def test_new_fields_are_refused_by_the_flydsl_families():
    from fa_lab import capabilities as C
    from fa_lab.kernels import FAMILIES

    for name, kw in (("softcap", dict(softcap=30.0)), ("exp_floor", dict(exp_floor=-100.0)),
                     ("mask_stage", dict(mask_stage="p")),
                     ("p_before_vote", dict(p_before_vote=True)), ("kv_split", dict(kv_split=2)),
                     ("merge_empty", dict(merge_empty="nan")), ("lse_base", dict(lse_base="2"))):
        pol = Policy("tile", "max", name=f"t_{name}", semantics=Semantics(**kw))
        with pytest.raises(ValueError, match=name):
            C.check_semantics(pol, FAMILIES["swp_bf16"], "model")


# -- issue 39 item 5: the first round's checks -----------------------------------------------

def test_flydsl_empty_tile_symptom_catches_a_visible_row():
    """A row that sees keys only after an all-masked first 128-column tile comes out NaN
    before aiter #5364; the symptom check flags it as well as the empty sequence."""
    e = ENTRIES["flydsl_fp8_empty_tile"]
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, n, 1, 8, generator=g).to(torch.float8_e4m3fn).float()
               for n in (1, 200, 200))
    mask = torch.ones(1, 200, dtype=torch.bool)
    mask[0, :128] = False
    case = Case(q, k, v, mask=mask)
    out, lse, c, rec = e.run("before", case)
    assert torch.isnan(out).all() and e.symptom(out, lse, c, rec)
    out, lse, c, rec = e.run("after", case)
    assert not e.symptom(out, lse, c, rec)
    assert torch.allclose(out.double(), case.reference()[0], atol=0.02)


def test_flydsl_lazy_drag_on_the_swp_bf16_family():
    e = ENTRIES["flydsl_lazy_drag"]
    out, lse = e.run_kernel("swp_bf16", "before")
    assert torch.isnan(out[0, 1]).all() and lse[0, 0, 1] == INF     # the victim row
    out, lse = e.run_kernel("swp_bf16", "after")
    assert (out.float() == 1).all()                                  # V = ones
    with pytest.raises(ValueError, match="kernel"):
        e.run_kernel("swp_fp8")


def test_sdpa_mask_is_the_repro_s_top_left_corner():
    case = ENTRIES["sdpa_masked_row"].case()
    want = torch.zeros(6, 10, dtype=torch.bool)
    for i in range(5):
        want[i, :i + 1] = True
    assert torch.equal(case.mask, want)


def test_fa3_tile_is_192_at_hdim_64_and_ffpa_votes_at_zero():
    fa3 = ENTRIES["fa3_v_tail_nan"]
    assert fa3.case().q.shape[-1] == 64 and fa3.before.semantics.block_n == 192
    ffpa = ENTRIES["ffpa_vote_nan"]
    assert ffpa.before.threshold == 0.0 and ffpa.after.threshold == 0.0
    # the vote fires on any rise: a jump of 1 log2 unit rescales the 16-row warp
    out, lse, case, rec = ffpa.run("before")
    assert any(bool(torch.isnan(r.o_factor).any()) for r in rec)
