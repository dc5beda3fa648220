"""Forward throughput of the fast Triton kernels beside their peers, in one run on one GPU,
timed in interleaved rounds.

Every implementation runs on the same inputs in the same process. The headline rows time
what a user calls: ``fa_lab.flash_attn_func(..., backend="fast")`` with the lazy and eager
policies (``api_lazy``, ``api_eager``) and on the same data quantised per tensor to fp8
(``api_fp8_lazy``): argument checks, routing, policy resolution and the kernel's own launch
work included. Beside them the kernels alone, their modules' ``forward`` called with a
resolved policy (``fast_lazy``, ``fast_lazy_unfixed``, ``fast_eager``, ``fast_fp8_lazy``,
``fast_fp8_eager``, and ``fast_fp8_lazy_vt`` given V already transposed, without the call's
V^T copy), torch SDPA with its FlashAttention and cuDNN backends, compiled
``flex_attention``, and the faithful Triton port (``faithful_lazy``, first shape only) when
it is importable. TFLOP/s counts ``4 B H Sq Skv D`` (halved when causal).

**Host time** (``host_time``). Each row also carries ``host_ms``, the wall time of one
Python call while the GPU is held busy: the timer below keeps launch overhead out of the
GPU times, so this column says where the host would set the pace of calls made back to
back (host_ms above the row's ms), and a sync inside a call shows there.

**Rounds** (``time_rounds``). Per shape, every implementation is first called once
(compile, autotune, and the output checked), then warmed for ``warmup`` ms, then timed in
``rounds`` rounds. Each round times every implementation once, for at least ``min_calls``
calls and ``rep`` ms, in an order rotated from round to round (``round_orders``: the
starting point moves through the list), so that a drift of the GPU (clocks, heat) hits
every implementation alike. A round's value is the median ms of its calls. Each row holds
the per-round values (``ms_rounds``, ``tflops_rounds``, ``calls_rounds``), their median
(``ms``; ``tflops`` is the FLOP count over that median ms) and their min and max. Ratios
between implementations are taken **within each round** (``A / B`` is B's ms over A's ms
in the same round: A's speed over B's, > 1 when A is faster; so ``fast_lazy /
fast_eager`` is eager's time over lazy's) and summarised by median and min-max over
rounds (``RATIO_PAIRS``; the table's ``attrs["ratios"]`` and the JSON's ``ratios``).

**Pairs** (``time_paired``). Under a power cap the SM clock swings by more than 10 %
within a round, so two implementations timed a few hundred ms apart can meet different
clocks; for pairs whose difference is smaller than that (``PAIRED_RATIOS``: one kernel
under two policies) the rounds are followed by as many rounds of those pairs timed
call-alternated: A B A B ..., one call of each per cycle (B leading in rounds 2, 4, ...), each
call flushed and timed alone, so both see the same clocks; a round's ratio is B's median
ms over A's (the JSON's ``paired_ratios``).

**Timer** (``fa_lab.timing``). On a CUDA device (``CudaTimer``): CUDA events around each
call, the L2 flushed before each call (a 256 MB memset, as ``triton.testing.do_bench``),
and a spin kernel (``torch.cuda._sleep``) ahead of each chunk of calls, sized from the
host's measured enqueue time, so that the host stays ahead of the GPU and launch overhead
does not enter the timing. On the CPU (``CpuTimer``): ``time.perf_counter`` around each
call, the same rounds, warm-up and statistics (what the CPU tests exercise).

**Clocks** (``gpu_clocks``). The GPU's SM clock, its maximum, the memory clock,
temperature, power and active clock-event (throttle) reasons are read at the start and end
of each shape's rounds: through pynvml where it imports, else ``nvidia-smi``, else
``torch.cuda.clock_rate`` (SM clock only); the reading names its ``source``. With pynvml a
thread also samples the SM clock every 50 ms during the rounds (``ClockSampler``), giving
each round's min / median / max clock: a slow round under a lower clock is drift, a ratio
that holds in every round under the same clocks is real.

**Correctness beside speed.** Every row carries ``rel_l2``: its output against fp32
attention (``fa_lab.reference.attention``, IEEE fp32 products) of the same bf16 inputs, on
a sub-sample of heads (``reference_heads``: evenly spaced, all of them below
``REF_SCORE_BUDGET`` (query, key) pairs x heads). fp8 rows also carry ``rel_l2_dequant``,
against fp32 attention of their own quantised inputs (the kernel's error without the
quantisation's). The autotuner's pick is each fast row's ``config``.

Suites (``SUITES``; ``fa-lab bench --suite dense,splitk,varlen``): ``dense`` is the above,
at the shapes of ``SHAPES`` (issue 14's table: B2 S8192 H32 D128 non-causal and causal,
B4 S4096 H32 Hkv8 (GQA) D128 causal, B4 S4096 H32 D64, B16 S1024 H16 D128 causal,
B1 S16384 H32 D128, and B1 S61380 H32 D128 causal).
``splitk`` is two decode-like long-KV shapes (B1 Sq512 Skv65536 D128, non-causal, H32 and
H8: 128 and 32 programs of 128 query rows for an H200's 132 SMs) where the fast kernel
runs dense (``fast_lazy``) and with 2, 4, 8 KV splits (``fast_lazy_split<S>``), beside
SDPA and flex.
``varlen`` is a packed batch of 8 sequences of 1k..8k tokens (``VARLEN_LENGTHS``, ~32k in
all), causal and not: the fast varlen kernel in one launch (``fast_lazy_varlen``) beside the
dense kernel called once per sequence (``fast_lazy``), SDPA once per sequence
(``sdpa_flash`` and ``sdpa_cudnn``) and flex with a document mask (``flex``, one call).
Per-sequence loops return their outputs unpacked (no copy is timed); the varlen kernel
checks its offsets on the host, one small copy back per call, as timed.
Rows carry ``suite``, ``Skv``, ``Hkv``, ``lengths`` and ``flops`` besides the dense columns.
"""

from __future__ import annotations

import importlib
import itertools
import math
import statistics
import subprocess
import threading
import time
from dataclasses import asdict, dataclass, field

import pandas as pd
import torch
from tqdm.auto import tqdm

from fa_lab import policies, reference
from fa_lab.studies.experiments import quantize_e4m3, save_result
from fa_lab.timing import CpuTimer, CudaTimer, measure, measure_cycle


@dataclass(frozen=True)
class Shape:
    """B, S (= Sq), H, D, causal; ``Skv`` when the KV length differs from S; ``lengths``
    for a packed (varlen) batch of B sequences with equal q and kv lengths (S is then the
    longest); ``Hkv`` when K and V have fewer heads than Q (GQA / MQA: q head h reads kv
    head h // (H / Hkv))."""

    B: int
    S: int
    H: int
    D: int
    causal: bool
    Skv: int | None = None
    lengths: tuple[int, ...] | None = None
    Hkv: int | None = None

    def __post_init__(self):
        if self.Hkv is not None and (self.Hkv < 1 or self.H % self.Hkv):
            raise ValueError(f"Hkv={self.Hkv} must divide H={self.H}")

    @property
    def seqlen_kv(self) -> int:
        return self.S if self.Skv is None else self.Skv

    @property
    def heads_kv(self) -> int:
        return self.H if self.Hkv is None else self.Hkv

    @property
    def varlen(self) -> bool:
        return self.lengths is not None

    @property
    def name(self) -> str:
        kv = f" Hkv{self.Hkv}" if self.Hkv is not None else ""
        tail = f"H{self.H}{kv} D{self.D}{' causal' if self.causal else ''}"
        if self.varlen:
            return f"varlen B{self.B} T{sum(self.lengths)} Smax{self.S} {tail}"
        if self.Skv is not None:
            return f"B{self.B} Sq{self.S} Skv{self.Skv} {tail}"
        return f"B{self.B} S{self.S} {tail}"

    def flops(self) -> float:
        """4 B H Sq Skv D: two matrix products of 2 B H Sq Skv D each (per sequence when
        packed); half when causal (the convention, for Sq = Skv)."""
        if self.varlen:
            f = sum(4.0 * self.H * n * n * self.D for n in self.lengths)
        else:
            f = 4.0 * self.B * self.H * self.S * self.seqlen_kv * self.D
        return f / 2 if self.causal else f


def varlen_shape(lengths, H: int, D: int, causal: bool) -> Shape:
    lengths = tuple(int(n) for n in lengths)
    return Shape(len(lengths), max(lengths), H, D, causal, lengths=lengths)


