"""Forward throughput of the fast Triton kernels beside their peers, in one run on one GPU.

Every implementation runs on the same inputs in the same process: the fast kernels with
each rescale policy (``fast_lazy``, ``fast_lazy_unfixed``, ``fast_eager``, and the fp8
kernel's ``fast_fp8_lazy`` / ``fast_fp8_eager`` on the same data quantised per tensor),
torch SDPA with its FlashAttention and cuDNN backends, compiled ``flex_attention``, and
the faithful Triton port (``faithful_lazy``, first shape only) when it is importable.
TFLOP/s counts ``4 B H Sq Skv D`` (halved when causal); times are medians of
``triton.testing.do_bench``. Each row also carries the output's rel-L2 against SDPA's
FlashAttention backend, so that a wrong kernel cannot post a fast number unnoticed.

Suites (``SUITES``; ``fa-lab bench --suite dense,splitk,varlen``): ``dense`` is the above.
``splitk`` is two decode-like long-KV shapes (B1 Sq512 Skv65536 D128, non-causal, H32 and
H8: 128 and 32 programs of 128 query rows for an H200's 132 SMs) where the fast kernel
runs dense (``fast_lazy``) and with 2, 4, 8 KV splits (``fast_lazy_split<S>``), beside
SDPA and flex.
``varlen`` is a packed batch of 8 sequences of 1k..8k tokens (``VARLEN_LENGTHS``, ~32k in
all), causal and not: the fast varlen kernel in one launch (``fast_lazy_varlen``) beside the
dense kernel called once per sequence (``fast_lazy``), SDPA once per sequence
(``sdpa_flash``, the rel-L2 reference, and ``sdpa_cudnn``) and flex with a document mask
(``flex``, one call). Per-sequence loops return their outputs unpacked (no copy is timed);
the varlen kernel checks its offsets on the host, one small copy back per call, as timed.
Rows carry ``suite``, ``Skv``, ``lengths`` and ``flops`` besides the dense columns.
"""

from __future__ import annotations

import importlib
import itertools
import math
from dataclasses import asdict, dataclass

import pandas as pd
import torch
from tqdm.auto import tqdm

from . import policies
from .experiments import quantize_e4m3, save_result


@dataclass(frozen=True)
class Shape:
    """B, S (= Sq), H, D, causal; ``Skv`` when the KV length differs from S; ``lengths``
    for a packed (varlen) batch of B sequences with equal q and kv lengths (S is then the
    longest)."""

    B: int
    S: int
    H: int
    D: int
    causal: bool
    Skv: int | None = None
    lengths: tuple[int, ...] | None = None

    @property
    def seqlen_kv(self) -> int:
        return self.S if self.Skv is None else self.Skv

    @property
    def varlen(self) -> bool:
        return self.lengths is not None

    @property
    def name(self) -> str:
        tail = f"H{self.H} D{self.D}{' causal' if self.causal else ''}"
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


