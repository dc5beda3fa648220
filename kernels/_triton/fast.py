"""Pieces shared by the fast forward kernels (``swp_bf16.fast``, ``swp_bf16.splitk``,
``swp_bf16.varlen``, ``swp_fp8.fast``).

Device helpers (the 32-row wave vote, the tile loaders, explicit roundings for the
interpreter, the scores and the KV walk's tile bounds) and the host side: argument
checks, launch configurations, autotuning, and a way to run a kernel through Triton's CPU
interpreter without setting ``TRITON_INTERPRET``.

The bf16/f16 KV walk (the last section) is the whole device side of the fast bf16/f16
kernels: ``walk`` takes a query block over a range of KV columns, whose first tile sets
the base, with the policy's rescale decisions (the semantics are in ``swp_bf16.fast``);
the dense kernel, split-K and varlen differ only in which rows and columns they hand it
and in what they store.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor  # host-side TMA descriptors

from fa_lab import checks
from fa_lab.kernels._common import geometry
from fa_lab.kernels.swp_bf16.model import softmax_scale_log2  # c, exactly as the model
from fa_lab.policies import Policy

from .tuner import Tuner
from .util import launch

#: Rows that vote together, as one gfx950 wave does (fa_lab.kernels._common.geometry.WAVE_ROWS).
WAVE_ROWS = 32
#: The range of ``Config.maxnreg`` (ptxas's ``.maxnreg``, registers per thread): 255 is an
#: NVIDIA thread's most, and ptxas raises a cap below 24 to 24.
MIN_REGISTERS, MAX_REGISTERS = 24, 255
#: ``Config.meta``'s keys that are compiler options, not the kernel's arguments.
COMPILER_OPTIONS = ("num_warps", "num_stages", "maxnreg")


@dataclass(frozen=True)
class Config:
    """One launch configuration: tile sizes, warps, pipeline depth, TMA or plain loads,
    for lazy policies whether the fast path tests row sums instead of row maxes
    (``row_sum_filter``; same decisions either way, a different amount of work), and a
    cap on registers per thread (``maxnreg``, ptxas's; None: ptxas chooses), which can let
    more programs share a multiprocessor's register file."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    use_tma: bool
    row_sum_filter: bool = True
    maxnreg: int | None = None

    def describe(self, lazy: bool = True) -> str:
        return (f"BM{self.block_m} BN{self.block_n} w{self.num_warps} s{self.num_stages}"
                f"{' tma' if self.use_tma else ''}{' rowsum' if lazy and self.row_sum_filter else ''}"
                f"{f' r{self.maxnreg}' if self.maxnreg is not None else ''}")

    def meta(self, lazy: bool) -> dict:
        """The kernel's launch keywords for this configuration (compiler options included:
        ``num_warps``, ``num_stages`` and, when set, ``maxnreg``)."""
        return dict(BLOCK_M=self.block_m, BLOCK_N=self.block_n, USE_TMA=self.use_tma,
                    ROW_SUM_FILTER=bool(lazy and self.row_sum_filter),
                    num_warps=self.num_warps, num_stages=self.num_stages,
                    **({} if self.maxnreg is None else {"maxnreg": self.maxnreg}))


def autotuners(kernel, configs, key, pre_hook, row_sum_filters=(True, False)):
    """{lazy: ``tuner.Tuner``} for ``kernel``: eager ranks each config once; lazy ranks
    each with every setting in ``row_sum_filters``. Both launch the same JIT function (one
    compile cache)."""
    def candidates(lazy):
        return tuple(dataclasses.replace(c, row_sum_filter=flt) for c in configs
                     for flt in (row_sum_filters if lazy else (False,)))
    return {lazy: Tuner(kernel, candidates(lazy), key, pre_hook, lazy) for lazy in (False, True)}


def tuned_config(tuner: Tuner, key_prefix: tuple):
    """The tuner's pick for a key that starts with ``key_prefix``, or None."""
    for key, cfg in tuner.cache.items():
        if tuple(key[:len(key_prefix)]) == key_prefix:
            return cfg
    return None


def tuning_timings(tuner: Tuner) -> list[dict]:
    """The measurements behind the tuner's last pick: one record per config (``describe``,
    median ms over the rounds, the ms of each round; ``error`` for a config that could not
    run); [] before any tuning."""
    return list(tuner.timings[tuner.last_key]) if tuner.last_key is not None else []


# ---- device helpers -----------------------------------------------------------------

@triton.jit
def program_rows(H, GROUP, BLOCK_M: tl.constexpr, CAUSAL: tl.constexpr):
    """This program's (batch or sequence b, head h, kv head hk, first row m0, rows): grid
    axis 0 walks query blocks, axis 1 batch x head; causal grids run their heaviest
    (bottom) blocks first, for a shorter tail."""
    pid_m = tl.program_id(0)
    if CAUSAL:
        pid_m = tl.num_programs(0) - 1 - pid_m
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    m0 = pid_m * BLOCK_M
    return b, h, h // GROUP, m0, m0 + tl.arange(0, BLOCK_M)


@triton.jit
def block_any(flags, BLOCK_M: tl.constexpr):
    """True (a block-uniform scalar) when any of the block's per-row ``flags`` (int 0/1) is
    set: the lazy kernels' test for skipping the rescale.

    ``tl.max(flags, 0)`` crosses warps through shared memory twice (the partials in, the
    result back out), a CTA barrier each. Here each run of BLOCK_M / 32 rows reduces inside
    its warp, one gather hands the 32 partials to a 32-element vector that every warp holds
    whole (one exchange, one barrier), and the last max stays inside each warp: with V
    loaded before the vote, fewer CTA barriers per KV tile on the lazy fast path
    (benchmarks/ptx_barriers.py counts them in the sm_90 PTX).
    """
    partials = tl.max(tl.reshape(flags, [32, BLOCK_M // 32]), 1)
    in_every_warp = tl.gather(partials, tl.arange(0, 32), 0)
    return tl.max(in_every_warp, 0) > 0


@triton.jit
def wave_any(flags, BLOCK_M: tl.constexpr):
    """Per row: the max of ``flags`` over its 32-row wave (an int vote, 0 or 1).

    The reshape moves rows across warps (a layout conversion through shared memory):
    kernels call this only inside the rare branch where some row of the block voted.
    """
    waves = tl.max(tl.reshape(flags, (BLOCK_M // 32, 32)), 1)
    return tl.reshape(tl.broadcast_to(waves[:, None], (BLOCK_M // 32, 32)), (BLOCK_M,))


@triton.jit
def round_bf16_bits(x):
    """fp32 -> nearest-even bfloat16 value, kept in fp32, by bit manipulation (the
    interpreter's fp32 -> bf16 cast truncates). inf stays inf; NaN stays NaN."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16 << 16
    return tl.where(x != x, x, bits.to(tl.float32, bitcast=True))


@triton.jit
def round_e4m3_bits(x):
    """fp32 >= 0 -> nearest-even float8_e4m3fn value (subnormals down to 2**-9), kept in
    fp32, no saturation (callers clamp first). For the interpreter, whose fp32 -> fp8 cast
    rounds ties away, flushes subnormals and maps inf/NaN to finite values."""
    bits = x.to(tl.uint32, bitcast=True)
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) >> 20 << 20).to(tl.float32, bitcast=True)
    # Below 2**-6 the step is 2**-9: scale up, round to an integer (fp32 magic number), back.
    subnormal = ((x * 512.0 + 12582912.0) - 12582912.0) * 0.001953125
    r = tl.where(x < 0.015625, subnormal, normal)
    return tl.where(x != x, x, r)


@triton.jit
def load_tile(desc, base, stride_s, row0, col0, n0, seqlen, BLOCK: tl.constexpr,
              WIDTH: tl.constexpr, USE_TMA: tl.constexpr, MASKED: tl.constexpr):
    """A [BLOCK, WIDTH] tile of a [.., S, .., WIDTH] tensor starting at sequence row n0.

    TMA: ``desc`` views the tensor as 2-D [rows, cols]; the tile sits at (row0 + n0, col0).
    Plain loads: ``base`` points at sequence row 0 of this (batch, head), rows ``stride_s``
    apart. MASKED tiles read zeros past ``seqlen`` (TMA reads the next batch's rows there;
    callers mask scores and zero V themselves).
    """
    if USE_TMA:
        tile = desc.load([row0 + n0, col0])
    else:
        offs = n0 + tl.arange(0, BLOCK)
        ptrs = base + offs[:, None] * stride_s + tl.arange(0, WIDTH)[None, :]
        if MASKED:
            tile = tl.load(ptrs, mask=(offs < seqlen)[:, None], other=0.0)
        else:
            tile = tl.load(ptrs)
    return tile


# ---- host side ----------------------------------------------------------------------

def run_interpreted(kernel, grid, *args, **kwargs):
    """Launch ``kernel`` (a @triton.jit function) on CPU tensors through Triton's
    interpreter, in this process, with no TRITON_INTERPRET needed (the faithful kernels'
    launcher: it also restores triton.language afterwards)."""
    launch(kernel, grid, True, *args, **kwargs)


def make_descriptor(t2d: torch.Tensor, block_shape):
    """A TMA descriptor over a 2-D view (zero fill past its edges)."""
    return TensorDescriptor.from_tensor(t2d, list(block_shape))


def compile_only(fn, target, *, types: dict, constexprs: dict, aligned=(), **options):
    """``fn`` built for ``target`` (a ``triton.backends.compiler.GPUTarget``) without a
    launch: Triton's back end and ptxas run on the CPU, so its PTX, cubin and resource use
    can be read on any machine.

    ``types`` gives each run-time argument's Triton type (``"*bf16"``, ``"i32"``,
    ``"fp32"``, ``"tensordesc<fp8e4nv[128, 128]>"``), ``constexprs`` each compile-time
    one; the arguments named in ``aligned`` are marked divisible by 16, as a launch marks
    16-byte aligned pointers and integers that are multiples of 16 (the marks decide
    vectorised loads and stores, hence registers). ``options`` go to ``triton.compile``."""
    from triton.compiler import ASTSource

    names = list(fn.arg_names)
    missing = [n for n in names if n not in types and n not in constexprs]
    both = sorted(set(types) & set(constexprs))
    unknown = sorted((set(types) | set(constexprs) | set(aligned)) - set(names))
    if missing or both or unknown:
        raise ValueError(f"types/constexprs must name each argument of {fn.__name__} once: "
                         f"missing {missing}, in both {both}, not arguments {unknown}")
    signature = {n: types[n] if n in types else "constexpr" for n in names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if n in aligned}
    return triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs),
                          target=target, options=options)


def check_device(q: torch.Tensor, interpret: bool) -> None:
    if not isinstance(interpret, bool):
        raise TypeError(f"interpret must be a bool, got {type(interpret).__name__}")
    if interpret and q.device.type != "cpu":
        raise ValueError(f"interpret=True runs on CPU tensors, got tensors on {q.device}")
    if not interpret and q.device.type != "cuda":
        raise ValueError(f"the compiled kernel needs CUDA tensors, got tensors on {q.device}; "
                         "pass interpret=True for Triton's CPU interpreter")


def check_qkv(q, k, v, dtypes, head_dims) -> None:
    """Shapes, dtypes and devices of [B, S, H, D] inputs; errors name the argument."""
    checks.check_qkv(q, k, v, dtypes=dtypes, head_dims=head_dims, kernel="this kernel")


def launch_fast(kernel, tuned: dict, grid, args, meta: dict, config, interpret: bool) -> None:
    """Launch a fast kernel: tuned (``config`` None; ``tuned`` from ``autotuners``),
    pinned, or through the interpreter. ``grid(block_m)`` gives the launch grid."""
    lazy = meta["LAZY"]
    if config is None:
        tuned[lazy].run(grid, args, meta)
    elif interpret:
        run_interpreted(kernel, grid(config.block_m), *args, **meta, **config.meta(lazy))
    else:
        kernel[grid(config.block_m)](*args, **meta, **config.meta(lazy))


#: Split-K cuts each 256-row query block's KV walk into even numbers of 64-column tiles
#: (fa_lab.kernels.swp_bf16.model.split_ranges): boundaries fall on multiples of 128 columns, and
#: a fast kernel's tiles and query blocks must nest in them.
SPLIT_COLUMN_ALIGN = 2 * geometry.BLOCK_N
SPLIT_ROW_BLOCK = geometry.BLOCK_M


def check_splits(num_kv_splits, config) -> None:
    """``num_kv_splits``: an int >= 1; with more than one, a pinned config's tiles must nest
    in the split boundaries."""
    if isinstance(num_kv_splits, bool) or not isinstance(num_kv_splits, int):
        raise TypeError(f"num_kv_splits must be an int, got {type(num_kv_splits).__name__}")
    if num_kv_splits < 1:
        raise ValueError(f"num_kv_splits must be >= 1, got {num_kv_splits}")
    if num_kv_splits > 1 and config is not None:
        if SPLIT_COLUMN_ALIGN % config.block_n:
            raise ValueError(f"split-K needs config.block_n to divide {SPLIT_COLUMN_ALIGN} (split "
                             f"boundaries), got {config.block_n}")
        if SPLIT_ROW_BLOCK % config.block_m:
            raise ValueError(f"split-K needs config.block_m to divide {SPLIT_ROW_BLOCK} (the "
                             f"model's query blocks), got {config.block_m}")


def check_config(config, fp8: bool):
    if config is None:
        return None
    if not isinstance(config, Config):
        raise TypeError(f"config must be a Config, got {type(config).__name__}")
    if config.block_m % WAVE_ROWS or config.block_m < WAVE_ROWS:
        raise ValueError(f"config.block_m must be a multiple of {WAVE_ROWS} (whole waves), got {config.block_m}")
    if config.block_n not in (16, 32, 64, 128, 256):
        raise ValueError(f"config.block_n must be a power of two in 16..256, got {config.block_n}")
    if config.maxnreg is not None and (isinstance(config.maxnreg, bool) or not isinstance(config.maxnreg, int)
                                       or not MIN_REGISTERS <= config.maxnreg <= MAX_REGISTERS):
        raise ValueError(f"config.maxnreg must be None or an int in {MIN_REGISTERS}..{MAX_REGISTERS} "
                         f"(registers per thread), got {config.maxnreg!r}")
    if fp8 and config.block_n != 128:
        raise ValueError("the fp8 kernel decides its rescale per 128 columns (a pair of 64-column "
                         f"tiles, as the model); config.block_n must be 128, got {config.block_n}")
    return config


# ---- the bf16/f16 walk: the fast bf16/f16 kernel, its split-K and its varlen kernel ---

#: Head dims and dtypes of the fast bf16/f16 kernels.
BF16_HEAD_DIMS = (64, 128)
BF16_DTYPES = (torch.bfloat16, torch.float16)
FP32_MAX = 3.4028234663852886e38
#: The tuner's list (Hopper) for the fast bf16/f16 Triton kernels (how it was chosen:
#: docs/performance.md). A deeper pipeline suits long D128 walks; 4 warps over 128 rows
#: suit D64 only, where the accumulator is half as large. Lazy tunes with the row-sum
#: filter only; Config(row_sum_filter=False) still selects the plain fast path.
BF16_CONFIGS = (
    Config(128, 128, 8, 2, False),
    Config(128, 64, 8, 3, False),
    Config(128, 64, 8, 4, True),
    Config(128, 64, 4, 3, True),
)
#: Small tiles for the CPU interpreter (whole waves, cheap numpy work per program).
BF16_INTERPRET_CONFIG = Config(64, 64, 4, 1, False)


@triton.jit
def round_input(x, DTYPE: tl.constexpr, INTERPRET: tl.constexpr):
    """Round fp32 to the input dtype (nearest even): a DTYPE tensor on the GPU; under the
    interpreter an fp32 tensor holding DTYPE values (its bf16 arithmetic is unusable)."""
    if INTERPRET:
        if DTYPE == tl.bfloat16:
            r = round_bf16_bits(x)
        else:
            r = x.to(tl.float16).to(tl.float32)
    else:
        r = x.to(DTYPE)
    return r


@triton.jit
def mma(a, b, acc, INTERPRET: tl.constexpr):
    if INTERPRET:
        out = tl.dot(a, b, acc, input_precision="ieee")
    else:
        out = tl.dot(a, b, acc)
    return out


@triton.jit
def scores(qs, k, n0, rows, seqlen_kv, diag, zero, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
           CAUSAL: tl.constexpr, MASKED: tl.constexpr, INTERPRET: tl.constexpr):
    """S = Qs K^T (bf16/f16: log2 units; fp8: the raw product), -inf past Skv and beyond
    the causal diagonal. ``zero`` (0.0, as a run-time value) starts the accumulator: a
    second call then is a product of its own, which the compiler cannot merge with the
    first. INTERPRET: an IEEE fp32 product (operands already widened to fp32)."""
    s = mma(qs, tl.trans(k), tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32) + zero, INTERPRET)
    if MASKED:
        cols = n0 + tl.arange(0, BLOCK_N)
        valid = (cols < seqlen_kv)[None, :]
        if CAUSAL:
            valid = valid & (cols[None, :] <= rows[:, None] + diag)
        s = tl.where(valid, s, float("-inf"))
    return s


@triton.jit
def rebase_waves(acc, l, m, mt, vote, rebase, BLOCK_M: tl.constexpr):
    """The rare branch: rows of a fired 32-row wave rebase (fixed: fmax(m, mt); unfixed:
    mt), O and l follow; rows of silent waves keep their base."""
    fire = wave_any(vote, BLOCK_M) > 0
    target = tl.where(rebase == 1, mt, tl.maximum(m, mt))
    corr = tl.where(fire, tl.math.exp2(m - target), 1.0)
    return acc * corr[:, None], l * corr, tl.where(fire, target, m)


@triton.jit
def walk_tile(acc, l, m, qs, desc_k, desc_v, k_base, v_base, stride_ks, stride_vs, kv_row0, kv_col0,
              n0, rows, seqlen_kv, diag, threshold, vote_limit, rebase,
              DTYPE: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              CAUSAL: tl.constexpr, LAZY: tl.constexpr, FIRST: tl.constexpr, MASKED: tl.constexpr,
              USE_TMA: tl.constexpr, INTERPRET: tl.constexpr, ROW_SUM_FILTER: tl.constexpr,
              FLOOR: tl.constexpr):
    """One KV tile: scores, the rescale decision, P, and O += P V. ``FLOOR``: the first
    tile's base is at least -3e38 (for rows that may see no column: P = 0, not NaN)."""
    k = load_tile(desc_k, k_base, stride_ks, kv_row0, kv_col0, n0, seqlen_kv, BLOCK_N, D,
                  USE_TMA, MASKED)
    # V is issued before the vote: after it, the pipelined load takes one more CTA barrier
    # per tile (sm_90 PTX, benchmarks/ptx_barriers.py)
    v = load_tile(desc_v, v_base, stride_vs, kv_row0, kv_col0, n0, seqlen_kv, BLOCK_N, D,
                  USE_TMA, MASKED)
    if INTERPRET:
        k = k.to(tl.float32)
    s = scores(qs, k, n0, rows, seqlen_kv, diag, 0.0, BLOCK_M, BLOCK_N, CAUSAL, MASKED, INTERPRET)
    if FIRST:
        m = tl.max(s, 1)
        if FLOOR:
            m = tl.maximum(m, -3e38)
        p = tl.math.exp2(s - m[:, None])
        row_sum = tl.sum(p, 1)
    elif LAZY:
        if ROW_SUM_FILTER:
            # Optimistic: P on the old base. A row votes (mt - m > threshold) only if some
            # P > 2**threshold, hence only if its row sum is >= vote_limit (2**threshold, a
            # hair lower for exp2's rounding): no row max on the fast path.
            p = tl.math.exp2(s - m[:, None])
            row_sum = tl.sum(p, 1)
            maybe = tl.where(row_sum < vote_limit, 0, 1)  # NaN: maybe
            if block_any(maybe, BLOCK_M):  # rare: decide exactly, then redo P
                # the scores again (the same product): keeping them live across the
                # branch would cost 64 registers a thread on the fast path
                s = scores(qs, k, n0, rows, seqlen_kv, diag, rebase * 0.0, BLOCK_M, BLOCK_N,
                           CAUSAL, MASKED, INTERPRET)
                mt = tl.max(s, 1)
                vote = tl.where(mt - m <= threshold, 0, 1)  # NaN votes yes
                acc, l, m = rebase_waves(acc, l, m, mt, vote, rebase, BLOCK_M)
                p = tl.math.exp2(s - m[:, None])
                row_sum = tl.sum(p, 1)
        else:
            mt = tl.max(s, 1)
            vote = tl.where(mt - m <= threshold, 0, 1)  # NaN votes yes
            if block_any(vote, BLOCK_M):  # the O rescale is skipped otherwise
                acc, l, m = rebase_waves(acc, l, m, mt, vote, rebase, BLOCK_M)
            p = tl.math.exp2(s - m[:, None])
            row_sum = tl.sum(p, 1)
    else:
        m_new = tl.maximum(m, tl.max(s, 1))
        corr = tl.math.exp2(m - m_new)
        acc = acc * corr[:, None]
        l = l * corr
        m = m_new
        p = tl.math.exp2(s - m[:, None])
        row_sum = tl.sum(p, 1)
    l = l + row_sum
    if MASKED and USE_TMA:  # TMA read the next batch's rows past seqlen_kv: P is 0 there,
        cols = n0 + tl.arange(0, BLOCK_N)  # but 0 * inf would not be
        v = tl.where((cols < seqlen_kv)[:, None], v, 0.0)
    if INTERPRET:
        v = v.to(tl.float32)
    acc = mma(round_input(p, DTYPE, INTERPRET), v, acc, INTERPRET)
    return acc, l, m


@triton.jit
def walk_bounds(kv_lo, kv_hi, m0, diag, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                CAUSAL: tl.constexpr):
    """(n_full, n_end): the KV tiles the query block at row m0 walks over columns
    [kv_lo, kv_hi) (kv_lo a multiple of BLOCK_N; ``diag`` = Skv - Sq). With t_lo =
    kv_lo // BLOCK_N, tiles [t_lo, n_full) need no mask and [n_full, n_end) do (the causal
    diagonal, a ragged end); n_end > t_lo always: a block that sees none of the range still
    runs its first tile (out 0, l 0)."""
    n_end = tl.cdiv(kv_hi, BLOCK_N)
    n_full = kv_hi // BLOCK_N
    if CAUSAL:
        last = m0 + BLOCK_M - 1 + diag  # last visible column of the block's bottom row
        n_end = tl.minimum(n_end, tl.where(last >= 0, last // BLOCK_N + 1, 0))
        first = m0 + diag + 1  # columns visible to the block's top row
        n_full = tl.minimum(n_full, tl.where(first >= 0, first // BLOCK_N, 0))
    n_end = tl.maximum(n_end, kv_lo // BLOCK_N + 1)
    return n_full, n_end


@triton.jit
def walk(qs, desc_k, desc_v, k_base, v_base, stride_ks, stride_vs, kv_row0, kv_col0,
         kv_lo, kv_hi, m0, rows, diag, threshold, vote_limit, rebase,
         DTYPE: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
         CAUSAL: tl.constexpr, LAZY: tl.constexpr, USE_TMA: tl.constexpr,
         INTERPRET: tl.constexpr, ROW_SUM_FILTER: tl.constexpr, FLOOR: tl.constexpr):
    """KV columns [kv_lo, kv_hi) for the query block at row m0 (kv_lo a multiple of
    BLOCK_N; kv_hi at most the sequence's Skv; ``diag`` = Skv - Sq): the range's first tile
    sets the base, as a whole KV walk's tile 0 does (floored at -3e38 with ``FLOOR``, as
    causal walks are: then an empty range gives l = 0, O = 0). Returns (acc, l, m)."""
    t_lo = kv_lo // BLOCK_N
    n_full, n_end = walk_bounds(kv_lo, kv_hi, m0, diag, BLOCK_M, BLOCK_N, CAUSAL)

    acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
    l = tl.zeros([BLOCK_M], dtype=tl.float32)
    m = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc, l, m = walk_tile(acc, l, m, qs, desc_k, desc_v, k_base, v_base, stride_ks, stride_vs,
                          kv_row0, kv_col0, kv_lo, rows, kv_hi, diag, threshold, vote_limit, rebase,
                          DTYPE, D, BLOCK_M, BLOCK_N, CAUSAL, LAZY, True, True, USE_TMA, INTERPRET,
                          ROW_SUM_FILTER, FLOOR)
    # (counted from 0: a run-time lower bound cost registers in the pipelined loop)
    for t in range(0, n_full - t_lo - 1):
        acc, l, m = walk_tile(acc, l, m, qs, desc_k, desc_v, k_base, v_base, stride_ks, stride_vs,
                              kv_row0, kv_col0, kv_lo + (t + 1) * BLOCK_N, rows, kv_hi, diag,
                              threshold, vote_limit, rebase, DTYPE, D, BLOCK_M, BLOCK_N, CAUSAL,
                              LAZY, False, False, USE_TMA, INTERPRET, ROW_SUM_FILTER, FLOOR)
    for t in range(tl.maximum(n_full, t_lo + 1), n_end):
        acc, l, m = walk_tile(acc, l, m, qs, desc_k, desc_v, k_base, v_base, stride_ks, stride_vs,
                              kv_row0, kv_col0, t * BLOCK_N, rows, kv_hi, diag, threshold,
                              vote_limit, rebase, DTYPE, D, BLOCK_M, BLOCK_N, CAUSAL, LAZY, False,
                              True, USE_TMA, INTERPRET, ROW_SUM_FILTER, FLOOR)
    return acc, l, m


@triton.jit
def load_q(q_base, stride_qs, rows, row_ok, scale_log2, D: tl.constexpr,
           DTYPE: tl.constexpr, INTERPRET: tl.constexpr):
    """Qs = round(Q * c) for ``rows`` of one (sequence, head); ``q_base`` points at row 0.
    Padding rows read 0 (and still vote, as the model's)."""
    ptrs = q_base + rows.to(tl.int64)[:, None] * stride_qs + tl.arange(0, D)[None, :]
    q = tl.load(ptrs, mask=row_ok[:, None], other=0.0)
    return round_input(q.to(tl.float32) * scale_log2, DTYPE, INTERPRET)


@triton.jit
def normalise(acc, l, DTYPE: tl.constexpr, INTERPRET: tl.constexpr):
    """out = round(O * (1/l if l > 0 else 0))."""
    inv = tl.where(l > 0, 1.0 / l, 0.0)
    return round_input(acc * inv[:, None], DTYPE, INTERPRET)


@triton.jit
def lse(l, m):
    """lse = m ln2 + ln l, natural log; -inf when l = 0."""
    return tl.where(l == 0, float("-inf"), m * 0.6931471805599453 + tl.log(l))


def set_block_shapes(nargs):
    """The tuner's pre-hook: TMA descriptors take the config's tile shape."""
    if isinstance(nargs["desc_k"], TensorDescriptor):
        shape = [nargs["BLOCK_N"], nargs["D"]]
        nargs["desc_k"].block_shape = shape
        nargs["desc_v"].block_shape = shape


def policy_args(policy: Policy, head_dim: int) -> tuple:
    """The bf16 kernels' run-time policy arguments: scale_log2, threshold, vote_limit and
    the rebase code (``Policy.codes``: 0 "max", 1 "tile")."""
    codes = policy.codes
    return (softmax_scale_log2(head_dim), codes.threshold, vote_limit(codes.threshold),
            codes.rebase)


def descriptors(k2d: torch.Tensor, v2d: torch.Tensor, head_dim: int, config: Config | None):
    """TMA descriptors over 2-D [rows, Hkv * D] views of K and V (the tuner's pre-hook re-sets
    their tile shape per config)."""
    block_n = config.block_n if config is not None else 64
    return (make_descriptor(k2d, [block_n, head_dim]),
            make_descriptor(v2d, [block_n, head_dim]))


def vote_limit(threshold: float) -> float:
    """The row-sum filter's bound: 2**threshold less 2**-12 relative (exp2 rounds), capped
    at the largest fp32 (a row sum of inf or NaN then still counts as a possible vote)."""
    try:
        limit = 2.0 ** threshold * (1.0 - 2.0 ** -12)
    except OverflowError:
        limit = math.inf
    return min(limit, FP32_MAX)