#: The dense suite: issue 14's shapes (long and short sequences, GQA, D64), then
#: S = 61,380 (not a multiple of 64; one of upstream's MI355X throughput claims) with
#: B = 1, H = 32, causal: 0.5 GB per tensor, ~31 TFLOP.
SHAPES = (
    Shape(2, 8192, 32, 128, False),
    Shape(2, 8192, 32, 128, True),
    Shape(4, 4096, 32, 128, True, Hkv=8),
    Shape(4, 4096, 32, 64, False),
    Shape(16, 1024, 16, 128, True),
    Shape(32, 512, 32, 128, True),
    Shape(1, 16384, 32, 128, False),
    Shape(1, 61380, 32, 128, True),
)
#: Split-K's case: few query blocks, a long KV walk (Sq >= 384, as upstream's split-K needs).
#: With 128-row blocks, H32 gives 128 programs (about one per H200 SM: dense already fills
#: the GPU once), H8 gives 32 (a quarter of it: where splitting the walk should pay).
SPLITK_SHAPES = (Shape(1, 512, 32, 128, False, Skv=65536), Shape(1, 512, 8, 128, False, Skv=65536))
#: Eight sequence lengths between 1k and 8k, fixed (mostly not multiples of 64): 32,250 tokens.
VARLEN_LENGTHS = (1111, 7777, 3000, 5321, 2048, 6100, 4093, 2800)
VARLEN_SHAPES = (varlen_shape(VARLEN_LENGTHS, 32, 128, False),
                 varlen_shape(VARLEN_LENGTHS, 32, 128, True))

#: The headline rows: ``fa_lab.flash_attn_func(..., backend="fast")``, what a user calls
#: (checks, routing, policy resolution and the kernel's own launch work included).
API_BF16 = {"api_lazy": "lazy", "api_eager": "eager"}
API_FP8 = {"api_fp8_lazy": "lazy"}
API = (*API_BF16, *API_FP8)
#: The kernels alone: the kernel modules' ``forward``, called with a resolved policy.
FAST_BF16 = {"fast_lazy": "lazy", "fast_lazy_unfixed": "lazy_unfixed", "fast_eager": "eager"}
FAST_FP8 = {"fast_fp8_lazy": "lazy", "fast_fp8_eager": "eager", "fast_fp8_lazy_vt": "lazy"}
#: fp8 rows whose V comes already transposed (``TransposedV``, made once outside the
#: timing): the kernel without its per-call V^T copy, as for a V that several calls read.
FP8_STORED_V = ("fast_fp8_lazy_vt",)
FAST_SPLITK = {"fast_lazy_split2": 2, "fast_lazy_split4": 4, "fast_lazy_split8": 8}
FAST_VARLEN = {"fast_lazy_varlen": "lazy"}
PEERS = ("sdpa_flash", "sdpa_cudnn", "flex")
FAITHFUL = "faithful_lazy"
#: The dense suite's implementations (the default): the API rows, the kernels alone beside
#: them, SDPA's two backends, and the faithful port at the first shape.
IMPLS = (*API, "fast_lazy", "fast_eager", "fast_fp8_lazy", "fast_fp8_lazy_vt", "sdpa_flash",
         "sdpa_cudnn", FAITHFUL)
#: Every implementation, in table order.
ALL_IMPLS = (*API, *FAST_BF16, *FAST_SPLITK, *FAST_VARLEN, *FAST_FP8, *PEERS, FAITHFUL)
#: What is timed on fp8 inputs (the same data, quantised per tensor).
FP8_IMPLS = (*API_FP8, *FAST_FP8)
#: What runs on a packed batch: the varlen kernel, and per-sequence loops / a document mask.
VARLEN_CAPABLE = (*FAST_BF16, *FAST_VARLEN, *PEERS)
#: What a suite's columns mean where it differs from the dense suite (printed with its table).
SUITE_NOTES = {"varlen": "fast_lazy and sdpa_* run once per sequence; flex with a document mask"}
SUITES = {
    "dense": (SHAPES, IMPLS),
    "splitk": (SPLITK_SHAPES, ("fast_lazy", *FAST_SPLITK, *PEERS)),
    "varlen": (VARLEN_SHAPES, ("fast_lazy", *FAST_VARLEN, "sdpa_flash", "sdpa_cudnn", "flex")),
}
#: The row every other is compared with, per round (``ratio_pairs``): the API's lazy call,
#: or where a suite has no API rows the lazy kernel alone.
HEADLINE = "api_lazy"


def headline(impls) -> str | None:
    """The row a table's ratios are taken against: ``HEADLINE``, else ``fast_lazy``."""
    return next((i for i in (HEADLINE, "fast_lazy") if i in impls), None)
#: Per-round ratios besides ``HEADLINE`` against every other implementation
#: (``ratio_pairs``): the API against its kernel alone, fp8 against bf16, and the kernels'
#: own comparisons.
EXTRA_RATIO_PAIRS = (
    ("api_fp8_lazy", "api_lazy"),
    ("api_fp8_lazy", "fast_fp8_lazy"),
    ("api_fp8_lazy", "sdpa_cudnn"),
    ("api_eager", "fast_eager"),
    ("fast_lazy", "sdpa_cudnn"),
    ("fast_lazy", "fast_eager"),
    ("fast_lazy", "fast_lazy_unfixed"),
    ("fast_fp8_lazy", "fast_lazy"),
    ("fast_fp8_lazy", "sdpa_cudnn"),
    ("fast_fp8_lazy", "fast_fp8_eager"),
    ("fast_fp8_lazy_vt", "fast_lazy"),
    ("fast_fp8_lazy_vt", "fast_fp8_lazy"),
    ("fast_eager", "sdpa_cudnn"),
    ("fast_lazy_varlen", "sdpa_cudnn"),
)

#: Pairs also timed call-alternated (``time_paired``): the same kernel under two policies,
#: or with and without its V^T copy, whose difference can be smaller than the clock's swing
#: under a power cap between two implementations' turns in a round.
PAIRED_RATIOS = (
    ("api_lazy", "fast_lazy"),
    ("api_lazy", "api_eager"),
    ("api_fp8_lazy", "fast_fp8_lazy"),
    ("fast_lazy", "fast_lazy_unfixed"),
    ("fast_lazy", "fast_eager"),
    ("fast_fp8_lazy", "fast_fp8_eager"),
    ("fast_fp8_lazy_vt", "fast_fp8_lazy"),
)


def applies(impl: str, shape: Shape) -> bool:
    """Whether ``impl`` runs on ``shape`` (varlen kernels need packed batches, which only
    they, the per-sequence loops and flex take; split-K needs Sq >= 384)."""
    if shape.varlen:
        return impl in VARLEN_CAPABLE
    if impl in FAST_SPLITK:
        return shape.S >= 384
    return impl not in FAST_VARLEN


def suite_jobs(suites=("dense",), impls=None) -> list[tuple[str, Shape, tuple[str, ...]]]:
    """(suite, shape, implementations) for each shape of the named suites, in order: the
    suite's own implementations, or those of ``impls`` that apply to the shape."""
    unknown = [s for s in suites if s not in SUITES]
    if unknown:
        raise ValueError(f"unknown suites {unknown}; choose from {tuple(SUITES)}")
    if impls is not None:
        _check_impls(impls)
    jobs = []
    for name in suites:
        shapes, own = SUITES[name]
        for shape in shapes:
            chosen = own if impls is None else tuple(i for i in impls if applies(i, shape))
            jobs.append((name, shape, tuple(chosen)))
    return jobs


def _check_impls(impls):
    unknown = [i for i in impls if i not in ALL_IMPLS]
    if unknown:
        raise ValueError(f"unknown implementations {unknown}; choose from {ALL_IMPLS}")


class Unavailable(RuntimeError):
    """An implementation that cannot run here (the reason goes into the table)."""


def _fast_module(name):
    """A fast kernel module by its path under fa_lab.kernels ("swp_bf16.fast", ...)."""
    return importlib.import_module(f"fa_lab.kernels.{name}")


def _faithful_module():
    try:
        return importlib.import_module("fa_lab.kernels.swp_bf16.faithful")
    except ImportError as e:
        raise Unavailable(f"fa_lab.kernels.swp_bf16.faithful is not importable ({e})") from None


_FLEX = {}


#: torch.compile recompiles flex per shape (dynamic=False); past dynamo's recompile limit
#: (8 by default: fewer than the suites' shapes together) it would fall back to eager
#: flex, which materialises the scores. The benchmark raises the limit to this.
FLEX_RECOMPILE_LIMIT = 64


def _flex_fn():
    if "fn" not in _FLEX:
        import torch._dynamo.config as dynamo_config
        from torch.nn.attention.flex_attention import flex_attention
        for name in ("recompile_limit", "cache_size_limit"):  # the newer name, the older
            if hasattr(dynamo_config, name):
                setattr(dynamo_config, name, max(getattr(dynamo_config, name), FLEX_RECOMPILE_LIMIT))
        _FLEX["fn"] = torch.compile(flex_attention, dynamic=False)
    return _FLEX["fn"]


