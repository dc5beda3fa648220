"""fa_lab.studies.training: the small transformer under the SDPA patch. The first
non-finite step that fa_lab reports under lazy_unfixed is the one the onset predictor
(an independent replay of the kernel's base recurrence from the tile maxima) finds in the
captured attention inputs; lazy stays finite on the same run."""

import math
import warnings

import numpy as np
import pytest
import torch

from fa_lab.studies import onset, training
from fa_lab.studies.onset.predict import predict

#: one layer, six steps, the logit scale rising geometrically from 1 to 512
CFG = dict(scale=512.0, steps=6, layers=1, seed=1)


def run(policy, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return training.train(training.Config(policy=policy, **{**CFG, **kw}), capture=True)


def predicted_bad_rows(call):
    on = predict(call["q"], call["k"], call["v"], causal=call["causal"], rescale="lazy_unfixed",
                 kernel="swp_bf16", level="exact")
    return sorted((b, h, s) for b, s, h in on.bad.nonzero().tolist())


@pytest.mark.slow
def test_first_nonfinite_step_under_lazy_unfixed_is_the_predicted_one():
    r = run("lazy_unfixed")
    first = r["first"]
    assert first is not None, "the logit scale must reach lazy_unfixed's failure"
    assert first["phase"] == "forward" and first["tensor"] == "out"
    # independent: the first captured call whose inputs the onset predictor calls bad
    predicted = next((c, rows) for c in r["inputs"] if (rows := predicted_bad_rows(c)))
    call, rows = predicted
    assert (first["step"], first["call"], first["module"]) == (call["step"], call["call"],
                                                                call["module"])
    assert first["module"] == "blocks.0.attn" and first["step"] > 0  # the growth did it
    assert [tuple(x) for x in first["rows"]] == rows[:64] and first["n_rows"] == len(rows)
    assert first["temperature"] == pytest.approx(512.0 ** (first["step"] / 5))
    # the run stops after the failing step, its loss non-finite
    assert r["steps_run"] == first["step"] + 1 and not math.isfinite(r["losses"][-1])
    assert all(math.isfinite(x) for x in r["losses"][:-1])


@pytest.mark.slow
def test_lazy_stays_finite_on_the_same_run():
    r = run("lazy", steps=5)
    assert r["first"] is None and r["events"] == [] and r["steps_run"] == 5
    assert all(math.isfinite(x) for x in r["losses"])


#: the set logit scale of the fast tests: three steps, the temperature 1, sqrt(scale), scale
FAST = dict(steps=3, layers=1, seed=1)


def test_the_first_nonfinite_step_under_lazy_unfixed_at_a_set_scale():
    """At a final logit scale of 200 (temperatures 1, 14.1, 200) lazy_unfixed first gives a
    non-finite value at step 2, in the forward output of blocks.0.attn, on exactly the
    rows the onset predictor calls bad in that call's captured inputs; the calls before
    it are predicted clean. lazy runs the same three steps finite."""
    r = run("lazy_unfixed", scale=200.0, **FAST)
    first = r["first"]
    assert (first["step"], first["call"], first["module"], first["phase"], first["tensor"]) == (
        2, 2, "blocks.0.attn", "forward", "out")
    assert [predicted_bad_rows(c) for c in r["inputs"][:2]] == [[], []]
    rows = predicted_bad_rows(r["inputs"][2])
    assert [tuple(x) for x in first["rows"]] == rows and first["n_rows"] == len(rows) > 0
    assert first["temperature"] == pytest.approx(200.0)
    lazy = run("lazy", scale=200.0, **FAST)
    assert lazy["first"] is None and lazy["steps_run"] == 3


def test_the_fixed_max_fails_where_its_bound_says():
    """The fixed max (primus-a6a16cdc, the online model) at a final scale of 60: its first
    non-finite value is a forward output at step 2. In the captured inputs every row whose
    best score alone reaches the one-key edge (127.997179 log2 units) is among the event's
    rows, and every event row lies outside the bound (its s_max + log2 n + log2 max|V|
    reaches the edge); the calls before it lie inside the region."""
    pol = "primus-a6a16cdc"
    r = run(pol, scale=60.0, **FAST)
    first = r["first"]
    assert r["config"]["policy"] == pol and r["kernel"] == "online"
    assert (first["step"], first["phase"], first["tensor"]) == (2, "forward", "out")
    region = onset.bound(pol)
    calls = {c["call"]: c for c in r["inputs"]}
    for c in r["inputs"][:first["call"]]:
        assert region.contains(onset.measure(c["q"], c["k"], c["v"], policy=pol, causal=True))
    c = calls[first["call"]]
    m = onset.measure(c["q"], c["k"], c["v"], policy=pol, causal=True)
    B, S, H = c["q"].shape[0], c["q"].shape[1], c["q"].shape[2]
    idx = [(b, h, s) for b in range(B) for h in range(H) for s in range(S)]  # measure's order
    e = m.s_max + np.log2(np.maximum(m.n, 1)) + math.log2(max(1.0, m.v_max))
    outside = {idx[i] for i in np.flatnonzero(e >= 127.997179)}
    surely = {idx[i] for i in np.flatnonzero(m.s_max >= 127.997179)}
    rows = {tuple(x) for x in first["rows"]}
    assert surely and surely <= rows <= outside
    assert r["scores"][2][0]["s_max"] >= 127.99


def test_config_and_task():
    with pytest.raises(ValueError, match="head dims"):
        training.Config(d_model=96, heads=2)
    with pytest.raises(ValueError, match="seq"):
        training.Config(seq=33)
    with pytest.raises(ValueError, match="scale"):
        training.Config(scale=0.5)
    cfg = training.Config(steps=5, scale=16.0)
    assert [cfg.temperature(s) for s in (0, 4)] == [1.0, 16.0]
    tok = training.batch(cfg, 3)
    assert tok.shape == (1, 384) and torch.equal(tok[:, :192], tok[:, 192:])
    assert torch.equal(tok, training.batch(cfg, 3)) and not torch.equal(tok, training.batch(cfg, 4))
    a, b = training.TinyTransformer(cfg), training.TinyTransformer(cfg)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
