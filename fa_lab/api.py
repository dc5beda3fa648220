"""``flash_attn_func`` and ``trace``: argument checks, policy resolution, dispatch.

The signature follows upstream's ``flydsl_flash_attn_func`` ([B, S, H, D] tensors, causal by
default, softmax scale fixed at 1/sqrt(D), fp8 selected by float8_e4m3fn inputs), so a
repro written against FlyDSL runs unchanged after
``from fa_lab import flash_attn_func as flydsl_flash_attn_func``. Everything is checked
before any work, and errors name the argument.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from . import policies, routing, varlen
from .checks import check_mod, check_qkv
from .models import generic, swa, swp_bf16, swp_fp8
from .trace import Trace, TraceRecorder, normalize_rows

FP8 = torch.float8_e4m3fn
HALF_DTYPES = (torch.bfloat16, torch.float16)
HEAD_DIMS = (64, 128)
#: emulator: the exact PyTorch model (any device). triton: the faithful Triton kernels on a
#: GPU. interpret: the same Triton kernels on CPU tensors through Triton's interpreter.
#: flydsl: upstream's real kernel (FlyDSL on an MI355X, ``fa_lab.flydsl``).
BACKENDS = ("auto", "emulator", "triton", "interpret", "flydsl")


@dataclass(frozen=True)
class Call:
    """A checked call: what every backend receives."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    causal: bool
    policy: policies.RescalePolicy
    fp8: bool
    descales: tuple[float, float, float] | None
    fp8_saturate: bool
    backend: str
    mods: dict  # bias / alibi_slopes / sink / num_kv_splits that were given (bf16/f16 only)
    kernel: str = "swp_bf16"  # the routed kernel: swp_bf16, swp_fp8 or generic


def _descale(name, x) -> float:
    if isinstance(x, torch.Tensor):
        if x.numel() != 1:
            raise ValueError(f"{name} must be a per-tensor scale (one element), got shape {tuple(x.shape)}")
        if x.is_floating_point() is False:
            raise TypeError(f"{name} must be a floating-point scale, got {x.dtype}")
        x = float(x.reshape(()).item())
    elif isinstance(x, bool) or not isinstance(x, (int, float)):
        raise TypeError(f"{name} must be a float or a one-element tensor, got {type(x).__name__}")
    x = float(x)
    if not math.isfinite(x) or x <= 0:
        raise ValueError(f"{name} must be finite and > 0, got {x!r}")
    return x


