"""The fast Triton forward kernels (fa_lab.kernels.swp_bf16.fast / swp_fp8.fast).

On CPU through Triton's interpreter (small shapes): agreement with the fp32 reference,
the policies' semantics (threshold 0 is eager; the unfixed rebase overflows on a dragged
case where the fixed one and eager stay finite), the fp8 kernel against the fp8 model,
the TMA and plain-load paths against each other, and argument checks. The compiled
kernels are checked the same way on a GPU (marked ``gpu``).
"""

import dataclasses
import re

import pytest
import torch
import triton
import triton.language as tl

import fa_lab
from _shared import BF16_TOL, check_against_reference, sm90_target
from fa_lab.studies import experiments as ex
from fa_lab import policies, reference
from fa_lab.kernels._triton import fast as common_fast
from fa_lab.kernels._triton.fast import Config
from fa_lab.kernels.swp_bf16 import fast as fast_bf16
from fa_lab.kernels.swp_fp8 import fast as fast_fp8
from fa_lab.metrics import rel_l2
from fa_lab.kernels.swp_fp8 import model as swp_fp8

FP8 = torch.float8_e4m3fn

BF16 = torch.bfloat16
# bf16 output rounding alone is ~2**-9 relative; P in bf16 adds about as much.


def bf16_policy(name, **kw):
    return policies.resolve(fp8=False, seqlen_kv=1, rescale=name, **kw)


def fp8_policy(name, **kw):
    return policies.resolve(fp8=True, seqlen_kv=1, rescale=name, **kw)


def randn(gen, *shape, dtype=BF16, scale=1.0, device="cpu"):
    x = torch.randn(shape, generator=gen) * scale
    return x.to(dtype).to(device)


def nonfinite_rows(out):
    return (~torch.isfinite(out.float())).any(-1)


# ---- bf16 / f16 on the interpreter ----------------------------------------------------

@pytest.mark.parametrize("policy", ["eager", "lazy"])
@pytest.mark.parametrize("causal, sq, skv", [
    (False, 100, 100),   # ragged last tile, one q block of padding rows
    (True, 70, 150),     # bottom-right causal, Skv > Sq
    (True, 150, 70),     # Sq > Skv: the top 80 rows see no key at all
])
def test_bf16_matches_fp32_reference(gen, policy, causal, sq, skv):
    q = randn(gen, 1, sq, 4, 64)
    k, v = randn(gen, 1, skv, 2, 64), randn(gen, 1, skv, 2, 64)  # GQA: 2 q heads per kv head
    out, lse = fast_bf16.forward(q, k, v, causal=causal, policy=bf16_policy(policy), interpret=True)
    assert out.dtype == BF16 and out.shape == q.shape and lse.shape == (1, 4, sq)
    check_against_reference(out, lse, q, k, v, causal)


def test_f16_head_dim_128_matches_reference(gen):
    q, k, v = (randn(gen, 2, 80, 1, 128, dtype=torch.float16) for _ in range(3))
    out, lse = fast_bf16.forward(q, k, v, causal=False, policy=bf16_policy("lazy"), interpret=True)
    assert out.dtype == torch.float16
    check_against_reference(out, lse, q, k, v, False, tol=5e-3)  # f16 has 3 more bits


def test_threshold_zero_is_eager(gen):
    """With threshold 0 a wave fires whenever some row's max grew, and every row of it
    rebases to fmax(m, mt); rows of silent waves did not grow: exactly eager."""
    q, k, v = (randn(gen, 1, 192, 1, 64, scale=s) for s in (1.0, 4.0, 1.0))
    eager, _ = fast_bf16.forward(q, k, v, causal=False, policy=bf16_policy("eager"), interpret=True)
    lazy0, _ = fast_bf16.forward(q, k, v, causal=False, policy=bf16_policy("lazy", rescale_threshold=0.0),
                                 interpret=True)
    lazy8, _ = fast_bf16.forward(q, k, v, causal=False, policy=bf16_policy("lazy"), interpret=True)
    assert torch.equal(lazy0, eager)
    assert not torch.equal(lazy8, eager)  # the default threshold really skips rescales
    ref, _ = reference.attention(q, k, v, causal=False)
    assert rel_l2(lazy8, ref) < BF16_TOL


def test_unfixed_rebase_drags_rows_to_nonfinite():
    """The seed's repro at K x64: a fired wave drags rows whose own tile max sits far below
    their base; the unfixed rebase overflows them, the fixed one and eager stay finite."""
    q, k, v = ex.bf16_inputs(1, 512, 1, 64, 64, seed=0)
    ref, _ = reference.attention(q, k, v, causal=False)
    outs = {p: fast_bf16.forward(q, k, v, causal=False, policy=bf16_policy(p), interpret=True)[0]
            for p in ("lazy_unfixed", "lazy", "eager")}
    assert nonfinite_rows(outs["lazy_unfixed"]).float().mean() > 0.05
    for p in ("lazy", "eager"):
        assert torch.isfinite(outs[p].float()).all(), p
        # |scores| reach ~600 in log2 units here: Q's bf16 rounding alone costs ~1e-2
        # (the seed's table: 1.39e-2 for both at S = 8192)
        assert rel_l2(outs[p], ref) < 2.5e-2, p


