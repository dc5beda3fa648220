"""The sentences of lesson 04 (notebooks/04_kernel_set.ipynb), computed again: each test
recomputes the numbers its markdown states, on its own inputs (its CPU defaults), so that a
change to the package that makes a sentence false fails here. The lessons keep only the asserts
that check the learner (fa_lab.lab.exercises); tests/lab/claims/ holds one file per lesson."""

import itertools

import pytest
import torch

for _extra in ("plotly", "ipywidgets", "anywidget"):  # fa_lab.lab needs the [lab] extra
    pytest.importorskip(_extra, reason="fa_lab.lab needs the [lab] extra")

import fa_lab  # noqa: E402
from fa_lab.lab import solutions as sol  # noqa: E402
from fa_lab.studies import experiments  # noqa: E402

# ---- lesson 04, section 1: per row or per wave -------------------------------------------

@pytest.fixture(scope="module")
def kernel_set_head():
    """Lesson 04's inputs (B=1, S=2048, H=2, D=128, K x32): its table of designs, and its
    breakdown of head 0's loop row-steps."""
    from fa_lab import metrics, reference

    q, k, v = experiments.bf16_inputs(1, 2048, 2, 128, k_scale=32.0, seed=0)
    ref, _ = reference.attention(q, k, v, causal=False)
    designs = {}
    for policy in ("eager", "fa4_row", "lazy", "lazy_unfixed"):
        c = fa_lab.count_rescales(q, k, v, causal=False, rescale=policy)
        designs[policy] = {"nan": 100 * torch.isnan(c["out"]).float().mean().item(),
                           "rel_l2": metrics.rel_l2(c["out"], ref),
                           "skipped": 100 * c["o_rescale_skip_frac"],
                           "swept": c["rows_swept"], "up": c["rows_scaled_up"]}
    breakdown = {}
    for policy in ("fa4_row", "lazy", "lazy_unfixed"):
        s = fa_lab.trace(q, k, v, rows=range(2048), head=0, causal=False, rescale=policy).steps
        s = s[s.phase == "loop"]
        breakdown[policy] = {"quiet": int((~s.fire).sum()), "voted": int(s.vote.sum()),
                             "within": int((s.fire & ~s.vote & ~s.swept).sum()),
                             "alone": int((s.swept & (s["corr"] <= 1)).sum()),
                             "dragged": int((s.swept & (s["corr"] > 1)).sum())}
    return designs, breakdown


@pytest.mark.slow
def test_04_the_safe_designs_and_the_column_that_reads_backwards(kernel_set_head):
    d, _ = kernel_set_head
    for p in ("fa4_row", "lazy"):     # finite, as accurate as eager (within 1 %)
        assert d[p]["nan"] == 0 and abs(d[p]["rel_l2"] / d["eager"]["rel_l2"] - 1) < 0.01, p
    assert d["lazy_unfixed"]["nan"] > 0 and all(d[p]["up"] == 0 for p in ("eager", "fa4_row", "lazy"))
    assert d["fa4_row"]["skipped"] > 5 and d["lazy"]["skipped"] > 5
    assert d["lazy_unfixed"]["skipped"] == 0
    assert d["lazy_unfixed"]["swept"] < d["lazy"]["swept"] < d["fa4_row"]["swept"]


@pytest.mark.slow
def test_04_the_breakdown_of_the_loop(kernel_set_head):
    d, b = kernel_set_head
    below = {p: b[p]["alone"] + b[p]["dragged"] for p in b}
    assert b["fa4_row"]["dragged"] == b["lazy"]["dragged"] == 0 and b["lazy_unfixed"]["alone"] == 0
    assert b["lazy_unfixed"]["voted"] > 3 * b["lazy"]["voted"]              # "several times"
    assert b["lazy_unfixed"]["quiet"] == 0 and below["lazy_unfixed"] < below["lazy"]
    assert d["lazy"]["skipped"] > d["fa4_row"]["skipped"] and b["lazy"]["quiet"] > b["fa4_row"]["quiet"]
    assert len({sum(row.values()) for row in b.values()}) == 1            # the same row-steps, sorted


@pytest.mark.slow
@pytest.mark.parametrize("k_try", [4.0, 8.0, 16.0, 64.0])
def test_04_try_this_the_drag_is_there_before_it_shows(k_try):
    """The "Try this": the unfixed design scales rows up at every K; once every wave fires,
    exactly where a row's tile max falls below its previous one; no NaN at K x8 or x16; the
    safe designs never scale up."""
    qt, kt, vt = experiments.bf16_inputs(1, 1024, 1, 128, k_scale=k_try, seed=0)
    tried = {p: fa_lab.count_rescales(qt, kt, vt, causal=False, rescale=p)
             for p in ("fa4_row", "lazy", "lazy_unfixed")}
    s = fa_lab.trace(qt, kt, vt, rows=range(1024), causal=False, rescale="lazy_unfixed").steps
    s = s.assign(prev_mt=s.groupby("lane").mt.shift())
    loop = s[s.phase == "loop"]
    assert tried["lazy_unfixed"]["rows_scaled_up"] > 0
    if k_try >= 8:
        assert loop.fire.all()
    if loop.fire.all():
        assert tried["lazy_unfixed"]["rows_scaled_up"] == int((loop.mt < loop.prev_mt).sum())
    else:
        assert k_try < 8                                       # "below K x8 some waves stop firing"
    assert tried["fa4_row"]["rows_scaled_up"] == tried["lazy"]["rows_scaled_up"] == 0
    if k_try <= 16:
        assert all(not torch.isnan(c["out"]).any() for c in tried.values())


@pytest.mark.slow
def test_04_the_combine_case_has_a_dead_part():
    from fa_lab.lab import exercises

    combined = exercises.check_combine(sol.combine, exercises.combine_cases(device="cpu"))
    assert combined.loc["lazy_unfixed", "rows with a part's LSE NaN"] > 0


@pytest.mark.slow
def test_04_more_parts_less_nan():
    """Section 2's split-K cell: on the check's inputs (512 rows, 2048 keys, 2 heads, K x48)
    the unfixed rule's NaN share falls with every part added (1 to 4 parts), and by the
    onset rule per part: a row dies only where some part has a tile 128 below that part's
    own record, which the whole walk's record bounds from above."""
    from fa_lab.studies.experiments import bf16_inputs

    q, k, v = bf16_inputs(1, 2048, 2, 128, k_scale=48.0, seed=0)
    q = q[:, :512].contiguous()
    nan = [100 * fa_lab.flash_attn_func(q, k, v, causal=False, rescale="lazy_unfixed",
                                        num_kv_splits=n).isnan().float().mean().item()
           for n in (1, 2, 3, 4)]
    assert all(a > b for a, b in itertools.pairwise(nan)) and nan[-1] > 0, nan