def _check_mod(name, x, shapes, q, fp8, dtype):
    """bias / alibi_slopes / sink: a tensor of one of ``shapes`` and of ``dtype`` (as
    upstream requires: bias in q's dtype, slopes and sink fp32) on q's device."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if fp8:
        raise ValueError(f"{name} is not supported with float8_e4m3fn inputs "
                         f"(the fp8 BN128 kernel has no {name} path)")
    check_mod(name, x, shapes, dtype, q.device)


def check_call(q, k, v, *, causal=True, num_kv_heads=None, q_descale=None, k_descale=None,
               v_descale=None, dualwave_swp_lazy_rescale=None, rescale=None,
               rescale_threshold=None, rebase_bound=None, p_headroom=None, fp8_saturate=None,
               backend="auto", bias=None, alibi_slopes=None, sink=None, num_kv_splits=1,
               kernel=None) -> Call:
    """Validate everything and resolve the policy; raises ValueError/TypeError naming the
    argument. Does no work on the tensors' data."""
    B, Sq, H, D, _, Hkv = check_qkv(q, k, v, dtypes=(*HALF_DTYPES, FP8), head_dims=HEAD_DIMS)
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    if num_kv_heads is not None:
        if isinstance(num_kv_heads, bool) or not isinstance(num_kv_heads, int):
            raise TypeError(f"num_kv_heads must be an int, got {type(num_kv_heads).__name__}")
        if num_kv_heads != Hkv:
            raise ValueError(f"num_kv_heads={num_kv_heads} but k and v have {Hkv} heads")
    fp8 = q.dtype == FP8
    if fp8 and D != 128:
        raise ValueError(f"head dim D={D} is not supported; the fp8 kernel takes D = 128")
    given = {"q_descale": q_descale, "k_descale": k_descale, "v_descale": v_descale}
    if fp8:
        missing = [n for n, x in given.items() if x is None]
        if missing:
            raise ValueError(f"fp8 inputs need per-tensor descales; missing {', '.join(missing)}")
        descales = tuple(_descale(n, x) for n, x in given.items())
    else:
        extra = [n for n, x in given.items() if x is not None]
        if extra:
            raise ValueError(f"{', '.join(extra)} apply to float8_e4m3fn inputs only, got {q.dtype}")
        descales = None
    if fp8_saturate is None:
        fp8_saturate = True
    elif not fp8:
        raise ValueError("fp8_saturate applies to float8_e4m3fn inputs only")
    elif not isinstance(fp8_saturate, bool):
        raise TypeError(f"fp8_saturate must be a bool, got {type(fp8_saturate).__name__}")
    Skv = k.shape[1]
    mods = {}
    for name, x, shapes, dtype in (("bias", bias, [(Sq, Skv)], q.dtype),
                                   ("alibi_slopes", alibi_slopes, [(H,), (B, H)], torch.float32),
                                   ("sink", sink, [(H,)], torch.float32)):
        if x is not None:
            _check_mod(name, x, shapes, q, fp8, dtype)
            mods[name] = x
    if isinstance(num_kv_splits, bool) or not isinstance(num_kv_splits, int):
        raise TypeError(f"num_kv_splits must be an int, got {type(num_kv_splits).__name__}")
    if num_kv_splits < 1:
        raise ValueError(f"num_kv_splits must be >= 1, got {num_kv_splits}")
    if num_kv_splits > 1:
        if fp8:
            raise ValueError("num_kv_splits > 1 (split-K) is not supported with float8_e4m3fn inputs")
        if Sq < 384:
            raise ValueError(f"num_kv_splits > 1 (split-K) needs seq_len >= 384 as upstream; got Sq={Sq}")
        mods["num_kv_splits"] = num_kv_splits
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise ValueError(f"backend={backend!r}; choose one of {BACKENDS}")
    # None: upstream's default (lazy), which the generic kernel may ignore as upstream does;
    # an explicit True/False is a request that routing must honour.
    lazy_flag = True if dualwave_swp_lazy_rescale is None else dualwave_swp_lazy_rescale
    policy = policies.resolve(
        fp8=fp8, seqlen_kv=k.shape[1], rescale=rescale, dualwave_swp_lazy_rescale=lazy_flag,
        rescale_threshold=rescale_threshold, rebase_bound=rebase_bound, p_headroom=p_headroom)
    asked = (rescale is not None or rescale_threshold is not None
             or dualwave_swp_lazy_rescale is not None)
    chosen = routing.choose_kernel(
        batch=B, seqlen_q=Sq, fp8=fp8, rescale=policy.name if asked else None, kernel=kernel,
        has_bias="bias" in mods, has_alibi="alibi_slopes" in mods, has_sink="sink" in mods,
        head_dim=D)
    if "num_kv_splits" in mods and chosen == "generic":
        if kernel == "generic":
            raise ValueError("kernel='generic' has no split-K; num_kv_splits > 1 runs on 'swp_bf16'")
        chosen = "swp_bf16"  # split-K is a DUALWAVE_SWP build, whatever the length
    if chosen not in TRITON_PORTS and backend in ("triton", "interpret"):
        if kernel is not None:
            raise NotImplementedError(f"no Triton port of {kernel} yet; use backend='emulator'")
        chosen = "swp_bf16"  # the Triton kernels asked for exist for DUALWAVE_SWP only
    if chosen == "generic":
        policy = policies.RescalePolicy("eager")  # the generic kernel is eager only
    return Call(q=q, k=k, v=v, causal=causal, policy=policy, fp8=fp8, descales=descales,
                fp8_saturate=fp8_saturate, backend=backend, mods=mods, kernel=chosen)


MODELS = {"swp_bf16": swp_bf16, "swp_fp8": swp_fp8, "generic": generic}
#: Kernels with a faithful Triton port (kernels/attention/<name>.py); "swa" is called
#: through ``swa_attn_func`` only.
TRITON_PORTS = ("swp_bf16", "swp_fp8", "generic", "swa")
#: Ports that take the DUALWAVE_SWP extras (bias, ALiBi, sink, split-K) and a native varlen
#: entry (``forward_varlen``).
TRITON_FEATURE_PORTS = ("swp_bf16",)


def resolve_backend(backend: str, device: torch.device, kernel: str = "swp_bf16", features=()) -> str:
    """``auto``: Triton on CUDA/ROCm tensors when the routed kernel has a Triton port that
    covers every feature asked for (bias, ALiBi, sink, split-K), else the model."""
    if backend != "auto":
        return backend
    if device.type == "cuda" and kernel in TRITON_PORTS and (
            not features or kernel in TRITON_FEATURE_PORTS):
        from .kernels import available
        if available():
            return "triton"
    return "emulator"


