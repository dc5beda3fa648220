"""The Gluon Hopper kernel (fa_lab.kernels.swp_bf16.hopper).

On CPU: it compiles for sm_90 with the installed Triton (no GPU needed: Gluon has no
interpreter, so this is what CI can check) into warp-specialised code that uses wgmma,
TMA and mbarriers; its configurations and entry points refuse bad input. On a Hopper GPU
(marked ``gpu``): agreement with the fp32 reference for every policy, tiling and grid
(a persistent grid on a few programs walks many work items through one ring), and the same
NaN rows as the Triton kernel at the same tiling under the unfixed rebase.
"""

import re
import types

import pytest
import torch
import triton

from _shared import CappedClock, check_against_reference
from fa_lab import policies, timing
from fa_lab.kernels._triton.fast import Config
from fa_lab.kernels._triton import tuner
from fa_lab.kernels.swp_bf16 import fast, hopper
from fa_lab.kernels.swp_bf16.hopper import HopperConfig

BF16 = torch.bfloat16


def pol(name, **kw):
    return policies.resolve(fp8=False, seqlen_kv=1, rescale=name, **kw)


def compile_sm90(causal: bool, lazy: bool, head_dim: int, config=HopperConfig()):
    """PTX of ``_attn_fwd`` compiled for sm_90 without a GPU."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    q = torch.empty(1, 256, 2, head_dim, dtype=BF16)
    _, args, meta, _, _ = hopper.launch_args(q, q, q, causal, pol("lazy" if lazy else "eager"),
                                             config, num_sms=132)
    fn = hopper._attn_fwd
    ints = {n if isinstance(n, str) else fn.arg_names[n] for n in fn.do_not_specialize}
    sig = {n: ("i32" if n in ints else mangle_type(a)) for n, a in zip(fn.arg_names, args)}
    sig.update({n: "constexpr" for n in meta})
    src = GluonASTSource(fn, sig, dict(meta))
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
    ready = hopper._tma_ready(q)
    assert ready.data_ptr() % 16 == 0 and torch.equal(ready, q)
    odd = torch.zeros(64 * 256, dtype=BF16).as_strided((1, 64, 256), (7, 256, 1))
    assert odd.is_contiguous()                  # a size-1 dimension may carry any stride
    assert list(hopper._descriptor(odd, 64, 128).strides) == [64 * 256, 256, 1]


def test_hopper_config_refuses_a_ring_larger_than_shared_memory():
    HopperConfig(128, 2).check(128)
    HopperConfig(64, 3).check(128)
    HopperConfig(128, 4).check(64)
    # Q and O (2 x 32 KiB) and three K and V slots of 32 KiB each, at D 128
    with pytest.raises(ValueError, match=r"stages=3\) needs 263168 bytes"):
        HopperConfig(128, 3).check(128)


def test_only_a_persistent_grid_asks_a_counter_for_work_and_it_leaves_it_at_zero():
    """A persistent program asks for each further item with one relaxed atomic add; when
    it runs out, it counts itself done (acquire-release), and the last one sets both
    counters back to zero. One program per item needs no atomics at all."""
    ptx = compile_sm90(True, True, 128, HopperConfig(128, 2, True, True))
    assert len(re.findall(r"atom\.global\.gpu\.relaxed\.add", ptx)) == 1
    assert len(re.findall(r"atom\.global\.gpu\.acq_rel\.add", ptx)) == 1
    assert len(re.findall(r"atom\.global\.gpu\.relaxed\.exch", ptx)) == 2
    assert "atom." not in compile_sm90(True, True, 128, HopperConfig(128, 2, True, False))


def test_the_tuner_warms_every_candidate_then_times_them_in_alternation(monkeypatch):
    """``_tune`` on the CPU, with the launch and the CUDA timer replaced by stand-ins on a
    clock that drops by 20 % part way (``CappedClock``). The candidate with the least work
    is listed last: timed one after another it meets the dropped clock alone and loses;
    the tuner calls each candidate once (its compile), then all of them in alternation,
    one call of each per cycle, and picks it."""
    last = hopper.CONFIGS[-1]
    work = {c: 0.97 if c == last else 1.0 for c in hopper.CONFIGS}

    def stand_in(clock, log):
        def run(device, grid, args, meta):
            c, = [c for c in hopper.CONFIGS if (c.pingpong, c.persistent, c.block_n)
                  == (meta["PINGPONG"], meta["PERSISTENT"], meta["BLOCK_N"])]
            log.append(c)
            clock.kernel(work[c])()
        return run

    t_drop = 0.120
    clock, log = CappedClock(t_drop), []
    run = stand_in(clock, log)
    in_turn = {c: timing.measure(lambda c=c: run(None, None, None, dict(
        PINGPONG=c.pingpong, PERSISTENT=c.persistent, BLOCK_N=c.block_n)),
        timing.CpuTimer(now=clock.now), min_calls=tuner.CALLS, min_ms=tuner.MS)[0]
        for c in hopper.CONFIGS}
    assert min(in_turn, key=in_turn.get) != last  # the wrong pick

    clock, log = CappedClock(t_drop), []
    monkeypatch.setattr(hopper, "_run", stand_in(clock, log))
    monkeypatch.setattr(hopper.timing, "CudaTimer", lambda device: timing.CpuTimer(now=clock.now))
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device: types.SimpleNamespace(multi_processor_count=132))
    q = torch.zeros(1, 256, 2, 128, dtype=BF16)
    best, records = hopper._tune(q, q, q, True, pol("lazy"))
    assert clock.t > t_drop  # the drop came during the tuning
    n = len(hopper.CONFIGS)
    assert log[:n] == list(hopper.CONFIGS)  # compiled first
    cycles = [log[i:i + n] for i in range(n, len(log), n)]
    assert all(sorted(map(hopper.CONFIGS.index, c)) == list(range(n)) for c in cycles)
    assert best == last
    assert [r["config"] for r in records] == [c.describe() for c in hopper.CONFIGS]
    assert all(len(r["ms_rounds"]) == tuner.ROUNDS for r in records)
    assert records[-1]["ms"] / records[0]["ms"] == pytest.approx(0.97)


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
    hopper._attn_fwd[grid](*args, **meta, num_warps=4)
    check_against_reference(out, lse, q, k, v, causal)


@pytest.mark.gpu
@pytest.mark.parametrize("pingpong", [True, False])
@pytest.mark.parametrize("B, Sq, H", [(2, 1024, 6), (1, 4096, 6)])
def test_gpu_persistent_grid_takes_every_item_once_and_can_be_launched_again(gen, B, Sq, H,
                                                                             pingpong):
    """Causal items of uneven length on 7 programs: the dynamic hand-out covers every
    item once (each output row matches the reference), and the counters are back at zero
    after each launch, so the same arguments give the same result a second time. 8 query
    blocks x 12 heads make one group of heads; 32 blocks x 6 heads make groups of 4 and 2."""
    D = 128
    q, k, v = (torch.randn(B, Sq, H, D, generator=gen).to(BF16).cuda() for _ in range(3))
    grid, args, meta, out, lse = hopper.launch_args(q, k, v, True, pol("lazy"),
                                                    HopperConfig(128, 2, pingpong, True), 7)
    assert args[8] == min(B * H, hopper.GROUP_ITEMS // (Sq // 128))  # heads per group
    counter = args[5]
    assert grid == (7,) and counter.tolist() == [0, 0]
    outs = []
    for _ in range(2):
        out.fill_(float("nan"))
        lse.fill_(float("nan"))
        hopper._attn_fwd[grid](*args, **meta, num_warps=4)
        assert counter.tolist() == [0, 0]
        check_against_reference(out, lse, q, k, v, True)
        outs.append(out.clone())
    assert torch.equal(outs[0], outs[1])


@pytest.mark.gpu
@pytest.mark.parametrize("policy", ["eager", "lazy"])
def test_gpu_f16_matches_reference(gen, policy):
    """f16 runs through the same code as bf16 (the descriptors and the rounding of Qs, P
    and O follow the input dtype)."""
    B, Sq, Skv, H, Hkv, D, causal = GPU_CASES[0]
    q = torch.randn(B, Sq, H, D, generator=gen).to(torch.float16).cuda()
    k = torch.randn(B, Skv, Hkv, D, generator=gen).to(torch.float16).cuda()
    v = torch.randn(B, Skv, Hkv, D, generator=gen).to(torch.float16).cuda()
    out, lse = hopper.forward(q, k, v, causal=causal, policy=pol(policy), config=HopperConfig())
    assert out.dtype == torch.float16
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
        timings = fast.tuning_timings(True)  # the pick's measurements are on record
        assert timings and all(t["ms"] > 0 for t in timings)  # every candidate ran ...
        assert all(len(t["ms_rounds"]) == tuner.ROUNDS for t in timings)  # ... in the rounds
        assert fast.best_config(q, q, True, True).describe() == min(
            timings, key=lambda t: t["ms"])["config"]
        if kind is HopperConfig:
            assert [t["config"] for t in timings] == [c.describe() for c in hopper.CONFIGS]
        else:
            assert [t["config"] for t in timings] == [c.describe() for c in fast.CONFIGS]
        check_against_reference(out, lse, q, q, q, True)
