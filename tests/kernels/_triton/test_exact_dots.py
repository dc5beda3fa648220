"""The faithful ports' exact compiled dot (``_triton.dots.DOT_EXACT_SCRATCH``) and its switch.

Compiled, the ports default to tensor-core dots; inside ``fa_lab.kernels.exact_dots()`` they
sum through a scratch buffer in fp64 instead, so that a GPU run gives the model's masks at
any size. The scratch path is plain loads, stores and fp64 arithmetic, so it also runs in
Triton's interpreter: here it must give exactly what the interpreter's own exact dot (fp64
``tl.dot``) gives, through all three ports, on inputs that drag rows into overflow. A
compile for sm_90 (CPU only) checks that the GPU build sums in fp64 behind barriers.
"""

import pytest
import torch
import triton
import triton.language as tl

import fa_lab
from fa_lab.kernels.generic import faithful as generic
from fa_lab.kernels.swa import faithful as swa
from fa_lab.kernels._triton import dots as _dots
from _ports import assert_same_masks, make_inputs
from _shared import sm90_target


def test_exact_dots_switches_the_compiled_mode_only():
    assert _dots.dot_mode(interpreted=False) == _dots.DOT_TENSOR_CORES
    with fa_lab.kernels.exact_dots():
        assert _dots.dot_mode(interpreted=False) == _dots.DOT_EXACT_SCRATCH
        assert _dots.dot_mode(interpreted=True) == _dots.DOT_EXACT
        with fa_lab.kernels.exact_dots(False):  # nested: off, then back on
            assert _dots.dot_mode(interpreted=False) == _dots.DOT_TENSOR_CORES
        assert _dots.dot_mode(interpreted=False) == _dots.DOT_EXACT_SCRATCH
    assert _dots.dot_mode(interpreted=False) == _dots.DOT_TENSOR_CORES


def test_exact_dots_rejects_a_non_bool():
    with pytest.raises(TypeError, match="bool"):
        with fa_lab.kernels.exact_dots("yes"):
            pass


def test_scratch_is_allocated_only_for_the_scratch_mode():
    grid = (3, 4, 2)
    floats = _dots.scratch_floats(64, 128, 64)
    assert floats == 64 * 128 + 128 * 64  # Q K^T: [64, 128] and [128, 64]
    assert _dots.scratch_floats(32, 64, 64) == 32 * 64 + 64 * 64
    assert _dots.scratch_buffer(_dots.DOT_EXACT_SCRATCH, grid, floats, "cpu").numel() == 24 * floats
    # the tensor-core mode's placeholder is the zero its dots start from
    placeholder = _dots.scratch_buffer(_dots.DOT_TENSOR_CORES, grid, floats, "cpu")
    assert placeholder.dtype == torch.float32 and placeholder.tolist() == [0.0]


@triton.jit
def _dot_probe(A, B, Out, Scratch, M: tl.constexpr, K: tl.constexpr, N: tl.constexpr,
               MODE: tl.constexpr):
    om, ok, on = tl.arange(0, M), tl.arange(0, K), tl.arange(0, N)
    a = tl.load(A + om[:, None] * K + ok[None, :])
    b = tl.load(B + ok[:, None] * N + on[None, :])
    sc = _dots.program_scratch(Scratch, M * K + K * N, MODE)
    tl.store(Out + om[:, None] * N + on[None, :], _dots.dot16(a, b, sc, MODE))


def test_scratch_dot_is_the_exact_sum_interpreted():
    # +2**20 first and -2**20 last: an fp32 running sum loses the terms in between below
    # 2**-3, the exact sum (fp64, rounded once) keeps them
    g = torch.Generator().manual_seed(3)
    a = torch.randn(16, 32, generator=g).to(torch.bfloat16)
    b = torch.randn(32, 16, generator=g).to(torch.bfloat16)
    a[:, 0], b[0, :], a[:, 31], b[31, :] = 2.0**20, 1.0, -(2.0**20), 1.0
    exact = (a.double() @ b.double()).float()
    from fa_lab.kernels._triton.util import launch
    for mode in (_dots.DOT_EXACT, _dots.DOT_EXACT_SCRATCH):
        out = torch.empty(16, 16)
        scratch = _dots.scratch_buffer(_dots.DOT_EXACT_SCRATCH, (1,), 16 * 32 + 32 * 16, "cpu")
        launch(_dot_probe, (1,), True, a.float(), b, out, scratch, M=16, K=32, N=16, MODE=mode)
        assert torch.equal(out, exact), mode
    assert not torch.equal((a.float() @ b.float()), exact)  # (the case does need the exact sum)