@pytest.mark.parametrize("policy", ["lazy", "lazy_unfixed"])
def test_row_sum_filter_takes_the_same_decisions(policy):
    """The fast path tests row sums of P instead of row maxes; the decisions, hence the
    outputs (NaN included), must be the same bits either way."""
    q, k, v = ex.bf16_inputs(1, 320, 1, 64, 48, seed=3)
    pol = bf16_policy(policy, rescale_threshold=4.0)
    outs = [fast_bf16.forward(q, k, v, causal=True, policy=pol, interpret=True,
                              config=Config(64, 64, 4, 1, False, row_sum_filter=f))[0]
            for f in (True, False)]
    assert torch.equal(torch.isnan(outs[0]), torch.isnan(outs[1]))
    assert torch.equal(outs[0].nan_to_num(), outs[1].nan_to_num())


def test_tma_and_plain_loads_agree_across_batches(gen):
    """The TMA path views K and V as [B*S, H*D]: a ragged last tile reads the next batch's
    rows. Those must not leak, even when they hold inf."""
    q = randn(gen, 2, 90, 2, 64)
    k, v = randn(gen, 2, 100, 2, 64), randn(gen, 2, 100, 2, 64)
    v[1, :40] = float("inf")  # what batch 0's last tile reads past its end
    pol = bf16_policy("lazy")
    plain, _ = fast_bf16.forward(q, k, v, causal=True, policy=pol, interpret=True,
                                 config=Config(64, 64, 4, 1, False))
    tma, tma_lse = fast_bf16.forward(q, k, v, causal=True, policy=pol, interpret=True,
                                     config=Config(64, 64, 4, 1, True))
    assert torch.isfinite(tma[0].float()).all()
    assert torch.equal(torch.isnan(tma), torch.isnan(plain))
    assert torch.equal(tma[0], plain[0])
    check_against_reference(tma[:1], tma_lse[:1], q[:1], k[:1], v[:1], True)


# ---- fp8 on the interpreter -------------------------------------------------------------

FP8_CASES = [
    ("eager", {}),
    ("lazy", {"p_headroom": True}),
    ("lazy_unfixed", {}),
    ("lazy_capped", {"rebase_bound": 8.0}),
]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("name, kw", FP8_CASES)
def test_fp8_matches_model(name, kw, causal):
    """The seed's fp8 inputs (V = ones) at k x5000, where the unfixed rule overflows: the
    kernel decides per 128 columns as the model does per pair, so the non-finite elements
    are the same ones and the finite outputs agree to the last bits of bf16."""
    (q8, k8, v8), (qd, kd, vd) = ex.fp8_inputs(1, 320, 1, 5000, seed=0)
    pol = fp8_policy(name, **kw)
    common = dict(q_descale=qd, k_descale=kd, v_descale=vd, causal=causal, policy=pol)
    out, lse = fast_fp8.forward(q8, k8, v8, interpret=True, **common)
    m_out, m_lse = swp_fp8.forward(q8, k8, v8, **common)
    bad, m_bad = ~torch.isfinite(out.float()), ~torch.isfinite(m_out.float())
    assert torch.equal(bad, m_bad)
    assert bool(bad.any()) == (name == "lazy_unfixed")
    ok = ~bad
    assert torch.allclose(out.float()[ok], m_out.float()[ok], atol=2e-3, rtol=1e-2)
    fin = torch.isfinite(lse) & torch.isfinite(m_lse)
    assert torch.allclose(lse[fin], m_lse[fin], atol=1e-3, rtol=0)


def test_fp8_matches_reference_on_random_v(gen):
    q, k, v = (randn(gen, 1, 200, 2, 128, dtype=torch.float32) for _ in range(3))
    (q8, qd), (k8, kd), (v8, vd) = (ex.quantize_e4m3(x) for x in (q, k, v))
    out, lse = fast_fp8.forward(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd,
                                causal=True, policy=fp8_policy("lazy"), interpret=True)
    ref, ref_lse = reference.attention(q8, k8, v8, causal=True, q_descale=qd, k_descale=kd,
                                       v_descale=vd)
    assert rel_l2(out, ref) < 0.05  # e4m3 P has 3 mantissa bits
    assert torch.allclose(lse, ref_lse, atol=2e-2)


