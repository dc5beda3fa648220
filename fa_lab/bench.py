"""Forward throughput of the fast Triton kernels beside their peers, in one run on one GPU.

Every implementation runs on the same inputs in the same process: the fast kernels with
each rescale policy (``fast_lazy``, ``fast_lazy_unfixed``, ``fast_eager``, and the fp8
kernel's ``fast_fp8_lazy`` / ``fast_fp8_eager`` on the same data quantised per tensor),
torch SDPA with its FlashAttention and cuDNN backends, compiled ``flex_attention``, and
the faithful Triton port (``faithful_lazy``, first shape only) when it is importable.
TFLOP/s counts ``4 B H Sq Skv D`` (halved when causal); times are medians of
``triton.testing.do_bench``. Each row also carries the output's rel-L2 against SDPA's
FlashAttention backend, so that a wrong kernel cannot post a fast number unnoticed.
"""

from __future__ import annotations

import importlib
import math
from dataclasses import asdict, dataclass

import pandas as pd
import torch
from tqdm.auto import tqdm

from . import policies
from .experiments import quantize_e4m3, save_result


@dataclass(frozen=True)
class Shape:
    B: int
    S: int
    H: int
    D: int
    causal: bool

    @property
    def name(self) -> str:
        return f"B{self.B} S{self.S} H{self.H} D{self.D}{' causal' if self.causal else ''}"

    def flops(self) -> float:
        """4 B H Sq Skv D: two matrix products of 2 B H Sq Skv D each; half when causal."""
        f = 4.0 * self.B * self.H * self.S * self.S * self.D
        return f / 2 if self.causal else f


#: The benchmark's shapes. S = 61,380 (not a multiple of 64; one of upstream's MI355X
#: throughput claims) runs with B = 1, H = 32, causal: 0.5 GB per tensor, ~31 TFLOP.
SHAPES = (
    Shape(2, 8192, 32, 128, False),
    Shape(2, 8192, 32, 128, True),
    Shape(1, 16384, 32, 128, False),
    Shape(1, 61380, 32, 128, True),
)
FAST_BF16 = {"fast_lazy": "lazy", "fast_lazy_unfixed": "lazy_unfixed", "fast_eager": "eager"}
FAST_FP8 = {"fast_fp8_lazy": "lazy", "fast_fp8_eager": "eager"}
PEERS = ("sdpa_flash", "sdpa_cudnn", "flex")
FAITHFUL = "faithful_lazy"
IMPLS = (*FAST_BF16, *FAST_FP8, *PEERS, FAITHFUL)


class Unavailable(RuntimeError):
    """An implementation that cannot run here (the reason goes into the table)."""


def _fast_module(name):
    return importlib.import_module(f"fa_lab.kernels.attention.{name}")


def _faithful_module():
    try:
        return importlib.import_module("fa_lab.kernels.attention.swp_bf16")
    except ImportError as e:
        raise Unavailable(f"fa_lab.kernels.attention.swp_bf16 is not importable ({e})") from None


_FLEX = {}


def _flex_fn():
    if "fn" not in _FLEX:
        from torch.nn.attention.flex_attention import flex_attention
        _FLEX["fn"] = torch.compile(flex_attention, dynamic=False)
    return _FLEX["fn"]


def _causal_mask(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def _runner(impl: str, shape: Shape, q, k, v, fp8_inputs):
    """A no-argument callable running ``impl`` once, returning out [B, S, H, D]."""
    causal = shape.causal
    if impl in FAST_BF16:
        mod = _fast_module("fast_bf16")
        pol = policies.resolve(fp8=False, seqlen_kv=shape.S, rescale=FAST_BF16[impl])
        return lambda: mod.forward(q, k, v, causal=causal, policy=pol)[0]
    if impl in FAST_FP8:
        mod = _fast_module("fast_fp8")
        (q8, k8, v8), (qd, kd, vd) = fp8_inputs
        pol = policies.resolve(fp8=True, seqlen_kv=shape.S, rescale=FAST_FP8[impl])
        return lambda: mod.forward(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd,
                                   causal=causal, policy=pol)[0]
    if impl == FAITHFUL:
        mod = _faithful_module()
        pol = policies.resolve(fp8=False, seqlen_kv=shape.S, rescale="lazy")
        return lambda: mod.forward(q, k, v, causal=causal, policy=pol)[0]
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))  # [B, H, S, D] views
    if impl in ("sdpa_flash", "sdpa_cudnn"):
        from torch.nn.attention import SDPBackend, sdpa_kernel
        backend = SDPBackend.FLASH_ATTENTION if impl == "sdpa_flash" else SDPBackend.CUDNN_ATTENTION
        sdpa = torch.nn.functional.scaled_dot_product_attention

        def run():
            with sdpa_kernel(backend):
                return sdpa(qt, kt, vt, is_causal=causal).transpose(1, 2)
        return run
    if impl == "flex":
        block_mask = None
        if causal:
            from torch.nn.attention.flex_attention import create_block_mask
            block_mask = create_block_mask(_causal_mask, None, None, shape.S, shape.S, device=q.device)
        flex = _flex_fn()
        return lambda: flex(qt, kt, vt, block_mask=block_mask).transpose(1, 2)
    raise ValueError(f"unknown implementation {impl!r}; choose from {IMPLS}")