def _causal_mask(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


@dataclass
class Inputs:
    """One shape's inputs: q [B, S, H, D], k and v [B, Skv, Hkv, D] bf16; packed [T, H, D]
    with int32 offsets ``cu`` for a varlen shape; the fp8 quantisation when asked for
    (``((q8, k8, v8), (q_descale, k_descale, v_descale))``)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    cu: torch.Tensor | None = None
    fp8: tuple | None = None

    def spans(self, shape: Shape):
        """(start, end) token rows of each packed sequence."""
        ends = list(itertools.accumulate(shape.lengths))
        return list(zip([0, *ends[:-1]], ends))


def _bf16_policy(rescale: str, shape: Shape):
    return policies.resolve(fp8=False, seqlen_kv=shape.seqlen_kv, rescale=rescale)


def _runner(impl: str, shape: Shape, inp: Inputs):
    """A no-argument callable running ``impl`` once, returning out [B, S, H, D] (packed:
    [T, H, D], or a list of per-sequence [L, H, D] for the per-sequence loops). A runner
    may carry a ``note`` (how it had to run), which goes into its row."""
    if shape.varlen:
        return _varlen_runner(impl, shape, inp)
    q, k, v = inp.q, inp.k, inp.v
    causal = shape.causal
    if causal and shape.S != shape.seqlen_kv and impl in PEERS:
        raise Unavailable("SDPA's and this flex mask's causal diagonal is top-left; the kernels' "
                          "is bottom-right: they differ when Sq != Skv")
    if impl in API_BF16:
        from fa_lab.api import flash_attn_func
        rescale = API_BF16[impl]
        return lambda: flash_attn_func(q, k, v, causal=causal, rescale=rescale, backend="fast")
    if impl in API_FP8:
        from fa_lab.api import flash_attn_func
        (q8, k8, v8), (qd, kd, vd) = inp.fp8
        rescale = API_FP8[impl]
        return lambda: flash_attn_func(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd,
                                       causal=causal, rescale=rescale, backend="fast")
    if impl in FAST_BF16:
        mod = _fast_module("swp_bf16.fast")
        pol = _bf16_policy(FAST_BF16[impl], shape)
        return lambda: mod.forward(q, k, v, causal=causal, policy=pol)[0]
    if impl in FAST_SPLITK:
        mod, splits = _fast_module("swp_bf16.fast"), FAST_SPLITK[impl]
        pol = _bf16_policy("lazy", shape)
        return lambda: mod.forward(q, k, v, causal=causal, policy=pol, num_kv_splits=splits)[0]
    if impl in FAST_FP8:
        mod = _fast_module("swp_fp8.fast")
        (q8, k8, v8), (qd, kd, vd) = inp.fp8
        pol = policies.resolve(fp8=True, seqlen_kv=shape.seqlen_kv, rescale=FAST_FP8[impl])
        if impl in FP8_STORED_V:
            v8 = mod.TransposedV.from_v(v8)
        return lambda: mod.forward(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd,
                                   causal=causal, policy=pol)[0]
    if impl == FAITHFUL:
        mod = _faithful_module()
        pol = _bf16_policy("lazy", shape)
        return lambda: mod.forward(q, k, v, causal=causal, policy=pol)[0]
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))  # [B, H, S, D] views
    gqa = shape.heads_kv != shape.H
    if impl in ("sdpa_flash", "sdpa_cudnn"):
        use, sdpa = _sdpa(impl)

        def run():
            with use():
                return sdpa(qt, kt, vt, is_causal=causal, **({"enable_gqa": True} if gqa else {})
                            ).transpose(1, 2)
        if not gqa:
            return run
        try:
            run()  # a backend without a GQA kernel refuses here
            return run
        except RuntimeError as e:
            why = str(e).splitlines()[0][:120] if str(e) else type(e).__name__
        ke, ve = (x.repeat_interleave(shape.H // shape.heads_kv, dim=1) for x in (kt, vt))

        def run_expanded():
            with use():
                return sdpa(qt, ke, ve, is_causal=causal).transpose(1, 2)
        run_expanded.note = (f"K and V expanded to {shape.H} heads outside the timing: "
                             f"enable_gqa refused ({why})")
        return run_expanded
    if impl == "flex":
        block_mask = None
        if causal:
            from torch.nn.attention.flex_attention import create_block_mask
            block_mask = create_block_mask(_causal_mask, None, None, shape.S, shape.seqlen_kv,
                                           device=q.device)
        flex = _flex_fn()
        kw = {"enable_gqa": True} if gqa else {}
        return lambda: flex(qt, kt, vt, block_mask=block_mask, **kw).transpose(1, 2)
    raise ValueError(f"unknown implementation {impl!r}; choose from {ALL_IMPLS}")


def _sdpa(impl):
    """(a context selecting ``impl``'s SDPA backend, the SDPA function)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    backend = SDPBackend.FLASH_ATTENTION if impl == "sdpa_flash" else SDPBackend.CUDNN_ATTENTION
    return (lambda: sdpa_kernel(backend)), torch.nn.functional.scaled_dot_product_attention


def _varlen_runner(impl: str, shape: Shape, inp: Inputs):
    q, k, v, causal = inp.q, inp.k, inp.v, shape.causal
    spans = inp.spans(shape)
    if impl in FAST_VARLEN:
        mod = _fast_module("swp_bf16.fast")
        pol = _bf16_policy(FAST_VARLEN[impl], shape)
        return lambda: mod.forward_varlen(q, k, v, inp.cu, inp.cu, shape.S, None, causal=causal,
                                          policy=pol)[0]
    if impl in FAST_BF16:  # the dense kernel once per sequence
        mod = _fast_module("swp_bf16.fast")
        pol = _bf16_policy(FAST_BF16[impl], shape)
        return lambda: [mod.forward(q[None, a:b], k[None, a:b], v[None, a:b], causal=causal,
                                    policy=pol)[0][0] for a, b in spans]
    if impl in ("sdpa_flash", "sdpa_cudnn"):  # once per sequence
        use, sdpa = _sdpa(impl)
        heads_first = [tuple(x[a:b].transpose(0, 1)[None] for x in (q, k, v)) for a, b in spans]

        def run():
            with use():
                return [sdpa(*qkv, is_causal=causal)[0].transpose(0, 1) for qkv in heads_first]
        return run
    if impl == "flex":  # one call, a document mask
        from torch.nn.attention.flex_attention import create_block_mask
        doc = torch.repeat_interleave(torch.arange(len(spans), device=q.device),
                                      torch.tensor(shape.lengths, device=q.device))

        def mask(b, h, q_idx, kv_idx):
            same = doc[q_idx] == doc[kv_idx]
            return same & (q_idx >= kv_idx) if causal else same
        total = q.shape[0]
        block_mask = create_block_mask(mask, None, None, total, total, device=q.device)
        flex = _flex_fn()
        qt, kt, vt = (x[None].transpose(1, 2) for x in (q, k, v))
        return lambda: flex(qt, kt, vt, block_mask=block_mask)[0].transpose(0, 1)
    raise Unavailable(f"{impl} does not run on packed (varlen) batches")


def _packed(out):
    """A runner's output as one tensor (per-sequence lists concatenated, outside timing)."""
    return torch.cat(out, 0) if isinstance(out, list) else out


def _inputs(shape: Shape, device, seed: int, fp8: bool = False) -> Inputs:
    g = torch.Generator(device=device)
    g.manual_seed(seed)

    def randn(*dims):
        return torch.randn(dims, generator=g, device=device, dtype=torch.bfloat16)
    if shape.varlen:
        total = sum(shape.lengths)
        q = randn(total, shape.H, shape.D)
        k, v = (randn(total, shape.heads_kv, shape.D) for _ in range(2))
        cu = torch.tensor([0, *itertools.accumulate(shape.lengths)], dtype=torch.int32, device=device)
        return Inputs(q, k, v, cu=cu)
    q = randn(shape.B, shape.S, shape.H, shape.D)
    k, v = (randn(shape.B, shape.seqlen_kv, shape.heads_kv, shape.D) for _ in range(2))
    inp = Inputs(q, k, v)
    if fp8:
        inp.fp8 = tuple(zip(*(quantize_e4m3(x.float()) for x in (q, k, v))))
    return inp


# ---- the fp32 reference ----------------------------------------------------------------------

#: The fp32 reference scores at most this many (query, key) pairs x heads: beyond it, it
#: runs on an evenly spaced sub-sample of heads (``reference_heads``). 2**34 takes every
#: head of every dense shape but the longest (B1 S61380: 4 of 32 heads).
REF_SCORE_BUDGET = 2**34


def reference_heads(shape: Shape, budget: int = REF_SCORE_BUDGET) -> list[int]:
    """The query heads the fp32 reference covers: all of them when ``shape`` scores at most
    ``budget`` (query, key) pairs x heads, else as many as fit (at least one), evenly spaced
    from head 0 to head H - 1."""
    per_head = sum(n * n for n in shape.lengths) if shape.varlen else shape.B * shape.S * shape.seqlen_kv
    n = max(1, min(shape.H, budget // per_head))
    if n >= shape.H:
        return list(range(shape.H))
    if n == 1:
        return [0]
    return [round(i * (shape.H - 1) / (n - 1)) for i in range(n)]


def _take_heads(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``x`` [..., heads, D] at heads ``idx`` (fp8 through a byte view: index_select has no
    fp8 kernel everywhere)."""
    if x.element_size() == 1 and x.is_floating_point():
        return x.view(torch.uint8).index_select(-2, idx).view(x.dtype)
    return x.index_select(-2, idx)


def _reference(shape: Shape, inp: Inputs, heads, *, fp8: bool = False) -> torch.Tensor:
    """fp32 attention (``fa_lab.reference.attention``) of query heads ``heads``: of the bf16
    inputs, or of their fp8 quantisation dequantised (``fp8``). [B, S, len(heads), D], or
    packed [T, len(heads), D] for a varlen shape."""
    hq = torch.tensor(heads, device=inp.q.device, dtype=torch.long)
    hk = hq // (shape.H // shape.heads_kv)  # each sampled q head with its own kv head
    if fp8:
        (q, k, v), (qd, kd, vd) = inp.fp8
        scales = dict(q_descale=qd, k_descale=kd, v_descale=vd)
    else:
        q, k, v, scales = inp.q, inp.k, inp.v, {}
    q, k, v = _take_heads(q, hq), _take_heads(k, hk), _take_heads(v, hk)
    if not shape.varlen:
        return reference.attention(q, k, v, causal=shape.causal, **scales)[0]
    return torch.cat([reference.attention(q[None, a:b], k[None, a:b], v[None, a:b],
                                          causal=shape.causal, **scales)[0][0]
                      for a, b in inp.spans(shape)], 0)


def _rel_l2(out, ref, heads=None) -> float:
    """||out - ref|| / ||ref|| in fp32 (NaN when ``out`` holds a non-finite value); with
    ``heads``, ``out`` is first cut to those heads (its dim -2), as ``ref`` was."""
    o = _packed(out)
    if heads is not None:
        o = o.index_select(-2, torch.tensor(heads, device=o.device, dtype=torch.long))
    o, r = o.float(), ref.float()
    if not bool(torch.isfinite(o).all()):
        return math.nan
    return float(torch.linalg.vector_norm(o - r) / torch.linalg.vector_norm(r))


def _fast_config(impl, shape, inp: Inputs):
    """The autotuner's pick for a fast kernel, as text (None for others, and for the
    per-sequence loops: one pick per length)."""
    lazy = True
    if impl in API:  # the API runs the kernel module, under the same tuner
        impl = {"api_lazy": "fast_lazy", "api_eager": "fast_eager", "api_fp8_lazy": "fast_fp8_lazy"}[impl]
    if impl in FAST_BF16 and not shape.varlen:
        lazy = FAST_BF16[impl] != "eager"
        cfg = _fast_module("swp_bf16.fast").best_config(inp.q, inp.k, shape.causal, lazy)
    elif impl in FAST_SPLITK:
        cfg = _fast_module("swp_bf16.splitk").best_config(inp.q, inp.k, shape.causal, lazy,
                                                           FAST_SPLITK[impl])
    elif impl in FAST_VARLEN:
        cfg = _fast_module("swp_bf16.varlen").best_config(inp.q, inp.k, shape.S, shape.S,
                                                           shape.causal, lazy)
    elif impl in FAST_FP8:
        lazy = FAST_FP8[impl] != "eager"
        (q8, k8, _), _ = inp.fp8
        cfg = _fast_module("swp_fp8.fast").best_config(q8, k8, shape.causal, lazy)
    else:
        return None
    return None if cfg is None else cfg.describe(lazy)


def _tuning(impl, shape):
    """The autotuner's timings of every config at its last new key (fast kernels;
    lazy_unfixed shares lazy's tuning, and fp8 with V stored transposed fp8 lazy's;
    per-sequence loops tune once per length)."""
    if impl in FAST_BF16 and impl != "fast_lazy_unfixed" and not shape.varlen:
        return _fast_module("swp_bf16.fast").tuning_timings(FAST_BF16[impl] != "eager")
    if impl in FAST_SPLITK:
        return _fast_module("swp_bf16.splitk").tuning_timings(True)
    if impl in FAST_VARLEN:
        return _fast_module("swp_bf16.varlen").tuning_timings(True)
    if impl in FAST_FP8 and impl not in FP8_STORED_V:
        return _fast_module("swp_fp8.fast").tuning_timings(FAST_FP8[impl] != "eager")
    return None


# ---- interleaved rounds -------------------------------------------------------------------------

def round_orders(impls, rounds: int) -> list[list[str]]:
    """The order of each round: ``impls`` rotated to start at offset ``r * n // rounds``
    in round r (n implementations), so that over the rounds the starting points spread
    evenly through the list (with more rounds than implementations: offset r mod n)."""
    impls = list(impls)
    n = len(impls)
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    if n == 0:
        return [[] for _ in range(rounds)]
    orders = []
    for r in range(rounds):
        k = (r * n // rounds) % n if rounds <= n else r % n
        orders.append(impls[k:] + impls[:k])
    return orders


@dataclass
class Rounds:
    """What ``time_rounds`` measured: per implementation and round, the median ms of that
    round's calls and their number (None where it was not timed: it failed, in that round
    or before); each round's order and its (start, end) ``time.perf_counter`` readings;
    the error of each implementation that failed."""

    impls: list[str]
    orders: list[list[str]]
    ms: dict[str, list[float | None]]
    calls: dict[str, list[int | None]]
    spans: list[tuple[float, float]] = field(default_factory=list)
    errors: dict[str, str] = field(default_factory=dict)


def _err(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"


def time_rounds(fns: dict, *, rounds: int = 5, min_calls: int = 10, min_ms: float = 100.0,
                warmup_ms: float = 25.0, timer=None, max_calls: int = 10_000,
                on_step=None) -> Rounds:
    """Time each of ``fns`` ({name: no-argument callable}) in ``rounds`` interleaved rounds:
    first ``warmup_ms`` ms of untimed calls each (at least one), then in each round every
    implementation once, in ``round_orders``' rotated order, by ``measure`` (at least
    ``min_calls`` calls and ``min_ms`` ms). An implementation that raises is left out of
    the rounds after (its error in ``errors``). ``timer``: ``CpuTimer()`` by default.
    ``on_step(round, impl)`` is called after each timing (round -1: warm-up)."""
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    if min_calls < 1:
        raise ValueError(f"min_calls must be >= 1, got {min_calls}")
    if min_ms < 0 or warmup_ms < 0:
        raise ValueError(f"min_ms and warmup_ms must be >= 0, got {min_ms}, {warmup_ms}")
    timer = CpuTimer() if timer is None else timer
    impls = list(fns)
    res = Rounds(impls, round_orders(impls, rounds), {i: [None] * rounds for i in impls},
                 {i: [None] * rounds for i in impls})
    for impl in impls:
        try:
            first = timer.probe(fns[impl])
            more = math.ceil(warmup_ms / first) - 1 if first > 0 else 0
            if more > 0:
                timer.times(fns[impl], min(more, max_calls))
        except Exception as e:  # an OOM, a kernel that fails at this shape ...
            res.errors[impl] = f"warm-up: {_err(e)}"
        if on_step is not None:
            on_step(-1, impl)
    for r, order in enumerate(res.orders):
        t0 = time.perf_counter()
        for impl in order:
            if impl not in res.errors:
                try:
                    res.ms[impl][r], res.calls[impl][r] = measure(
                        fns[impl], timer, min_calls=min_calls, min_ms=min_ms, max_calls=max_calls)
                except Exception as e:
                    res.errors[impl] = f"round {r + 1}: {_err(e)}"
            if on_step is not None:
                on_step(r, impl)
        res.spans.append((t0, time.perf_counter()))
    return res


def time_paired(fns: dict, pairs, *, rounds: int = 5, min_calls: int = 10, min_ms: float = 100.0,
                timer=None, max_calls: int = 10_000, on_step=None) -> dict:
    """``a / b`` for each (a, b) of ``pairs`` (names in ``fns``) in ``rounds`` rounds of
    ``measure_cycle`` of (a, b) (b's median ms over a's, each round; b leads the cycles in rounds
    2, 4, ...): {(a, b): {"rounds": [ratio or None], "calls": [cycles or None], "error":
    text or None}}. A pair whose call raises, or whose a takes 0 ms (no ratio), is left out
    of the rounds after, with the reason in "error".
    ``on_step(round, pair)`` is called after each measurement."""
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    if min_calls < 1:
        raise ValueError(f"min_calls must be >= 1, got {min_calls}")
    pairs = [tuple(p) for p in pairs]
    unknown = sorted({i for p in pairs for i in p} - set(fns))
    if unknown:
        raise ValueError(f"pairs name implementations not in fns: {unknown}")
    if any(len(p) != 2 or p[0] == p[1] for p in pairs):
        raise ValueError(f"each pair must name two different implementations, got {pairs}")
    timer = CpuTimer() if timer is None else timer
    out = {p: {"rounds": [None] * rounds, "calls": [None] * rounds, "error": None} for p in pairs}
    for r in range(rounds):
        for p in pairs:
            res = out[p]
            if res["error"] is None:
                try:
                    (ma, mb), n = measure_cycle([fns[p[0]], fns[p[1]]], timer, min_calls=min_calls,
                                                min_ms=min_ms, max_calls=max_calls, lead=r % 2)
                except Exception as e:
                    res["error"] = f"round {r + 1}: {_err(e)}"
                else:
                    res["calls"][r] = n
                    if ma > 0:
                        res["rounds"][r] = mb / ma
                    else:
                        res["error"] = f"round {r + 1}: {p[0]} took 0 ms, no ratio"
            if on_step is not None:
                on_step(r, p)
    return out


def spread(values) -> dict:
    """median, min, max and count of the values that are not None (all None when none is)."""
    v = [x for x in values if x is not None]
    if not v:
        return {"median": None, "min": None, "max": None, "n": 0}
    return {"median": statistics.median(v), "min": min(v), "max": max(v), "n": len(v)}


#: Probes behind each row's host time.
HOST_PROBES = 7


def host_time(fn, timer, probes: int = HOST_PROBES) -> float:
    """The median host time of one call of ``fn`` in ms: the wall time of the Python call
    alone, measured by ``timer.probe`` (on a GPU, with a spin kernel holding the GPU so the
    call never waits for the queue: a sync inside the call shows as waiting for the spin).
    In a loop of calls without gaps, a call whose host time exceeds its GPU time leaves the
    GPU idle: the host, not the kernel, then sets the pace."""
    out = []
    for _ in range(probes):
        timer.probe(fn)
        out.append(timer.host_ms)
    return statistics.median(out)


def ratio_rounds(ms: dict, a: str, b: str) -> list[float | None]:
    """``a / b`` in each round: b's ms over a's ms (a's speed over b's), None where either
    was not timed."""
    return [None if x is None or y is None or x == 0 else y / x for x, y in zip(ms[a], ms[b])]


def ratio_pairs(impls) -> list[tuple[str, str]]:
    """The (a, b) pairs whose per-round ratio ``a / b`` is reported: ``HEADLINE`` against
    every other implementation, then ``EXTRA_RATIO_PAIRS``, where both are present."""
    impls = list(impls)
    base = headline(impls)
    pairs = [(base, i) for i in impls if i != base] if base else []
    pairs += [p for p in EXTRA_RATIO_PAIRS if p[0] in impls and p[1] in impls and p not in pairs]
    return pairs


# ---- GPU clocks ------------------------------------------------------------------------------

#: NVML's clock-event (throttle) reason bits.
CLOCK_REASONS = {0x1: "gpu_idle", 0x2: "applications_clocks_setting", 0x4: "sw_power_cap",
                 0x8: "hw_slowdown", 0x10: "sync_boost", 0x20: "sw_thermal_slowdown",
                 0x40: "hw_thermal_slowdown", 0x80: "hw_power_brake_slowdown",
                 0x100: "display_clock_setting"}


def clock_reasons(mask) -> list[str] | None:
    """The names of the reason bits set in ``mask`` (unknown bits as hex), None for None."""
    if mask is None:
        return None
    mask = int(mask)
    names = [n for bit, n in CLOCK_REASONS.items() if mask & bit]
    rest = mask & ~sum(CLOCK_REASONS)
    return names + ([hex(rest)] if rest else [])


def _cuda_index(device) -> int:
    dev = torch.device(device)
    return torch.cuda.current_device() if dev.index is None else dev.index


def _gpu_uuid(device) -> str | None:
    """The device's UUID as NVML and nvidia-smi name it (``GPU-...``), or None."""
    try:
        u = str(torch.cuda.get_device_properties(_cuda_index(device)).uuid)
    except Exception:
        return None
    return u if u.startswith("GPU-") else f"GPU-{u}"


_NVML: dict = {}


def _nvml(device):
    """(pynvml, the device's NVML handle), found by UUID (CUDA and NVML may number GPUs
    differently), else by torch's NVML index, else by the CUDA index."""
    import pynvml
    if "init" not in _NVML:
        pynvml.nvmlInit()
        _NVML["init"] = True
    idx = _cuda_index(device)
    if idx not in _NVML:
        try:
            _NVML[idx] = pynvml.nvmlDeviceGetHandleByUUID(_gpu_uuid(device))
        except Exception:
            try:
                nvml_idx = torch.cuda._get_nvml_device_index(idx)
            except Exception:
                nvml_idx = idx
            _NVML[idx] = pynvml.nvmlDeviceGetHandleByIndex(nvml_idx)
    return pynvml, _NVML[idx]


def _clocks_nvml(device) -> dict:
    nv, h = _nvml(device)

    def get(fn, *a):
        try:
            return fn(h, *a)
        except Exception:
            return None
    power = get(nv.nvmlDeviceGetPowerUsage)
    reasons_fn = (getattr(nv, "nvmlDeviceGetCurrentClocksEventReasons", None)
                  or nv.nvmlDeviceGetCurrentClocksThrottleReasons)
    return {"source": "pynvml", "sm_mhz": get(nv.nvmlDeviceGetClockInfo, nv.NVML_CLOCK_SM),
            "max_sm_mhz": get(nv.nvmlDeviceGetMaxClockInfo, nv.NVML_CLOCK_SM),
            "mem_mhz": get(nv.nvmlDeviceGetClockInfo, nv.NVML_CLOCK_MEM),
            "temp_c": get(nv.nvmlDeviceGetTemperature, nv.NVML_TEMPERATURE_GPU),
            "power_w": None if power is None else power / 1000,
            "reasons": clock_reasons(get(reasons_fn))}


#: nvidia-smi's fields, in the order of ``parse_smi``'s columns.
SMI_FIELDS = ("clocks.sm", "clocks.max.sm", "clocks.mem", "temperature.gpu", "power.draw",
              "clocks_event_reasons.active")


def parse_smi(line: str) -> dict:
    """One line of ``nvidia-smi --query-gpu=<SMI_FIELDS> --format=csv,noheader,nounits``."""
    cells = [c.strip() for c in line.strip().split(",")]

    def num(c, kind=float):
        try:
            return kind(c)
        except ValueError:
            return None  # "[N/A]", "[Not Supported]"
    cells += [""] * (len(SMI_FIELDS) - len(cells))
    sm, max_sm, mem, temp, power, reasons = cells[:len(SMI_FIELDS)]
    mask = num(reasons, lambda c: int(c, 16))
    return {"source": "nvidia-smi", "sm_mhz": num(sm, int), "max_sm_mhz": num(max_sm, int),
            "mem_mhz": num(mem, int), "temp_c": num(temp, int), "power_w": num(power),
            "reasons": clock_reasons(mask)}


def _clocks_smi(device) -> dict:
    target = _gpu_uuid(device) or str(_cuda_index(device))
    r = subprocess.run(["nvidia-smi", f"--query-gpu={','.join(SMI_FIELDS)}",
                        "--format=csv,noheader,nounits", f"--id={target}"],
                       capture_output=True, text=True, timeout=10, check=False)
    if r.returncode != 0 or not r.stdout.strip():
        raise RuntimeError(f"nvidia-smi exited {r.returncode}: {(r.stderr or r.stdout).strip()[:200]}")
    return parse_smi(r.stdout.strip().splitlines()[0])


def gpu_clocks(device="cuda") -> dict:
    """The GPU's clocks now: ``{"source", "sm_mhz", "max_sm_mhz", "mem_mhz", "temp_c",
    "power_w", "reasons"}`` (fields a source cannot give are None). Sources in turn:
    pynvml, ``nvidia-smi``, ``torch.cuda.clock_rate`` (SM clock only); none working:
    ``{"source": None, "note": why}``. Not a CUDA device: ``{"source": None, ...}``."""
    if torch.device(device).type != "cuda":
        return {"source": None, "note": f"{device}: no GPU clocks"}
    why = []
    for read in (_clocks_nvml, _clocks_smi):
        try:
            return read(device)
        except Exception as e:
            why.append(f"{read.__name__[len('_clocks_'):]}: {_err(e)}")
    try:
        return {"source": "torch.cuda.clock_rate", "sm_mhz": torch.cuda.clock_rate(_cuda_index(device))}
    except Exception as e:
        why.append(f"torch.cuda.clock_rate: {_err(e)}")
    return {"source": None, "note": "; ".join(why)}


class ClockSampler:
    """The SM clock every ``interval`` s on a thread while in use (``with``), through pynvml
    only (a call of microseconds, no process started); without pynvml it samples nothing.
    ``summary(t0, t1)``: min, median and max of the samples between two
    ``time.perf_counter`` readings."""

    def __init__(self, device="cuda", interval: float = 0.05):
        self.interval = interval
        self.samples: list[tuple[float, int]] = []
        self._read = None
        if torch.device(device).type == "cuda":
            try:
                nv, h = _nvml(device)
                nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM)
                self._read = lambda: nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM)
            except Exception:
                self._read = None
        self._stop = threading.Event()
        self._thread = None

    @property
    def active(self) -> bool:
        return self._read is not None

    def _loop(self):
        while not self._stop.wait(self.interval):
            try:
                self.samples.append((time.perf_counter(), int(self._read())))
            except Exception:
                return

    def __enter__(self):
        if self.active:
            self._thread = threading.Thread(target=self._loop, name="fa-lab clock sampler", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        return False

    def summary(self, t0: float, t1: float) -> dict | None:
        v = [mhz for t, mhz in self.samples if t0 <= t <= t1]
        if not self.active:
            return None
        return spread(v)


# ---- the benchmark -----------------------------------------------------------------------------

def run(shapes=SHAPES, impls=IMPLS, *, jobs=None, device="cuda", seed=0, rounds=5, min_calls=10,
        warmup=25, rep=100, faithful_shapes=1, progress=True, on_shape=None, tuning=None,
        timer=None, paired=True) -> pd.DataFrame:
    """Time every implementation at every shape in ``rounds`` interleaved rounds
    (``time_rounds``: each round at least ``min_calls`` calls and ``rep`` ms of each, after
    ``warmup`` ms of untimed calls). One row per (shape, impl):
    suite, shape, B, S, H, D, causal, Skv, Hkv, lengths, impl, dtype, flops,
    ms / tflops (median over rounds), ms_min, ms_max, tflops_min, tflops_max, spread_pct
    ((max - min) / median ms, %), rounds (how many timed it), ms_rounds, tflops_rounds,
    calls_rounds, host_ms (``host_time``: the host's time per call), rel_l2 (vs fp32
    attention), rel_l2_dequant (fp8), config, note.

    ``jobs`` (``suite_jobs``: (suite, shape, impls) triples) replaces ``shapes`` x
    ``impls``; there, implementations that do not apply to a shape (``applies``) are left
    out. ``faithful_lazy`` runs at the first ``faithful_shapes`` shapes only (it is slow).
    ``device`` "cuda[:N]" times with ``CudaTimer``, "cpu" with ``CpuTimer`` (``timer``
    replaces either). ``on_shape(table)`` is called after each shape with the table so far
    (to save it); ``tuning``, a list, receives the autotuner's timings of every config.

    With ``paired``, the pairs of ``PAIRED_RATIOS`` that ran are then also timed
    call-alternated (``time_paired``), ``rounds`` rounds of them.

    The table's ``attrs`` hold ``ratios`` (one dict per (shape, pair): median, min, max and
    the per-round values of ``a / b``, see ``ratio_pairs``), ``paired_ratios`` (the same
    for the call-alternated pairs, with each round's cycles and any error), ``shapes``
    (per shape: round orders, GPU clocks at the start and end of its rounds and per round,
    the autotuner's choices, the reference's heads, seconds) and ``timing`` (the method
    and its parameters)."""
    if jobs is None:
        _check_impls(impls)
        if not shapes:
            raise ValueError("shapes is empty")
        jobs = [("varlen" if s.varlen else "dense", s, tuple(i for i in impls if applies(i, s)))
                for s in shapes]
    elif not jobs:
        raise ValueError("jobs is empty")
    for name, value, lo, kinds in (("rounds", rounds, 1, int), ("min_calls", min_calls, 1, int),
                                   ("warmup", warmup, 0, (int, float)), ("rep", rep, 0, (int, float))):
        if isinstance(value, bool) or not isinstance(value, kinds):
            raise TypeError(f"{name} must be a{'n int' if kinds is int else ' number'}, got {value!r}")
        if value < lo:
            raise ValueError(f"{name} must be >= {lo}, got {value!r}")
    if not isinstance(paired, bool):
        raise TypeError(f"paired must be a bool, got {type(paired).__name__}")
    dev = torch.device(device)
    if dev.type not in ("cuda", "cpu"):
        raise ValueError(f"the benchmark runs on a CUDA device or the CPU, got device={device!r}")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"the benchmark needs a CUDA device for device={device!r}, and none is "
                         f"available (torch.cuda.is_available() is False); device='cpu' times on the CPU")
    if timer is None:
        timer = CudaTimer(dev) if dev.type == "cuda" else CpuTimer()
    cuda = dev.type == "cuda"

    def sync():
        if cuda:
            torch.cuda.synchronize(dev)
    jobs = [(suite, shape, tuple(i for i in chosen if i != FAITHFUL or si < faithful_shapes))
            for si, (suite, shape, chosen) in enumerate(jobs)]
    shapes = [shape for _, shape, _ in jobs]
    rows, ratio_rows, paired_rows, shape_info = [], [], [], []
    timing = {"timer": timer.name, "rounds": rounds, "min_calls": min_calls, "rep_ms": rep,
              "warmup_ms": warmup, "order": "rotated each round (round_orders)",
              "paired": ("PAIRED_RATIOS call-alternated (time_paired: one call of each per "
                         "cycle, b leading in rounds 2, 4, ...)" if paired else None),
              "reference": f"fa_lab.reference.attention fp32, heads sub-sampled above "
                           f"{REF_SCORE_BUDGET} (query, key) pairs x heads"}

    def table_so_far():
        t = _ordered(rows, shapes)
        t.attrs.update(ratios=list(ratio_rows), paired_ratios=list(paired_rows),
                       shapes=list(shape_info), timing=dict(timing))
        return t
    bar = tqdm(total=sum(len(i) * (rounds + 2) for _, _, i in jobs), desc="bench", disable=not progress)
    for suite, shape, impls in jobs:
        t_shape = time.perf_counter()
        inp = _inputs(shape, device, seed, fp8=any(i in FP8_IMPLS for i in impls))
        heads = reference_heads(shape)
        info = {"suite": suite, "shape": shape.name, "impls": list(impls),
                "reference_heads": heads, "reference_of": shape.H, "note": None}
        try:
            ref = _reference(shape, inp, heads)
        except Exception as e:  # an OOM ...
            ref, info["note"] = None, f"fp32 reference failed: {_err(e)}"
            if cuda:
                torch.cuda.empty_cache()
        ref8 = {}
        fns, by_impl = {}, {}
        for impl in impls:
            bar.set_postfix_str(f"{shape.name}: {impl} (first call)")
            row = {"suite": suite, **asdict(shape), "Skv": shape.seqlen_kv,
                   "lengths": list(shape.lengths) if shape.varlen else None,
                   "shape": shape.name, "impl": impl,
                   "dtype": "float8_e4m3fn" if impl in FP8_IMPLS else "bfloat16",
                   "flops": shape.flops(), "ms": None, "tflops": None, "ms_min": None,
                   "ms_max": None, "tflops_min": None, "tflops_max": None, "spread_pct": None,
                   "rounds": 0, "ms_rounds": None, "tflops_rounds": None, "calls_rounds": None,
                   "host_ms": None, "rel_l2": None, "rel_l2_dequant": None, "config": None,
                   "note": None}
            try:
                fn = _runner(impl, shape, inp)
                out = fn()  # compile / autotune outside the timing
                sync()
                if tuning is not None and _tuning(impl, shape):
                    tuning.extend({"shape": shape.name, "impl": impl, **t} for t in _tuning(impl, shape))
                row["config"] = _fast_config(impl, shape, inp)
                row["note"] = getattr(fn, "note", None)
                fns[impl] = fn
                try:
                    if ref is not None:
                        row["rel_l2"] = _rel_l2(out, ref, heads)
                    if impl in FP8_IMPLS:
                        if "ref" not in ref8:
                            ref8["ref"] = _reference(shape, inp, heads, fp8=True)
                        row["rel_l2_dequant"] = _rel_l2(out, ref8["ref"], heads)
                except Exception as e:  # the check, not the kernel, failed (an OOM ...)
                    row["note"] = "; ".join(x for x in (row["note"], f"rel-L2 failed: {_err(e)}") if x)
                del out
            except Unavailable as e:
                row["note"] = str(e)
            except Exception as e:  # a peer that has no kernel for this shape, an OOM ...
                row["note"] = _err(e)
                if cuda:
                    torch.cuda.empty_cache()
            rows.append(row)
            by_impl[impl] = row
            bar.update()
        ref8.clear()
        del ref

        def step(r, impl, name=shape.name):
            bar.set_postfix_str(f"{name}: {'warm-up' if r < 0 else f'round {r + 1}'} {impl}")
            bar.update()
        bar.update(len(impls) - len(fns))  # warm-up steps of those that did not run
        clocks_start = gpu_clocks(device)
        with ClockSampler(device) as sampler:
            res = time_rounds(fns, rounds=rounds, min_calls=min_calls, min_ms=rep,
                              warmup_ms=warmup, timer=timer, on_step=step)
            pairs = [p for p in PAIRED_RATIOS
                     if all(i in fns and i not in res.errors for i in p)] if paired else []
            bar.total += len(pairs) * rounds
            paired_res = time_paired(fns, pairs, rounds=rounds, min_calls=min_calls, min_ms=rep,
                                     timer=timer, on_step=lambda r, p: step(r, " / ".join(p)))
        clocks_end = gpu_clocks(device)
        for impl in fns:
            if impl not in res.errors:
                try:
                    by_impl[impl]["host_ms"] = host_time(fns[impl], timer)
                except Exception as e:
                    res.errors[impl] = f"host time: {_err(e)}"
        bar.update((len(impls) - len(fns)) * rounds)
        for impl in fns:
            row, ms = by_impl[impl], res.ms[impl]
            s = spread(ms)
            if s["n"]:
                f = shape.flops()
                row.update(ms=s["median"], tflops=f / (s["median"] * 1e-3) / 1e12,
                           ms_min=s["min"], ms_max=s["max"],
                           tflops_min=f / (s["max"] * 1e-3) / 1e12,
                           tflops_max=f / (s["min"] * 1e-3) / 1e12,
                           spread_pct=100 * (s["max"] - s["min"]) / s["median"], rounds=s["n"],
                           ms_rounds=ms, calls_rounds=res.calls[impl],
                           tflops_rounds=[None if x is None else f / (x * 1e-3) / 1e12 for x in ms])
            if impl in res.errors:
                row["note"] = "; ".join(x for x in (row["note"], res.errors[impl]) if x)
        for a, b in ratio_pairs(list(fns)):
            per_round = ratio_rounds(res.ms, a, b)
            s = spread(per_round)
            if s["n"]:
                ratio_rows.append({"suite": suite, "shape": shape.name, "ratio": f"{a} / {b}",
                                   "a": a, "b": b, **s, "rounds": per_round})
        for (a, b), pr in paired_res.items():
            paired_rows.append({"suite": suite, "shape": shape.name, "ratio": f"{a} / {b}",
                                "a": a, "b": b, **spread(pr["rounds"]), "rounds": pr["rounds"],
                                "calls": pr["calls"], "error": pr["error"]})
        info.update(
            rounds=rounds, orders=res.orders,
            clocks={"start": clocks_start, "end": clocks_end,
                    "rounds_sm_mhz": ([sampler.summary(t0, t1) for t0, t1 in res.spans]
                                      if sampler.active else None),
                    "sampled": "pynvml every 50 ms" if sampler.active else None},
            autotune={i: by_impl[i]["config"] for i in impls if by_impl[i]["config"]},
            round_seconds=[t1 - t0 for t0, t1 in res.spans],
            seconds=time.perf_counter() - t_shape)
        shape_info.append(info)
        del inp, fns
        if cuda:
            torch.cuda.empty_cache()
        if on_shape is not None:
            on_shape(table_so_far())
    bar.close()
    return table_so_far()


