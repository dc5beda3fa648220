"""NaN or inf already in the inputs is detected and named by ``trace`` and
``onset.predict`` (a RuntimeWarning at the user's line, and a field), so the policy is not
blamed for it; the output still carries it (issue 36)."""

import math
import warnings

import pytest
import torch

import fa_lab
from fa_lab.studies import onset
from fa_lab.studies.experiments import bf16_inputs


@pytest.fixture(scope="module")
def poisoned():
    q, k, v = bf16_inputs(1, 512, 2, 64, 4.0)
    q, k = q.clone(), k.clone()
    q[0, 5, 1, 3] = math.nan
    k[0, 7, 0, 0] = math.inf
    k[0, 9, 1, 2] = -math.inf
    return q, k, v


def nonfinite_inputs(*tensors):
    from fa_lab.checks import nonfinite_inputs as note
    return note(*tensors)


SAID = (r"q has 1 non-finite value \(1 NaN, 0 inf\) at \(batch, row, head\) \(0, 5, 1\); "
        r"k has 2 non-finite values \(0 NaN, 2 inf\) at \(batch, key, head\) \(0, 7, 0\), "
        r"\(0, 9, 1\): the inputs carry them into the output, whatever the policy does")


def test_the_note_counts_and_places_each_tensors_values(poisoned):
    import re
    assert re.fullmatch(SAID, nonfinite_inputs(*poisoned))
    assert nonfinite_inputs(*bf16_inputs(1, 64, 1, 64, 4.0)) is None


def test_trace_names_nonfinite_inputs(poisoned):
    q, k, v = poisoned
    with pytest.warns(RuntimeWarning, match=SAID) as said:
        tr = fa_lab.trace(q, k, v, rows=[5], head=1, causal=False, rescale="eager")
    assert [w.filename for w in said if w.category is RuntimeWarning] == [__file__]
    assert tr.meta["nonfinite_inputs"] == nonfinite_inputs(q, k, v)
    assert not tr.lanes.o_finite.all() if "o_finite" in tr.lanes else True
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        clean = fa_lab.trace(*bf16_inputs(1, 64, 1, 64, 4.0), rows=[5], causal=False)
    assert clean.meta["nonfinite_inputs"] is None


def test_predict_names_nonfinite_inputs(poisoned):
    q, k, v = poisoned
    with pytest.warns(RuntimeWarning, match=SAID):
        p = onset.predict(q, k, v, causal=False, rescale="eager", kernel="swp_bf16")
    assert p.meta["nonfinite_inputs"] == nonfinite_inputs(q, k, v)
    out = fa_lab.flash_attn_func(q, k, v, causal=False, rescale="eager", kernel="swp_bf16")
    assert not torch.isfinite(out).all()        # the output carries them