def _inputs(shape: Shape, device, seed: int):
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    dims = (shape.B, shape.S, shape.H, shape.D)
    q, k, v = (torch.randn(dims, generator=g, device=device, dtype=torch.bfloat16) for _ in range(3))
    return q, k, v


def _rel_l2(out, ref) -> float:
    o, r = out.float(), ref.float()
    if not bool(torch.isfinite(o).all()):
        return math.nan
    return float(torch.linalg.vector_norm(o - r) / torch.linalg.vector_norm(r))


def _fast_config(impl, shape, q, k):
    """The autotuner's pick for a fast kernel, as text (None for others)."""
    if impl in FAST_BF16:
        lazy = FAST_BF16[impl] != "eager"
        cfg = _fast_module("fast_bf16").best_config(q, k, shape.causal, lazy)
    elif impl in FAST_FP8:
        lazy = FAST_FP8[impl] != "eager"
        cfg = _fast_module("fast_fp8").best_config(q, k, shape.causal, lazy)
    else:
        return None
    return None if cfg is None else cfg.describe(lazy)


def _tuning(impl):
    """The autotuner's timings of every config at its last new key (fast kernels;
    lazy_unfixed shares lazy's tuning)."""
    if impl in FAST_BF16 and impl != "fast_lazy_unfixed":
        return _fast_module("fast_bf16").tuning_timings(FAST_BF16[impl] != "eager")
    if impl in FAST_FP8:
        return _fast_module("fast_fp8").tuning_timings(FAST_FP8[impl] != "eager")
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