def _ordered(rows, shapes) -> pd.DataFrame:
    shape_pos = {s.name: n for n, s in enumerate(shapes)}
    impl_pos = {i: n for n, i in enumerate(ALL_IMPLS)}
    return pd.DataFrame(sorted(rows, key=lambda r: (shape_pos[r["shape"]], impl_pos[r["impl"]])))


def ratios(table: pd.DataFrame, impl=None) -> pd.DataFrame:
    """Per shape: ``impl``'s (median) TFLOP/s over each other implementation's. The
    per-round ratios (``table.attrs["ratios"]``, ``ratio_table``) are the ones to trust;
    this serves tables without rounds (older results)."""
    wide = table.pivot_table(index="shape", columns="impl", values="tflops", sort=False)
    impl = headline(wide.columns) if impl is None else impl
    if impl not in wide:
        raise ValueError(f"{impl!r} has no timings in this table")
    out = wide.rdiv(wide[impl], axis=0).drop(columns=[impl])
    return out.add_prefix(f"{impl} / ")


def ratio_table(table_or_ratios) -> pd.DataFrame:
    """The per-round ratios as a table: suite, shape, ratio, a, b, median, min, max, n,
    rounds; from a ``run`` table (its ``attrs``), a loaded result (``{"ratios": ...}``)
    or the list itself."""
    if isinstance(table_or_ratios, pd.DataFrame):
        items = table_or_ratios.attrs.get("ratios", [])
    elif isinstance(table_or_ratios, dict):
        items = table_or_ratios.get("ratios", [])
    else:
        items = table_or_ratios
    cols = ["suite", "shape", "ratio", "a", "b", "median", "min", "max", "n", "rounds"]
    return pd.DataFrame(list(items), columns=cols)


