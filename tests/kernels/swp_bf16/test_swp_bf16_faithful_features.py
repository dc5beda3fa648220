"""The faithful bf16 port's DUALWAVE_SWP extras against the model: bias, ALiBi, sink,
split-K and native varlen, under every rescale policy.

Interpreted on CPU (``backend="interpret"``) against the model (``backend="emulator"``)
on shapes where the unfixed lazy rescale drags rows into overflow: identical NaN, +inf
and -inf masks on out and LSE, finite values within 1e-3 of the largest output plus
what two fp32 summation orders can flip in the 16-bit roundings (tolerances built from
an fp32 reference with the same modifiers), traces equal tile for tile. Bad arguments
raise the api's errors before any launch. GPU tests (marked ``gpu``) do the same with
the compiled kernel on mid-size shapes.
"""

import math

import pytest
import torch
from _shared import assert_lse_close, packed
import triton
import triton.language as tl

import fa_lab
from fa_lab import reference
from fa_lab.kernels._triton.util import launch
from fa_lab.kernels.swp_bf16 import combine as swp_bf16_splitk
from fa_lab.kernels.swp_bf16 import faithful as swp_bf16
from fa_lab.kernels.swp_bf16 import model as model
from fa_lab.policies import Policy
from fa_lab.policies import get as get_policy
from _ports import (POLICIES, UNIT_ROUNDOFF, assert_same_masks, assert_traces_match,
                    make_inputs)

BF = torch.bfloat16
INF = math.inf


def mods_for(name, Sq, Skv, H, B=1, dtype=BF, seed=20):
    """The modifiers a test case turns on: natural-log units, as upstream takes them."""
    g = torch.Generator().manual_seed(seed)
    slopes_h = torch.linspace(0.3, 0.02, H)
    bias = (torch.randn(Sq, Skv, generator=g) * 8).to(dtype)
    sink = torch.linspace(2.0, 30.0, H)
    return {
        "bias": {"bias": bias},
        "alibi_h": {"alibi_slopes": slopes_h},
        "alibi_bh": {"alibi_slopes": torch.rand(B, H, generator=g) * 0.2},
        "sink": {"sink": sink},
        "all": {"bias": (bias.float() / 4).to(dtype), "alibi_slopes": slopes_h, "sink": sink},
    }[name]


def run_both(q, k, v, *, causal, policy, backend="interpret", **kw):
    kw = dict(causal=causal, rescale=policy, return_lse=True, kernel="swp_bf16", **kw)
    return (fa_lab.flash_attn_func(q, k, v, backend=backend, **kw),
            fa_lab.flash_attn_func(q, k, v, backend="emulator", **kw))


def weighted_abs_v(q, k, v, causal, mods):
    """sum_j P_j |v_j| / l per output element (fp32 reference with the same modifiers)."""
    mods = {n: x for n, x in mods.items() if n in ("bias", "alibi_slopes", "sink")}
    return reference.attention(q, k, v.abs(), causal=causal, **mods)[0].double()


def assert_close_to_model(kernel, model_res, wav, *, roundings=2):
    """Identical NaN/+inf/-inf masks on out and LSE. Finite outputs: 1e-3 of the largest
    |output|, plus ``roundings`` 16-bit roundings that two fp32 orders may flip (each P
    pack: 2u of the weighted |V|; split-K's partial outputs: 2u more), plus 2u of the
    element for the final rounding. LSE within 1e-5 of the largest finite |LSE|."""
    (out_k, lse_k), (out_m, lse_m) = kernel, model_res
    assert out_k.dtype == out_m.dtype and out_k.shape == out_m.shape
    assert lse_k.dtype == torch.float32 and lse_k.shape == lse_m.shape
    assert_same_masks("out", out_k, out_m)
    assert_same_masks("lse", lse_k, lse_m)
    u = UNIT_ROUNDOFF[out_m.dtype]
    b = out_m.double()
    fin = torch.isfinite(b)
    if fin.any():
        tol = 1e-3 * b[fin].abs().max() + roundings * u * wav + 2 * u * b.abs()
        ratio = ((out_k.double() - b).abs() / tol)[fin].max().item()
        assert ratio <= 1, f"out: |kernel - model| up to {ratio:.2f} x the tolerance"
    assert_lse_close(lse_k, lse_m)


