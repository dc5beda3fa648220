"""Small Triton helpers shared by the kernels (the faithful ports above all).

One kernel definition runs two ways: compiled on a GPU, or through Triton's CPU interpreter
in a normal process (no TRITON_INTERPRET needed; it also works when that is set):
``launch(kernel, grid, interpret, ...)``. The roundings here are explicit because the
interpreter's fp32 -> bf16 ``.to()`` truncates, and ``fmax`` because ``tl.maximum``'s NaN
handling differs between the GPU (maxNum) and the interpreter (NaN wins).
"""

from __future__ import annotations

import contextlib
import sys
import threading

import numpy as np
import triton
import triton.language as tl
import triton.runtime.interpreter as _interp
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction

# Private, but present from Triton 3.x to 3.9; without it each device call patches itself.
_patch_lang = getattr(_interp, "_patch_lang", None)

_LOCK = threading.Lock()
_INTERPRETED: dict = {}


def _interpreted(fn) -> InterpretedFunction:
    if fn not in _INTERPRETED:
        _INTERPRETED[fn] = InterpretedFunction(fn)
    return _INTERPRETED[fn]


_PATCHED_GLOBALS: set = set()


def _interpret_call(self, *args, **kwargs):
    # A @triton.jit function (our device functions, tl.max, tl.sum, ...) called from an
    # interpreted kernel: run it through the interpreter too. The interpreter's own device
    # call re-patches triton.language on every call (most of the run time); patching each
    # module once per interpreter run is enough, as the run restores everything at its end.
    interp = _interpreted(self.fn)
    if _patch_lang is None or not hasattr(interp, "rewrite"):
        return interp(*args, **kwargs)
    key = id(self.fn.__globals__)
    if key not in _PATCHED_GLOBALS:
        _patch_lang(self.fn)
        _PATCHED_GLOBALS.add(key)
    return interp.rewrite()(*args, **kwargs)


def _language_state():
    """Everything the interpreter may patch: the triton.language modules and the classes
    of triton.language.core (tensor, dtype, ...), as {object: copy of its __dict__}."""
    objs = [m for name, m in list(sys.modules.items())
            if m is not None and (name == "triton.language" or name.startswith("triton.language."))]
    objs += [c for c in vars(tl.core).values() if isinstance(c, type)]
    objs.append(JITFunction)
    return {id(o): (o, dict(vars(o))) for o in objs}


def _restore(state):
    for obj, saved in state.values():
        now = vars(obj)
        if isinstance(obj, type):  # modules keep added names: submodules imported meanwhile,
            for name in [n for n in now if n not in saved]:  # the interpreter's own globals
                delattr(obj, name)
        for name, value in saved.items():
            if now.get(name, _restore) is not value:
                setattr(obj, name, value)


def _scalar_index(self):
    return int(np.asarray(self.handle.data).reshape(-1)[0])


def _patch_lang_tensor_robust(original):
    # Triton 3.6's interpreter turns a scalar (a one-element 1-D array) into a loop bound
    # with int(array), which numpy >= 2.4 refuses; 3.9 squeezes first. Do as 3.9 does.
    def patch(tensor, *rest):
        original(tensor, *rest)
        tensor.__index__ = _scalar_index
    return patch


@contextlib.contextmanager
def _interpreter_session():
    """While an interpreted kernel runs: JITFunction calls go to the interpreter, numpy's
    overflow warnings are off (exp2 overflow and inf - inf are the semantics here), and
    afterwards triton.language is put back exactly as it was (some Triton versions leave
    the interpreter's patches in place, which would break later compiled launches)."""
    with _LOCK:
        state = _language_state()
        original_patch_tensor = getattr(_interp, "_patch_lang_tensor", None)
        if original_patch_tensor is not None:
            _interp._patch_lang_tensor = _patch_lang_tensor_robust(original_patch_tensor)
        JITFunction.__call__ = _interpret_call
        _PATCHED_GLOBALS.clear()
        try:
            with np.errstate(all="ignore"):
                yield
        finally:
            _PATCHED_GLOBALS.clear()
            if original_patch_tensor is not None:
                _interp._patch_lang_tensor = original_patch_tensor
            _restore(state)


def launch(kernel, grid, interpret: bool, *args, **kwargs):
    """Launch ``kernel`` (a ``@triton.jit`` function) on ``grid``: compiled, or through the
    interpreter on CPU tensors when ``interpret`` is True (or TRITON_INTERPRET=1 was set
    when Triton was imported). Compiler options (num_warps, enable_fp_fusion, ...) pass
    through; the interpreter ignores them."""
    if isinstance(kernel, InterpretedFunction):
        interpret = True
    if not interpret:
        kernel[grid](*args, **kwargs)
        return
    runner = kernel if isinstance(kernel, InterpretedFunction) else _interpreted(kernel.fn)
    with _interpreter_session():
        runner[grid](*args, **kwargs)


@triton.jit
def round_bf16(x):
    """Round fp32 to the nearest bfloat16 value, ties to even (``v_cvt_pk_bf16_f32``);
    overflow gives +-inf, inf and NaN pass. Returns fp32 holding the bf16 value."""
    bits = tl.where(x != x, 0, x.to(tl.uint32, bitcast=True))  # NaN bits could wrap
    lsb = (bits >> 16) & 1
    rounded = ((bits + 0x7FFF + lsb) >> 16) << 16
    return tl.where(x != x, x, rounded.to(tl.float32, bitcast=True))


@triton.jit
def round_f16(x):
    """Round fp32 to the nearest float16 value, ties to even (overflow gives +-inf);
    both the GPU and the interpreter round this conversion correctly."""
    return x.to(tl.float16).to(tl.float32)


