"""``backend="flydsl"``: hand a checked call to upstream's real kernel on an MI355X.

Where the FlyDSL package and a gfx950 GPU are present, ``flash_attn_func(...,
backend="flydsl")`` calls upstream's ``flydsl_flash_attn_func`` with the same arguments,
so that ``fa_lab.compare(q, k, v, a="emulator", b="flydsl")`` holds the model against the
real kernel. Everywhere else it raises ``BackendUnavailable`` naming what is missing,
before any work.

What upstream cannot be asked for is refused rather than dropped: upstream builds its
rescale as ``dualwave_swp_lazy_rescale`` on or off (``lazy`` with the fixed threshold 8,
or ``eager``), so ``rescale="lazy_unfixed"``, ``"fa4_row"``, another threshold, a rebase
bound or a P headroom exist in fa_lab's models only; ``kernel=`` (upstream routes by
itself), ``fp8_saturate`` and an argument the installed version's signature lacks (bias,
ALiBi, sink, LSE, descales differ between FlyDSL versions) raise too.

Where upstream lives: ``FA_LAB_FLYDSL_INTERFACE="module:function"`` names it; otherwise
the first importable of ``INTERFACES`` (a FlyDSL checkout on ``sys.path`` exposes
``kernels.attention.flash_attn_interface``).
"""

from __future__ import annotations

import importlib
import inspect
import os

import torch

#: Where upstream's entry point is looked for, in order.
INTERFACES = (
    "kernels.attention.flash_attn_interface:flydsl_flash_attn_func",
    "flydsl.kernels.attention.flash_attn_interface:flydsl_flash_attn_func",
)
ENV = "FA_LAB_FLYDSL_INTERFACE"
#: The architecture whose kernels fa_lab models.
ARCH = "gfx950"
#: Upstream's fixed lazy-rescale threshold (log2 units).
UPSTREAM_THRESHOLD = 8.0


class BackendUnavailable(RuntimeError):
    """backend="flydsl" cannot run here; the message says what is missing."""


def _import(spec: str):
    module, _, name = spec.partition(":")
    if not module or not name:
        raise BackendUnavailable(f"{ENV}={spec!r} must read 'module:function'")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise BackendUnavailable(f"cannot import {spec} ({e})") from None


def upstream_function():
    """Upstream's ``flydsl_flash_attn_func``, or BackendUnavailable naming each place tried."""
    if os.environ.get(ENV):
        return _import(os.environ[ENV])
    tried = []
    for spec in INTERFACES:
        try:
            return _import(spec)
        except BackendUnavailable as e:
            tried.append(str(e))
    raise BackendUnavailable(
        "backend='flydsl' needs the FlyDSL package (github.com/ROCm/FlyDSL) importable: "
        + "; ".join(tried) + f". Put its checkout on sys.path or set {ENV}='module:function'.")


def check_device(device: torch.device) -> None:
    """A ROCm build of torch and a gfx950 GPU under ``device``."""
    if device.type != "cuda":
        raise BackendUnavailable(f"backend='flydsl' runs on GPU tensors; got tensors on {device}")
    if torch.version.hip is None:
        raise BackendUnavailable(
            f"backend='flydsl' needs a ROCm build of torch and an AMD {ARCH} GPU (MI355X); "
            f"this torch is built for CUDA ({torch.cuda.get_device_name(device)})")
    arch = getattr(torch.cuda.get_device_properties(device), "gcnArchName", "") or "unknown"
    if not arch.startswith(ARCH):
        raise BackendUnavailable(f"backend='flydsl' needs an AMD {ARCH} GPU (MI355X); "
                                 f"{device} is {arch}")


def upstream_kwargs(call, *, varlen: dict | None, return_lse: bool, kernel_requested: bool,
                    rescale_requested: bool, accepts) -> dict:
    """The keyword arguments of upstream's call for a checked ``api.Call``; raises
    ValueError for anything upstream cannot be asked for. ``rescale_requested``: the user
    named a rescale (else upstream keeps its own default and routing). ``accepts(name)``
    tells whether the installed upstream takes a keyword."""
    pol = call.policy
    if not rescale_requested:
        pass
    elif pol.name not in ("lazy", "eager"):
        raise ValueError(f"rescale={pol.name!r} exists in fa_lab's models only; upstream's "
                         "kernel takes dualwave_swp_lazy_rescale (lazy) or not (eager)")
    if pol.name == "lazy" and pol.threshold != UPSTREAM_THRESHOLD:
        raise ValueError(f"rescale_threshold={pol.threshold}: upstream's lazy rescale has the "
                         f"fixed threshold {UPSTREAM_THRESHOLD:g}")
    if pol.rebase_bound is not None or pol.p_headroom:
        raise ValueError("rebase_bound and p_headroom exist in fa_lab's fp8 models only")
    if kernel_requested:
        raise ValueError("kernel= picks a path in fa_lab; upstream routes by itself "
                         "(leave kernel=None with backend='flydsl')")
    kw = {"causal": call.causal, "num_kv_heads": call.k.shape[-2]}
    if varlen:
        kw.update(varlen)
    wanted = dict(call.mods)
    if rescale_requested and (pol.name == "eager" or accepts("dualwave_swp_lazy_rescale")):
        wanted["dualwave_swp_lazy_rescale"] = pol.name == "lazy"
    if call.fp8:
        wanted.update(zip(("q_descale", "k_descale", "v_descale"),
                          (torch.tensor([d], device=call.q.device) for d in call.descales)))
    if return_lse:
        wanted["return_lse"] = True
    missing = [name for name in wanted if not accepts(name)]
    if missing:
        raise ValueError(f"the installed FlyDSL's flydsl_flash_attn_func takes no "
                         f"{', '.join(missing)}; upgrade FlyDSL or leave them out")
    kw.update(wanted)
    return kw


def forward(call, *, varlen: dict | None = None, return_lse: bool = False,
            kernel_requested: bool = False, rescale_requested: bool = True):
    """Run a checked call on upstream's kernel. Returns (out, lse or None)."""
    check_device(call.q.device)
    fn = upstream_function()
    params = inspect.signature(fn).parameters
    takes_any = any(p.kind is p.VAR_KEYWORD for p in params.values())
    kw = upstream_kwargs(call, varlen=varlen, return_lse=return_lse,
                         kernel_requested=kernel_requested, rescale_requested=rescale_requested,
                         accepts=lambda name: takes_any or name in params)
    result = fn(call.q, call.k, call.v, **kw)
    if return_lse:
        out, lse = result
        return out, lse
    return result, None