def test_fp8_saturate_false_turns_large_p_into_nan():
    """A headroom of 10 lifts P to 2**10 > 464: NaN without saturation, 448 with it."""
    (q8, k8, v8), (qd, kd, vd) = ex.fp8_inputs(1, 256, 1, 1, seed=1)
    with pytest.warns(UserWarning, match="exceeds log2"):
        pol = fp8_policy("eager", p_headroom=10.0)
    common = dict(q_descale=qd, k_descale=kd, v_descale=vd, causal=False, policy=pol)
    for saturate in (True, False):
        out, _ = fast_fp8.forward(q8, k8, v8, saturate=saturate, interpret=True, **common)
        m_out, _ = swp_fp8.forward(q8, k8, v8, saturate=saturate, **common)
        assert torch.equal(torch.isnan(out), torch.isnan(m_out))
        assert bool(torch.isnan(out).any()) == (not saturate)


def test_fp8_tma_plain_and_filter_variants_agree():
    (q8, k8, v8), (qd, kd, vd) = ex.fp8_inputs(2, 200, 1, 5000, seed=2)
    common = dict(q_descale=qd, k_descale=kd, v_descale=vd, causal=True,
                  policy=fp8_policy("lazy_unfixed"), interpret=True)
    plain, _ = fast_fp8.forward(q8, k8, v8, config=Config(64, 128, 4, 1, False), **common)
    tma, _ = fast_fp8.forward(q8, k8, v8, config=Config(64, 128, 4, 1, True), **common)
    exact, _ = fast_fp8.forward(q8, k8, v8, config=Config(64, 128, 4, 1, False, False), **common)
    assert torch.isnan(plain).any()  # the unfixed rule dragged rows: NaN must match too
    for other in (tma, exact):
        assert torch.equal(torch.isnan(plain), torch.isnan(other))
        assert torch.equal(plain.nan_to_num(), other.nan_to_num())


def _fp8_operand_column(key: int) -> int:
    """Where the fp8 kernel's V^T keeps ``key``: wgmma's accumulator gives a thread score
    columns 8j + 2i, 8j + 2i + 1 (j = 0, 1 in each 16); an fp8 A operand takes 4 adjacent
    keys 4i .. 4i + 3 of each 16 from it. Stored in that order, the thread's own P values
    are the operand: key 16b + 8j + 2i + e sits at column 16b + 4i + 2j + e."""
    b, r = divmod(key, 16)
    j, r = divmod(r, 8)
    i, e = divmod(r, 2)
    return 16 * b + 4 * i + 2 * j + e


def _v_transposed_as_stored(v8: torch.Tensor, skv_pad: int) -> torch.Tensor:
    """The expected V^T copy of v8 [B, Skv, Hkv, D], as uint8: zeros past Skv."""
    B, skv, hkv, d = v8.shape
    want = torch.zeros(B, hkv, d, skv_pad, dtype=torch.uint8, device=v8.device)
    cols = torch.tensor([_fp8_operand_column(s) for s in range(skv)], device=v8.device)
    want[..., cols] = v8.view(torch.uint8).permute(0, 2, 3, 1)
    return want


@pytest.mark.parametrize("skv, strided", [(200, False), (64, False), (13, True)])
def test_fp8_v_transpose_stores_keys_in_operand_order_with_zero_padding(skv, strided):
    """The transposed V copy (interpreted): every byte of V at [b, h, d, column of s],
    zeros at the columns of the padded keys, also from a non-contiguous V."""
    gen = torch.Generator().manual_seed(skv)
    raw = torch.randint(0, 256, (2, skv, 3, 256 if strided else 128), generator=gen, dtype=torch.uint8)
    v8 = raw[..., :128].view(torch.float8_e4m3fn) if not strided else raw[..., ::2].view(torch.float8_e4m3fn)
    vt = fast_fp8.transpose_v(v8, interpret=True)
    pad = -skv % fast_fp8.V_PAD
    assert vt.shape == (2, 3, 128, skv + pad) and vt.is_contiguous()
    assert torch.equal(vt.view(torch.uint8), _v_transposed_as_stored(v8, skv + pad))


@pytest.mark.parametrize("skv", [200, 16, 13])
def test_fp8_transposed_v_holds_v_in_the_kernel_key_order_and_gives_it_back(skv):
    """``TransposedV.from_v`` (interpreted) holds the same bytes as the per-call copy, its
    column map is the operand formula's, and ``to_v`` returns V byte for byte."""
    gen = torch.Generator().manual_seed(skv)
    v8 = torch.randint(0, 256, (2, skv, 3, 128), generator=gen, dtype=torch.uint8).view(FP8)
    tv = fast_fp8.TransposedV.from_v(v8, interpret=True)
    pad = -skv % fast_fp8.V_PAD
    assert tv.shape == v8.shape and tv.seqlen == skv and tv.device == v8.device
    assert tv.data.shape == (2, 3, 128, skv + pad) and tv.data.dtype == FP8 and tv.data.is_contiguous()
    assert torch.equal(tv.data.view(torch.uint8), _v_transposed_as_stored(v8, skv + pad))
    assert fast_fp8.stored_columns(skv).tolist() == [_fp8_operand_column(s) for s in range(skv)]
    assert torch.equal(tv.to_v().view(torch.uint8), v8.view(torch.uint8))


