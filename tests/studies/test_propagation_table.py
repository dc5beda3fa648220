"""fa_lab.studies.propagation: the cells of the forward-to-backward table that the
kernel-level tests (tests/kernels/bwd/test_propagation.py) do not cover, each against an
independent reading: the fixed max (primus-a6a16cdc) on TransformerEngine #3528's empty
band, on the bug report's K x64 inputs, and on a row whose scores all lie below -126."""

import math

import pytest
import torch

from fa_lab.studies import propagation as P

from _grads import attention64

FIXED = "primus-a6a16cdc"


def log2_scores(name):
    q, k, v, do, causal = P.case_inputs(name)
    return P._scores(q, k, causal) * math.log2(math.e)


@pytest.mark.parametrize("policy", P.POLICIES)
def test_the_empty_band_stays_finite_under_every_policy(policy):
    """TransformerEngine #3528 (causal, Sq 104 > Skv 64: rows 0..39 see no key): O = 0 and
    LSE = -inf there under every policy, the fixed max included (l = 0, and its epilogue
    guard gives 0); the dQ kernel's LSE floor and dK/dV's select keep every gradient
    finite (their values against fp64 autograd: tests/kernels/bwd/test_propagation.py)."""
    r = P.run_case("empty_band", policy)
    f = r["forward"]
    assert f["rows_that_see_no_key"] == 80 and f["nan_rows"] == f["inf_rows"] == []
    assert f["lse_neginf"] == [(0, h, i) for h in range(2) for i in range(40)]
    assert all(not g["rows"] and g["nan"] == g["inf"] == 0 for g in r["grads"].values())


def test_the_fixed_max_overflow_reaches_dq_and_dk_but_not_dv():
    """At K x64 every row's best score lies far past 128 log2 units: the fixed max sums l =
    inf, writes O = NaN and LSE = +inf. The backward's P = exp2(s - inf) = 0, so dV (which
    reads P alone) is finite, while delta = rowsum(dO * O) is NaN: dS = P (dP - delta) is
    NaN, hence every dQ row and every dK row."""
    s = log2_scores("forward_nan")
    assert float(s.amax(-1).min()) > 128
    r = P.run_case("forward_nan", FIXED)
    f, g = r["forward"], r["grads"]
    every_row = [(0, 0, i) for i in range(32)]
    assert f["nan_rows"] == every_row and f["lse_posinf"] == every_row
    assert r["p_max"] == 0.0
    assert g["dq"]["rows"] == every_row and len(g["dk"]["rows"]) == 512
    assert g["dv"]["rows"] == [] and g["dv"]["nan"] == g["dv"]["inf"] == 0


def test_the_fixed_max_silent_zero_row_is_loud_in_the_backward():
    """Row 3 sees all 128 keys, but its best score lies below -126 log2 units: the fixed
    max flushes every P and writes a zero row with LSE = -inf (silent in the forward).
    The backward recomputes P from that LSE: dQ's floor (-3e38) and dK/dV's raw -inf both
    give exp2(+huge) = inf on every key, so dQ row 3 and every dK and dV row are non-finite.
    Under an online max the same inputs give fp64 autograd's gradients."""
    s = log2_scores("underflow_row")
    assert float(s[0, 0, 3].max()) < -126 and float(s[0, 0, 3].max()) > -300
    assert float(s[0, 0, [0, 1, 2, 4]].amax(-1).min()) > -126   # the other rows are ordinary
    r = P.run_case("underflow_row", FIXED)
    f, g = r["forward"], r["grads"]
    assert f["zero_rows_that_see_keys"] == [(0, 0, 3)] and f["lse_neginf"] == [(0, 0, 3)]
    assert f["nan_rows"] == f["inf_rows"] == [] and r["p_inf"] == 128
    assert g["dq"]["rows"] == [(0, 0, 3)]
    assert len(g["dk"]["rows"]) == 128 and len(g["dv"]["rows"]) == 128
    e = P.run_case("underflow_row", "eager")
    assert e["forward"]["lse_neginf"] == [] and all(not x["rows"] for x in e["grads"].values())
    q, k, v, do, _ = P.case_inputs("underflow_row")
    ref = attention64(q, k, v, do, causal=False)
    assert float(ref[1][0, 0, 3]) > -math.inf  # the true LSE is finite


def test_a_case_name_is_checked():
    with pytest.raises(ValueError, match="case must be one of"):
        P.case_inputs("nope")
    assert torch.is_tensor(P.case_inputs("empty_band")[0])
