"""How a forward failure reaches dQ, dK and dV under each policy (fa_lab.autograd on the
models): a forward NaN, an LSE of -inf (an empty causal band, TransformerEngine #3528) and
a saturated P. The backward reads only the forward's O (through delta) and its LSE."""

import math
import warnings

import pytest
import torch

import fa_lab
from fa_lab.autograd import nonfinite_report
from fa_lab.kernels.bwd import common, model
from fa_lab.studies import experiments

from _grads import attention64, inputs

POLICIES = ("eager", "lazy", "lazy_unfixed", "fa4_row")


def run(q, k, v, do, **kw):
    qq, kk, vv = (x.clone().requires_grad_() for x in (q, k, v))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out, lse = fa_lab.flash_attn_func(qq, kk, vv, return_lse=True, backend="emulator",
                                          kernel="swp_bf16", **kw)
    out.backward(do)
    return out.detach(), lse, nonfinite_report(dq=qq.grad, dk=kk.grad, dv=vv.grad)


@pytest.fixture(scope="module")
def seed_case():
    """The bug report's recipe at K x64, one head, 32 query rows against 512 keys."""
    q, k, v = experiments.bf16_inputs(1, 512, 1, 64, k_scale=64)
    do = torch.randn(1, 32, 1, 64, generator=torch.Generator().manual_seed(1)).bfloat16()
    return q[:, :32], k, v, do


@pytest.mark.parametrize("policy", POLICIES)
def test_a_forward_nan_row_poisons_its_dq_row_and_all_of_dk(policy, seed_case):
    """A NaN row i of O makes delta_i NaN: dS[i, :] = P (dP - NaN) is NaN even where P is
    0, so dQ row i and every dK row (dK_j sums dS[i, j] Q_i over i) are NaN. dV reads P,
    not delta: it goes NaN only through an LSE that is NaN (dK/dV have no LSE floor;
    dQ's floor maps a NaN LSE to -3e38, whose rows are NaN through delta anyway)."""
    q, k, v, do = seed_case
    out, lse, rep = run(q, k, v, do, causal=False, rescale=policy)
    nan_rows = sorted((0, 0, i) for i in torch.isnan(out[0, :, 0]).any(-1).nonzero().flatten().tolist())
    if policy != "lazy_unfixed":
        assert not nan_rows and all(not r["rows"] for r in rep.values())
        return
    assert len(nan_rows) == 5  # the unfixed rebase: 5 of 32 rows die in the forward
    assert rep["dq"]["rows"] == nan_rows and rep["dq"]["inf"] == 0
    assert len(rep["dk"]["rows"]) == 512 and rep["dk"]["nan"] == k.numel()
    lse_nan = torch.isnan(lse).any().item()
    assert lse_nan  # one of the dead rows has l = NaN: its LSE is NaN too
    assert len(rep["dv"]["rows"]) == 512 and rep["dv"]["nan"] == v.numel()


@pytest.mark.parametrize("policy", ["eager", "lazy", "lazy_unfixed"])
def test_an_empty_causal_band_stays_finite_under_the_lse_floor(policy):
    """TransformerEngine #3528: causal with Sq > Skv (bottom-right), rows 0..39 see no key.
    The forward writes O = 0 and LSE = -inf for them under every policy. Upstream's dQ
    floors the LSE (-3e38) and gives exact zeros; dK/dV zero P by a select after exp2, so
    the gradients are finite and match fp64 autograd. Without the floor (a variant of the
    dQ model) the same LSE gives NaN in exactly those dQ rows."""
    q, k, v, do = inputs(1, 104, 64, 2, 1, 64, seed=21)
    out, lse, rep = run(q, k, v, do, causal=True, rescale=policy)
    assert (out[:, :40] == 0).all() and torch.isneginf(lse[..., :40]).all()
    assert torch.isfinite(lse[..., 40:]).all()
    assert all(not r["rows"] for r in rep.values())
    no_floor = model.backward(q, k, v, out, do, lse, causal=True, lse_floor=False)
    bad = nonfinite_report(dq=no_floor[0], dk=no_floor[1], dv=no_floor[2])
    assert bad["dq"]["rows"] == [(0, h, i) for h in range(2) for i in range(40)]
    assert not bad["dk"]["rows"] and not bad["dv"]["rows"]


def test_the_folded_forward_lse_lets_the_backward_p_exceed_one(seed_case):
    """fa_lab's forward models fold qk_scale into Q and round it to bf16 (FlyDSL 11c4174d);
    the backward recomputes P from the unrounded Q. At K x64 the LSE is off by up to 0.26
    (natural units, every policy alike), so the recomputed P reaches 1.30: saturated
    against the softmax's bound of 1, and the gradients stay finite."""
    q, k, v, do = seed_case
    _, lse, rep = run(q, k, v, do, causal=False, rescale="eager")
    s = q.double()[0, :, 0] @ k.double()[0, :, 0].T / 8
    lse64 = torch.logsumexp(s, -1)
    assert 0.2 < (lse[0, 0].double() - lse64).abs().max() < 0.3
    p_max = torch.exp(s - lse[0, 0].double()[:, None]).max().item()
    assert 1.25 < p_max < 1.35
    assert all(not r["rows"] for r in rep.values())


def test_an_lse_128_log2_units_too_low_overflows_p_to_inf():
    """A saturated P in the other sense: exp2 past 128 is inf. An LSE that lies below row
    5's largest score by 129 log2 units makes that P inf (its neighbours reach 2**120 and
    more); dS = P * (dP - delta) is then +-inf or NaN. Non-finite: dQ row 5 alone, and the
    dV and dK rows of the keys whose P (or its products) overflowed."""
    q, k, v, do = inputs(1, 32, 64, 1, 1, 64, seed=22)
    o64, lse64, *_ = attention64(q, k, v, do, causal=False)
    lse = lse64.float()
    _, c = common.scales(64)
    log2e = math.log2(math.e)
    s = (q.double()[0, 5, 0] @ k.double()[0, :, 0].T).float() * c  # row 5, log2 units
    lse[0, 0, 5] -= float(129.0 - (s - lse[0, 0, 5] * log2e).max()) / log2e
    dq, dk, dv = model.backward(q, k, v, o64.bfloat16(), do, lse, causal=False)
    rep = nonfinite_report(dq=dq, dk=dk, dv=dv)
    x = (s - lse[0, 0, 5] * log2e).double()
    overflow = set(torch.isinf(torch.exp2(x).float()).nonzero().flatten().tolist())
    dk_rows, dv_rows = ({r[2] for r in rep[n]["rows"]} for n in ("dk", "dv"))
    assert rep["dq"]["rows"] == [(0, 0, 5)]
    # dV_j = sum_i P_ij dO_i: non-finite where P overflowed or its product with dO did;
    # dK_j reads dS = P (dP - delta), a larger factor still; other keys stay finite
    assert overflow and overflow <= dv_rows <= dk_rows and len(dk_rows) < 64