@pytest.mark.parametrize("causal", [False, True])
def test_fp8_forward_given_a_transposed_v_equals_the_call_that_copies_it(causal):
    """The same outputs, NaN for NaN, with V^T made once: the seed's q and k at k x5000
    under the unfixed rule (NaN rows), a random V (a key in the wrong place would show),
    GQA, a length that is not a multiple of 16."""
    (q8, k8, _), (qd, kd, _) = ex.fp8_inputs(1, 200, 2, 5000, seed=4)
    k8 = k8[:, :, :1].contiguous()  # two query heads on one kv head
    v8, vd = ex.quantize_e4m3(torch.randn(1, 200, 1, 128, generator=torch.Generator().manual_seed(4)))
    common = dict(q_descale=qd, k_descale=kd, v_descale=vd, causal=causal,
                  policy=fp8_policy("lazy_unfixed"), interpret=True)
    tv = fast_fp8.TransposedV.from_v(v8, interpret=True)
    out, lse = fast_fp8.forward(q8, k8, v8, **common)
    out_t, lse_t = fast_fp8.forward(q8, k8, tv, **common)
    assert torch.isnan(out).any()
    assert torch.equal(torch.isnan(out), torch.isnan(out_t))
    assert torch.equal(out.nan_to_num(), out_t.nan_to_num())
    assert torch.equal(lse.nan_to_num(), lse_t.nan_to_num())


def test_fp8_transposed_v_refuses_bad_input_and_a_v_of_another_shape():
    v8 = torch.zeros(1, 40, 1, 128, dtype=FP8)
    for bad, exc, words in [
        (v8.float(), TypeError, "v8 has dtype torch.float32"),
        (v8.view(torch.uint8), TypeError, "v8 has dtype torch.uint8"),
        ("v", TypeError, "v8 must be a torch.Tensor"),
        (v8[..., :64], ValueError, r"v8 must be \[B, Skv, Hkv, 128\]"),
        (v8[0], ValueError, r"v8 must be \[B, Skv, Hkv, 128\]"),
        (v8[:, :0], ValueError, "no empty dimension"),
    ]:
        with pytest.raises(exc, match=words):
            fast_fp8.TransposedV.from_v(bad, interpret=True)
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        fast_fp8.TransposedV.from_v(v8)
    with pytest.raises(TypeError, match=r"TransposedV.from_v\(v8\)"):
        fast_fp8.TransposedV(v8, 40)
    tv = fast_fp8.TransposedV.from_v(v8, interpret=True)
    with pytest.raises(AttributeError):
        tv.data = v8
    common = dict(q_descale=1.0, k_descale=1.0, v_descale=1.0, causal=False,
                  policy=fp8_policy("lazy"), interpret=True)
    q8 = torch.zeros(1, 40, 2, 128, dtype=FP8)
    for k8 in (torch.zeros(1, 41, 1, 128, dtype=FP8), torch.zeros(1, 40, 2, 128, dtype=FP8)):
        with pytest.raises(ValueError, match="v8 \\(a TransposedV of V \\(1, 40, 1, 128\\)"):
            fast_fp8.forward(q8, k8, tv, **common)


# ---- the fp8 P operand, compiled for sm_90 on the CPU ------------------------------------

@triton.jit
def _pv_probe(Q, K, Vt, Out, IN_STORED_ORDER: tl.constexpr):
    """One fp8 tile as the kernel computes it: S = Q K^T on the tensor cores, P = exp2(S)
    cast to e4m3, O = P V (V transposed)."""
    r, n, d = tl.arange(0, 64), tl.arange(0, 128), tl.arange(0, 128)
    k = tl.load(K + n[:, None] * 128 + d[None, :])
    s = tl.dot(tl.load(Q + r[:, None] * 128 + d[None, :]), tl.trans(k))
    p = tl.math.exp2(s).to(tl.float8e4nv)
    if IN_STORED_ORDER:
        p = fast_fp8._in_stored_order(p, 64, 128)
    vt = tl.load(Vt + d[:, None] * 128 + n[None, :])
    tl.store(Out + r[:, None] * 128 + d[None, :], tl.dot(p, tl.trans(vt)))


def _lane_exchanges(ptx: str) -> list[str]:
    """The shuffles that read a lane chosen per thread (a layout change moves data so);
    a broadcast from a fixed lane and the butterflies of row reductions are not counted."""
    return re.findall(r"shfl\.sync\.idx\.b32\s+%r\d+, %r\d+, %r\d+", ptx)