# GQA 2:1, Sq != Skv, neither a multiple of 64 (the interpreter's cost is per tile and
# program, so one 256-row block): K x48 makes the ballot fire and the unfixed rebase
# overflow with every modifier, causal or not (Skv - Sq = 250: diagonal mid-wave). Rows
# 200..223 are padding in a wave with real rows: their votes (ALiBi's term alone) count.
SQ, SKV = 200, 450
# split-K needs Sq >= 384 (as upstream): two blocks, N = 12 tiles (causal: 8, then 12);
# rows 400..415 are padding in a wave with real rows
SQ_SPLIT, SKV_SPLIT = 400, 650


@pytest.fixture(scope="module")
def drag_inputs():
    return make_inputs(1, SQ, SKV, 2, 1, 64, 48.0, seed=4)


@pytest.fixture(scope="module")
def split_inputs():
    return make_inputs(1, SQ_SPLIT, SKV_SPLIT, 2, 1, 64, 48.0, seed=3)


# ----------------------------------------------------------------------------------
# bias / ALiBi / sink, per policy (interpreted)
# ----------------------------------------------------------------------------------

MOD_CAUSAL = {"bias": [False], "alibi_h": [True], "alibi_bh": [False], "sink": [True],
              "all": [False, True]}


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("mod", sorted(MOD_CAUSAL))
def test_score_mods_match_model(drag_inputs, mod, policy):
    q, k, v = drag_inputs
    kw = mods_for(mod, SQ, SKV, 2)
    for causal in MOD_CAUSAL[mod]:
        kernel, ref = run_both(q, k, v, causal=causal, policy=policy, **kw)
        assert_close_to_model(kernel, ref, weighted_abs_v(q, k, v, causal, kw))
        if policy == "lazy_unfixed":
            assert torch.isnan(kernel[0]).any(), "drag inputs produced no NaN"
        else:
            assert torch.isfinite(kernel[0]).all()


def test_score_mods_f16_head_dim_128_and_one_row():
    # f16 packs, D = 128, every modifier at once; then Sq = 1 (one row, padding votes).
    q, k, v = make_inputs(1, 200, 450, 2, 1, 128, 48.0, dtype=torch.float16, seed=21)
    kw = mods_for("all", 200, 450, 2, dtype=torch.float16)
    kernel, ref = run_both(q, k, v, causal=True, policy="lazy_unfixed", **kw)
    assert_close_to_model(kernel, ref, weighted_abs_v(q, k, v, True, kw))
    q1, k1, v1 = make_inputs(2, 1, 70, 2, 2, 64, 4.0, seed=22)
    kw = {"bias": torch.randn(1, 70).bfloat16(), "alibi_slopes": torch.rand(2, 2), "sink": torch.ones(2)}
    kernel, ref = run_both(q1, k1, v1, causal=False, policy="lazy", **kw)
    assert_close_to_model(kernel, ref, weighted_abs_v(q1, k1, v1, False, kw))


def test_eager_extras_against_fp64_reference():
    # Independent of the model: plain softmax attention in fp64 with the same bias, ALiBi
    # and sink, run by the kernel with split-K. Error budget as tests/kernels/swp_bf16/test_swp_bf16_split_k.py: Q*c,
    # P and the output rounded to bf16, and each split's partial output once more.
    q, k, v = make_inputs(1, SQ_SPLIT, SKV_SPLIT, 2, 1, 64, 2.0, seed=25)
    kw = mods_for("all", SQ_SPLIT, SKV_SPLIT, 2)
    for splits, causal in ((1, True), (3, False)):
        out, lse = fa_lab.flash_attn_func(q, k, v, causal=causal, rescale="eager", return_lse=True,
                                          backend="interpret", kernel="swp_bf16",
                                          num_kv_splits=splits, **kw)
        ref, ref_lse = reference.attention(q, k, v, causal=causal, dtype=torch.float64, **kw)
        assert torch.isfinite(out).all()
        assert (out.double() - ref).abs().max() < 8 * 2.0**-8 * v.double().abs().max()
        assert (lse.double() - ref_lse).abs().max() < 2e-2


