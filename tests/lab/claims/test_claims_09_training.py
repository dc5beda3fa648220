"""The sentences of lesson 09 (notebooks/09_training.ipynb), computed again: each test recomputes
the numbers its markdown states, on its own inputs (its CPU defaults), so that a change to the
package that makes a sentence false fails here. The lessons keep only the asserts that check
the learner (fa_lab.lab.exercises); tests/lab/claims/ holds one file per lesson."""

import math

import pytest
import torch

for _extra in ("plotly", "ipywidgets", "anywidget"):  # fa_lab.lab needs the [lab] extra
    pytest.importorskip(_extra, reason="fa_lab.lab needs the [lab] extra")

import fa_lab  # noqa: E402
from fa_lab.studies import experiments  # noqa: E402

# ---- lesson 09: the backward ---------------------------------------------------------------

def _grads_09(q, k, v, do, **kw):
    """Lesson 09's `grads`: out, lse, the gradients and their non-finite report."""
    from fa_lab.autograd import nonfinite_report

    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = fa_lab.flash_attn_func(*leaves, return_lse=True, backend="emulator",
                                      kernel="swp_bf16", **kw)
    out.backward(do)
    g = [t.grad for t in leaves]
    return out.detach(), lse, g, nonfinite_report(dq=g[0], dk=g[1], dv=g[2])


@pytest.mark.filterwarnings("ignore::fa_lab.RoutingWarning")  # the lesson picks swp_bf16 knowingly
def test_09_the_empty_band_and_the_floor():
    """Section 2: 104 causal rows over 64 keys, bottom-right aligned: the first 104 - 64 = 40
    rows see no key, their LSE is -inf and their output 0; every gradient is finite and dQ
    on them exactly 0. Without dQ's floor, dQ is non-finite on exactly those 40 rows, dK and
    dV on none."""
    from fa_lab.autograd import nonfinite_report
    from fa_lab.kernels.bwd import model as bwd_model

    g0 = torch.Generator().manual_seed(21)
    q, k, v, do = (torch.randn(1, s, 2, 64, generator=g0).bfloat16() for s in (104, 64, 64, 104))
    out, lse, g, rep = _grads_09(q, k, v, do, causal=True, rescale="lazy")
    empty = torch.isneginf(lse[0, 0]).nonzero().flatten().tolist()
    assert empty == list(range(104 - 64)) and (out[0, :40] == 0).all()
    assert all(not r["rows"] for r in rep.values()) and (g[0][0, :40] == 0).all()
    no_floor = bwd_model.backward(q, k, v, out, do, lse, causal=True, lse_floor=False)
    bad = nonfinite_report(dq=no_floor[0], dk=no_floor[1], dv=no_floor[2])
    assert sorted({r[2] for r in bad["dq"]["rows"]}) == empty
    assert not bad["dk"]["rows"] and not bad["dv"]["rows"]


@pytest.mark.filterwarnings("ignore::fa_lab.RoutingWarning")  # the lesson picks swp_bf16 knowingly
def test_09_a_forward_nan_row_tensor_by_tensor():
    """Section 3's table (the report's inputs at K x64, 512 keys, 32 rows): under lazy_unfixed
    5 rows of O die and the same 5 of dQ, every one of the 512 rows of dK, and, through the
    one NaN LSE, every one of dV; eager and lazy leave all zeros."""
    q, k, v = experiments.bf16_inputs(1, 512, 1, 64, k_scale=64)
    q = q[:, :32]
    do = torch.randn(1, 32, 1, 64, generator=torch.Generator().manual_seed(1)).bfloat16()
    for pol in ("eager", "lazy", "lazy_unfixed"):
        out, lse, _, rep = _grads_09(q, k, v, do, causal=False, rescale=pol)
        nan_o = out[0, :, 0].isnan().any(-1).nonzero().flatten().tolist()
        dq_rows = sorted({r[2] for r in rep["dq"]["rows"]})
        counts = (len(nan_o), int(lse.isnan().sum()), len(rep["dk"]["rows"]), len(rep["dv"]["rows"]))
        if pol == "lazy_unfixed":
            assert counts == (5, 1, 512, 512) and dq_rows == nan_o, (counts, dq_rows, nan_o)
        else:
            assert counts == (0, 0, 0, 0) and not dq_rows and not torch.isposinf(lse).any(), pol