def test_fp8_p_operand_in_stored_order_moves_no_data_between_lanes():
    """From the scores' accumulator to wgmma's fp8 A operand, P in key order needs lane
    shuffles (the control); reordered by ``_in_stored_order`` it needs none."""
    from triton.compiler import ASTSource

    def ptx(in_order):
        sig = {"Q": "*fp8e4nv", "K": "*fp8e4nv", "Vt": "*fp8e4nv", "Out": "*fp32",
               "IN_STORED_ORDER": "constexpr"}
        src = ASTSource(fn=_pv_probe, signature=sig, constexprs={"IN_STORED_ORDER": in_order})
        return triton.compile(src, target=sm90_target(), options={"num_warps": 4}).asm["ptx"]
    control, ours = ptx(False), ptx(True)
    assert "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3" in ours
    assert len(_lane_exchanges(control)) >= 16
    assert _lane_exchanges(ours) == []


@pytest.mark.parametrize("config", fast_fp8.CONFIGS, ids=lambda c: c.describe())
def test_fp8_kernel_compiles_to_no_lane_shuffle(config):
    """The fp8 kernel itself (lazy, causal, every autotuned config): no data moves
    between lanes on the way to the PV product."""
    ptx = fast_fp8.compile_only(sm90_target(), config, lazy=True, causal=True).asm["ptx"]
    assert "e4m3.e4m3" in ptx
    assert _lane_exchanges(ptx) == []


def test_fp8_compile_only_refuses_bad_arguments():
    with pytest.raises(TypeError, match="config"):
        fast_fp8.compile_only(None, (64, 128, 4, 3, True), lazy=True, causal=False)
    with pytest.raises(TypeError, match="causal"):
        fast_fp8.compile_only(None, fast_fp8.CONFIGS[0], lazy=True, causal=1)
    with pytest.raises(ValueError, match=r"options \['maxnreg'\] come from the config"):
        fast_fp8.compile_only(None, fast_fp8.CONFIGS[0], lazy=True, causal=False, maxnreg=168)


def test_a_register_cap_reaches_ptxas_and_the_tuner():
    """``Config.maxnreg``: the sm_90 PTX carries it (ptxas reads it there), the tuner's
    candidates keep it (with and without the row-sum filter), it is a compiler option in
    the launch keywords, its text names it; a cap out of range is refused before any
    compile."""
    capped = Config(64, 128, 4, 2, True, True, 168)
    assert capped.describe(True) == "BM64 BN128 w4 s2 tma rowsum r168"
    assert capped.meta(True)["maxnreg"] == 168 and "maxnreg" not in Config(64, 128, 4, 2, True).meta(True)
    tuned = common_fast.autotuners(fast_fp8._attn_fwd_fp8, (capped,), ["seqlen_q"], None)
    assert set(tuned[True].configs) == {capped, dataclasses.replace(capped, row_sum_filter=False)}
    assert tuned[False].configs == (dataclasses.replace(capped, row_sum_filter=False),)
    ptx = fast_fp8.compile_only(sm90_target(), capped, lazy=True, causal=True).asm["ptx"]
    assert ".maxnreg 168" in ptx
    for bad in (16, 300, True):
        with pytest.raises(ValueError, match="config.maxnreg must be None or an int in 24..255"):
            fast_fp8.compile_only(None, dataclasses.replace(capped, maxnreg=bad), lazy=True, causal=True)


def test_compile_only_wants_each_argument_typed_or_given_once():
    from fa_lab.kernels._triton.fast import compile_only

    types = {"Q": "*fp8e4nv", "K": "*fp8e4nv", "Vt": "*fp8e4nv", "Out": "*fp32"}
    flag = {"IN_STORED_ORDER": True}
    assert set(_pv_probe.arg_names) == {*types, *flag}
    with pytest.raises(ValueError, match=r"missing \['Out'\]"):
        compile_only(_pv_probe, None, types={n: types[n] for n in ("Q", "K", "Vt")}, constexprs=flag)
    with pytest.raises(ValueError, match=r"in both \['IN_STORED_ORDER'\]"):
        compile_only(_pv_probe, None, types={**types, "IN_STORED_ORDER": "i1"}, constexprs=flag)
    with pytest.raises(ValueError, match=r"not arguments \['Qx'\]"):
        compile_only(_pv_probe, None, types=types, constexprs=flag, aligned=["Qx"])


# ---- bad input ---------------------------------------------------------------------------

Q = torch.zeros(1, 64, 2, 64, dtype=BF16)


