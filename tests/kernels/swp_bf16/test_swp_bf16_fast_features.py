"""Split-K and varlen in the fast bf16 kernel (fa_lab.kernels.swp_bf16.fast, .splitk, .varlen).

On CPU through Triton's interpreter (small shapes): split-K and varlen against the fp32
reference for eager and lazy, split-K against the model's split-K (the same split
boundaries: LSE to fp32 rounding), one split and all-but-one-empty splits identical to the
dense kernel, empty splits contributing nothing, varlen identical to the dense kernel run
once per sequence (equal and ragged lengths, empty sequences, TMA and plain loads), and
the argument checks. The compiled kernels are checked the same way on a GPU (``gpu``).
"""

import itertools

import pytest
import torch
from _shared import check_against_reference

from fa_lab.studies import experiments as ex
from fa_lab import policies, reference, varlen
from fa_lab.kernels._triton.fast import Config
from fa_lab.kernels.swp_bf16 import fast as fast_bf16
from fa_lab.kernels.swp_bf16 import splitk as fast_bf16_splitk
from fa_lab.metrics import rel_l2
from fa_lab.kernels.swp_bf16 import model as swp_bf16

BF16 = torch.bfloat16
SMALL = Config(64, 64, 4, 1, False)  # the interpreter's default tiles
SMALL_TMA = Config(64, 64, 4, 1, True)


def pol(name, **kw):
    return policies.resolve(fp8=False, seqlen_kv=1, rescale=name, **kw)


def randn(gen, *shape, scale=1.0, device="cpu"):
    return (torch.randn(shape, generator=gen) * scale).to(BF16).to(device)


def same(a, b):
    """Bit-for-bit, NaN where NaN."""
    return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())


# ---- split-K on the interpreter ----------------------------------------------------------