def _force_scratch_mode(monkeypatch):
    """Interpreted launches take the GPU's exact path instead of the fp64 tl.dot; returns
    the scratch sizes the launches allocated (so a test can see the path was taken)."""
    monkeypatch.setattr(_dots, "dot_mode", lambda interpreted: _dots.DOT_EXACT_SCRATCH)
    allocated, real = [], _dots.scratch_buffer

    def spy(mode, grid, floats, device):
        buf = real(mode, grid, floats, device)
        allocated.append(buf.numel())
        return buf

    monkeypatch.setattr(_dots, "scratch_buffer", spy)
    return allocated


@pytest.mark.parametrize("policy", ["lazy_unfixed", "lazy"])
def test_swp_bf16_scratch_dots_equal_the_interpreters_exact_dots(monkeypatch, policy):
    q, k, v = make_inputs(1, 256, 320, 2, 1, 64, 48.0, seed=21)
    kw = dict(causal=True, rescale=policy, return_lse=True, kernel="swp_bf16")
    want = fa_lab.flash_attn_func(q, k, v, backend="interpret", **kw)
    allocated = _force_scratch_mode(monkeypatch)
    got = fa_lab.flash_attn_func(q, k, v, backend="interpret", **kw)
    assert allocated and min(allocated) > 1  # a real scratch buffer, not the placeholder
    for x, y, name in ((got[0], want[0], "out"), (got[1], want[1], "lse")):
        assert_same_masks(name, x, y)
        assert torch.equal(x.nan_to_num(), y.nan_to_num()), name
    assert torch.isnan(want[0]).any() == (policy == "lazy_unfixed")


@pytest.mark.slow
def test_generic_and_swa_scratch_dots_equal_the_interpreters_exact_dots(monkeypatch):
    q, k, v = make_inputs(1, 256, 256, 2, 1, 128, 32.0, seed=22)  # (SWA: D 128)
    runs = ((generic, dict(causal=True)), (swa, dict(window_left=64, rescale="lazy_unfixed")))
    for module, kw in runs:
        want = module.forward(q, k, v, interpret=True, **kw)
        with monkeypatch.context() as mp:
            allocated = _force_scratch_mode(mp)
            got = module.forward(q, k, v, interpret=True, **kw)
        assert allocated and min(allocated) > 1, module.__name__
        for x, y in zip(got, want):
            assert torch.equal(x.nan_to_num(), y.nan_to_num()), module.__name__
            assert_same_masks(module.__name__, x, y)


def test_scratch_mode_compiles_to_fp64_sums_behind_barriers():
    from triton.compiler import ASTSource

    sig = {"A": "*fp32", "B": "*bf16", "Out": "*fp32", "Scratch": "*fp32", "M": "constexpr",
           "K": "constexpr", "N": "constexpr", "MODE": "constexpr"}
    src = ASTSource(fn=_dot_probe, signature=sig,
                    constexprs={"M": 64, "K": 128, "N": 64, "MODE": _dots.DOT_EXACT_SCRATCH})
    ptx = triton.compile(src, target=sm90_target(),
                         options={"num_warps": 4, "enable_fp_fusion": False}).asm["ptx"]
    assert "mul.rn.f64" in ptx and "add.rn.f64" in ptx  # fp64, no fused rounding
    assert ptx.count("bar.sync") + ptx.count("barrier.sync") >= 2
    assert "wgmma" not in ptx and "mma.sync" not in ptx  # no tensor-core sum