def _kernel_module(kernel: str, backend: str, device):
    """The module that runs a kernel: its model, or its Triton port."""
    if backend == "emulator":
        return MODELS[kernel]
    from .kernels import attention_module
    return attention_module(kernel, backend, device)


def _run(call: Call, recorder=None):
    if call.backend == "flydsl":
        raise ValueError("backend='flydsl' runs upstream's kernel, which records no trace or "
                         "counts; trace and count_rescales take the other backends")
    backend = resolve_backend(call.backend, call.q.device, call.kernel, tuple(call.mods))
    module = _kernel_module(call.kernel, backend, call.q.device)
    kw = {"causal": call.causal, "recorder": recorder}
    if backend != "emulator":
        kw["interpret"] = backend == "interpret"
        if call.mods and call.kernel not in TRITON_FEATURE_PORTS:
            raise NotImplementedError(f"{', '.join(call.mods)} not ported to the {call.kernel} "
                                      "Triton kernel; use backend='emulator'")
    kw.update(call.mods)
    if call.kernel != "generic":
        kw["policy"] = call.policy
    if call.fp8:
        qd, kd, vd = call.descales
        kw.update(q_descale=qd, k_descale=kd, v_descale=vd, saturate=call.fp8_saturate)
    return module.forward(call.q, call.k, call.v, **kw)


def flash_attn_func(q, k, v, *, causal=True, num_kv_heads=None, cu_seqlens_q=None,
                    cu_seqlens_kv=None, max_seqlen_q=None, max_seqlen_kv=None, q_descale=None,
                    k_descale=None, v_descale=None, return_lse=False,
                    dualwave_swp_lazy_rescale=None, rescale=None, rescale_threshold=None,
                    rebase_bound=None, p_headroom=None, fp8_saturate=None, backend="auto",
                    bias=None, alibi_slopes=None, sink=None, num_kv_splits=1, kernel=None):
    """Forward attention with the gfx950 kernels' semantics.

    q [B, Sq, H, D], k and v [B, Skv, Hkv, D]; bf16/f16, or float8_e4m3fn with per-tensor
    ``*_descale``. ``rescale`` names a policy (``eager``, ``lazy``, ``lazy_unfixed``; fp8
    also ``lazy_capped``); None takes ``lazy`` or ``eager`` from
    ``dualwave_swp_lazy_rescale`` as upstream. ``rescale_threshold`` (log2 units, default 8;
    fp8 also ``"by_kv_len"``), ``rebase_bound`` (``lazy_capped``, default 16) and
    ``p_headroom`` (fp8: True for PR #1020's lift, or a number) tune it.
    ``backend``: ``"emulator"`` runs the exact model (CPU or GPU tensors); ``"triton"`` the
    faithful Triton kernels (GPU tensors); ``"interpret"`` the same kernels on CPU tensors
    through Triton's interpreter (small sizes); ``"auto"`` picks Triton for GPU tensors and
    the model for CPU tensors.
    ``bias`` [Sq, Skv], ``alibi_slopes`` [H] or [B, H] and ``sink`` [H] (bf16/f16) modify
    the scores as upstream's DUALWAVE_SWP path does (natural-log units);
    ``num_kv_splits`` > 1 runs split-K with its combine pass.
    Varlen: ``cu_seqlens_q`` / ``cu_seqlens_kv`` (int32 [B+1]) with packed q [total_q, H, D],
    k and v [total_kv, Hkv, D], ``max_seqlen_q`` (and ``max_seqlen_kv`` when lengths
    differ); a bias is then [total_q, max_seqlen_kv] and the LSE [B, H, max_seqlen_q].
    Returns out [B, Sq, H, D], and lse [B, H, Sq] fp32 (natural log) if ``return_lse``.
    """
    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse must be a bool, got {type(return_lse).__name__}")
    packing = varlen.check(q, k, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv)
    asked = (rescale is not None or rescale_threshold is not None
             or dualwave_swp_lazy_rescale is not None)  # a rescale the user named
    if packing is not None and backend == "flydsl":
        if bias is not None or alibi_slopes is not None:
            raise ValueError("backend='flydsl' with varlen forwards q, k, v and cu_seqlens only; "
                             "bias / alibi_slopes with varlen run on the other backends")
        call = check_call(q[None], k[None], v[None], causal=causal, num_kv_heads=num_kv_heads,
                          dualwave_swp_lazy_rescale=dualwave_swp_lazy_rescale, rescale=rescale,
                          rescale_threshold=rescale_threshold, backend=backend, sink=sink,
                          num_kv_splits=num_kv_splits, kernel=kernel, q_descale=q_descale,
                          k_descale=k_descale, v_descale=v_descale, rebase_bound=rebase_bound,
                          p_headroom=p_headroom, fp8_saturate=fp8_saturate)
        from . import flydsl
        seq = {"cu_seqlens_q": cu_seqlens_q, "cu_seqlens_kv": cu_seqlens_kv,
               "max_seqlen_q": packing.max_seqlen_q, "max_seqlen_kv": packing.max_seqlen_kv}
        out, lse = flydsl.forward(dataclasses.replace(call, q=q, k=k, v=v), varlen=seq,
                                  return_lse=return_lse, kernel_requested=kernel is not None,
                                  rescale_requested=asked)
        return (out, lse) if return_lse else out
    if packing is not None:
        out, lse = _run_varlen(packing, q, k, v, causal=causal, num_kv_heads=num_kv_heads,
                               q_descale=q_descale, k_descale=k_descale, v_descale=v_descale,
                               dualwave_swp_lazy_rescale=dualwave_swp_lazy_rescale,
                               rescale=rescale, rescale_threshold=rescale_threshold,
                               rebase_bound=rebase_bound, p_headroom=p_headroom,
                               fp8_saturate=fp8_saturate, backend=backend, bias=bias,
                               alibi_slopes=alibi_slopes, sink=sink, num_kv_splits=num_kv_splits,
                               kernel=kernel)
        return (out, lse) if return_lse else out
    call = check_call(q, k, v, causal=causal, num_kv_heads=num_kv_heads, q_descale=q_descale,
                      k_descale=k_descale, v_descale=v_descale,
                      dualwave_swp_lazy_rescale=dualwave_swp_lazy_rescale, rescale=rescale,
                      rescale_threshold=rescale_threshold, rebase_bound=rebase_bound,
                      p_headroom=p_headroom, fp8_saturate=fp8_saturate, backend=backend,
                      bias=bias, alibi_slopes=alibi_slopes, sink=sink, num_kv_splits=num_kv_splits,
                      kernel=kernel)
    if call.backend == "flydsl":
        from . import flydsl
        out, lse = flydsl.forward(call, return_lse=return_lse, kernel_requested=kernel is not None,
                                  rescale_requested=asked)
    else:
        out, lse = _run(call)
    return (out, lse) if return_lse else out