def test_split_columns_are_the_models_ranges_per_256_row_block():
    """Causal Sq 384, Skv 640: the first block has N = 8 tiles (cut at its diagonal), one
    split of 8 and an empty one; the second N = 10: 6 + 4."""
    cols = fast_bf16_splitk.split_columns(384, 640, True, 2)
    assert cols == [[(0, 512), (384, 384)], [(0, 384), (384, 640)]]
    for n, blocks in ((700, 3), (4096, 8)):
        got = fast_bf16_splitk.split_columns(300, n, False, blocks)
        tiles = -(-n // 64)
        want = [(a * 64, b * 64) for a, b in swp_bf16.split_ranges(tiles + tiles % 2, blocks)]
        assert got == [want] * 2


@pytest.mark.parametrize("policy", ["eager", "lazy"])
@pytest.mark.parametrize("causal, sq, skv, splits", [
    (False, 300, 700, 2),   # 12 tiles: 6 + 6; ragged ends in q and kv
    (False, 100, 1000, 3),  # 16 tiles: 6 + 6 + 4
    (True, 384, 640, 2),    # per-block ranges differ (see above); GQA below
])
def test_split_k_matches_reference_and_model(gen, policy, causal, sq, skv, splits):
    q = randn(gen, 1, sq, 2, 64)
    k, v = randn(gen, 1, skv, 1, 64), randn(gen, 1, skv, 1, 64)
    p = pol(policy)
    out, lse = fast_bf16.forward(q, k, v, causal=causal, policy=p, interpret=True,
                                 num_kv_splits=splits)
    assert out.dtype == BF16 and out.shape == q.shape and lse.shape == (1, 2, sq)
    check_against_reference(out, lse, q, k, v, causal)
    m_out, m_lse = swp_bf16.forward(q, k, v, causal=causal, policy=p, num_kv_splits=splits)
    fin = torch.isfinite(m_lse)
    assert torch.equal(torch.isfinite(lse), fin)
    # the same split boundaries and combine: the LSE agrees to fp32 summation order
    assert torch.allclose(lse[fin], m_lse[fin], atol=1e-4, rtol=0)
    assert (out.float() - m_out.float()).abs().max() < 0.02


def test_one_split_is_the_dense_kernel(gen):
    q, k, v = randn(gen, 1, 130, 2, 64), randn(gen, 1, 900, 2, 64), randn(gen, 1, 900, 2, 64)
    dense = fast_bf16.forward(q, k, v, causal=True, policy=pol("lazy"), interpret=True)
    one = fast_bf16.forward(q, k, v, causal=True, policy=pol("lazy"), interpret=True,
                            num_kv_splits=1)
    assert all(torch.equal(a, b) for a, b in zip(dense, one))


@pytest.mark.parametrize("causal", [False, True])
def test_a_single_nonempty_split_is_bitwise_dense(gen, causal):
    """N = 8 tiles in 2 splits: split 0 takes all 8 (the 2-tile remainder joins it), split 1
    is empty. The combine then gives out = round(l O_0 / l) = O_0 and the same LSE."""
    q, k, v = randn(gen, 1, 200, 1, 64), randn(gen, 1, 500, 1, 64), randn(gen, 1, 500, 1, 64)
    assert fast_bf16_splitk.split_columns(200, 500, causal, 2)[0][1] == (384, 384)
    dense = fast_bf16.forward(q, k, v, causal=causal, policy=pol("lazy"), interpret=True)
    split = fast_bf16.forward(q, k, v, causal=causal, policy=pol("lazy"), interpret=True,
                              num_kv_splits=2)
    assert torch.equal(dense[0], split[0]) and torch.equal(dense[1], split[1])


def test_empty_splits_contribute_nothing(gen):
    """12 tiles: 2 splits are 6 + 6; 4 splits are 6 + 6 + two empty ones (m -1e30, l 0)."""
    assert fast_bf16_splitk.split_columns(64, 768, False, 4) == [[(0, 384), (384, 768), (768, 768),
                                                                  (1152, 1152)]]
    q, k, v = randn(gen, 1, 64, 1, 64), randn(gen, 1, 768, 1, 64), randn(gen, 1, 768, 1, 64)
    two = fast_bf16.forward(q, k, v, causal=False, policy=pol("eager"), interpret=True, num_kv_splits=2)
    four = fast_bf16.forward(q, k, v, causal=False, policy=pol("eager"), interpret=True, num_kv_splits=4)
    assert torch.equal(two[0], four[0]) and torch.equal(two[1], four[1])


@pytest.mark.slow
def test_split_k_policy_semantics():
    """Each split runs the policy from its own first tile: threshold 0 is still exactly
    eager; the unfixed rebase still drags rows to non-finite where lazy and eager do not."""
    q, k, v = ex.bf16_inputs(1, 768, 1, 64, 64, seed=0)
    run = lambda p: fast_bf16.forward(q, k, v, causal=False, policy=p, interpret=True,  # noqa: E731
                                      num_kv_splits=2)[0]
    eager = run(pol("eager"))
    assert torch.equal(run(pol("lazy", rescale_threshold=0.0)), eager)
    assert (~torch.isfinite(run(pol("lazy_unfixed")).float())).any(-1).float().mean() > 0.05
    ref, _ = reference.attention(q, k, v, causal=False)
    for out in (eager, run(pol("lazy"))):
        assert torch.isfinite(out.float()).all()
        assert rel_l2(out, ref) < 2.5e-2  # |scores| ~600 in log2 units: Q's rounding dominates


# ---- varlen on the interpreter -------------------------------------------------------------

def packed(gen, lens_q, lens_k, H=4, Hkv=2, D=64, device="cpu"):
    cu_q = torch.tensor([0, *itertools.accumulate(lens_q)], dtype=torch.int32, device=device)
    cu_k = torch.tensor([0, *itertools.accumulate(lens_k)], dtype=torch.int32, device=device)
    q = randn(gen, sum(lens_q), H, D, device=device)
    k, v = randn(gen, sum(lens_k), Hkv, D, device=device), randn(gen, sum(lens_k), Hkv, D, device=device)
    return q, k, v, cu_q, cu_k


def per_sequence(q, k, v, cu_q, cu_k, max_q, max_k, **kw):
    """The dense kernel once per sequence, packed as fa_lab.varlen packs it."""
    packing = varlen.check(q, k, cu_q, cu_k, max_q, max_k)
    return varlen.run(packing, q, k, v, lambda a, b, c: fast_bf16.forward(a, b, c, **kw))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("policy", ["eager", "lazy"])
def test_varlen_is_the_dense_kernel_per_sequence(gen, policy, causal):
    """Ragged lengths, Sq != Skv, a sequence without queries and one without keys: bit for
    bit the dense kernel's per-sequence results, and the reference's."""
    lens_q, lens_k = [100, 0, 150, 64, 30], [130, 5, 70, 64, 0]
    q, k, v, cu_q, cu_k = packed(gen, lens_q, lens_k)
    kw = dict(causal=causal, policy=pol(policy), interpret=True)
    out, lse = fast_bf16.forward_varlen(q, k, v, cu_q, cu_k, 150, 130, **kw)
    assert out.shape == q.shape and lse.shape == (5, 4, 150) and lse.dtype == torch.float32
    want, want_lse = per_sequence(q, k, v, cu_q, cu_k, 150, 130, **kw)
    assert same(out, want) and same(lse, want_lse)
    for b in range(5):
        q0, q1, k0, k1 = (int(x) for x in (cu_q[b], cu_q[b + 1], cu_k[b], cu_k[b + 1]))
        assert (lse[b, :, q1 - q0:] == float("-inf")).all()  # padding past the sequence
        if q1 > q0 and k1 > k0:
            check_against_reference(out[None, q0:q1], lse[None, b, :, :q1 - q0], q[None, q0:q1],
                            k[None, k0:k1], v[None, k0:k1], causal)
    assert (out[sum(lens_q[:4]):] == 0).all()  # no keys: out 0


def test_varlen_with_equal_lengths_is_the_dense_batch(gen):
    q, k, v = randn(gen, 3, 96, 2, 64), randn(gen, 3, 96, 2, 64), randn(gen, 3, 96, 2, 64)
    kw = dict(causal=True, policy=pol("lazy"), interpret=True)
    dense, dense_lse = fast_bf16.forward(q, k, v, **kw)
    cu = torch.arange(0, 4 * 96, 96, dtype=torch.int32)
    out, lse = fast_bf16.forward_varlen(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu, cu,
                                        96, None, **kw)
    assert torch.equal(out, dense.flatten(0, 1)) and torch.equal(lse, dense_lse)


def test_varlen_tma_and_plain_loads_agree(gen):
    """TMA views K and V as [total_kv, Hkv * D]: a ragged last tile reads the next
    sequence's rows, which must not leak even when they hold inf."""
    q, k, v, cu_q, cu_k = packed(gen, [90, 70], [100, 80], H=2, Hkv=2)
    v[100:140] = float("inf")  # what sequence 0's last tile reads past its end
    kw = dict(causal=True, policy=pol("lazy"), interpret=True)
    plain = fast_bf16.forward_varlen(q, k, v, cu_q, cu_k, 90, 100, config=SMALL, **kw)
    tma = fast_bf16.forward_varlen(q, k, v, cu_q, cu_k, 90, 100, config=SMALL_TMA, **kw)
    assert torch.isfinite(tma[0][:90].float()).all()
    assert same(tma[0], plain[0]) and same(tma[1], plain[1])


# ---- bad input -------------------------------------------------------------------------------

Q = torch.zeros(1, 64, 2, 64, dtype=BF16)


@pytest.mark.parametrize("kw, exc, words", [
    ({"num_kv_splits": 0}, ValueError, "num_kv_splits must be >= 1"),
    ({"num_kv_splits": 2.0}, TypeError, "num_kv_splits must be an int"),
    ({"num_kv_splits": True}, TypeError, "num_kv_splits must be an int"),
    ({"num_kv_splits": 2, "config": Config(64, 256, 4, 1, False)}, ValueError, "config.block_n"),
    ({"num_kv_splits": 2, "config": Config(96, 64, 4, 1, False)}, ValueError, "config.block_m"),
])
def test_split_k_bad_input(kw, exc, words):
    with pytest.raises(exc, match=words):
        fast_bf16.forward(Q, Q, Q, causal=False, policy=pol("lazy"), interpret=True, **kw)


def I32(*x):
    return torch.tensor(x, dtype=torch.int32)


P = torch.zeros(30, 2, 64, dtype=BF16)
CU = I32(0, 10, 30)  # two sequences of 10 and 20 tokens
OK = (P, P, P, CU, CU, 20)


@pytest.mark.parametrize("args, kw, exc, words", [
    ((P, P, P, I32(0, 20, 10, 30), I32(0, 10, 20, 30), 20), {}, ValueError,
     "cu_seqlens_q must be non-decreasing"),
    ((P, P, P, CU, I32(0, 20, 10, 30), 20), {}, ValueError, "cu_seqlens_kv must be non-decreasing"),
    ((P, P, P, torch.tensor([0, 10, 30]), CU, 20), {}, ValueError, "cu_seqlens_q must be an int32"),
    ((P, P, P, [0, 10, 30], CU, 20), {}, TypeError, "cu_seqlens_q must be a torch.Tensor"),
    ((P, P, P, None, CU, 20), {}, ValueError, "cu_seqlens_q is required"),
    ((P, P, P, CU, CU, 19), {}, ValueError, "max_seqlen_q=19 is shorter"),
    ((P, P, P, CU, CU, 20.0), {}, TypeError, "max_seqlen_q must be an int"),
    ((P.float(), P, P, CU, CU, 20), {}, TypeError, "q has dtype"),
    ((P, P.half(), P.half(), CU, CU, 20), {}, TypeError, "k has dtype"),
    ((P[None], P, P, CU, CU, 20), {}, ValueError, "varlen q must be packed"),
    ((P, P, P[:, :1], CU, CU, 20), {}, ValueError, "same shape"),
    (OK, {"causal": None}, TypeError, "causal must be a bool"),
    (OK, {"policy": "lazy"}, TypeError, "policy must be"),
    (OK, {"interpret": False}, ValueError, "needs CUDA"),
])
def test_varlen_bad_input(args, kw, exc, words):
    kwargs = {"causal": False, "policy": pol("lazy"), "interpret": True, **kw}
    with pytest.raises(exc, match=words):
        fast_bf16.forward_varlen(*args, **kwargs)


# ---- compiled kernels on a GPU ---------------------------------------------------------------

# plain loads / TMA (the autotuned path: test_gpu_split_k_long_kv_and_empty_splits and
# test_gpu_varlen_autotuned_matches_reference)
GPU_CONFIGS = [fast_bf16.CONFIGS[0], Config(128, 128, 8, 2, True)]


def describe(c):
    return c.describe()


@pytest.mark.gpu
@pytest.mark.parametrize("config", GPU_CONFIGS, ids=describe)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("policy", ["eager", "lazy"])
def test_gpu_split_k_matches_reference_and_model(gen, policy, causal, config):
    q = randn(gen, 2, 700, 4, 128, device="cuda")
    k, v = randn(gen, 2, 3000, 2, 128, device="cuda"), randn(gen, 2, 3000, 2, 128, device="cuda")
    p = pol(policy)
    out, lse = fast_bf16.forward(q, k, v, causal=causal, policy=p, config=config, num_kv_splits=3)
    check_against_reference(out, lse, q, k, v, causal)
    _, m_lse = swp_bf16.forward(q, k, v, causal=causal, policy=p, num_kv_splits=3)
    fin = torch.isfinite(m_lse)
    assert torch.equal(torch.isfinite(lse), fin)
    assert torch.allclose(lse[fin], m_lse[fin], atol=2e-3, rtol=0)  # GPU exp2 is approximate


@pytest.mark.gpu
def test_gpu_split_k_long_kv_and_empty_splits(gen):
    """The benchmark's kind of shape (short Sq, long Skv), every split count it times, and
    a count with empty splits."""
    q = randn(gen, 1, 512, 4, 128, device="cuda")
    k, v = randn(gen, 1, 16384, 4, 128, device="cuda"), randn(gen, 1, 16384, 4, 128, device="cuda")
    for splits in (2, 4, 8, 64):
        out, lse = fast_bf16.forward(q, k, v, causal=False, policy=pol("lazy"), num_kv_splits=splits)
        check_against_reference(out, lse, q, k, v, False)


@pytest.mark.gpu
def test_gpu_split_k_unfixed_still_drags():
    q, k, v = ex.bf16_inputs(1, 4096, 4, 128, 64, seed=0, device="cuda")
    outs = {p: fast_bf16.forward(q, k, v, causal=False, policy=pol(p), num_kv_splits=4)[0]
            for p in ("lazy_unfixed", "lazy", "eager")}
    assert (~torch.isfinite(outs["lazy_unfixed"].float())).any(-1).float().mean() > 0.05
    assert torch.isfinite(outs["lazy"].float()).all() and torch.isfinite(outs["eager"].float()).all()


@pytest.mark.gpu
@pytest.mark.parametrize("config", GPU_CONFIGS, ids=describe)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("policy", ["eager", "lazy"])
def test_gpu_varlen_is_the_dense_kernel_per_sequence(gen, policy, causal, config):
    lens_q, lens_k = [1000, 0, 1500, 640, 300], [1300, 50, 700, 640, 0]
    q, k, v, cu_q, cu_k = packed(gen, lens_q, lens_k, H=4, Hkv=2, D=128, device="cuda")
    kw = dict(causal=causal, policy=pol(policy), config=config)
    out, lse = fast_bf16.forward_varlen(q, k, v, cu_q, cu_k, 1500, 1300, **kw)
    want, want_lse = per_sequence(q, k, v, cu_q, cu_k, 1500, 1300, **kw)
    # the same walk in two compiled binaries: bit for bit unless the compiler contracts a
    # multiply-add differently in one of them (then within an ulp)
    assert torch.equal(out.isnan(), want.isnan()) and torch.equal(lse.isinf(), want_lse.isinf())
    assert (out.float() - want.float()).abs().max() <= 2**-7 * want.float().abs().max()
    fin = torch.isfinite(want_lse)
    assert torch.allclose(lse[fin], want_lse[fin], atol=1e-5, rtol=0)
    for b in range(5):
        q0, q1, k0, k1 = (int(x) for x in (cu_q[b], cu_q[b + 1], cu_k[b], cu_k[b + 1]))
        if q1 > q0 and k1 > k0:
            check_against_reference(out[None, q0:q1], lse[None, b, :, :q1 - q0], q[None, q0:q1],
                            k[None, k0:k1], v[None, k0:k1], causal)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_varlen_autotuned_matches_reference(gen, causal):
    lens = [1111, 2048, 333, 4000]
    q, k, v, cu, _ = packed(gen, lens, lens, H=4, Hkv=4, D=128, device="cuda")
    out, lse = fast_bf16.forward_varlen(q, k, v, cu, cu, 4000, None, causal=causal, policy=pol("lazy"))
    for b in range(4):
        s0, s1 = int(cu[b]), int(cu[b + 1])
        check_against_reference(out[None, s0:s1], lse[None, b, :, :s1 - s0], q[None, s0:s1], k[None, s0:s1],
                        v[None, s0:s1], causal)