def test_sink_dominating_every_row():
    # a sink far above every score takes the whole denominator: out 0, lse = sink
    q, k, v = make_inputs(1, 256, 320, 2, 2, 64, 1.0, seed=23)
    out, lse = fa_lab.flash_attn_func(q, k, v, causal=False, return_lse=True, backend="interpret",
                                      kernel="swp_bf16", sink=torch.tensor([500.0, 500.0]))
    assert out.abs().max() == 0 and torch.allclose(lse, torch.full_like(lse, 500.0))


def test_bias_strides_and_alibi_layouts():
    # A bias view with any strides is read as its contiguous copy; ALiBi [H] equals ALiBi
    # [B, H] with the same slopes in every row.
    q, k, v = make_inputs(2, 130, 200, 2, 1, 64, 8.0, seed=24)
    big = torch.randn(300, 450).bfloat16()
    bias = big[:260:2, 10:410:2]  # [130, 200], strides (900, 2)
    assert bias.shape == (130, 200) and not bias.is_contiguous()
    pol = get_policy("lazy_unfixed")
    a = swp_bf16.forward(q, k, v, causal=True, policy=pol, interpret=True, bias=bias)
    b = swp_bf16.forward(q, k, v, causal=True, policy=pol, interpret=True, bias=bias.contiguous())
    assert torch.equal(a[0].view(torch.int16), b[0].view(torch.int16))
    slopes = torch.tensor([0.2, 0.05])
    c = swp_bf16.forward(q, k, v, causal=True, policy=pol, interpret=True, alibi_slopes=slopes)
    d = swp_bf16.forward(q, k, v, causal=True, policy=pol, interpret=True,
                         alibi_slopes=slopes.expand(2, 2))
    assert torch.equal(c[0].view(torch.int16), d[0].view(torch.int16))
    assert torch.equal(c[1].view(torch.int32), d[1].view(torch.int32))


# ----------------------------------------------------------------------------------
# split-K (interpreted)
# ----------------------------------------------------------------------------------

@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("splits, causal, mod", [(2, False, None), (4, True, "sink"),
                                                 (3, False, "all")])
def test_split_k_matches_model(split_inputs, splits, causal, mod, policy):
    # N = 12 tiles: two splits of 6 (each with two loop tiles), then empty splits;
    # causal, the first block has N = 8: one split of 8 (the 2-tile remainder joins it),
    # the rest empty. The sink is folded in once, in the combine.
    q, k, v = split_inputs
    kw = dict(mods_for(mod, SQ_SPLIT, SKV_SPLIT, 2) if mod else {}, num_kv_splits=splits)
    kernel, ref = run_both(q, k, v, causal=causal, policy=policy, **kw)
    assert_close_to_model(kernel, ref, weighted_abs_v(q, k, v, causal, kw), roundings=4)
    if policy == "lazy_unfixed":
        assert torch.isnan(kernel[0]).any()
    else:
        assert torch.isfinite(kernel[0]).all()


@triton.jit
def _split_range_probe(Out, num_splits, SPLITS: tl.constexpr):
    n = 4 + 2 * tl.program_id(0)  # every even tile count from 4
    s = tl.program_id(1)
    t0, t_end = swp_bf16_splitk.split_range(n, s, num_splits)
    tl.store(Out + (tl.program_id(0) * SPLITS + s) * 2, t0)
    tl.store(Out + (tl.program_id(0) * SPLITS + s) * 2 + 1, t_end)


def test_split_ranges_in_kernel_equal_the_model():
    # The kernel's split boundaries (a @triton.jit helper) against the model's, for every
    # even N up to 40 and 1..6 splits, interpreted.
    ns = list(range(4, 42, 2))
    for splits in range(1, 7):
        out = torch.full((len(ns), splits, 2), -1, dtype=torch.int32)
        launch(_split_range_probe, (len(ns), splits), True, out, splits, SPLITS=splits)
        for i, n in enumerate(ns):
            assert [tuple(r) for r in out[i].tolist()] == model.split_ranges(n, splits), (n, splits)


# ----------------------------------------------------------------------------------
# Traced mode with the extras on
# ----------------------------------------------------------------------------------