def run(shapes=SHAPES, impls=IMPLS, *, device="cuda", seed=0, warmup=25, rep=100,
        faithful_shapes=1, progress=True, on_shape=None, tuning=None) -> pd.DataFrame:
    """Time every implementation at every shape. One row per (shape, impl):
    shape, B, S, H, D, causal, impl, dtype, ms, tflops, rel_l2 (vs sdpa_flash), config, note.
    ``faithful_lazy`` runs at the first ``faithful_shapes`` shapes only (it is slow).
    ``on_shape(table)`` is called after each shape with the rows so far (to save them);
    ``tuning``, a list, receives the autotuner's timings of every config it tried."""
    unknown = [i for i in impls if i not in IMPLS]
    if unknown:
        raise ValueError(f"unknown implementations {unknown}; choose from {IMPLS}")
    if not shapes:
        raise ValueError("shapes is empty")
    if torch.device(device).type != "cuda" or not torch.cuda.is_available():
        raise ValueError(f"the benchmark needs a CUDA device, got device={device!r}")
    rows = []
    bar = tqdm(total=len(shapes) * len(impls), desc="bench", disable=not progress)
    for si, shape in enumerate(shapes):
        q, k, v = _inputs(shape, device, seed)
        fp8_inputs = None
        if any(i in FAST_FP8 for i in impls):
            fp8_inputs = tuple(zip(*(quantize_e4m3(x.float()) for x in (q, k, v))))
        ref = None
        for impl in sorted(impls, key=lambda i: i != "sdpa_flash"):  # the reference first
            bar.set_postfix_str(f"{shape.name}: {impl}")
            row = {**asdict(shape), "shape": shape.name, "impl": impl,
                   "dtype": "float8_e4m3fn" if impl in FAST_FP8 else "bfloat16",
                   "ms": None, "tflops": None, "rel_l2": None, "config": None, "note": None}
            if impl == FAITHFUL and si >= faithful_shapes:
                bar.update()
                continue
            try:
                fn = _runner(impl, shape, q, k, v, fp8_inputs)
                out = fn()  # compile / autotune outside the timing
                torch.cuda.synchronize()
                if tuning is not None and _tuning(impl):
                    tuning.extend({"shape": shape.name, "impl": impl, **t} for t in _tuning(impl))
                if impl == "sdpa_flash":
                    ref = out
                elif ref is not None:
                    row["rel_l2"] = _rel_l2(out, ref)
                del out
                ms = _time_ms(fn, warmup, rep)
                cfg_q, cfg_k = (fp8_inputs[0][0], fp8_inputs[0][1]) if impl in FAST_FP8 else (q, k)
                row.update(ms=ms, tflops=shape.flops() / (ms * 1e-3) / 1e12,
                           config=_fast_config(impl, shape, cfg_q, cfg_k))
            except Unavailable as e:
                row["note"] = str(e)
            except Exception as e:  # a peer that has no kernel for this shape, an OOM ...
                row["note"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
                torch.cuda.empty_cache()
            rows.append(row)
            bar.update()
        del q, k, v, fp8_inputs, ref
        torch.cuda.empty_cache()
        if on_shape is not None:
            on_shape(_ordered(rows, shapes))
    bar.close()
    return _ordered(rows, shapes)


def _ordered(rows, shapes) -> pd.DataFrame:
    shape_pos = {s.name: n for n, s in enumerate(shapes)}
    impl_pos = {i: n for n, i in enumerate(IMPLS)}
    return pd.DataFrame(sorted(rows, key=lambda r: (shape_pos[r["shape"]], impl_pos[r["impl"]])))


def ratios(table: pd.DataFrame, impl="fast_lazy") -> pd.DataFrame:
    """Per shape: ``impl``'s TFLOP/s over each other implementation's."""
    wide = table.pivot_table(index="shape", columns="impl", values="tflops", sort=False)
    if impl not in wide:
        raise ValueError(f"{impl!r} has no timings in this table")
    out = wide.rdiv(wide[impl], axis=0).drop(columns=[impl])
    return out.add_prefix(f"{impl} / ")


def format_table(table: pd.DataFrame) -> str:
    """TFLOP/s, shapes down, implementations across; then the ratios and the notes."""
    wide = table.pivot_table(index="shape", columns="impl", values="tflops", sort=False)
    cols = [i for i in IMPLS if i in wide.columns]
    wide = wide[cols]
    lines = ["TFLOP/s (median of do_bench)",
             f"{'shape':<28}" + "".join(f"{c:>18}" for c in cols)]
    for shape, r in wide.iterrows():
        lines.append(f"{shape:<28}" + "".join(
            f"{'—' if pd.isna(r[c]) else f'{r[c]:.1f}':>18}" for c in cols))
    if "fast_lazy" in wide:
        lines.append("")
        lines.append("fast_lazy / other")
        rat = ratios(table)
        lines.append(f"{'shape':<28}" + "".join(f"{c.split(' / ')[1]:>18}" for c in rat.columns))
        for shape, r in rat.iterrows():
            lines.append(f"{shape:<28}" + "".join(
                f"{'—' if pd.isna(x) else f'{x:.3f}':>18}" for x in r))
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


def save(table: pd.DataFrame, name="bench_h200", *, directory=None, device="cuda", params=None):
    """data/results/<name>.json (or ``directory``), with provenance (atomic write)."""
    return save_result(name, table, params=params or {}, device=device, directory=directory)


def figure(table: pd.DataFrame, title="Forward TFLOP/s"):
    """Grouped bars: TFLOP/s per shape (x) and implementation (colour)."""
    import plotly.graph_objects as go  # not on every GPU machine: imported on use

    fig = go.Figure()
    shapes = list(dict.fromkeys(table["shape"]))
    for impl in [i for i in IMPLS if i in set(table["impl"])]:
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

    bf16_mod, fp8_mod = _fast_module("fast_bf16"), _fast_module("fast_fp8")
    configs = bf16_mod.CANDIDATE_CONFIGS if configs is None else configs
    fp8_configs = fp8_mod.CANDIDATE_CONFIGS if fp8_configs is None else fp8_configs
    q, k, v = _inputs(shape, device, seed)
    (q8, k8, v8), (qd, kd, vd) = tuple(zip(*(quantize_e4m3(x.float()) for x in (q, k, v))))
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
                p = policies.resolve(fp8=False, seqlen_kv=shape.S, rescale=pol)
                fn = lambda: bf16_mod.forward(q, k, v, causal=shape.causal, policy=p, config=cfg)  # noqa: E731
            else:
                p = policies.resolve(fp8=True, seqlen_kv=shape.S, rescale=pol)
                fn = lambda: fp8_mod.forward(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd,  # noqa: E731
                                             causal=shape.causal, policy=p, config=cfg)
            fn()
            ms = do_bench(fn, warmup=warmup, rep=rep, return_mode="median")
            row.update(ms=ms, tflops=shape.flops() / (ms * 1e-3) / 1e12)
        except Exception as e:  # out of shared memory, a config the compiler rejects ...
            row["note"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
        rows.append(row)
    return pd.DataFrame(rows)
