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

**Pairs** (``time_paired``). Under a power cap the SM clock moves within a round, by more
than some pairs differ, so two implementations timed a few hundred ms apart can meet different
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
at the shapes of ``SHAPES`` (B2 S8192 H32 D128 non-causal and causal, B4 S4096 H32 Hkv8
(GQA) D128 causal, B4 S4096 H32 D64, B16 S1024 H16 D128 causal, B32 S512 H32 D128 causal,
B1 S16384 H32 D128, and B1 S61380 H32 D128 causal).
``splitk`` is two decode-like long-KV shapes (B1 Sq512 Skv65536 D128, non-causal, H32 and
H8: 128 and 32 programs of 128 query rows for a 132-SM Hopper GPU) where the fast kernel
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

from .suites import (Shape, varlen_shape, SHAPES, SPLITK_SHAPES, VARLEN_LENGTHS, VARLEN_SHAPES,
                     API_BF16, API_FP8, API, FAST_BF16, FAST_FP8, FP8_STORED_V, FAST_SPLITK,
                     FAST_VARLEN, PEERS, FAITHFUL, IMPLS, ALL_IMPLS, FP8_IMPLS, VARLEN_CAPABLE,
                     SUITE_NOTES, SUITES, HEADLINE, headline, EXTRA_RATIO_PAIRS, PAIRED_RATIOS,
                     applies, suite_jobs)
from .impls import Unavailable, FLEX_RECOMPILE_LIMIT, Inputs, REF_SCORE_BUDGET, reference_heads
from .rounds import (round_orders, Rounds, time_rounds, time_paired, spread, HOST_PROBES,
                     host_time, ratio_rounds, ratio_pairs)
from .clocks import CLOCK_REASONS, clock_reasons, SMI_FIELDS, parse_smi, gpu_clocks, ClockSampler
from .harness import run
from .report import ratios, ratio_table, format_table, save, figure
from .configs import config_sweep

__all__ = ["Shape", "varlen_shape", "SHAPES", "SPLITK_SHAPES", "VARLEN_LENGTHS", "VARLEN_SHAPES", "API_BF16",
           "API_FP8", "API", "FAST_BF16", "FAST_FP8", "FP8_STORED_V", "FAST_SPLITK", "FAST_VARLEN",
           "PEERS", "FAITHFUL", "IMPLS", "ALL_IMPLS", "FP8_IMPLS", "VARLEN_CAPABLE", "SUITE_NOTES",
           "SUITES", "HEADLINE", "headline", "EXTRA_RATIO_PAIRS", "PAIRED_RATIOS", "applies",
           "suite_jobs", "Unavailable", "FLEX_RECOMPILE_LIMIT", "Inputs", "REF_SCORE_BUDGET",
           "reference_heads", "round_orders", "Rounds", "time_rounds", "time_paired", "spread",
           "HOST_PROBES", "host_time", "ratio_rounds", "ratio_pairs", "CLOCK_REASONS",
           "clock_reasons", "SMI_FIELDS", "parse_smi", "gpu_clocks", "ClockSampler", "run",
           "ratios", "ratio_table", "format_table", "save", "figure", "config_sweep"]