@pytest.mark.parametrize("kw, causal, split", [
    (dict(mods_for("all", SQ, SKV, 2), rescale="lazy_unfixed"), True, False),
    (dict(num_kv_splits=3, sink=torch.tensor([2.0, 30.0]), rescale="lazy_unfixed"), False, True),
    (dict(num_kv_splits=2, alibi_slopes=torch.tensor([0.3, 0.02]), rescale="lazy"), True, True),
])
def test_trace_matches_model_with_extras(drag_inputs, split_inputs, kw, causal, split):
    q, k, v = split_inputs if split else drag_inputs
    rows = [(0, h, r) for h in (0, 1) for r in range(0, q.shape[1], 5)]
    kw = dict(rows=rows, causal=causal, kernel="swp_bf16", **kw)
    tk = fa_lab.trace(q, k, v, backend="interpret", **kw)
    tm = fa_lab.trace(q, k, v, backend="emulator", **kw)
    assert_traces_match(tk, tm)
    st = tm.steps
    assert st.fire.any() and st.swept.any()
    if split:  # each split has its own prologue: two in the second block
        assert (st[(st.row == 380) & (st["head"] == 1)].phase == "prologue").sum() == 2


def test_padding_rows_vote_with_their_alibi_term():
    # Sq = 193: row 192 shares its wave with 31 padding rows (Q = 0), whose scores are
    # ALiBi's term alone, rising 64 * 0.1 * log2 e = 9.2 > 8 per tile: they vote on every
    # loop tile, so the wave fires where row 192 itself did not vote (and drags it).
    q, k, v = make_inputs(1, 193, 700, 1, 1, 64, 16.0, seed=5)
    kw = dict(rows=[0, 100, 192], causal=False, rescale="lazy_unfixed", kernel="swp_bf16",
              alibi_slopes=torch.tensor([0.1]))
    tk = fa_lab.trace(q, k, v, backend="interpret", **kw)
    tm = fa_lab.trace(q, k, v, backend="emulator", **kw)
    assert_traces_match(tk, tm)
    last = tm.steps[(tm.steps.row == 192) & (tm.steps.phase == "loop")]
    assert last.fire.all() and (last.fire & ~last.vote).any() and last.swept.any()


# ----------------------------------------------------------------------------------
# Native varlen: one launch over packed sequences (interpreted)
# ----------------------------------------------------------------------------------

def packed_k48(lens_q, lens_k, **kw):
    return packed(lens_q, lens_k, **{"k_scale": 48.0, "seed": 30, **kw})


def varlen_weighted_abs_v(q, k, v, cu_q, cu_k, causal, bias, alibi, sink):
    wav = torch.zeros(q.shape, dtype=torch.float64)
    for b in range(len(cu_q) - 1):
        q0, q1, k0, k1 = int(cu_q[b]), int(cu_q[b + 1]), int(cu_k[b]), int(cu_k[b + 1])
        if q1 > q0 and k1 > k0:
            kw = {"sink": sink}
            if bias is not None:
                kw["bias"] = bias[q0:q1, :k1 - k0]
            if alibi is not None:
                kw["alibi_slopes"] = alibi[b] if alibi.dim() == 2 else alibi
            wav[q0:q1] = weighted_abs_v(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], causal, kw)[0]
    return wav


@pytest.mark.parametrize("policy, causal", [("lazy_unfixed", False), ("lazy_unfixed", True),
                                            ("lazy", False), ("eager", True), ("fa4_row", False)])