def _fmt(x, spec=".1f", none="—"):
    return none if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def _clock_text(c: dict | None) -> str:
    if not c or c.get("source") is None:
        return f"no reading ({(c or {}).get('note', 'none')})"
    parts = [f"SM {_fmt(c.get('sm_mhz'), 'd')}/{_fmt(c.get('max_sm_mhz'), 'd')} MHz"]
    if c.get("mem_mhz") is not None:
        parts.append(f"mem {c['mem_mhz']} MHz")
    if c.get("temp_c") is not None:
        parts.append(f"{c['temp_c']} C")
    if c.get("power_w") is not None:
        parts.append(f"{c['power_w']:.0f} W")
    if c.get("reasons"):
        parts.append("reasons " + "+".join(c["reasons"]))
    return ", ".join(parts)


def _shape_lines(sub: pd.DataFrame, info: dict | None, rats: list[dict],
                 paired: list[dict] = ()) -> list[str]:
    """One shape's block: clocks, autotune picks, per implementation the median TFLOP/s
    with its min-max over rounds, the per-round ratios and the call-alternated ones."""
    shape = sub["shape"].iloc[0]
    n = int(sub["rounds"].max()) if sub["rounds"].notna().any() else 0
    head = f"== {sub['suite'].iloc[0]} · {shape}" if "suite" in sub else f"== {shape}"
    if info and info.get("seconds") is not None:
        head += f" · {n} rounds · {info['seconds']:.0f} s"
    lines = [head]
    if info:
        c = info.get("clocks") or {}
        src = (c.get("start") or {}).get("source") or (c.get("end") or {}).get("source")
        if src:
            lines.append(f"   clocks ({src}): start {_clock_text(c.get('start'))}; "
                         f"end {_clock_text(c.get('end'))}")
        else:
            lines.append(f"   clocks: {_clock_text(c.get('start'))}")
        per_round = c.get("rounds_sm_mhz")
        if per_round:
            lines.append("   SM MHz per round (median [min..max]): " + "  ".join(
                f"{_fmt(p.get('median'), '.0f')} [{_fmt(p.get('min'), 'd')}..{_fmt(p.get('max'), 'd')}]"
                if p and p.get("n") else "—" for p in per_round))
        if info.get("autotune"):
            lines.append("   autotune: " + " · ".join(f"{i} {c}" for i, c in info["autotune"].items()))
        if info.get("reference_heads") is not None and len(info["reference_heads"]) < info.get("reference_of", 0):
            lines.append(f"   rel-L2 on heads {info['reference_heads']} of {info['reference_of']}")
        if info.get("note"):
            lines.append(f"   note: {info['note']}")
    lines.append(f"   {'impl':<20}{'TFLOP/s':>9}  {'[min .. max]':<17}{'ms':>9}{'spread':>8}"
                 f"{'host ms':>9}{'rel-L2 fp32':>13}  per round TFLOP/s")
    for _, r in sub.iterrows():
        if r.get("ms") is None or pd.isna(r.get("ms")):
            continue
        per = r.get("tflops_rounds")
        per_txt = " ".join(_fmt(x, ".0f") for x in per) if isinstance(per, (list, tuple)) else ""
        lines.append(f"   {r['impl']:<20}{_fmt(r['tflops']):>9}  "
                     f"{'[' + _fmt(r.get('tflops_min')) + ' .. ' + _fmt(r.get('tflops_max')) + ']':<17}"
                     f"{_fmt(r['ms'], '.3f'):>9}{_fmt(r.get('spread_pct'), '.1f') + '%':>8}"
                     f"{_fmt(r.get('host_ms'), '.3f'):>9}{_fmt(r.get('rel_l2'), '.2e'):>13}  {per_txt}")
    if rats:
        lines.append(f"   {'ratio (A / B = B ms / A ms, per round)':<40}{'median':>8}  [min .. max]")
        for q in rats:
            lines.append(f"   {q['ratio']:<40}{q['median']:>8.3f}  [{q['min']:.3f} .. {q['max']:.3f}]")
    if paired:
        lines.append(f"   {'call-alternated (A B A B ..., per round)':<40}{'median':>8}  [min .. max]")
        for q in paired:
            if q["n"]:
                lines.append(f"   {q['ratio']:<40}{q['median']:>8.3f}  [{q['min']:.3f} .. {q['max']:.3f}]")
            if q.get("error"):
                lines.append(f"   {q['ratio']:<40}  failed: {q['error']}")
    return lines


