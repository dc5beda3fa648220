"""How the faithful ports take their dot products of 16-bit values (the DOT_MODE switch).

Every product of two bf16 (or two f16) values is exact in fp32; the modes differ in how
the products are summed:

- ``DOT_EXACT`` (the interpreter): ``tl.dot`` in fp64, rounded once to fp32: bit for bit
  the models' ``numerics.exact_dot`` (exact products, fp64 sum, one rounding).
- ``DOT_EXACT_SCRATCH`` (compiled, opt-in: ``exact_dots()``): the same sum on the GPU.
  Triton 3.6 cannot compile an fp64 ``tl.dot``, and a register tile cannot be indexed by
  column, so both operands go through a per-program scratch buffer in global memory and
  an fp64 loop sums one rank-1 product per step: far slower than the tensor cores, with
  ``scratch_floats`` fp32 of scratch for each program; in exchange a compiled run agrees
  with the model bit for bit at any size.
- ``DOT_TENSOR_CORES`` (compiled, the default): the 16-bit tensor-core dot, fp32
  accumulation in the hardware's order, a few ulps off the exact sum. That can move a
  borderline overflow across 2**128, so GPU tests that demand the model's exact masks run
  under ``exact_dots()``.
"""

from __future__ import annotations

import contextlib
import threading

import torch
import triton
import triton.language as tl

from .util import runs_interpreted

DOT_EXACT, DOT_EXACT_SCRATCH, DOT_TENSOR_CORES = 0, 1, 2

_setting = threading.local()


@contextlib.contextmanager
def exact_dots(enabled: bool = True):
    """Within the block, compiled faithful ports (swp_bf16, generic, swa) sum their dots
    exactly, as the models and the interpreter do (``DOT_EXACT_SCRATCH``); slow.

    >>> with fa_lab.kernels.exact_dots():
    ...     out = fa_lab.flash_attn_func(q, k, v, backend="triton")
    """
    if not isinstance(enabled, bool):
        raise TypeError(f"exact_dots(enabled) takes a bool, got {type(enabled).__name__}")
    before = getattr(_setting, "exact", False)
    _setting.exact = enabled
    try:
        yield
    finally:
        _setting.exact = before


def dot_mode(interpreted: bool) -> int:
    """The DOT_MODE of a launch: exact when interpreted; compiled, tensor cores unless
    inside ``exact_dots()``."""
    if interpreted:
        return DOT_EXACT
    return DOT_EXACT_SCRATCH if getattr(_setting, "exact", False) else DOT_TENSOR_CORES


def scratch_floats(rows: int, head_dim: int, tile_n: int) -> int:
    """fp32 scratch a program needs for its largest dot: Q K^T ([rows, D] and [D, tile_n])
    or P V ([rows, tile_n] and [tile_n, D])."""
    return rows * max(head_dim, tile_n) + head_dim * tile_n


def scratch_buffer(mode: int, grid, floats_per_program: int, device) -> torch.Tensor:
    """The scratch of ``DOT_EXACT_SCRATCH`` (one slice per program of ``grid``), else one
    0.0: the run-time zero that ``DOT_TENSOR_CORES`` starts its sums from."""
    if mode != DOT_EXACT_SCRATCH:
        return torch.zeros(1, dtype=torch.float32, device=device)
    programs = 1
    for g in grid:
        programs *= g
    return torch.empty(max(programs * floats_per_program, 1), dtype=torch.float32, device=device)


def launch_dots(kernel, interpret: bool, grid, rows: int, head_dim: int, tile_n: int, device):
    """For one launch of a faithful port: (the scratch buffer argument, the DOT_MODE and
    SCRATCH_FLOATS launch keywords)."""
    mode = dot_mode(runs_interpreted(kernel, interpret))
    floats = scratch_floats(rows, head_dim, tile_n)
    return scratch_buffer(mode, grid, floats, device), {"DOT_MODE": mode, "SCRATCH_FLOATS": floats}