@pytest.mark.parametrize("args, kw, exc, words", [
    ((Q.float(), Q, Q), {}, TypeError, "q has dtype"),
    ((Q, Q[0], Q), {}, ValueError, "k must be 4-D"),
    ((Q, Q, Q[:, :10]), {}, ValueError, "k .* and v .* same shape"),
    ((Q[..., :32], Q[..., :32], Q[..., :32]), {}, ValueError, "head dim D=32"),
    ((Q, Q[:, :, :1], Q[:, :, :1].clone()), {"causal": 1}, TypeError, "causal must be a bool"),
    ((Q, Q, Q), {"policy": "lazy"}, TypeError, "policy must be"),
    ((Q, Q, Q), {"policy": bf16_policy("fa4_row")}, ValueError, "vote='row'"),
    ((Q, Q, Q), {"policy": bf16_policy("lazy_capped")}, ValueError, "rebase='capped'"),
    ((Q, Q, Q), {"interpret": False}, ValueError, "needs CUDA tensors"),
    ((Q, Q, Q), {"config": Config(48, 64, 4, 1, False)}, ValueError, "multiple of 32"),
    ((Q, Q, Q), {"config": Config(64, 64, 4, 1, False, maxnreg=16)}, ValueError, r"maxnreg .* 24\.\.255"),
    ((Q, Q, Q), {"config": Config(64, 64, 4, 1, False, maxnreg=256)}, ValueError, "got 256"),
    ((Q, Q, Q), {"config": Config(64, 64, 4, 1, False, maxnreg=168.0)}, ValueError, "got 168.0"),
    ((Q, Q, Q), {"config": Config(64, 64, 4, 1, False, maxnreg=True)}, ValueError, "got True"),
])
def test_bf16_bad_input(args, kw, exc, words):
    kwargs = {"causal": False, "policy": bf16_policy("lazy"), "interpret": True, **kw}
    with pytest.raises(exc, match=words):
        fast_bf16.forward(*args, **kwargs)


def test_fp8_bad_input():
    q8 = torch.zeros(1, 64, 1, 128).to(torch.float8_e4m3fn)
    ok = dict(q_descale=1.0, k_descale=1.0, v_descale=1.0, causal=False,
              policy=fp8_policy("lazy"), interpret=True)
    with pytest.raises(ValueError, match="k_descale must be finite and > 0"):
        fast_fp8.forward(q8, q8, q8, **{**ok, "k_descale": 0.0})
    with pytest.raises(ValueError, match="block_n must be 128"):
        fast_fp8.forward(q8, q8, q8, config=Config(64, 64, 4, 1, False), **ok)
    with pytest.raises(TypeError, match="saturate must be a bool"):
        fast_fp8.forward(q8, q8, q8, saturate=None, **ok)
    with pytest.raises(ValueError, match="D=64 is not supported"):
        fast_fp8.forward(q8[..., :64], q8[..., :64], q8[..., :64], **ok)
    with pytest.raises(ValueError, match="vote='row'"):
        fast_fp8.forward(q8, q8, q8, **{**ok, "policy": fp8_policy("fa4_row")})


# ---- compiled kernels on a GPU -------------------------------------------------------------

GPU_CONFIGS = [fast_bf16.CONFIGS[0], Config(128, 128, 8, 2, True)]  # plain loads / TMA
#: every tiling the autotuner may pick, each at D 64 and 128 (lazy: its row-sum filter)
TUNED_CONFIGS = [c for c in fast_bf16.CONFIGS if c not in GPU_CONFIGS]


@pytest.mark.gpu
@pytest.mark.parametrize("config", GPU_CONFIGS, ids=lambda c: c.describe())
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("policy", ["eager", "lazy", "lazy_unfixed"])
def test_gpu_bf16_matches_reference(gen, policy, causal, config):
    q = randn(gen, 2, 1000, 4, 128, device="cuda")
    k, v = randn(gen, 2, 1100, 2, 128, device="cuda"), randn(gen, 2, 1100, 2, 128, device="cuda")
    out, lse = fast_bf16.forward(q, k, v, causal=causal, policy=bf16_policy(policy), config=config)
    check_against_reference(out, lse, q, k, v, causal)


@pytest.mark.gpu
@pytest.mark.parametrize("config", TUNED_CONFIGS, ids=lambda c: c.describe())
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("policy", ["eager", "lazy"])
def test_gpu_bf16_every_tuned_tiling(gen, policy, head_dim, config):
    q = randn(gen, 2, 1000, 4, head_dim, device="cuda")
    k, v = randn(gen, 2, 1100, 2, head_dim, device="cuda"), randn(gen, 2, 1100, 2, head_dim, device="cuda")
    out, lse = fast_bf16.forward(q, k, v, causal=True, policy=bf16_policy(policy), config=config)
    check_against_reference(out, lse, q, k, v, True)


@pytest.mark.gpu
def test_gpu_bf16_head_dim_64(gen):
    q, k, v = (randn(gen, 1, 777, 2, 64, device="cuda") for _ in range(3))
    out, lse = fast_bf16.forward(q, k, v, causal=True, policy=bf16_policy("lazy"), config=GPU_CONFIGS[0])
    check_against_reference(out, lse, q, k, v, True)


