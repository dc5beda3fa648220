"""The Gluon Hopper kernel (fa_lab.kernels.swp_bf16.hopper).

On CPU: it compiles for sm_90 with the installed Triton (no GPU needed: Gluon has no
interpreter, so this is what CI can check) into warp-specialised code that uses wgmma,
TMA and mbarriers; its configurations and entry points refuse bad input. On a Hopper GPU
(marked ``gpu``): agreement with the fp32 reference for every policy, tiling and grid
(a persistent grid on a few programs walks many work items through one ring), and the same
NaN rows as the Triton kernel at the same tiling under the unfixed rebase.
"""

import re

import pytest
import torch
import triton

from _shared import check_against_reference
from fa_lab import experiments as ex
from fa_lab import policies, reference
from fa_lab.metrics import rel_l2
from fa_lab.models import swp_fp8
from fa_lab.kernels._gluon import hopper as gluon_hopper
from fa_lab.kernels._triton.fast import Config
from fa_lab.kernels.swp_bf16 import fast, hopper
from fa_lab.kernels.swp_bf16.hopper import HopperConfig
from fa_lab.kernels.swp_fp8 import fast as fast_fp8
from fa_lab.kernels.swp_fp8 import hopper as hopper_fp8

BF16 = torch.bfloat16


def pol(name, **kw):
    return policies.resolve(fp8=False, seqlen_kv=1, rescale=name, **kw)


def fp8_pol(name, **kw):
    return policies.resolve(fp8=True, seqlen_kv=1, rescale=name, **kw)


