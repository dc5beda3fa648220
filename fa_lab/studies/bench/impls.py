"""How each implementation runs at a shape: its inputs (bf16, and the same data quantised
to fp8), its runner (the API, a kernel module's ``forward``, SDPA, flex), the fp32
reference its output is checked against, and the autotuner's pick."""

from __future__ import annotations

import importlib
import itertools
import math
from dataclasses import dataclass

import torch

from fa_lab import policies, reference
from fa_lab.studies.experiments import quantize_e4m3
from .suites import (ALL_IMPLS, API, API_BF16, API_FP8, FAITHFUL, FAST_BF16, FAST_FP8, FAST_SPLITK,
                     FAST_VARLEN, FP8_STORED_V, PEERS, Shape)


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