def format_table(table: pd.DataFrame) -> str:
    """Per shape (when the table has rounds): clocks, autotune picks, median TFLOP/s with
    min-max and per-round values, the per-round ratios. Then TFLOP/s medians, shapes down,
    implementations across, and fast_lazy's ratios (one block per suite when the table has
    several); then the rel-L2 checks, configs and notes."""
    lines = []
    rats = table.attrs.get("ratios") or []
    paired = table.attrs.get("paired_ratios") or []
    infos = {i["shape"]: i for i in table.attrs.get("shapes") or []}
    if "ms_rounds" in table.columns:
        for shape, sub in table.groupby("shape", sort=False):
            lines += _shape_lines(sub, infos.get(shape), [q for q in rats if q["shape"] == shape],
                                  [q for q in paired if q["shape"] == shape])
            lines.append("")
    blocks = table.groupby("suite", sort=False) if "suite" in table.columns else [(None, table)]
    width = max(28, 2 + max(len(str(s)) for s in table["shape"]))
    first = True
    for suite, sub in blocks:
        if not first:
            lines.append("")
        first = False
        lines += _tflops_lines(sub, width, suite, rats)
    checks = table.dropna(subset=["rel_l2"])
    if len(checks):
        worst = checks.groupby("impl", sort=False)["rel_l2"].max()
        lines.append("")
        lines.append("max rel-L2 vs fp32 attention: " + ", ".join(f"{i} {x:.2e}" for i, x in worst.items()))
    for _, r in table[table["config"].notna()].iterrows():
        lines.append(f"autotuned {r['impl']} @ {r['shape']}: {r['config']}")
    for _, r in table[table["note"].notna()].iterrows():
        lines.append(f"note: {r['impl']} @ {r['shape']}: {r['note']}")
    return "\n".join(lines)