@triton.jit
def program_scratch(Scratch, FLOATS: tl.constexpr, DOT_MODE: tl.constexpr):
    """This program's slice of the scratch buffer (``scratch_buffer``)."""
    if DOT_MODE == 1:
        pid = (tl.program_id(0).to(tl.int64)
               + tl.num_programs(0) * (tl.program_id(1) + tl.num_programs(1) * tl.program_id(2)))
        base = Scratch + pid * FLOATS
    else:
        base = Scratch
    return base


@triton.jit
def _dot_exact_scratch(a, b, scratch):
    """a @ b summed exactly through global scratch, as fp64 (exact for operands whose
    products and partial sums fit fp64's significand: 16-bit or 8-bit floats)."""
    M: tl.constexpr = a.shape[0]
    K: tl.constexpr = a.shape[1]
    N: tl.constexpr = b.shape[1]
    om = tl.arange(0, M)
    ok = tl.arange(0, K)
    on = tl.arange(0, N)
    tl.debug_barrier()  # every thread is done reading the previous dot's operands
    tl.store(scratch + om[:, None] * K + ok[None, :], a.to(tl.float32))
    tl.store(scratch + M * K + ok[:, None] * N + on[None, :], b.to(tl.float32))
    tl.debug_barrier()  # ... and sees every thread's operands of this one
    acc = tl.zeros([M, N], dtype=tl.float64)
    for kk in range(K):
        a_col = tl.load(scratch + om * K + kk).to(tl.float64)
        b_row = tl.load(scratch + M * K + kk * N + on).to(tl.float64)
        acc += a_col[:, None] * b_row[None, :]  # exact products (16-bit x 16-bit)
    return acc


@triton.jit
def dot16(a, b, scratch, DOT_MODE: tl.constexpr):
    """a @ b for operands that hold 16-bit values (``b`` keeps its 16-bit dtype for the
    tensor cores); fp32 result. ``scratch``: ``program_scratch`` (DOT_EXACT_SCRATCH's
    operand buffer; DOT_TENSOR_CORES reads its zero there)."""
    if DOT_MODE == 2:
        # A run-time zero accumulator (scratch_buffer's placeholder holds 0.0): with a
        # constant one, Triton folds ``O + dot(P, V)`` into dot(P, V, acc=O), which adds O
        # inside the tensor core's sum (a different rounding, so a different NaN mask at
        # an overflow boundary). One scalar load: a zero reduced from
        # the operand (b * 0) would take two cross-warp reductions per dot, and is NaN
        # when b holds an inf.
        acc = tl.zeros([a.shape[0], b.shape[1]], dtype=tl.float32) + tl.load(scratch)
        r = tl.dot(a.to(b.dtype), b, acc)
    elif DOT_MODE == 1:
        r = _dot_exact_scratch(a, b, scratch).to(tl.float32)
    else:
        r = tl.dot(a.to(tl.float64), b.to(tl.float64), out_dtype=tl.float64).to(tl.float32)
    return r


@triton.jit
def dot8(a, b, scratch, DOT_MODE: tl.constexpr):
    """a @ b for fp32 operands that hold e4m3 values, as fp64: the exact sum in
    ``DOT_EXACT`` and ``DOT_EXACT_SCRATCH`` (8-bit products are exact, and so is their
    fp64 sum at the head dims the ports use), so a caller may add two such dots and round
    once. ``DOT_TENSOR_CORES`` takes bf16 operands (every e4m3 value is one) on the
    tensor cores with the hardware's fp32 accumulation."""
    if DOT_MODE == 2:
        acc = tl.zeros([a.shape[0], b.shape[1]], dtype=tl.float32) + tl.load(scratch)
        r = tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16), acc).to(tl.float64)
    elif DOT_MODE == 1:
        r = _dot_exact_scratch(a, b, scratch)
    else:
        r = tl.dot(a.to(tl.float64), b.to(tl.float64), out_dtype=tl.float64)
    return r


@triton.jit
def load16(ptrs, mask, DOT_MODE: tl.constexpr):
    """A K or V tile: kept 16-bit for the tensor cores, else widened at once (the
    interpreter's bf16 arithmetic is wrong). Masked entries read 0."""
    x = tl.load(ptrs, mask=mask, other=0.0)
    if DOT_MODE != 2:
        x = x.to(tl.float32)
    return x