def test_varlen_matches_model_in_one_launch(monkeypatch, policy, causal):
    # Ragged lengths: a sequence without keys, one without queries, one over a block
    # (its second block starts mid-packed-tensor: waves count from the sequence's first
    # row), Sq > Skv and Sq < Skv; bias [total_q, max_seqlen_kv], ALiBi [B, H], a sink.
    lens_q, lens_k = [270, 40, 0, 257, 30], [330, 0, 20, 200, 90]
    q, k, v, cu_q, cu_k = packed_k48(lens_q, lens_k, H=2, Hkv=1)
    g = torch.Generator().manual_seed(31)
    bias = (torch.randn(q.shape[0], 330, generator=g) * 4).to(BF)
    alibi = torch.rand(5, 2, generator=g) * 0.1
    sink = torch.linspace(1.0, 20.0, 2)
    launches = []
    real_launch = swp_bf16.launch
    monkeypatch.setattr(swp_bf16, "launch", lambda *a, **kw: launches.append(a[1]) or real_launch(*a, **kw))
    kw = dict(cu_seqlens_q=cu_q, cu_seqlens_kv=cu_k, max_seqlen_q=270, max_seqlen_kv=330,
              causal=causal, rescale=policy, return_lse=True, bias=bias, alibi_slopes=alibi, sink=sink)
    kernel = fa_lab.flash_attn_func(q, k, v, backend="interpret", **kw)
    assert len(launches) == 1 and launches[0][1] == 5 * 2  # one launch: sequences x heads
    ref = fa_lab.flash_attn_func(q, k, v, backend="emulator", **kw)
    wav = varlen_weighted_abs_v(q, k, v, cu_q, cu_k, causal, bias, alibi, sink)
    assert_close_to_model(kernel, ref, wav)
    out, lse = kernel
    assert (out[270:310] == 0).all() and (lse[1] == -INF).all()  # no keys: 0 and -inf
    assert (lse[3, :, 257:] == -INF).all()  # padding past the sequence
    if policy == "lazy_unfixed" and not causal:
        assert torch.isnan(out).any()


def test_varlen_rows_per_program_and_direct_entry():
    # forward_varlen directly: 32-row programs give the 256-row programs' result bit for
    # bit (waves never straddle sequences), and equal per-sequence dense kernel calls.
    lens_q, lens_k = [40, 100, 33], [300, 130, 64]
    q, k, v, cu_q, cu_k = packed_k48(lens_q, lens_k, H=1, Hkv=1, seed=32)
    pol = get_policy("lazy_unfixed")
    slopes = torch.tensor([0.2])
    a = swp_bf16.forward_varlen(q, k, v, cu_q, cu_k, 100, 300, causal=True, policy=pol,
                                interpret=True, alibi_slopes=slopes)
    b = swp_bf16.forward_varlen(q, k, v, cu_q, cu_k, 100, 300, causal=True, policy=pol,
                                interpret=True, alibi_slopes=slopes, rows_per_program=32)
    assert torch.equal(a[0].view(torch.int16), b[0].view(torch.int16))
    assert torch.equal(a[1].view(torch.int32), b[1].view(torch.int32))
    for i in range(3):
        q0, q1, k0, k1 = int(cu_q[i]), int(cu_q[i + 1]), int(cu_k[i]), int(cu_k[i + 1])
        d = swp_bf16.forward(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], causal=True,
                             policy=pol, interpret=True, alibi_slopes=slopes)
        assert torch.equal(a[0][q0:q1].view(torch.int16), d[0][0].view(torch.int16))
        assert torch.equal(a[1][i, :, :q1 - q0].view(torch.int32), d[1][0].view(torch.int32))


def test_api_varlen_uses_the_native_entry_for_triton_backends_only(monkeypatch):
    q, k, v, cu_q, cu_k = packed_k48([40, 60], [40, 60], H=2, Hkv=1, k_scale=1.0)
    calls = []
    real = swp_bf16.forward_varlen
    monkeypatch.setattr(swp_bf16, "forward_varlen", lambda *a, **kw: calls.append(kw) or real(*a, **kw))
    kw = dict(cu_seqlens_q=cu_q, cu_seqlens_kv=cu_k, max_seqlen_q=60, rescale="lazy")
    a = fa_lab.flash_attn_func(q, k, v, backend="interpret", **kw)
    assert len(calls) == 1 and calls[0]["interpret"] is True and calls[0]["policy"].name == "lazy"
    b = fa_lab.flash_attn_func(q, k, v, backend="emulator", **kw)
    assert len(calls) == 1
    assert torch.equal(a.isnan(), b.isnan()) and (a.float() - b.float()).abs().max() < 2e-2


# ----------------------------------------------------------------------------------
# Bad arguments: the Triton path raises the api's errors, before any launch
# ----------------------------------------------------------------------------------

