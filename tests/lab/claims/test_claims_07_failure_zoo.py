"""The sentences of lesson 07 (notebooks/07_failure_zoo.ipynb), computed again: each test
recomputes the numbers its markdown states, on its own inputs (its CPU defaults), so that a
change to the package that makes a sentence false fails here. The lessons keep only the asserts
that check the learner (fa_lab.lab.exercises); tests/lab/claims/ holds one file per lesson."""

import math

import pytest
import torch

for _extra in ("plotly", "ipywidgets", "anywidget"):  # fa_lab.lab needs the [lab] extra
    pytest.importorskip(_extra, reason="fa_lab.lab needs the [lab] extra")

from fa_lab.lab import solutions as sol  # noqa: E402

# ---- lesson 07, sections 1 to 3: FA4's toy, the boundary, the rows that see keys ----------

def _zoo_history(name, key, row=(0, 0, 0)):
    """Lesson 07's strip, one side: the entry's row state per step under ``key``."""
    from fa_lab.kernels.online.model import row_history
    from fa_lab.zoo import ENTRIES

    return row_history(ENTRIES[name].run(key)[3], *row)


def test_07_fa4_saturation_and_the_offset():
    """Section 1: before the fix, step 1's key has P = 2^11.5, cast to 448 while `l` adds it
    whole, so the output is 448 / (256 + 2^11.5); after (threshold 0) the base moves to 3.5
    and P stays 256. The offset's fix clips nothing and is off only by e4m3's 181 -> 176."""
    from fa_lab.numerics import E4M3_MAX
    from fa_lab.zoo import ENTRIES

    before, after = (_zoo_history("fa4_fp8_saturation", key) for key in ("before", "after"))
    assert before[1]["m"] == 0 and abs(before[1]["p_max"] / 2 ** 11.5 - 1) < 1e-6
    assert before[1]["saturated"] == 1 and abs(before[1]["l"] - (256 + 2 ** 11.5)) < 1e-3
    out_b = ENTRIES["fa4_fp8_saturation"].run("before")[0].item()
    assert abs(out_b - 448 / (256 + 2 ** 11.5)) < 1e-6
    assert after[1]["m"] == 3.5 and after[1]["p_max"] == 256
    offset_after = _zoo_history("fa4_fp8_offset", "after")
    assert offset_after[1]["saturated"] == 0 and offset_after[1]["p_max"] < E4M3_MAX
    assert abs(ENTRIES["fa4_fp8_offset"].run("after")[0].item() - 176 / (16 + 2 ** 7.5)) < 1e-6


@pytest.mark.slow
def test_07_fa4_boundary_curves():
    """Section 1's sweep of the second tile's jump: within log2 448 - 8 the unfixed error is
    e4m3's rounding (at most 2^-4), past it the clipped P loses weight; every fix stays
    within 2^-4, e5m2 within 2^-3, and their bounds rule P saturation out."""
    from fa_lab.numerics import E4M3_MAX
    from fa_lab.studies import onset
    from fa_lab.zoo import ENTRIES, Case
    from fa_lab.zoo.entries import fa4_tile_boundary

    def sat(policy):
        return next(h for h in onset.bound(policy).hazards if h.name == "P saturation")

    fa4 = {p.name: p for p in ENTRIES["fa4_fp8_saturation"].policies().values()}
    assert [(p.threshold, p.p_headroom) for p in fa4.values()] == [(4, 8), (0, 8), (0.75, 8), (4, 4), (4, 8)]
    jumps = [i / 20 for i in range(0, 91)]
    errors = {name: [] for name in fa4}
    for j in jumps:
        c = fa4_tile_boundary()
        k = c.k.clone()
        k[0, 0] = j
        c = Case(c.q, k, c.v, mask=c.mask, softmax_scale=c.softmax_scale)
        ref_j = c.reference()[0].item()
        for name, p in fa4.items():
            errors[name].append(abs(c.run(p)[0].item() - ref_j))
    n_inside = sum(j <= math.log2(E4M3_MAX) - 8 for j in jumps)
    assert max(errors["fa4_fp8_saturation:before"][:n_inside]) <= 2 ** -4
    assert max(errors["fa4_fp8_saturation:before"][n_inside + 4:80]) > 0.25
    assert not sat("fa4_fp8_saturation:before").never
    assert all(sat(n).never for n in errors if not n.endswith(":before"))
    fixes = [n for n in errors if n.endswith(("after", "0.75", "offset"))]
    assert len(fixes) == 3 and all(max(errors[n]) <= 2 ** -4 for n in fixes)
    assert max(errors["fa4_fp8_saturation:before_e5m2"]) <= 2 ** -3
    assert "log2(57344) = 15.8" in sat("fa4_fp8_saturation:before_e5m2").formula