def _run_varlen(packing, q, k, v, *, bias, alibi_slopes, **kw):
    """Check a packed call as a whole, then run it: in one launch of a Triton port's
    ``forward_varlen``, or as one dense call per sequence (the models, and ports without
    a varlen entry)."""
    if q.dtype == FP8:
        raise ValueError("varlen (cu_seqlens_q/kv) is not supported with float8_e4m3fn inputs, "
                         "as upstream's fp8 kernel")
    if kw.get("num_kv_splits", 1) != 1:
        raise ValueError("varlen (cu_seqlens_q/kv) is not supported together with num_kv_splits > 1")
    B, (total_q, H, _) = packing.batch, q.shape
    for name, x, shapes, dtype in (
            ("bias", bias, [(total_q, packing.max_seqlen_kv)], q.dtype),
            ("alibi_slopes", alibi_slopes, [(H,), (B, H)], torch.float32)):
        if x is not None:
            _check_mod(name, x, shapes, q, False, dtype)
    if kw.get("kernel") is None:
        # every sequence runs DUALWAVE_SWP (upstream's short-sequence "light" varlen build
        # is not modelled)
        kw["kernel"] = "swp_bf16"
    call = check_call(q[None], k[None], v[None], **kw)  # everything else, checked once
    given = (*call.mods, *(n for n, x in (("bias", bias), ("alibi_slopes", alibi_slopes))
                           if x is not None))
    backend = resolve_backend(call.backend, q.device, call.kernel, given)
    if backend != "emulator" and call.kernel in TRITON_FEATURE_PORTS:
        # the port's native varlen entry: one launch over the packed tensors
        module = _kernel_module(call.kernel, backend, q.device)
        cu_q, cu_kv = (torch.tensor(c, dtype=torch.int32, device=q.device)
                       for c in (packing.cu_q, packing.cu_kv))
        return module.forward_varlen(q, k, v, cu_q, cu_kv, packing.max_seqlen_q,
                                     packing.max_seqlen_kv, causal=call.causal, policy=call.policy,
                                     interpret=backend == "interpret", bias=bias,
                                     alibi_slopes=alibi_slopes, sink=call.mods.get("sink"))

    def dense(qb, kb, vb, **mods):
        return _run(dataclasses.replace(call, q=qb, k=kb, v=vb, mods={**call.mods, **mods}))

    return varlen.run(packing, q, k, v, dense, bias=bias, alibi_slopes=alibi_slopes)