def _tflops_lines(table: pd.DataFrame, width: int, suite=None, rats=()) -> list[str]:
    wide = table.pivot_table(index="shape", columns="impl", values="tflops", sort=False)
    cols = [i for i in ALL_IMPLS if i in wide.columns]
    wide = wide[cols]
    n = int(table["rounds"].max()) if "rounds" in table and table["rounds"].notna().any() else 0
    title = (f"TFLOP/s (median over {n} interleaved rounds)" if n else "TFLOP/s") + (f": {suite}" if suite else "")
    if suite in SUITE_NOTES:
        title += f" ({SUITE_NOTES[suite]})"
    lines = [title, f"{'shape':<{width}}" + "".join(f"{c:>18}" for c in cols)]
    for shape, r in wide.iterrows():
        lines.append(f"{shape:<{width}}" + "".join(
            f"{'—' if pd.isna(r[c]) else f'{r[c]:.1f}':>18}" for c in cols))
    base = headline(cols)
    if base and len(cols) > 1:
        lines.append("")
        shapes = set(wide.index)
        mine = {(q["shape"], q["b"]): q["median"] for q in rats
                if q["a"] == base and q["shape"] in shapes}
        rat = ratios(table, base)
        if mine:  # the medians of the per-round ratios
            lines.append(f"{base} / other (median of per-round ratios)")
            rat = pd.DataFrame({c: [mine.get((s, c.split(" / ")[1]), math.nan) for s in rat.index]
                                for c in rat.columns}, index=rat.index)
        else:
            lines.append(f"{base} / other")
        lines.append(f"{'shape':<{width}}" + "".join(f"{c.split(' / ')[1]:>18}" for c in rat.columns))
        for shape, r in rat.iterrows():
            lines.append(f"{shape:<{width}}" + "".join(
                f"{'—' if pd.isna(x) else f'{x:.3f}':>18}" for x in r))
    return lines