#: The benchmark's shapes. S = 61,380 (not a multiple of 64; one of upstream's MI355X
#: throughput claims) runs with B = 1, H = 32, causal: 0.5 GB per tensor, ~31 TFLOP.
SHAPES = (
    Shape(2, 8192, 32, 128, False),
    Shape(2, 8192, 32, 128, True),
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

FAST_BF16 = {"fast_lazy": "lazy", "fast_lazy_unfixed": "lazy_unfixed", "fast_eager": "eager"}
FAST_FP8 = {"fast_fp8_lazy": "lazy", "fast_fp8_eager": "eager"}
FAST_SPLITK = {"fast_lazy_split2": 2, "fast_lazy_split4": 4, "fast_lazy_split8": 8}
FAST_VARLEN = {"fast_lazy_varlen": "lazy"}
PEERS = ("sdpa_flash", "sdpa_cudnn", "flex")
FAITHFUL = "faithful_lazy"
#: The dense suite's implementations (the default).
IMPLS = (*FAST_BF16, *FAST_FP8, *PEERS, FAITHFUL)
#: Every implementation, in table order.
ALL_IMPLS = (*FAST_BF16, *FAST_SPLITK, *FAST_VARLEN, *FAST_FP8, *PEERS, FAITHFUL)
#: What runs on a packed batch: the varlen kernel, and per-sequence loops / a document mask.
VARLEN_CAPABLE = (*FAST_BF16, *FAST_VARLEN, *PEERS)
#: What a suite's columns mean where it differs from the dense suite (printed with its table).
SUITE_NOTES = {"varlen": "fast_lazy and sdpa_* run once per sequence; flex with a document mask"}
SUITES = {
    "dense": (SHAPES, IMPLS),
    "splitk": (SPLITK_SHAPES, ("fast_lazy", *FAST_SPLITK, *PEERS)),
    "varlen": (VARLEN_SHAPES, ("fast_lazy", *FAST_VARLEN, "sdpa_flash", "sdpa_cudnn", "flex")),
}


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


def _flex_fn():
    if "fn" not in _FLEX:
        from torch.nn.attention.flex_attention import flex_attention
        _FLEX["fn"] = torch.compile(flex_attention, dynamic=False)
    return _FLEX["fn"]


def _causal_mask(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


@dataclass
class Inputs:
    """One shape's inputs: q [B, S, H, D], k and v [B, Skv, H, D] bf16; packed [T, H, D]
    with int32 offsets ``cu`` for a varlen shape; the fp8 quantisation when asked for."""

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
    [T, H, D], or a list of per-sequence [L, H, D] for the per-sequence loops)."""
    if shape.varlen:
        return _varlen_runner(impl, shape, inp)
    q, k, v = inp.q, inp.k, inp.v
    causal = shape.causal
    if causal and shape.S != shape.seqlen_kv and impl in PEERS:
        raise Unavailable("SDPA's and this flex mask's causal diagonal is top-left; the kernels' "
                          "is bottom-right: they differ when Sq != Skv")
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
        return lambda: mod.forward(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd,
                                   causal=causal, policy=pol)[0]
    if impl == FAITHFUL:
        mod = _faithful_module()
        pol = _bf16_policy("lazy", shape)
        return lambda: mod.forward(q, k, v, causal=causal, policy=pol)[0]
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))  # [B, H, S, D] views
    if impl in ("sdpa_flash", "sdpa_cudnn"):
        use, sdpa = _sdpa(impl)

        def run():
            with use():
                return sdpa(qt, kt, vt, is_causal=causal).transpose(1, 2)
        return run
    if impl == "flex":
        block_mask = None
        if causal:
            from torch.nn.attention.flex_attention import create_block_mask
            block_mask = create_block_mask(_causal_mask, None, None, shape.S, shape.seqlen_kv,
                                           device=q.device)
        flex = _flex_fn()
        return lambda: flex(qt, kt, vt, block_mask=block_mask).transpose(1, 2)
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
        q, k, v = (randn(total, shape.H, shape.D) for _ in range(3))
        cu = torch.tensor([0, *itertools.accumulate(shape.lengths)], dtype=torch.int32, device=device)
        return Inputs(q, k, v, cu=cu)
    q = randn(shape.B, shape.S, shape.H, shape.D)
    k, v = (randn(shape.B, shape.seqlen_kv, shape.H, shape.D) for _ in range(2))
    inp = Inputs(q, k, v)
    if fp8:
        inp.fp8 = tuple(zip(*(quantize_e4m3(x.float()) for x in (q, k, v))))
    return inp


def _rel_l2(out, ref) -> float:
    o, r = out.float(), ref.float()
    if not bool(torch.isfinite(o).all()):
        return math.nan
    return float(torch.linalg.vector_norm(o - r) / torch.linalg.vector_norm(r))


def _fast_config(impl, shape, inp: Inputs):
    """The autotuner's pick for a fast kernel, as text (None for others, and for the
    per-sequence loops: one pick per length)."""
    lazy = True
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
    lazy_unfixed shares lazy's tuning; per-sequence loops tune once per length)."""
    if impl in FAST_BF16 and impl != "fast_lazy_unfixed" and not shape.varlen:
        return _fast_module("swp_bf16.fast").tuning_timings(FAST_BF16[impl] != "eager")
    if impl in FAST_SPLITK:
        return _fast_module("swp_bf16.splitk").tuning_timings(True)
    if impl in FAST_VARLEN:
        return _fast_module("swp_bf16.varlen").tuning_timings(True)
    if impl in FAST_FP8:
        return _fast_module("swp_fp8.fast").tuning_timings(FAST_FP8[impl] != "eager")
    return None