@pytest.mark.gpu
def test_gpu_unfixed_rebase_drags_rows_to_nonfinite():
    q, k, v = ex.bf16_inputs(1, 4096, 4, 128, 64, seed=0, device="cuda")
    cfg = GPU_CONFIGS[0]
    outs = {p: fast_bf16.forward(q, k, v, causal=False, policy=bf16_policy(p), config=cfg)[0]
            for p in ("lazy_unfixed", "lazy", "eager")}
    assert nonfinite_rows(outs["lazy_unfixed"]).float().mean() > 0.05
    assert torch.isfinite(outs["lazy"].float()).all() and torch.isfinite(outs["eager"].float()).all()


@pytest.mark.gpu
@pytest.mark.parametrize("config", fast_fp8.CONFIGS, ids=lambda c: c.describe())
@pytest.mark.parametrize("name, kw", FP8_CASES)
def test_gpu_fp8_matches_model(name, kw, config):
    (q8, k8, v8), (qd, kd, vd) = ex.fp8_inputs(1, 2000, 2, 5000, seed=0, device="cuda")
    pol = fp8_policy(name, **kw)
    common = dict(q_descale=qd, k_descale=kd, v_descale=vd, causal=True, policy=pol)
    out, _ = fast_fp8.forward(q8, k8, v8, config=config, **common)
    m_out, _ = swp_fp8.forward(q8, k8, v8, **common)
    bad, m_bad = ~torch.isfinite(out.float()), ~torch.isfinite(m_out.float())
    # exp2 on the GPU is approximate: allow a sliver of rows on the edge of overflow
    assert (bad != m_bad).float().mean() < 1e-3
    assert bool(bad.any()) == (name == "lazy_unfixed")
    # V = ones: out = sum(e4m3(P)) / l. The GPU's exp2 is approximate, so a P on an e4m3
    # rounding boundary can land one step away from the model's; in a near-one-hot row
    # that moves the output by up to a step of the largest P: 1/8 relative below 448
    # (P headroom lifts P there; an H200 showed 0.074), far less on average.
    diff = (out.float() - m_out.float())[~(bad | m_bad)].abs()
    assert diff.mean() < 2e-3 and diff.max() < 0.13


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_fp8_autotuned_matches_reference(gen, causal):
    q, k, v = (randn(gen, 2, 1500, 2, 128, dtype=torch.float32, device="cuda") for _ in range(3))
    (q8, qd), (k8, kd), (v8, vd) = (ex.quantize_e4m3(x) for x in (q, k, v))
    out, lse = fast_fp8.forward(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd,
                                causal=causal, policy=fp8_policy("lazy"))
    ref, ref_lse = reference.attention(q8, k8, v8, causal=causal, q_descale=qd, k_descale=kd,
                                       v_descale=vd)
    assert rel_l2(out, ref) < 0.05
    assert torch.allclose(lse, ref_lse, atol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("skv", [1, 1000, 4099])
def test_gpu_fp8_v_transpose_stores_keys_in_operand_order_with_zero_padding(skv):
    raw = torch.randint(0, 256, (2, skv, 4, 128), dtype=torch.uint8, device="cuda")
    v8 = raw.view(torch.float8_e4m3fn)
    vt = fast_fp8.transpose_v(v8)
    assert torch.equal(vt.view(torch.uint8), _v_transposed_as_stored(v8, skv + -skv % fast_fp8.V_PAD))
    tv = fast_fp8.TransposedV.from_v(v8)
    assert torch.equal(tv.data.view(torch.uint8), vt.view(torch.uint8))
    assert torch.equal(tv.to_v().view(torch.uint8), raw)


@pytest.mark.gpu
def test_gpu_fp8_register_cap_launches_and_leaves_the_output_alone():
    """A launch with ``maxnreg`` 168 (2 stages) gives the uncapped launch's output, NaN for
    NaN: the cap changes where values live, not the arithmetic."""
    (q8, k8, v8), (qd, kd, vd) = ex.fp8_inputs(1, 2000, 2, 5000, seed=0, device="cuda")
    common = dict(q_descale=qd, k_descale=kd, v_descale=vd, causal=True,
                  policy=fp8_policy("lazy_unfixed"))
    capped = Config(64, 128, 4, 2, True, True, 168)
    plain, plain_lse = fast_fp8.forward(q8, k8, v8, config=dataclasses.replace(capped, maxnreg=None), **common)
    out, lse = fast_fp8.forward(q8, k8, v8, config=capped, **common)
    assert not torch.isfinite(plain.float()).all()  # the unfixed rule's overflow, in both
    assert torch.equal(torch.isnan(plain), torch.isnan(out))
    assert torch.equal(plain.nan_to_num(), out.nan_to_num())
    assert torch.equal(plain_lse.nan_to_num(), lse.nan_to_num())


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_fp8_forward_given_a_transposed_v_equals_the_call_that_copies_it(causal):
    (q8, k8, _), (qd, kd, _) = ex.fp8_inputs(2, 1500, 2, 5000, seed=5, device="cuda")
    v8, vd = ex.quantize_e4m3(torch.randn(2, 1500, 2, 128, device="cuda"))
    common = dict(q_descale=qd, k_descale=kd, v_descale=vd, causal=causal,
                  policy=fp8_policy("lazy_unfixed"))
    out, lse = fast_fp8.forward(q8, k8, v8, **common)
    out_t, lse_t = fast_fp8.forward(q8, k8, fast_fp8.TransposedV.from_v(v8), **common)
    assert torch.equal(torch.isnan(out), torch.isnan(out_t))
    assert torch.equal(out.nan_to_num(), out_t.nan_to_num())
    assert torch.equal(lse.nan_to_num(), lse_t.nan_to_num())


# ---- backend="fast" through the public API ---------------------------------------------

@pytest.mark.slow
def test_api_fast_backend_runs_the_fast_kernels_interpreted():
    q, k, v = ex.bf16_inputs(1, 512, 2, 64, 1.0, seed=3)
    out, lse = fa_lab.flash_attn_func(q, k, v, causal=True, backend="fast", return_lse=True)
    want, want_lse = fast_bf16.forward(q, k, v, causal=True, interpret=True,
                                       policy=bf16_policy("lazy"))
    assert torch.equal(out, want) and torch.equal(lse, want_lse)
    # GQA, varlen and split-K go to the fast kernels' own entries
    cu = torch.tensor([0, 200, 512], dtype=torch.int32)
    packed = fa_lab.flash_attn_func(q[0], k[0], v[0], cu_seqlens_q=cu, cu_seqlens_kv=cu,
                                    max_seqlen_q=312, causal=True, backend="fast")
    assert torch.isfinite(packed.float()).all() and packed.shape == q[0].shape
    split, split_lse = fa_lab.flash_attn_func(q, k, v, causal=False, backend="fast",
                                              num_kv_splits=2, return_lse=True)
    check_against_reference(split, split_lse, q, k, v, False)


@pytest.mark.parametrize("kw, words", [
    (dict(bias=torch.zeros(512, 512, dtype=BF16)), "bias not supported.*backend='fast'"),
    (dict(rescale="fa4_row"), "vote='row'.*backend='fast'"),
    (dict(rescale="lazy_capped"), "rebase='capped'.*backend='fast'"),
    (dict(kernel="generic"), "backend='fast' has no generic kernel"),
])
def test_api_fast_backend_refuses_what_it_cannot_do(kw, words):
    q, k, v = ex.bf16_inputs(1, 512, 1, 64, 8.0, seed=3)
    with pytest.raises(ValueError, match=words):
        fa_lab.flash_attn_func(q, k, v, backend="fast", **kw)
    with pytest.raises(ValueError, match="records no trace"):
        fa_lab.trace(q, k, v, rows=[0], backend="fast")


@pytest.mark.gpu
@pytest.mark.parametrize("k_scale", [32, 64])
def test_gpu_api_fast_and_model_agree_on_nan_under_lazy_unfixed(k_scale):
    # the seed's inputs at its K scales. A fast kernel's own tiling moves the NaN onset, so
    # the fractions of bad rows are compared, at a tiling that votes every 64 columns as
    # the model does; the API's default (on Hopper the Gluon kernel, 128 columns per vote)
    # is the fast kernel's own default
    q, k, v = ex.bf16_inputs(1, 4096, 4, 128, k_scale, seed=0, device="cuda")
    api = nonfinite_rows(fa_lab.flash_attn_func(q, k, v, causal=False, rescale="lazy_unfixed",
                                                backend="fast"))
    own, _ = fast_bf16.forward(q, k, v, causal=False, policy=bf16_policy("lazy_unfixed"))
    assert torch.equal(api, nonfinite_rows(own))
    frac = {"emulator": nonfinite_rows(fa_lab.flash_attn_func(
        q, k, v, causal=False, rescale="lazy_unfixed", backend="emulator")).float().mean().item()}
    per64, _ = fast_bf16.forward(q, k, v, causal=False, policy=bf16_policy("lazy_unfixed"),
                                 config=Config(128, 64, 8, 4, True))
    frac["fast, 64 columns per vote"] = nonfinite_rows(per64).float().mean().item()
    assert frac["emulator"] > 0 and abs(frac["fast, 64 columns per vote"] - frac["emulator"]) < 0.02, frac
    for pol in ("lazy", "eager"):
        out = fa_lab.flash_attn_func(q, k, v, causal=False, rescale=pol, backend="fast")
        assert torch.isfinite(out.float()).all()