@pytest.fixture
def no_launch(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("a kernel was launched before the bad argument was caught")
    monkeypatch.setattr(swp_bf16, "launch", boom)
    monkeypatch.setattr(swp_bf16_splitk, "launch", boom)


def _t(*shape, dtype=BF):
    return torch.zeros(*shape, dtype=dtype)


def I32(*x):
    return torch.tensor(x, dtype=torch.int32)


DENSE = (_t(1, 400, 2, 64), _t(1, 420, 1, 64), _t(1, 420, 1, 64))
PACKED = (_t(30, 2, 64), _t(30, 1, 64), _t(30, 1, 64))
VARLEN = dict(cu_seqlens_q=I32(0, 10, 30), cu_seqlens_kv=I32(0, 10, 30), max_seqlen_q=20)


@pytest.mark.parametrize("args, kw, exc, words", [
    (DENSE, dict(bias=_t(400, 419)), ValueError, r"bias has shape \[400, 419\]"),
    (DENSE, dict(bias=_t(400, 420, dtype=torch.float32)), TypeError, "bias must be torch.bfloat16"),
    (DENSE, dict(bias=[[0.0]]), TypeError, "bias must be a torch.Tensor"),
    (DENSE, dict(alibi_slopes=torch.zeros(3)), ValueError, "alibi_slopes has shape"),
    (DENSE, dict(alibi_slopes=torch.zeros(2, 2)), ValueError, "alibi_slopes has shape"),
    (DENSE, dict(alibi_slopes=torch.zeros(2, dtype=torch.float64)), TypeError, "alibi_slopes must be torch.float32"),
    (DENSE, dict(sink=torch.zeros(1, 2)), ValueError, "sink has shape"),
    (DENSE, dict(sink=torch.zeros(2, dtype=BF)), TypeError, "sink must be torch.float32"),
    (DENSE, dict(num_kv_splits=0), ValueError, "num_kv_splits must be >= 1"),
    (DENSE, dict(num_kv_splits=2.0), TypeError, "num_kv_splits must be an int"),
    (DENSE, dict(num_kv_splits=True), TypeError, "num_kv_splits must be an int"),
    ((_t(1, 383, 2, 64), _t(1, 383, 1, 64), _t(1, 383, 1, 64)), dict(num_kv_splits=2), ValueError,
     "seq_len >= 384"),
    ((_t(1, 64, 2, 128, dtype=torch.float8_e4m3fn),) * 3,
     dict(sink=torch.zeros(2), q_descale=1.0, k_descale=1.0, v_descale=1.0), ValueError,
     "sink is not supported with float8"),
    ((_t(1, 400, 2, 128, dtype=torch.float8_e4m3fn),) * 3,
     dict(num_kv_splits=10 ** 6, q_descale=1.0, k_descale=1.0, v_descale=1.0), ValueError,
     "exceeds the 7 KV tiles"),
    (PACKED, dict(VARLEN, cu_seqlens_q=I32(0, 20, 10, 30), cu_seqlens_kv=I32(0, 10, 20, 30)),
     ValueError, "non-decreasing"),
    (PACKED, dict(VARLEN, cu_seqlens_q=torch.tensor([0, 10, 30])), ValueError, "int32"),
    (PACKED, dict(VARLEN, cu_seqlens_q=I32(0, 10, 29)), ValueError, "ends at 29"),
    (PACKED, dict(VARLEN, max_seqlen_q=19), ValueError, "shorter"),
    (PACKED, dict(VARLEN, num_kv_splits=2), ValueError, "varlen .* num_kv_splits"),
    (PACKED, dict(VARLEN, bias=_t(30, 19)), ValueError, "bias has shape"),
    (PACKED, dict(VARLEN, alibi_slopes=torch.zeros(3, 2)), ValueError, "alibi_slopes has shape"),
    (PACKED, dict(VARLEN, sink=torch.zeros(3)), ValueError, "sink has shape"),
])
def test_bad_arguments_raise_the_api_errors_before_launch(no_launch, args, kw, exc, words):
    for backend in ("interpret", "emulator"):
        with pytest.raises(exc, match=words):
            fa_lab.flash_attn_func(*args, backend=backend, **kw)


LAZY = get_policy("lazy")


@pytest.mark.parametrize("kw, exc, words", [
    (dict(bias=_t(400, 419)), ValueError, r"bias has shape \[400, 419\]; expected \[400, 420\]"),
    (dict(bias=_t(400, 420, dtype=torch.float16)), TypeError, "bias must be torch.bfloat16"),
    (dict(alibi_slopes=torch.zeros(2, 2)), ValueError, "alibi_slopes has shape"),
    (dict(alibi_slopes=torch.zeros(2, dtype=BF)), TypeError, "alibi_slopes must be torch.float32"),
    (dict(sink=torch.zeros(3)), ValueError, "sink has shape"),
    (dict(sink=[1.0, 2.0]), TypeError, "sink must be a torch.Tensor"),
    (dict(num_kv_splits=0), ValueError, "num_kv_splits must be >= 1"),
    (dict(num_kv_splits=1 << 20), ValueError, "num_kv_splits"),
    (dict(num_kv_splits=None), TypeError, "num_kv_splits must be an int"),
])
def test_forward_bad_extras_raise_before_launch(no_launch, kw, exc, words):
    with pytest.raises(exc, match=words):
        swp_bf16.forward(*DENSE, causal=False, policy=LAZY, interpret=True, **kw)


@pytest.mark.parametrize("args, kw, exc, words", [
    (PACKED, dict(cu_seqlens_q=I32(0, 20, 10, 30), cu_seqlens_kv=I32(0, 10, 20, 30)), ValueError,
     "non-decreasing"),
    (PACKED, dict(cu_seqlens_kv=None), ValueError, "cu_seqlens_kv is required"),
    (PACKED, dict(cu_seqlens_q=I32(1, 10, 30)), ValueError, "start at 0"),
    (PACKED, dict(max_seqlen_q=None), ValueError, "max_seqlen_q is required"),
    (PACKED, dict(cu_seqlens_kv=I32(0, 15, 30)), ValueError, "max_seqlen_kv is required"),
    ((PACKED[0], PACKED[1], PACKED[2][None]), {}, ValueError, "varlen v must be packed"),
    ((PACKED[0][None], PACKED[1], PACKED[2]), {}, ValueError, "varlen q must be packed"),
    ((PACKED[0], PACKED[1], PACKED[2].half()), {}, TypeError, "v has dtype"),
    (PACKED, dict(bias=_t(30, 21)), ValueError, r"bias has shape \[30, 21\]; expected \[30, 20\]"),
    (PACKED, dict(alibi_slopes=torch.zeros(3, 2)), ValueError, "alibi_slopes has shape"),
    (PACKED, dict(policy=Policy.from_rule(lambda m, mt, t: m, name="rule")), ValueError, "Python rule"),
    (PACKED, dict(interpret=False), ValueError, "needs CUDA/ROCm tensors"),
])
def test_forward_varlen_bad_arguments_raise_before_launch(no_launch, args, kw, exc, words):
    kw = dict(dict(cu_seqlens_q=VARLEN["cu_seqlens_q"], cu_seqlens_kv=VARLEN["cu_seqlens_kv"],
                   max_seqlen_q=20, causal=False, policy=LAZY, interpret=True), **kw)
    cu_q, cu_kv, mq = kw.pop("cu_seqlens_q"), kw.pop("cu_seqlens_kv"), kw.pop("max_seqlen_q")
    with pytest.raises(exc, match=words):
        swp_bf16.forward_varlen(*args, cu_q, cu_kv, mq, **kw)


def test_auto_backend_picks_triton_for_the_extras_on_cuda():
    from fa_lab.dispatch import auto_backend
    lazy = get_policy("lazy")
    for features in ((), ("bias",), ("alibi_slopes", "sink"), ("num_kv_splits",)):
        assert auto_backend("swp_bf16", "cuda", features, lazy, True) == "triton"
        assert auto_backend("swp_bf16", "cpu", features, lazy, True) == "emulator"
        assert auto_backend("swp_bf16", "cuda", features, lazy, False) == "emulator"
    rule = Policy.from_rule(lambda m, mt, t: m, name="rule")
    assert auto_backend("swp_bf16", "cuda", (), rule, True) == "emulator"  # rules: models only


# ----------------------------------------------------------------------------------
# GPU: the compiled kernel against the model (skipped without CUDA/ROCm). Each (policy,
# causal, extras) is its own compiled kernel: the matrix is cut to keep compiles few.
# ----------------------------------------------------------------------------------

GPU_RUNS = [("lazy_unfixed", False), ("lazy_unfixed", True), ("lazy", False), ("lazy", True)]


@pytest.mark.gpu
@pytest.mark.usefixtures("exact_dots")
@pytest.mark.parametrize("mod", ["bias", "alibi_h", "alibi_bh", "sink", "all"])
def test_gpu_score_mods_match_model(mod):
    q, k, v = make_inputs(2, 2000, 2300, 8, 2, 128, 48.0, seed=40, device="cuda")
    kw = {n: x.cuda() for n, x in mods_for(mod, 2000, 2300, 8, B=2).items()}
    runs = GPU_RUNS + ([("eager", False), ("fa4_row", True)] if mod == "all" else [])
    for policy, causal in runs:
        kernel, ref = run_both(q, k, v, causal=causal, policy=policy, backend="triton", **kw)
        assert_close_to_model(kernel, ref, weighted_abs_v(q, k, v, causal, kw))
        if policy == "lazy_unfixed":
            assert torch.isnan(kernel[0]).any()
        else:
            assert torch.isfinite(kernel[0]).all()


@pytest.mark.gpu
@pytest.mark.usefixtures("exact_dots")
def test_gpu_split_k_matches_model():
    # N = 36 tiles: 2 splits of 18, 3 of 12, 8 of 6 (the last two empty); causal blocks have
    # fewer tiles and more empty splits
    q, k, v = make_inputs(2, 2000, 2300, 8, 2, 128, 48.0, seed=41, device="cuda")
    sink = torch.linspace(1.0, 30.0, 8, device="cuda")
    for splits in (2, 3, 8):
        for policy, causal in GPU_RUNS:
            kw = dict(num_kv_splits=splits, sink=sink)
            kernel, ref = run_both(q, k, v, causal=causal, policy=policy, backend="triton", **kw)
            assert_close_to_model(kernel, ref, weighted_abs_v(q, k, v, causal, kw), roundings=4)


@pytest.mark.gpu
@pytest.mark.usefixtures("exact_dots")
def test_gpu_varlen_matches_model():
    lens_q, lens_k = [1000, 1, 0, 700, 513, 2000], [1200, 64, 30, 0, 513, 1900]
    q, k, v, cu_q, cu_k = packed_k48(lens_q, lens_k, H=8, Hkv=2, D=128, seed=42)
    g = torch.Generator().manual_seed(43)
    bias = (torch.randn(q.shape[0], 1900, generator=g) * 4).to(BF)
    alibi = torch.rand(6, 8, generator=g) * 0.05
    sink = torch.linspace(1.0, 20.0, 8)
    dev = dict(cu_seqlens_q=cu_q.cuda(), cu_seqlens_kv=cu_k.cuda(), max_seqlen_q=2000,
               max_seqlen_kv=1900, bias=bias.cuda(), alibi_slopes=alibi.cuda(), sink=sink.cuda())
    qc, kc, vc = q.cuda(), k.cuda(), v.cuda()
    for policy, causal in GPU_RUNS:
        kernel, ref = run_both(qc, kc, vc, causal=causal, policy=policy, backend="triton", **dev)
        wav = varlen_weighted_abs_v(q, k, v, cu_q, cu_k, causal, bias, alibi, sink)
        assert_close_to_model(kernel, ref, wav.cuda())


@pytest.mark.gpu
@pytest.mark.usefixtures("exact_dots")
def test_gpu_trace_matches_model_with_extras():
    q, k, v = make_inputs(1, 1000, 1500, 4, 2, 128, 48.0, seed=44, device="cuda")
    rows = [(0, h, r) for h in range(4) for r in range(0, 1000, 7)]
    kw = {n: x.cuda() for n, x in mods_for("all", 1000, 1500, 4).items()}
    for extra in ({}, {"num_kv_splits": 3}):
        args = dict(rows=rows, causal=True, rescale="lazy_unfixed", kernel="swp_bf16", **kw, **extra)
        assert_traces_match(fa_lab.trace(q, k, v, backend="triton", **args),
                            fa_lab.trace(q, k, v, backend="emulator", **args))