def test_07_rows_that_see_keys_die():
    """Section 3: PyTorch's row 600 sees keys only in its second block, and dies before the
    fix (born in block 0, kept by 0 x NaN), not after (#130014 skips block 0); every entry's
    row is NaN before; after, only ffpa's (its P is NaN too: the fix removes the factor)."""
    from fa_lab.zoo import ENTRIES

    cpu = ENTRIES["pytorch_cpu_masked_block"]
    block = cpu.before.semantics.block_n
    seen = cpu.case().mask[600].isfinite().nonzero().flatten()
    assert (seen // block == 1).all()
    rows = {"flydsl_fp8_empty_tile": 0, "sdpa_masked_row": 5, "pytorch_cpu_masked_block": 600,
            "ffpa_vote_nan": 0}
    for name, r in rows.items():
        e = ENTRIES[name]
        ref_row = e.case().reference()[0][0, r, 0]
        err = {key: (e.run(key)[0][0, r, 0].double() - ref_row).abs().max().item()
               for key in ("before", "after")}
        assert math.isnan(err["before"]) and math.isnan(err["after"]) == (name == "ffpa_vote_nan"), name
    cpu_b, cpu_a = (_zoo_history("pytorch_cpu_masked_block", k, (0, 0, 600)) for k in ("before", "after"))
    assert math.isnan(cpu_b[0]["factor"]) and math.isnan(cpu_b[1]["o_max"])
    assert cpu_a[0]["skipped"] and math.isfinite(cpu_a[1]["o_max"])
    ffpa_b, ffpa_a = (_zoo_history("ffpa_vote_nan", k) for k in ("before", "after"))
    assert math.isnan(ffpa_b[0]["o_factor"]) and ffpa_a[0]["o_factor"] == 1.0
    assert math.isnan(ffpa_a[-1]["o_max"])


def test_07_the_headroom_halves_the_safe_length_per_unit():
    """Section 1's bound: the silent-mass-loss hazard's formula as printed, and its safe
    length (2 to its margin on a one-key row) 2^(8 - 4) = 16 times longer at H = 8 than at 4."""
    from fa_lab.studies import onset
    from fa_lab.zoo import ENTRIES

    fa4 = {p.name: p for p in ENTRIES["fa4_fp8_saturation"].policies().values()}
    keep, lower = fa4["fa4_fp8_saturation:after"], fa4["fa4_fp8_saturation:dtype_aware_offset"]
    mass = "silent mass loss (rounding and flushed tails)"
    one = torch.ones(1, 1, 1, 8)

    def safe(p):
        return 2 ** onset.bound(p).margins(onset.measure(one, one, one, policy=p))[mass]

    hz = next(h for h in onset.bound(keep).hazards if h.name == mass)
    assert hz.formula.startswith("2^-4 + n 2^(-10 - H)") and (keep.p_headroom, lower.p_headroom) == (8, 4)
    assert safe(keep) == 2 ** (keep.p_headroom - lower.p_headroom) * safe(lower) > 1


def test_07_sentinels():
    """Section 3: flashinfer's -5e4 sentinel puts the base so high that every P is 0 and the
    output 0 where the reference is not; TensorRT-LLM's masked row weighs every column 1 and
    returns exactly the mean of V."""
    from fa_lab.zoo import ENTRIES

    assert ENTRIES["flashinfer_sentinel"].before.semantics.mask_value == -5e4
    fi_b, trt_b = _zoo_history("flashinfer_sentinel", "before"), _zoo_history("trtllm_neg_inf", "before")
    out_fi, _, case_fi, _ = ENTRIES["flashinfer_sentinel"].run("before")
    ref_fi = case_fi.reference()[0][0, 0, 0]
    assert abs(fi_b[0]["m"] - -5e4 * case_fi.softmax_scale * math.log2(math.e)) < 0.1
    assert fi_b[0]["p_max"] == 0 and (out_fi[0, 0, 0] == 0).all() and (ref_fi != 0).any()
    out_trt, _, case_trt, _ = ENTRIES["trtllm_neg_inf"].run("before")
    assert trt_b[0]["l"] == case_trt.k.shape[1]
    assert torch.equal(out_trt[0, 0, 0].double(), case_trt.v[0, :, 0].double().mean(0))


def test_07_the_sentinel_bound_and_one_keys_lift():
    """Section 3's bound: sound and within a binade at flashinfer's finite sentinel (onset at
    most 129), never for TensorRT-LLM's; one key lifted below the sentinel is right, then inf
    from a lift of 128 to 140, then 0 from about 150 (the prose's 128 and 150)."""
    from fa_lab.studies import onset
    from fa_lab.studies.onset import boundcheck
    from fa_lab.zoo import ENTRIES, Case

    sw = boundcheck.sweep("flashinfer_sentinel:before", "finite sentinel")
    assert sw["sound"] and sw["within_one_binade_or_tile"] and sw["measured_onset"] <= 129
    assert next(h for h in onset.bound("trtllm_neg_inf:before").hazards
                if h.name == "finite sentinel").never

    def one_key(lift):
        s_max = -5e4 - lift / math.log2(math.e)
        k = torch.full((1, 64, 1, 1), s_max - 1.0)
        k[0, 0] = s_max
        v = torch.zeros(1, 64, 1, 1)
        v[0, 0] = 1.0
        return Case(torch.ones(1, 1, 1, 1), k, v, softmax_scale=1.0)

    fi = ENTRIES["flashinfer_sentinel"].before
    lifts = range(100, 171)
    outs = {lift: one_key(lift).run(fi)[0].item() for lift in lifts}
    ref_key = one_key(0).reference()[0].item()
    first_inf = min(lift for lift in lifts if outs[lift] == math.inf)
    first_zero = min(lift for lift in lifts if outs[lift] == 0)
    assert all(abs(outs[lift] - ref_key) < 0.01 for lift in lifts if lift < first_inf)
    assert all(outs[lift] == math.inf for lift in lifts if first_inf <= lift < first_zero)
    assert all(outs[lift] == 0 for lift in lifts if lift >= first_zero)
    assert 128 <= first_inf < 140 and 145 <= first_zero <= 155


# ---- lesson 07, section 4: outside the arithmetic -----------------------------------------

def test_07_fa3_tail_and_the_drag():
    """Section 4: FA3's `l` is finite and the same before and after (the tail's P is 0), the
    largest |O| NaN before and finite after; the lab's drag moves the base down from 200 to 0
    at step 1 with an inf factor; its bound is onset.bound's first hazard, and not exact."""
    from fa_lab.studies import onset

    fa3_b, fa3_a = _zoo_history("fa3_v_tail_nan", "before"), _zoo_history("fa3_v_tail_nan", "after")
    assert math.isfinite(fa3_b[0]["l"]) and fa3_b[0]["l"] == fa3_a[0]["l"]
    assert math.isnan(fa3_b[0]["o_max"]) and math.isfinite(fa3_a[0]["o_max"])
    drag_b = _zoo_history("flydsl_lazy_drag", "before")
    assert drag_b[1]["step"] == 1 and drag_b[1]["factor"] == math.inf
    assert drag_b[0]["m"] == 200 and drag_b[1]["m"] == 0                 # dragged down
    first = onset.bound("lazy_unfixed").hazards[0]
    assert first.name == "accumulator overflow" and not first.exact


# ---- lesson 07: the glance, section 2's geometry, section 5's attack and the exercise -------

def test_07_every_entry_shows_before_and_none_after():
    """The glance table: twenty entries (the introduction's "twenty"); every one shows its
    symptom on its own input before its fix and none after; no fix changes the tile."""
    from fa_lab.zoo import ENTRIES

    assert len(ENTRIES) == 20
    assert [n for n, e in ENTRIES.items() if not e.shows("before")] == []
    assert [n for n, e in ENTRIES.items() if e.shows("after")] == []
    assert all(e.after.semantics.block_n == e.before.semantics.block_n for e in ENTRIES.values())


def test_07_the_empty_max_is_one_tile_wide():
    """Section 2's bound: for PyTorch's CPU block, SDPA's masked row and ffpa the formula's
    boundary and the measured onset are both the kernel's tile (512, 64, 64 keys of mask) and
    sound; after the three fixes the hazard is never."""
    from fa_lab.kernels.online.model import DEFAULT_BLOCK_N
    from fa_lab.studies import onset
    from fa_lab.studies.onset import boundcheck
    from fa_lab.zoo import ENTRIES

    hollow = "NaN from a first tile with nothing visible"
    for name, width in (("pytorch_cpu_masked_block", 512), ("sdpa_masked_row", 64), ("ffpa_vote_nan", 64)):
        assert (ENTRIES[name].before.semantics.block_n or DEFAULT_BLOCK_N) == width
        sw = boundcheck.sweep(f"{name}:before", hollow)
        assert sw["formula_boundary"] == sw["measured_onset"] == width and sw["sound"], name
    for name in ("pytorch_cpu_masked_block", "sdpa_masked_row", "flydsl_fp8_empty_tile"):
        assert next(h for h in onset.bound(f"{name}:after").hazards if h.name == hollow).never, name


def test_07_the_recorded_attack_finds_every_entry_and_two_fixes():
    """Section 5's record: every entry's failure found from both kinds of start, the slowest
    after 42.4 s, inside the 60 s budget; against the fixes only #5364's floor
    (`flydsl_fp8_empty_tile`, nonfinite) and tt-metal's clamp (`ttmetal_exp_clamp`, empty)."""
    from fa_lab import results
    from fa_lab.zoo import ENTRIES

    rec = results.reference("zoo_attack")
    before = [r for r in rec["table"] if not r["fix"]]
    assert {(r["entry"], r["starts"]) for r in before} == {
        (n, s) for n in ENTRIES for s in ("structured", "random only")}
    assert all(r["found"] for r in before)
    worst = max(r["time_to_first_s"] for r in before)
    assert round(worst, 1) == 42.4 and worst < rec["budget_s"] == 60
    fixes = {r["entry"]: r["found_classes"] for r in rec["table"] if r["fix"] and r["found"]}
    assert fixes == {"flydsl_fp8_empty_tile": ["nonfinite"], "ttmetal_exp_clamp": ["empty"]}


def test_07_the_live_searches():
    """Section 5's live searches: SDPA's masked row fails before its fix after 2 model runs and
    survives 12 after it; #130014 alone fails once the search counts the `empty` class."""
    from fa_lab.studies import adversary

    kw = dict(budget_s=600, seed=0, shrink=False)
    before = adversary.search("sdpa_masked_row:before", max_evals=12, **kw)
    after = adversary.search("sdpa_masked_row:after", max_evals=12, **kw)
    assert before.found and before.evals_to_first == 2
    assert not after.found and after.evals == 12
    pt = adversary.search("pytorch_cpu_masked_block:after", classes=("nonfinite", "empty"),
                          max_evals=40, **kw)
    assert pt.found and "FAILS (empty)" in adversary.summary(pt)


@pytest.mark.slow
def test_07_the_reference_zoo_policy():
    """The exercise's markdown on the reference answer: the check passes (nothing in 40 runs);
    NaN and saturation are never; the tails' safe length is 48,128 keys, which is
    (0.25 - 2^-4 - 2^-8) 2^(10 + H) at H = 8 (rounding, the output's roundoff, the flush)."""
    from fa_lab.lab.exercises import check_zoo_policy
    from fa_lab.studies import onset

    policy = sol.zoo_policy()
    attack, region = check_zoo_policy(policy)
    assert not attack.found and attack.evals == 40
    assert all(h.never for h in region.hazards if h.kind in ("nan", "saturation"))
    one = torch.ones(1, 1, 1, 8)
    mass = "silent mass loss (rounding and flushed tails)"
    safe = 2 ** region.margins(onset.measure(one, one, one, policy=policy))[mass]
    by_hand = (region.tolerance - 2 ** -4 - 2 ** -8) * 2 ** (10 + policy.p_headroom)
    assert region.tolerance == 0.25 and policy.p_headroom == 8 and by_hand == 48128
    assert round(safe) == 48128