def compile_sm90(causal: bool, lazy: bool, head_dim: int, config=HopperConfig(), fp8=False,
                 saturate=True):
    """PTX of ``_attn_fwd`` compiled for sm_90 without a GPU (bf16, or fp8 with its
    transposed V)."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    if fp8:
        q = torch.empty(1, 256, 2, head_dim, dtype=torch.float8_e4m3fn)
        vt = torch.empty(1, 2, head_dim, 256, dtype=torch.float8_e4m3fn)
        _, args, meta, _, _ = hopper_fp8.launch_args(
            q, q, vt, causal, fp8_pol("lazy" if lazy else "eager"), config, q_descale=1.0,
            k_descale=1.0, v_descale=1.0, saturate=saturate, num_sms=132)
    else:
        q = torch.empty(1, 256, 2, head_dim, dtype=BF16)
        _, args, meta, _, _ = hopper.launch_args(q, q, q, causal, pol("lazy" if lazy else "eager"),
                                                 config, num_sms=132)
    fn = gluon_hopper._attn_fwd
    ints = {n if isinstance(n, str) else fn.arg_names[n] for n in fn.do_not_specialize}
    sig = {n: ("i32" if n in ints else mangle_type(a)) for n, a in zip(fn.arg_names, args)}
    constants = dict(meta)
    for n, a in zip(fn.arg_names, args):
        if a is None:  # fp8 stores O without a descriptor
            sig[n] = "constexpr"
            constants[n] = None
    sig.update({n: "constexpr" for n in meta})
    src = GluonASTSource(fn, sig, constants)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4)).asm["ptx"]


@pytest.mark.parametrize("causal, lazy, head_dim", [(False, True, 128), (True, False, 64)])
def test_compiles_for_sm90_into_a_warp_specialised_wgmma_kernel(causal, lazy, head_dim):
    ptx = compile_sm90(causal, lazy, head_dim)
    assert "wgmma.mma_async" in ptx            # tensor cores through wgmma
    assert "cp.async.bulk.tensor" in ptx       # TMA loads
    assert "mbarrier.try_wait" in ptx          # the ring's barriers
    assert "setmaxnreg.dec" in ptx and "setmaxnreg.inc" in ptx  # loader gives registers away
    # two consumer warpgroups and a loader warp (newer Triton pads the loader's group)
    assert int(re.search(r"\.reqntid (\d+)", ptx).group(1)) in (288, 384)


def test_the_lazy_vote_is_one_barrier_reduction_per_wave_and_adds_no_partition_barrier():
    """Lazy differs from eager by a bar.red.or over each wave's 64 threads (in each of
    the two consumers' two KV loops, full tiles and masked tiles), on the four named
    barriers from WAVE_BARRIER on, and by no bar.sync of its own (no shared-memory
    reduction)."""
    for causal in (False, True):
        lazy, eager = (compile_sm90(causal, lz, 128) for lz in (True, False))
        assert "bar.red" not in eager
        assert len(re.findall(r"bar\.red\.or\.pred \w+, %r\d+, 64, \w+;", lazy)) == 4
        assert lazy.count("bar.sync") == eager.count("bar.sync")
    assert hopper.WAVE_BARRIER + 3 <= 15  # the hardware has 16 named barriers


@pytest.mark.parametrize("config, exc, words", [
    (HopperConfig(block_n=96), ValueError, "block_n must be 64 or 128"),
    (HopperConfig(stages=1), ValueError, "stages must be an int in 2..4"),
    (HopperConfig(stages=True), ValueError, "stages must be an int"),
    (HopperConfig(pingpong=1), TypeError, "pingpong must be a bool"),
    (HopperConfig(persistent="yes"), TypeError, "persistent must be a bool"),
])
def test_hopper_config_refuses_bad_fields(config, exc, words):
    with pytest.raises(exc, match=words):
        config.check()


def test_launch_args_refuse_a_float_tile_and_an_empty_persistent_grid():
    q = torch.zeros(1, 64, 2, 128, dtype=BF16)
    with pytest.raises(ValueError, match=r"block_n must be 64 or 128 \(an int\), got 128.0"):
        hopper.launch_args(q, q, q, False, pol("lazy"), HopperConfig(block_n=128.0), num_sms=4)
    with pytest.raises(ValueError, match="persistent HopperConfig needs num_sms >= 1"):
        hopper.launch_args(q, q, q, False, pol("lazy"), HopperConfig(persistent=True))


def test_tma_inputs_are_aligned_and_their_descriptors_take_strides_from_the_shape():
    flat = torch.arange(1 + 64 * 2 * 128, dtype=torch.float32).to(BF16)
    q = flat[1:].view(1, 64, 2, 128)            # contiguous, 2 bytes off a 16-byte boundary
    assert q.is_contiguous() and q.data_ptr() % 16 == 2
    ready = gluon_hopper.tma_ready(q)
    assert ready.data_ptr() % 16 == 0 and torch.equal(ready, q)
    odd = torch.zeros(64 * 256, dtype=BF16).as_strided((1, 64, 256), (7, 256, 1))
    assert odd.is_contiguous()                  # a size-1 dimension may carry any stride
    assert list(gluon_hopper.descriptor(odd, [1, 64, 128]).strides) == [64 * 256, 256, 1]


def test_hopper_config_refuses_a_ring_larger_than_shared_memory():
    HopperConfig(128, 3).check(128)
    HopperConfig(128, 4).check(64)
    with pytest.raises(ValueError, match=r"stages=4\) needs 295936 bytes"):
        HopperConfig(128, 4).check(128)


def test_entry_points_refuse_what_they_cannot_run():
    q = torch.zeros(1, 64, 2, 128, dtype=BF16)
    ok = dict(causal=False, policy=pol("lazy"))
    with pytest.raises(TypeError, match="config must be a HopperConfig"):
        hopper.forward(q, q, q, **ok, config=Config(128, 64, 8, 2, False))
    with pytest.raises(ValueError, match="Hopper GPU"):
        hopper.forward(q, q, q, **ok)  # CPU tensors (and, here, no GPU)
    with pytest.raises(ValueError, match="no interpreter"):
        fast.forward(q, q, q, **ok, interpret=True, config=HopperConfig())
    with pytest.raises(ValueError, match="rebase='capped'"):
        hopper.forward(q, q, q, causal=False, policy=pol("lazy_capped"))
    with pytest.raises(ValueError, match="block_n must be 64 or 128"):
        hopper.forward(q, q, q, **ok, config=HopperConfig(block_n=32))


@pytest.mark.parametrize("causal, lazy, saturate", [(False, True, True), (True, False, False)])
def test_fp8_compiles_for_sm90_into_e4m3_wgmma_with_a_saturating_p_cast(causal, lazy, saturate):
    """fp8 through the same schedule: e4m3 x e4m3 wgmma for both products (V read
    transposed, so both operands are K-major), P cast with satfinite (without saturation
    the kernel turns a P past 448 into NaN first), the wave vote when lazy."""
    ptx = compile_sm90(causal, lazy, 128, fp8=True, saturate=saturate)
    mmas = re.findall(r"wgmma\.mma_async\.sync\.aligned\.(\S+)", ptx)
    assert mmas and set(mmas) == {"m64n128k32.f32.e4m3.e4m3"}
    assert "cvt.rn.satfinite.e4m3x2.f32" in ptx
    assert ("bar.red.or.pred" in ptx) == lazy
    assert "cp.async.bulk.tensor" in ptx and "setmaxnreg.inc" in ptx


def test_fp8_entry_points_refuse_what_they_cannot_run():
    q8 = torch.zeros(1, 64, 2, 128).to(torch.float8_e4m3fn)
    vt = torch.zeros(1, 2, 128, 64).to(torch.float8_e4m3fn)
    ok = dict(q_descale=1.0, k_descale=1.0, v_descale=1.0, causal=False, policy=fp8_pol("lazy"))
    with pytest.raises(ValueError, match="votes every 128 columns: HopperConfig.block_n must be 128"):
        hopper_fp8.launch_args(q8, q8, vt, False, fp8_pol("lazy"), HopperConfig(block_n=64),
                               q_descale=1.0, k_descale=1.0, v_descale=1.0, saturate=True)
    with pytest.raises(ValueError, match="no interpreter"):
        fast_fp8.forward(q8, q8, q8, **ok, interpret=True, config=HopperConfig())
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        fast_fp8.forward(q8, q8, q8, **ok, config=HopperConfig())
    with pytest.raises(ValueError, match="stages must be an int in 2..4"):
        fast_fp8.forward(q8, q8, q8, **ok, config=HopperConfig(stages=5))


def test_fp8_ring_holds_twice_the_tiles_of_bf16():
    """One byte per element: four stages of 128-column K and V tiles fit at D128 in fp8,
    not in bf16."""
    HopperConfig(128, 4).check(128, elem_bytes=1)
    with pytest.raises(ValueError, match="needs 295936 bytes"):
        HopperConfig(128, 4).check(128)


# ---- on a Hopper GPU -------------------------------------------------------------------

GPU_CASES = [  # (B, Sq, Skv, H, Hkv, D, causal)
    (2, 300, 517, 4, 2, 128, True),    # Skv > Sq, ragged tiles, GQA
    (2, 517, 300, 4, 1, 64, True),     # Sq > Skv: top rows see no key (0, -inf), MQA
    (1, 1000, 1000, 2, 2, 128, False),
]
GPU_CONFIGS = [(HopperConfig(128, 2, True, False), 0), (HopperConfig(128, 2, False, True), 3),
               (HopperConfig(64, 3, True, True), 5)]


@pytest.mark.gpu
@pytest.mark.parametrize("config, sms", GPU_CONFIGS, ids=lambda c: getattr(c, "describe", str)(c))
@pytest.mark.parametrize("case", GPU_CASES, ids=str)
@pytest.mark.parametrize("policy", ["eager", "lazy", "lazy_unfixed"])
def test_gpu_matches_reference(gen, policy, case, config, sms):
    B, Sq, Skv, H, Hkv, D, causal = case
    q = torch.randn(B, Sq, H, D, generator=gen).to(BF16).cuda()
    k = torch.randn(B, Skv, Hkv, D, generator=gen).to(BF16).cuda()
    v = torch.randn(B, Skv, Hkv, D, generator=gen).to(BF16).cuda()
    # sms > 0: a persistent grid of that many programs, each walking many work items
    grid, args, meta, out, lse = hopper.launch_args(q, k, v, causal, pol(policy), config, sms)
    gluon_hopper.launch(grid, args, meta, q.device)
    check_against_reference(out, lse, q, k, v, causal)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("k_scale", [32, 64])
def test_gpu_same_nan_rows_as_the_triton_kernel_at_the_same_tiling(k_scale, causal):
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 2048, 8, 128, generator=g).to(BF16).cuda()
    k = (torch.randn(2, 2048, 8, 128, generator=g) * k_scale).to(BF16).cuda()
    v = torch.randn(2, 2048, 8, 128, generator=g).to(BF16).cuda()
    for block_n in (64, 128):
        bad = [~torch.isfinite(fast.forward(q, k, v, causal=causal, policy=pol("lazy_unfixed"),
                                            config=c)[0].float()).all(-1)
               for c in (HopperConfig(block_n, 2, True, True), Config(128, block_n, 8, 2, True))]
        assert bad[0].any() and torch.equal(bad[0], bad[1])
    fixed, _ = fast.forward(q, k, v, causal=causal, policy=pol("lazy"), config=HopperConfig())
    assert torch.isfinite(fixed.float()).all()


@pytest.mark.gpu
def test_gpu_fast_forward_picks_gluon_at_d128_and_triton_at_d64(gen):
    if not hopper.available():
        pytest.skip("needs a Hopper GPU")
    for D, kind in ((128, HopperConfig), (64, Config)):
        q = torch.randn(1, 512, 4, D, generator=gen).to(BF16).cuda()
        out, lse = fast.forward(q, q, q, causal=True, policy=pol("lazy"))
        assert isinstance(fast.best_config(q, q, True, True), kind)
        assert fast.tuning_timings(True)  # the pick's measurements are on record
        check_against_reference(out, lse, q, q, q, True)


# ---- fp8 on a Hopper GPU ---------------------------------------------------------------

FP8_CASES = [("eager", {}), ("lazy", {"p_headroom": True}), ("lazy_unfixed", {}),
             ("lazy_capped", {"rebase_bound": 8.0})]
FP8_LAUNCHES = [(HopperConfig(128, 2, True, False), 0), (HopperConfig(128, 3, False, True), 3)]


@pytest.mark.gpu
@pytest.mark.parametrize("config, sms", FP8_LAUNCHES, ids=lambda c: getattr(c, "describe", str)(c))
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("name, kw", FP8_CASES)
def test_gpu_fp8_matches_model(name, kw, causal, config, sms):
    """The seed's fp8 inputs (V = ones) at k x5000, where the unfixed rule overflows: the
    kernel decides per 128 columns as the model does per pair of 64-column tiles, so the
    same elements are non-finite, and the finite ones agree up to the GPU's approximate
    exp2 landing a P one e4m3 step away (the bounds of test_kernel_fast's fp8 test)."""
    (q8, k8, v8), (qd, kd, vd) = ex.fp8_inputs(1, 2000, 2, 5000, seed=0, device="cuda")
    pol = fp8_pol(name, **kw)
    vt = fast_fp8.transpose_v(v8)
    # sms > 0: a persistent grid of that many programs, each walking many work items
    grid, args, meta, out, _ = hopper_fp8.launch_args(
        q8, k8, vt, causal, pol, config, q_descale=qd, k_descale=kd, v_descale=vd,
        saturate=True, num_sms=sms)
    gluon_hopper.launch(grid, args, meta, q8.device)
    m_out, _ = swp_fp8.forward(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd,
                               causal=causal, policy=pol)
    bad, m_bad = ~torch.isfinite(out.float()), ~torch.isfinite(m_out.float())
    assert (bad != m_bad).float().mean() < 1e-3
    assert bool(bad.any()) == (name == "lazy_unfixed")
    diff = (out.float() - m_out.float())[~(bad | m_bad)].abs()
    assert diff.mean() < 2e-3 and diff.max() < 0.13


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_fp8_same_nan_rows_as_the_triton_kernel(causal):
    (q8, k8, v8), descales = ex.fp8_inputs(2, 2048, 4, 5000, seed=3, device="cuda")
    common = dict(q_descale=descales[0], k_descale=descales[1], v_descale=descales[2],
                  causal=causal, policy=fp8_pol("lazy_unfixed"))
    bad = [~torch.isfinite(fast_fp8.forward(q8, k8, v8, config=c, **common)[0].float()).all(-1)
           for c in (HopperConfig(), Config(128, 128, 8, 3, False))]
    assert bad[0].any() and torch.equal(bad[0], bad[1])


@pytest.mark.gpu
@pytest.mark.parametrize("saturate", [True, False])
@pytest.mark.parametrize("policy", ["eager", "lazy"])
def test_gpu_fp8_matches_reference_on_ragged_gqa_batches(gen, policy, saturate):
    """Random V, B2, Skv > Sq (ragged last tiles, a V^T padded past Skv), GQA, causal:
    against fp32 attention of the same fp8 inputs, lse included."""
    q, k, v = (torch.randn(2, s, h, 128, generator=gen).cuda()
               for s, h in ((300, 4), (517, 2), (517, 2)))
    (q8, qd), (k8, kd), (v8, vd) = (ex.quantize_e4m3(x) for x in (q, k, v))
    out, lse = fast_fp8.forward(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd,
                                causal=True, policy=fp8_pol(policy), saturate=saturate,
                                config=HopperConfig(128, 2, True, True))
    ref, ref_lse = reference.attention(q8, k8, v8, causal=True, q_descale=qd, k_descale=kd,
                                       v_descale=vd)
    assert rel_l2(out, ref) < 0.05  # e4m3 P has 3 mantissa bits
    fin = torch.isfinite(ref_lse)
    assert torch.equal(fin, torch.isfinite(lse)) and torch.allclose(lse[fin], ref_lse[fin], atol=2e-2)


@pytest.mark.gpu
def test_gpu_fast_fp8_forward_picks_the_gluon_kernel(gen):
    if not hopper.available():
        pytest.skip("needs a Hopper GPU")
    (q8, qd), (k8, kd), (v8, vd) = (ex.quantize_e4m3(torch.randn(1, 512, 4, 128, generator=gen).cuda())
                                    for _ in range(3))
    out, lse = fast_fp8.forward(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd,
                                causal=True, policy=fp8_pol("lazy"))
    assert isinstance(fast_fp8.best_config(q8, k8, True, True), HopperConfig)
    assert fast_fp8.tuning_timings(True)
    ref, _ = reference.attention(q8, k8, v8, causal=True, q_descale=qd, k_descale=kd, v_descale=vd)
    assert rel_l2(out, ref) < 0.05