@pytest.mark.slow
def test_09_the_predictor_finds_trainings_first_event():
    """Section 4: one layer, six steps, scale 512: lazy_unfixed's first event is a forward one
    at step 4 in blocks.0.attn, 11 rows, and the onset predictor, on the captured inputs, finds
    its first bad rows at the same step and module, the same 11, its deficit past 128 there
    (212.3) and below it before (53.4 at step 3); lazy stays finite."""
    from fa_lab.studies import training
    from fa_lab.studies.onset.predict import predict

    cfg = dict(scale=512.0, steps=6, layers=1, seed=1)
    run_u = training.train(training.Config(policy="lazy_unfixed", **cfg), capture=True)
    f = run_u["first"]
    assert (f["step"], f["module"], f["phase"], f["n_rows"]) == (4, "blocks.0.attn", "forward", 11)
    deficits, first_pred = [], None
    for call in run_u["inputs"]:
        on = predict(call["q"], call["k"], call["v"], causal=True, rescale="lazy_unfixed",
                     kernel="swp_bf16", level="exact")
        deficits.append(round(on.deficit.max().item(), 1))
        if on.bad.any() and first_pred is None:
            first_pred = (call["step"], call["module"], int(on.bad.sum()))
    assert first_pred == (4, "blocks.0.attn", 11)
    assert deficits[0] == 0.9 and deficits[3] == 53.4 and deficits[4] == 212.3
    assert training.train(training.Config(policy="lazy", **cfg))["first"] is None


def test_09_the_training_record():
    """Section 4's record: lazy never fails; lazy_unfixed and the fixed max fail at every
    scale, the fixed max first (steps 72 to 112, against 101 to 161); at scale 16 its first
    event is a zero row (lse_neginf), not a NaN."""
    from fa_lab import results

    rows = results.reference("training_nonfinite")["table"]
    first = {(r["policy"], r["scale"]): r["first_step"] for r in rows}
    assert all(first[p, s] is None or math.isnan(first[p, s]) for p, s in first if p == "lazy")
    fixed = {s: v for (p, s), v in first.items() if p == "primus-a6a16cdc"}
    unfixed = {s: v for (p, s), v in first.items() if p == "lazy_unfixed"}
    assert set(fixed) == set(unfixed) == {16.0, 32.0, 64.0, 128.0, 256.0}
    assert all(fixed[s] < unfixed[s] for s in fixed)
    assert (min(fixed.values()), max(fixed.values())) == (72, 112)
    assert (min(unfixed.values()), max(unfixed.values())) == (101, 161)
    kind16 = next(r["kind"] for r in rows if r["policy"] == "primus-a6a16cdc" and r["scale"] == 16)
    assert kind16 == "lse_neginf"


def test_09_a_zero_row_is_loud_in_the_gradients():
    """Section 4's hand-built row: under the fixed max it sees keys but comes back zero with an
    LSE of -inf, the recompute's P is inf on all 128 keys, and 1 row of dQ and all 128 of dK
    and dV are non-finite; under eager nothing is."""
    from fa_lab.studies import propagation

    r = propagation.run_case("underflow_row", "primus-a6a16cdc")
    f, g = r["forward"], r["grads"]
    assert f["zero_rows_that_see_keys"] == f["lse_neginf"] and len(f["lse_neginf"]) == 1
    assert r["p_inf"] == 128
    assert [len(g[n]["rows"]) for n in ("dq", "dk", "dv")] == [1, 128, 128]
    e = propagation.run_case("underflow_row", "eager")
    assert e["p_inf"] == 0 and not e["forward"]["lse_neginf"] and not any(x["rows"] for x in e["grads"].values())


def test_07_copies_lag_their_fixes():
    """Section 6: on the hand-built wave (row 0 rising 10 a tile, row 1 falling 40; V = ones),
    FlyDSL as it is today (body `lazy`) has no NaN row and row 1 is exactly 1; MSLK's copy at
    2a3c897 (body `lazy_unfixed`) loses row 1 to NaN, and only it."""
    from fa_lab import upstream
    from fa_lab.studies.experiments import drag_case

    q, k, v = drag_case()
    assert torch.equal(v, torch.ones_like(v))
    bodies, nan_rows, row1 = {}, {}, {}
    for name in ("fixed", "mslk-2a3c897"):
        out = fa_lab.flash_attn_func(q, k, v, causal=False, upstream=name, kernel="swp_bf16")
        bodies[name] = upstream.VERSIONS[name].bf16_lazy
        nan_rows[name] = out.isnan().any(-1).flatten().nonzero().flatten().tolist()
        row1[name] = float(out[0, 1, 0, 0])
    assert bodies == {"fixed": "lazy", "mslk-2a3c897": "lazy_unfixed"}
    assert nan_rows == {"fixed": [], "mslk-2a3c897": [1]}
    assert row1["fixed"] == 1.0 and math.isnan(row1["mslk-2a3c897"])