def _time_ms(fn, warmup, rep) -> float:
    """Median ms of ``fn``: do_bench, except for a slow implementation (over 250 ms a
    call): the mean of that probe and one more call, timed with CUDA events."""
    from triton.testing import do_bench

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    if start.elapsed_time(end) < 250:
        return do_bench(fn, warmup=warmup, rep=rep, return_mode="median")
    first = start.elapsed_time(end)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    return (first + start.elapsed_time(end)) / 2


def run(shapes=SHAPES, impls=IMPLS, *, jobs=None, device="cuda", seed=0, warmup=25, rep=100,
        faithful_shapes=1, progress=True, on_shape=None, tuning=None) -> pd.DataFrame:
    """Time every implementation at every shape. One row per (shape, impl):
    suite, shape, B, S, H, D, causal, Skv, lengths, impl, dtype, flops, ms, tflops, rel_l2
    (vs sdpa_flash), config, note. ``jobs`` (``suite_jobs``: (suite, shape, impls) triples)
    replaces ``shapes`` x ``impls``; there, implementations that do not apply to a shape
    (``applies``) are left out.
    ``faithful_lazy`` runs at the first ``faithful_shapes`` shapes only (it is slow).
    ``on_shape(table)`` is called after each shape with the rows so far (to save them);
    ``tuning``, a list, receives the autotuner's timings of every config it tried."""
    if jobs is None:
        _check_impls(impls)
        if not shapes:
            raise ValueError("shapes is empty")
        jobs = [("varlen" if s.varlen else "dense", s, tuple(i for i in impls if applies(i, s)))
                for s in shapes]
    elif not jobs:
        raise ValueError("jobs is empty")
    if torch.device(device).type != "cuda" or not torch.cuda.is_available():
        raise ValueError(f"the benchmark needs a CUDA device, got device={device!r}")
    shapes = [shape for _, shape, _ in jobs]
    rows = []
    bar = tqdm(total=sum(len(i) for _, _, i in jobs), desc="bench", disable=not progress)
    for si, (suite, shape, impls) in enumerate(jobs):
        inp = _inputs(shape, device, seed, fp8=any(i in FAST_FP8 for i in impls))
        ref = None
        for impl in sorted(impls, key=lambda i: i != "sdpa_flash"):  # the reference first
            bar.set_postfix_str(f"{shape.name}: {impl}")
            row = {"suite": suite, **asdict(shape), "Skv": shape.seqlen_kv,
                   "lengths": list(shape.lengths) if shape.varlen else None,
                   "shape": shape.name, "impl": impl,
                   "dtype": "float8_e4m3fn" if impl in FAST_FP8 else "bfloat16",
                   "flops": shape.flops(), "ms": None, "tflops": None, "rel_l2": None,
                   "config": None, "note": None}
            if impl == FAITHFUL and si >= faithful_shapes:
                bar.update()
                continue
            try:
                fn = _runner(impl, shape, inp)
                out = _packed(fn())  # compile / autotune outside the timing
                torch.cuda.synchronize()
                if tuning is not None and _tuning(impl, shape):
                    tuning.extend({"shape": shape.name, "impl": impl, **t} for t in _tuning(impl, shape))
                if impl == "sdpa_flash":
                    ref = out
                elif ref is not None:
                    row["rel_l2"] = _rel_l2(out, ref)
                del out
                ms = _time_ms(fn, warmup, rep)
                row.update(ms=ms, tflops=shape.flops() / (ms * 1e-3) / 1e12,
                           config=_fast_config(impl, shape, inp))
            except Unavailable as e:
                row["note"] = str(e)
            except Exception as e:  # a peer that has no kernel for this shape, an OOM ...
                row["note"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
                torch.cuda.empty_cache()
            rows.append(row)
            bar.update()
        del inp, ref
        torch.cuda.empty_cache()
        if on_shape is not None:
            on_shape(_ordered(rows, shapes))
    bar.close()
    return _ordered(rows, shapes)


def _ordered(rows, shapes) -> pd.DataFrame:
    shape_pos = {s.name: n for n, s in enumerate(shapes)}
    impl_pos = {i: n for n, i in enumerate(ALL_IMPLS)}
    return pd.DataFrame(sorted(rows, key=lambda r: (shape_pos[r["shape"]], impl_pos[r["impl"]])))


def ratios(table: pd.DataFrame, impl="fast_lazy") -> pd.DataFrame:
    """Per shape: ``impl``'s TFLOP/s over each other implementation's."""
    wide = table.pivot_table(index="shape", columns="impl", values="tflops", sort=False)
    if impl not in wide:
        raise ValueError(f"{impl!r} has no timings in this table")
    out = wide.rdiv(wide[impl], axis=0).drop(columns=[impl])
    return out.add_prefix(f"{impl} / ")


def format_table(table: pd.DataFrame) -> str:
    """TFLOP/s, shapes down, implementations across, and fast_lazy's ratios (one block per
    suite when the table has several); then the rel-L2 checks, configs and notes."""
    lines = []
    blocks = table.groupby("suite", sort=False) if "suite" in table.columns else [(None, table)]
    width = max(28, 2 + max(len(str(s)) for s in table["shape"]))
    for suite, sub in blocks:
        if lines:
            lines.append("")
        lines += _tflops_lines(sub, width, suite)
    checks = table.dropna(subset=["rel_l2"])
    if len(checks):
        worst = checks.groupby("impl")["rel_l2"].max()
        lines.append("")
        lines.append("max rel-L2 vs sdpa_flash: " + ", ".join(f"{i} {x:.2e}" for i, x in worst.items()))
    for _, r in table[table["config"].notna()].iterrows():
        lines.append(f"autotuned {r['impl']} @ {r['shape']}: {r['config']}")
    for _, r in table[table["note"].notna()].iterrows():
        lines.append(f"note: {r['impl']} @ {r['shape']}: {r['note']}")
    return "\n".join(lines)


def _tflops_lines(table: pd.DataFrame, width: int, suite=None) -> list[str]:
    wide = table.pivot_table(index="shape", columns="impl", values="tflops", sort=False)
    cols = [i for i in ALL_IMPLS if i in wide.columns]
    wide = wide[cols]
    title = "TFLOP/s (median of do_bench)" + (f": {suite}" if suite else "")
    if suite in SUITE_NOTES:
        title += f" ({SUITE_NOTES[suite]})"
    lines = [title, f"{'shape':<{width}}" + "".join(f"{c:>18}" for c in cols)]
    for shape, r in wide.iterrows():
        lines.append(f"{shape:<{width}}" + "".join(
            f"{'—' if pd.isna(r[c]) else f'{r[c]:.1f}':>18}" for c in cols))
    if "fast_lazy" in wide and len(cols) > 1:
        lines.append("")
        lines.append("fast_lazy / other")
        rat = ratios(table)
        lines.append(f"{'shape':<{width}}" + "".join(f"{c.split(' / ')[1]:>18}" for c in rat.columns))
        for shape, r in rat.iterrows():
            lines.append(f"{shape:<{width}}" + "".join(
                f"{'—' if pd.isna(x) else f'{x:.3f}':>18}" for x in r))
    return lines


def save(table: pd.DataFrame, name="bench_h200", *, directory=None, device="cuda", params=None):
    """data/results/<name>.json (or ``directory``), with provenance (atomic write)."""
    return save_result(name, table, params=params or {}, device=device, directory=directory)


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