def save(table: pd.DataFrame, name="bench_h200", *, directory=None, device="cuda", params=None,
         tuning=None):
    """data/results/<name>.json (or ``directory``), with provenance (atomic write): ``rows``
    (one per (shape, impl), with the per-round values), ``ratios`` (per round, with median
    and min-max), ``paired_ratios`` (call-alternated, likewise), ``shapes`` (round
    orders, clocks, autotune picks, seconds), ``timing`` (the method),
    ``autotune_timings`` (``tuning``) and ``params``."""
    if "timing" not in table.attrs:  # a table without rounds (config_sweep's): rows alone
        return save_result(name, table, params=dict(params or {}), device=device, directory=directory)
    payload = {"params": dict(params or {}), "timing": table.attrs.get("timing"),
               "shapes": table.attrs.get("shapes", []), "ratios": table.attrs.get("ratios", []),
               "paired_ratios": table.attrs.get("paired_ratios", []),
               "autotune_timings": list(tuning or []), "rows": table.to_dict("records")}
    return save_result(name, payload, params=payload["params"], device=device, directory=directory)


def figure(table: pd.DataFrame, title="Forward TFLOP/s"):
    """Grouped bars: TFLOP/s per shape (x) and implementation (colour)."""
    import plotly.graph_objects as go  # not on every GPU machine: imported on use

    fig = go.Figure()
    shapes = list(dict.fromkeys(table["shape"]))
    for impl in [i for i in ALL_IMPLS if i in set(table["impl"])]:
        sub = table[table["impl"] == impl].set_index("shape")
        y = [sub["tflops"].get(s) if s in sub.index else None for s in shapes]
        fig.add_bar(name=impl, x=shapes, y=y)
    fig.update_layout(barmode="group", title=title, yaxis_title="TFLOP/s",
                      xaxis_title="shape", legend_title="implementation")
    return fig


def config_sweep(shape: Shape = SHAPES[0], *, configs=None, bf16_policies=("eager", "lazy"),
                 fp8_policies=("eager", "lazy"), fp8_configs=None, device="cuda", seed=0,
                 warmup=25, rep=100, progress=True) -> pd.DataFrame:
    """Time the fast kernels at one shape with each launch configuration pinned (no
    autotune): the data behind the kernels' CONFIGS lists."""
    from triton.testing import do_bench

    bf16_mod, fp8_mod = _fast_module("swp_bf16.fast"), _fast_module("swp_fp8.fast")
    configs = bf16_mod.CANDIDATE_CONFIGS if configs is None else configs
    fp8_configs = fp8_mod.CANDIDATE_CONFIGS if fp8_configs is None else fp8_configs
    if shape.varlen:
        raise ValueError(f"config_sweep times the dense kernels; {shape.name} is a packed batch")
    inp = _inputs(shape, device, seed, fp8=True)
    q, k, v = inp.q, inp.k, inp.v
    (q8, k8, v8), (qd, kd, vd) = inp.fp8
    jobs = [("bf16", p, c) for c in configs for p in bf16_policies]
    jobs += [("fp8", p, c) for c in fp8_configs for p in fp8_policies]
    # eager ignores the row-sum filter: time it once per tile configuration
    jobs = [j for j in jobs if j[1] != "eager" or j[2].row_sum_filter]
    rows = []
    for kind, pol, cfg in tqdm(jobs, desc=f"sweep {shape.name}", disable=not progress):
        row = {"shape": shape.name, "kernel": kind, "policy": pol, "config": cfg.describe(pol != "eager"),
               "ms": None, "tflops": None, "note": None}
        try:
            if kind == "bf16":
                p = policies.resolve(fp8=False, seqlen_kv=shape.seqlen_kv, rescale=pol)
                fn = lambda: bf16_mod.forward(q, k, v, causal=shape.causal, policy=p, config=cfg)  # noqa: E731
            else:
                p = policies.resolve(fp8=True, seqlen_kv=shape.seqlen_kv, rescale=pol)
                fn = lambda: fp8_mod.forward(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd,  # noqa: E731
                                             causal=shape.causal, policy=p, config=cfg)
            fn()
            ms = do_bench(fn, warmup=warmup, rep=rep, return_mode="median")
            row.update(ms=ms, tflops=shape.flops() / (ms * 1e-3) / 1e12)
        except Exception as e:  # out of shared memory, a config the compiler rejects ...
            row["note"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
        rows.append(row)
    return pd.DataFrame(rows)