def count_rescales(q, k, v, **kwargs) -> dict:
    """Run ``flash_attn_func(q, k, v, **kwargs)`` through the model and count its rescale
    work over the main loop (see ``fa_lab.counters``); returns the counts and the output."""
    from .counters import RescaleCounter

    call = check_call(q, k, v, **kwargs)
    if call.fp8:
        raise ValueError("count_rescales counts the bf16/f16 kernel's loop; got float8_e4m3fn inputs")
    counter = RescaleCounter(call.policy)
    out, lse = _run(dataclasses.replace(call, backend="emulator"), counter)
    return {**counter.summary(), "out": out, "lse": lse}


def trace(q, k, v, *, rows, batch=0, head=0, causal=True, num_kv_heads=None, q_descale=None,
          k_descale=None, v_descale=None, dualwave_swp_lazy_rescale=None, rescale=None,
          rescale_threshold=None, rebase_bound=None, p_headroom=None, fp8_saturate=None,
          backend="auto", bias=None, alibi_slopes=None, sink=None, num_kv_splits=1,
          kernel=None) -> Trace:
    """Run ``flash_attn_func`` with the same arguments and record, for the chosen lanes,
    every step's running max, tile max, vote, wave decision, drag, correction, l and
    finiteness (see ``fa_lab.trace.Trace``).

    ``rows``: query rows of (``batch``, ``head``) — an int, a range or a list — or
    (batch, head, row) tuples.
    """
    call = check_call(q, k, v, causal=causal, num_kv_heads=num_kv_heads, q_descale=q_descale,
                      k_descale=k_descale, v_descale=v_descale,
                      dualwave_swp_lazy_rescale=dualwave_swp_lazy_rescale, rescale=rescale,
                      rescale_threshold=rescale_threshold, rebase_bound=rebase_bound,
                      p_headroom=p_headroom, fp8_saturate=fp8_saturate, backend=backend,
                      bias=bias, alibi_slopes=alibi_slopes, sink=sink, num_kv_splits=num_kv_splits,
                      kernel=kernel)
    B, Sq, H, _ = q.shape
    triples = normalize_rows(rows, batch, head, (B, H, Sq))
    recorder = TraceRecorder(triples, group_size=H // k.shape[2])
    _run(call, recorder)
    per_unit = swp_fp8.log2_scale(call.descales[0], call.descales[1]) if call.fp8 else 1.0
    thr = call.policy.threshold / per_unit if call.policy.lazy else float("nan")
    return recorder.build(kernel=call.kernel, policy=call.policy, log2_per_unit=per_unit,
                          threshold_units=thr)


def swa_attn_func(q, k, v, *, window_left, window_right=0, causal=True, rescale="lazy",
                  rescale_threshold=8.0, return_lse=False, backend="auto"):
    """The SWA GQA sliding-window kernel (``swa_gfx950.py``), which upstream's
    ``flydsl_flash_attn_func`` does not route to: row i sees keys i - window_left ...
    i + window_right. ``rescale``: its own deferred rescale ``"lazy"`` (correct by
    construction) or the counterfactual ``"lazy_unfixed"``. See ``fa_lab.models.swa``.
    ``backend`` as ``flash_attn_func``: the model (``"emulator"``), its faithful Triton
    port (``"triton"`` on GPU tensors, ``"interpret"`` on CPU tensors), or ``"auto"``."""
    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse must be a bool, got {type(return_lse).__name__}")
    if backend == "flydsl":
        raise ValueError("backend='flydsl': upstream's flydsl_flash_attn_func does not route to "
                         "the SWA kernel; use 'emulator', 'triton', 'interpret' or 'auto'")
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise ValueError(f"backend={backend!r}; choose one of {BACKENDS}")
    swa.check_args(q, k, v, window_left, window_right, causal, rescale_threshold, rescale)
    backend = resolve_backend(backend, q.device, "swa")
    module = swa if backend == "emulator" else _kernel_module("swa", backend, q.device)
    kw = {} if backend == "emulator" else {"interpret": backend == "interpret"}
    out, lse = module.forward(q, k, v, window_left=window_left, window_right=window_right,
                              causal=causal, threshold=rescale_threshold, rescale=rescale, **kw)
    return (out, lse) if return_lse else out
