"""What the benchmark times: the shapes of each suite, the implementations (the API's rows,
the kernels alone, the peers), which apply where, and the ratios it reports."""

from __future__ import annotations

from dataclasses import dataclass




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


#: The dense suite: long and short sequences, GQA and D64, then
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
#: With 128-row blocks, H32 gives 128 programs (about one per multiprocessor of a 132-SM
#: Hopper GPU: dense already fills it once), H8 gives 32 (a quarter of it: where splitting
#: the walk should pay).
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