@triton.jit
def fmax(a, b):
    """maxNum: the non-NaN operand wins; fmax(-inf, x) = x."""
    return tl.where(a != a, b, tl.where(b != b, a, tl.maximum(a, b)))


@triton.jit
def exp2_ieee(x):
    """2**x of fp32 x, correctly rounded to fp32, as the models' ``numerics.exp2``: the
    power is taken in fp64 and rounded once. Triton's fp32 exp2 is ex2.approx.ftz on NVIDIA
    GPUs: ~2 ulps off, and it flushes results below 2**-126 to 0 (a correction exp2(-d),
    d in (126, 149], must stay > 0: inf * 0 would be NaN where the model keeps inf)."""
    return tl.exp2(x.to(tl.float64)).to(tl.float32)


#: CUDA's limit on the second launch-grid dimension (the kernels put B * H there).
GRID_Y_MAX = 65535


def check_launch(tensors, names, *, batch_heads, causal, recorder, interpret):
    """The launch arguments a direct caller of a faithful port could get wrong (q, k, v
    themselves are checked by ``fa_lab.checks.check_qkv``); errors name the argument.
    A kernel with a rescale policy checks it with ``fa_lab.capabilities.check_policy``."""
    from fa_lab.trace import TraceRecorder

    for name, t in zip(names, tensors):
        if any(st < 0 for st in t.stride()):
            raise ValueError(f"{name} has a negative stride {t.stride()}")
    if batch_heads > GRID_Y_MAX:
        raise ValueError(f"B * H = {batch_heads} exceeds the launch grid's limit {GRID_Y_MAX}")
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    if recorder is not None and not isinstance(recorder, TraceRecorder):
        raise TypeError(f"recorder must be a TraceRecorder or None, got {type(recorder).__name__}")
    if not isinstance(interpret, bool):
        raise TypeError(f"interpret must be a bool, got {type(interpret).__name__}")
    device = tensors[0].device
    if interpret and device.type != "cpu":
        raise ValueError(f"interpret=True runs on CPU tensors, got tensors on {device}")
    if not interpret and device.type != "cuda":
        raise ValueError(f"the compiled kernel needs CUDA/ROCm tensors, got tensors on {device}; "
                         "pass interpret=True for Triton's CPU interpreter")


def rows_per_program(interpret: bool, rows: int | None) -> int:
    """Query rows per faithful-kernel program: whole 32-row waves of one 256-row block.
    Default: two waves compiled, the whole block interpreted (the interpreter's cost is
    per operation). Either is exact: a wave's vote reads only its rows."""
    from fa_lab.kernels._common.geometry import BLOCK_M, WAVE_ROWS

    if rows is None:
        return BLOCK_M if interpret else 2 * WAVE_ROWS
    allowed = tuple(WAVE_ROWS << i for i in range(4) if WAVE_ROWS << i <= BLOCK_M)
    if isinstance(rows, bool) or rows not in allowed:
        raise ValueError(f"rows_per_program must be one of {allowed} (whole waves of one block), "
                         f"got {rows!r}")
    return rows


@triton.jit
def fma_f32(a, b, c, VIA_FP64: tl.constexpr):
    """a * b + c rounded once to fp32 (``v_fma_f32``); a, b, c of one shape. VIA_FP64: for
    interpreters whose tl.fma rounds twice (``interpreter_fma_rounds_twice``): the models'
    emulation (``fa_lab.numerics.fma_f32``: the exact fp64 product, the sum rounded to odd
    from its TwoSum error, then one rounding to fp32). Compiled, pass False: tl.fma is one
    IEEE fma."""
    if VIA_FP64:
        p = a.to(tl.float64) * b.to(tl.float64)
        c64 = c.to(tl.float64)
        s = p + c64
        z = s - p
        err = (p - (s - z)) + (c64 - z)
        bits = s.to(tl.int64, bitcast=True)
        to_odd = (err != 0) & ((bits & 1) == 0) & ((s - s) == 0)
        step = tl.where((err > 0) == (s > 0), 1, -1).to(tl.int64)
        r = tl.where(to_odd, bits + step, bits).to(tl.float64, bitcast=True).to(tl.float32)
    else:
        r = tl.fma(a, b, c)
    return r


@triton.jit
def _fma_probe(A, C, Out):
    a = tl.load(A + tl.arange(0, 1))
    tl.store(Out + tl.arange(0, 1), tl.fma(a, a, tl.load(C + tl.arange(0, 1))))


_FMA_TWICE: list = []


def interpreter_fma_rounds_twice() -> bool:
    """Does this Triton's interpreter round tl.fma twice (3.6 multiplies, then adds, in
    fp32; 3.9 rounds once)? (1 + 2**-12)**2 minus its fp32 square is 2**-24 only with a
    single rounding."""
    if not _FMA_TWICE:
        import torch

        a = torch.tensor([1.0 + 2.0 ** -12], dtype=torch.float32)
        out = torch.empty_like(a)
        launch(_fma_probe, (1,), True, a, -(a * a), out)
        _FMA_TWICE.append(float(out) != 2.0 ** -24)
    return _FMA_TWICE[0]


def runs_interpreted(kernel, interpret: bool) -> bool:
    """Will ``launch(kernel, grid, interpret, ...)`` interpret? (asked for, or
    TRITON_INTERPRET=1 when Triton was imported made every @triton.jit interpreted)."""
    return interpret or isinstance(kernel, InterpretedFunction)


def fma_via_fp64(kernel, interpret: bool) -> bool:
    """The VIA_FP64 switch of ``fma_f32`` for a launch of ``kernel``: True only when it runs
    interpreted on an interpreter whose tl.fma rounds twice."""
    return runs_interpreted(kernel, interpret) and interpreter_fma_rounds_twice()
