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
``kernels.attention.flash_attn_interface``). A top-level ``kernels`` is looked for only
where it is not fa_lab's own Triton folder (``fa_lab.kernels``, importable by no other
name), so a fa_lab checkout on ``sys.path`` never shadows FlyDSL's package.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import inspect
import os
import pathlib
import sys

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


def _our_kernels_dirs() -> set:
    """Where fa_lab's own ``kernels`` folder lies (installed as ``fa_lab.kernels``)."""
    dirs = {(pathlib.Path(__file__).resolve().parent.parent / "kernels")}
    try:
        spec = importlib.util.find_spec("fa_lab.kernels")
    except (ImportError, ValueError):
        spec = None
    if spec is not None:
        dirs.update(pathlib.Path(d).resolve() for d in spec.submodule_search_locations or ())
    return dirs


def _load_foreign_kernels() -> None:
    """Import the top-level package ``kernels`` (FlyDSL's) from the first ``sys.path`` entry
    whose ``kernels`` is not fa_lab's own folder."""
    if "kernels" in sys.modules:
        return
    ours = _our_kernels_dirs()
    path = [e for e in sys.path
            if isinstance(e, str) and (pathlib.Path(e or os.curdir) / "kernels").resolve() not in ours]
    spec = importlib.machinery.PathFinder.find_spec("kernels", path)
    if spec is None:
        raise ModuleNotFoundError("no module named 'kernels' on sys.path (other than fa_lab's own "
                                  "kernels folder)", name="kernels")
    module = importlib.util.module_from_spec(spec)
    sys.modules["kernels"] = module
    try:
        if spec.loader is not None:
            spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop("kernels", None)
        raise


def _import(spec: str):
    module, _, name = spec.partition(":")
    if not module or not name:
        raise BackendUnavailable(f"{ENV}={spec!r} must read 'module:function'")
    try:
        if module.partition(".")[0] == "kernels":
            _load_foreign_kernels()
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


def upstream_kwargs(call, *, accepts) -> dict:
    """The keyword arguments of upstream's call for a checked ``dispatch.Call``; raises
    ValueError for anything upstream cannot be asked for. A rescale the caller did not
    name (``call.policy_asked`` False) is left to upstream's own default and routing.
    ``accepts(name)`` tells whether the installed upstream takes a keyword."""
    pol = call.policy
    lazy = pol.vote == "wave"
    if call.policy_asked:
        if pol.rule is not None or (pol.vote, pol.rebase) not in (("tile", "max"), ("wave", "max")):
            raise ValueError(f"rescale={pol.name!r} exists in fa_lab's models only; upstream's "
                             "kernel takes dualwave_swp_lazy_rescale (lazy) or not (eager)")
        if lazy and pol.threshold != UPSTREAM_THRESHOLD:
            raise ValueError(f"rescale_threshold={pol.threshold}: upstream's lazy rescale has the "
                             f"fixed threshold {UPSTREAM_THRESHOLD:g}")
        if pol.rebase_bound is not None or pol.p_headroom:
            raise ValueError("rebase_bound and p_headroom exist in fa_lab's fp8 models only")
    if call.kernel_asked is not None:
        raise ValueError("kernel= picks a path in fa_lab; upstream routes by itself "
                         "(leave kernel=None with backend='flydsl')")
    kw = {"causal": call.causal, "num_kv_heads": call.k.shape[-2]}
    if call.packing is not None:
        if "bias" in call.mods or "alibi_slopes" in call.mods:
            raise ValueError("backend='flydsl' with varlen forwards q, k, v and cu_seqlens only; "
                             "bias / alibi_slopes with varlen run on the other backends")
        pk = call.packing
        kw.update(cu_seqlens_q=pk.cu_q_tensor, cu_seqlens_kv=pk.cu_kv_tensor, max_seqlen_q=pk.max_seqlen_q, max_seqlen_kv=pk.max_seqlen_kv)
    wanted = dict(call.mods)
    pg = wanted.pop("paged", None)
    if pg is not None:  # upstream's own paged arguments (fa_lab.paged)
        if call.return_lse:
            raise ValueError("backend='flydsl' with paged KV: upstream returns no LSE for paged KV "
                             "(return_lse raises there); leave return_lse out")
        kw["num_kv_heads"] = pg.num_kv_heads
        wanted.update(block_table=pg.block_table, kv_cache_layout=pg.layout,
                      seqlen_k=torch.tensor(pg.seqlen_k, dtype=torch.int32, device=call.q.device))
    if call.policy_asked and (not lazy or accepts("dualwave_swp_lazy_rescale")):
        wanted["dualwave_swp_lazy_rescale"] = lazy
    if call.fp8:
        wanted.update(zip(("q_descale", "k_descale", "v_descale"),
                          (torch.tensor([d], device=call.q.device) for d in call.descales)))
    if call.return_lse:
        wanted["return_lse"] = True
    missing = [name for name in wanted if not accepts(name)]
    if missing:
        raise ValueError(f"the installed FlyDSL's flydsl_flash_attn_func takes no "
                         f"{', '.join(missing)}; upgrade FlyDSL or leave them out")
    kw.update(wanted)
    return kw


def forward(call):
    """Run a checked call on upstream's kernel. Returns (out, lse or None)."""
    check_device(call.q.device)
    fn = upstream_function()
    params = inspect.signature(fn).parameters
    takes_any = any(p.kind is p.VAR_KEYWORD for p in params.values())
    kw = upstream_kwargs(call, accepts=lambda name: takes_any or name in params)
    result = fn(call.q, call.k, call.v, **kw)
    if call.return_lse:
        out, lse = result
        return out, lse
    return result, None
