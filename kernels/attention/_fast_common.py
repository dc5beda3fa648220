"""Pieces shared by the fast forward kernels (``fast_bf16``, ``fast_fp8``).

Device helpers (the 32-row wave vote, the tile loaders, explicit roundings for the
interpreter) and the host side: argument checks, launch configurations, and a way to run
a kernel through Triton's CPU interpreter without setting ``TRITON_INTERPRET``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from fa_lab import checks
from fa_lab.models import geometry
from fa_lab.policies import RescalePolicy

from ._triton_util import launch

try:  # host-side TMA descriptors: Triton >= 3.4 on Hopper and newer
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - the project needs triton >= 3.4
    TensorDescriptor = None

#: Rows that vote together, as one gfx950 wave does (fa_lab.models.geometry.WAVE_ROWS).
WAVE_ROWS = 32
#: How a lazy policy rebases the rows of a fired wave (a run-time kernel argument).
REBASE_RULES = {"lazy": 0, "lazy_unfixed": 1, "lazy_capped": 2}


@dataclass(frozen=True)
class Config:
    """One launch configuration: tile sizes, warps, pipeline depth, TMA or plain loads,
    and, for lazy policies, whether the fast path tests row sums instead of row maxes
    (``row_sum_filter``; same decisions either way, a different amount of work)."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    use_tma: bool
    row_sum_filter: bool = True

    def describe(self, lazy: bool = True) -> str:
        return (f"BM{self.block_m} BN{self.block_n} w{self.num_warps} s{self.num_stages}"
                f"{' tma' if self.use_tma else ''}{' rowsum' if lazy and self.row_sum_filter else ''}")

    def meta(self, lazy: bool) -> dict:
        """The kernel's launch keywords for this configuration."""
        return dict(BLOCK_M=self.block_m, BLOCK_N=self.block_n, USE_TMA=self.use_tma,
                    ROW_SUM_FILTER=bool(lazy and self.row_sum_filter),
                    num_warps=self.num_warps, num_stages=self.num_stages)


def autotuners(kernel, configs, key, pre_hook, row_sum_filters=(True, False)):
    """{lazy: autotuned kernel}: eager tries each config once; lazy tries each with every
    setting in ``row_sum_filters``. Both wrap the same JIT function (one compile cache)."""
    def triton_configs(lazy):
        out = []
        for c in configs:
            for flt in (row_sum_filters if lazy else (False,)):
                meta = Config(c.block_m, c.block_n, c.num_warps, c.num_stages, c.use_tma, flt).meta(lazy)
                nw, ns = meta.pop("num_warps"), meta.pop("num_stages")
                out.append(triton.Config(meta, num_warps=nw, num_stages=ns, pre_hook=pre_hook))
        return out
    return {lazy: triton.autotune(configs=triton_configs(lazy), key=key)(kernel) for lazy in (False, True)}


def _config_of(cfg) -> Config:
    kw = cfg.kwargs
    return Config(kw["BLOCK_M"], kw["BLOCK_N"], cfg.num_warps, cfg.num_stages, kw["USE_TMA"],
                  kw["ROW_SUM_FILTER"])


def tuned_config(tuner, key_prefix: tuple):
    """The autotuner's pick for a key that starts with ``key_prefix``, or None."""
    for key, cfg in tuner.cache.items():
        if tuple(key[:len(key_prefix)]) == key_prefix:
            return _config_of(cfg)
    return None


def tuning_timings(tuner, lazy: bool) -> list[dict]:
    """The autotuner's last measurements: one row per config (ms, median of its bench)."""
    rows = []
    for cfg, t in (getattr(tuner, "configs_timings", None) or {}).items():
        ms = t[0] if isinstance(t, (list, tuple)) else t
        rows.append({"config": _config_of(cfg).describe(lazy), "ms": float(ms)})
    return rows


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
    whole (one exchange, one barrier), and the last max stays inside each warp. In the
    sm_90 PTX (benchmarks/ptx_barriers.py) that, with V loaded before the vote, takes the
    fast kernel's lazy loop from 5 to 3 barriers per KV tile under Triton 3.6 (4 under 3.9;
    eager has 2 and 3).
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
    if TensorDescriptor is None:
        raise RuntimeError("TMA descriptors need triton >= 3.4 (triton.tools.tensor_descriptor)")
    return TensorDescriptor.from_tensor(t2d, list(block_shape))


def check_policy(policy, allowed: dict, kernel: str) -> None:
    if not isinstance(policy, RescalePolicy):
        raise TypeError(f"policy must be a fa_lab.policies.RescalePolicy, got {type(policy).__name__}")
    if policy.name not in allowed:
        raise ValueError(f"policy {policy.name!r} is not a {kernel} policy; choose one of {sorted(allowed)}")


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
    """Launch a fast kernel: autotuned (``config`` None; ``tuned`` from ``autotuners``),
    pinned, or through the interpreter. ``grid(block_m)`` gives the launch grid."""
    lazy = meta["LAZY"]
    if config is None:
        tuned[lazy][lambda nargs: grid(nargs["BLOCK_M"])](*args, **meta)
    elif interpret:
        run_interpreted(kernel, grid(config.block_m), *args, **meta, **config.meta(lazy))
    else:
        kernel[grid(config.block_m)](*args, **meta, **config.meta(lazy))


#: Split-K cuts each 256-row query block's KV walk into even numbers of 64-column tiles
#: (fa_lab.models.swp_bf16.split_ranges): boundaries fall on multiples of 128 columns, and
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
    if fp8 and config.block_n != 128:
        raise ValueError("the fp8 kernel decides its rescale per 128 columns (a pair of 64-column "
                         f"tiles, as the model); config.block_n must be 128, got {config.block_n}")
    return config
