"""A user's own model under a policy: ``patched`` routes
``torch.nn.functional.scaled_dot_product_attention`` through ``fa_lab.flash_attn_func``
and records where attention produced non-finite values.

::

    with fa_lab.sdpa.patched(rescale="lazy_unfixed", kernel="swp_bf16", model=net) as rec:
        rec.step = 0
        loss = net(x).sum(); loss.backward()
    rec.events          # [Event(call=.., step=0, module='layers.1.attn', phase='forward', ...)]

What the patch honours, exactly as SDPA defines it, and what it refuses (ValueError or
TypeError naming the argument, before any work):

* layouts: SDPA's [B, H, S, D] in and out, fa_lab's [B, S, H, D] inside; 4-D tensors only.
* ``is_causal``: SDPA's causal mask is top-left aligned, fa_lab's (upstream's)
  bottom-right; they agree when L == S, and ``is_causal`` with L != S is refused.
* ``scale``: fa_lab's kernels fix the softmax scale at 1/sqrt(D); None or that value is
  honoured, any other refused.
* ``attn_mask``: mapped to fa_lab's ``bias`` [L, S] (added to the scaled scores, natural-log
  units, as SDPA adds a float mask). A boolean mask becomes 0 / -inf; a float mask must be
  held exactly in q's dtype (the bias's dtype). A mask that differs between batch entries
  or heads, one that does not broadcast to [B, H, L, S], one that requires grad, one that
  masks every key of a row (SDPA returns zeros there, fa_lab's kernels NaN) and a mask
  together with ``is_causal`` (SDPA refuses that pair too) are refused.
* ``enable_gqa``: k and v with fewer heads (query head h reads kv head h // (Hq / Hkv), as
  SDPA's repeat_interleave); without it, differing head counts are refused, as SDPA does.
* ``dropout_p`` other than 0 is refused (flash_attn_func has no dropout); so are dtypes
  other than bf16/f16 (fp32 models: ``model.to(torch.bfloat16)``), a value head dim that
  differs from the query's, and head dims fa_lab's kernels do not take.

Everything else (the policy, the upstream version, the backend, ``kernel=``) is passed to
``flash_attn_func``, whose own checks apply. Gradients flow through ``fa_lab.autograd``.

Only callers that look the function up on ``torch.nn.functional`` at call time are routed
(``F.scaled_dot_product_attention(...)``, ``nn.MultiheadAttention``'s slow path); a name
bound earlier with ``from torch.nn.functional import scaled_dot_product_attention`` is not.
The patch restores the original function on exit, also when the body raises; nesting is
refused (one recorder owns the function at a time).
"""

from __future__ import annotations

import math
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from fa_lab import api

HALF = (torch.bfloat16, torch.float16)

_LOCK = threading.Lock()
_ACTIVE: list = []  # the recorder of the patch in force, if any


@dataclass(frozen=True)
class Event:
    """A non-finite tensor seen at one attention call. ``call``: the call's index within
    the patch; ``step``: the recorder's ``step`` when the call's forward ran; ``module``:
    the innermost calling ``nn.Module`` (its name in ``model``, else its class name; None
    outside any module); ``phase``: "forward" or "backward"; ``tensor``: "out" or "lse"
    (forward), "dout" (the gradient arriving at the output) or "dq", "dk", "dv"
    (backward); ``kind``: "nonfinite" (NaN or +-inf in an output or gradient), "lse_nan",
    "lse_posinf" or "lse_neginf" (an LSE of -inf is a row that saw no key: not an
    overflow, but what the backward's LSE floor is for); ``rows``: (batch, head, row) in
    SDPA's layout, sorted; ``nan`` / ``inf``: element counts."""

    call: int
    step: object
    module: str | None
    phase: str
    tensor: str
    kind: str
    rows: tuple
    nan: int
    inf: int


@dataclass
class Recorder:
    """What a ``patched`` block saw. Set ``step`` to tag the calls that follow (a training
    step, an epoch); ``events`` lists every non-finite ``Event`` in order; ``calls`` counts
    the attention calls; ``inputs`` holds, with ``capture=True``, each call's call index, step,
    module and detached q, k, v, bias and causal in fa_lab's layout (a dict), for checking a
    call afterwards."""

    options: dict
    names: dict
    capture: bool = False
    step: object = None
    calls: int = 0
    events: list = field(default_factory=list)
    inputs: list = field(default_factory=list)
    _stack: list = field(default_factory=list)

    def first(self, phase: str | None = None, kind: str | None = None) -> Event | None:
        """The first event (of ``phase`` and ``kind`` if given), or None."""
        for e in self.events:
            if (phase is None or e.phase == phase) and (kind is None or e.kind == kind):
                return e
        return None

    def _module(self) -> str | None:
        for mod in reversed(self._stack):
            if not self.names or id(mod) in self.names:
                return self.names.get(id(mod), type(mod).__name__)
        return None

    def _check(self, call, step, module, phase, tensor, x, lse=False):
        """Record ``x`` ([B, H, S, D], or an LSE [B, H, S]) if any row is non-finite."""
        xf = x.detach().float()
        if lse:
            for kind, bad in (("lse_nan", torch.isnan(xf)), ("lse_posinf", xf == math.inf),
                              ("lse_neginf", xf == -math.inf)):
                if bad.any():
                    rows = tuple(map(tuple, bad.nonzero().tolist()))
                    self.events.append(Event(call, step, module, phase, tensor, kind, rows,
                                             int(torch.isnan(xf).sum()), int(torch.isinf(xf).sum())))
            return
        bad = ~torch.isfinite(xf).all(-1)
        if bad.any():
            rows = tuple(map(tuple, bad.nonzero().tolist()))
            self.events.append(Event(call, step, module, phase, tensor, "nonfinite", rows,
                                     int(torch.isnan(xf).sum()), int(torch.isinf(xf).sum())))


class _Watch(torch.autograd.Function):
    """Identity on its tensors; its backward hands the arriving gradients to ``report``."""

    @staticmethod
    def forward(ctx, report, *xs):
        ctx.report = report
        return tuple(x.view_as(x) for x in xs)

    @staticmethod
    def backward(ctx, *grads):
        ctx.report(grads)
        return (None, *grads)


def _bias(attn_mask, B, H, L, S, dtype, device):
    """SDPA's ``attn_mask`` as fa_lab's bias [L, S] in q's dtype; refuses what it cannot hold."""
    if attn_mask is None:
        return None
    if not isinstance(attn_mask, torch.Tensor):
        raise TypeError(f"attn_mask must be a torch.Tensor or None, got {type(attn_mask).__name__}")
    if attn_mask.requires_grad:
        raise ValueError("attn_mask requires grad: fa_lab's backward returns no gradient for its "
                         "bias; pass it detached")
    if attn_mask.device != device:
        raise ValueError(f"attn_mask is on {attn_mask.device} but query is on {device}")
    try:
        full = attn_mask.expand(B, H, L, S)
    except RuntimeError:
        raise ValueError(f"attn_mask of shape {list(attn_mask.shape)} does not broadcast to "
                         f"[B, H, L, S] = {[B, H, L, S]}") from None
    if attn_mask.dtype == torch.bool:
        bias = torch.zeros(L, S, dtype=dtype, device=device)
        bias.masked_fill_(~full[0, 0], -math.inf)
    elif attn_mask.is_floating_point():
        if torch.isnan(attn_mask).any():
            raise ValueError("attn_mask holds NaN, which no bias can honour")
        bias = full[0, 0].to(dtype)
        if not torch.equal(bias.to(attn_mask.dtype), full[0, 0]):
            raise ValueError(f"attn_mask ({attn_mask.dtype}) holds values that {dtype} (the dtype "
                             "of fa_lab's bias) cannot represent exactly; round it to the "
                             "query's dtype first")
    else:
        raise TypeError(f"attn_mask must be bool or floating point, got {attn_mask.dtype}")
    empty = (bias == -math.inf).all(-1).nonzero().flatten().tolist()
    if empty:
        raise ValueError(f"attn_mask masks every key of query rows {empty[:8]}: SDPA returns "
                         "zeros for such a row and fa_lab's kernels NaN (no bias-masked row "
                         "gets the causal floor); leave a key unmasked in every row")
    if not (full == full[:1, :1]).all():
        raise ValueError("attn_mask differs between batch entries or heads; fa_lab's bias is "
                         "one [L, S] matrix for every batch entry and head")
    return bias.contiguous()


def check(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
          enable_gqa=False):
    """Check an SDPA call for what ``patched`` can honour (see the module docstring); returns
    the bias [L, S] (or None). Raises ValueError/TypeError naming the argument."""
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D [B, H, S, D] (fa_lab's kernels take no other "
                             f"batch shapes), got {list(t.shape)}")
        if t.dtype not in HALF:
            raise ValueError(f"{name} dtype {t.dtype}: fa_lab's kernels take bf16/f16 (as "
                             "upstream's); run the model in bf16, e.g. model.to(torch.bfloat16)")
    B, Hq, L, E = query.shape
    Bk, Hkv, S, Ek = key.shape
    if key.dtype != query.dtype or value.dtype != query.dtype:
        raise ValueError(f"query, key and value must share a dtype, got {query.dtype}, "
                         f"{key.dtype}, {value.dtype}")
    if Bk != B or value.shape[0] != B:
        raise ValueError(f"batch sizes differ: query {B}, key {Bk}, value {value.shape[0]}")
    if Ek != E or value.shape[3] != E:
        raise ValueError(f"value and key head dims must equal query's ({E}); got key {Ek}, "
                         f"value {value.shape[3]} (fa_lab's kernels take one head dim)")
    if value.shape[1] != Hkv or value.shape[2] != S:
        raise ValueError(f"value shape {list(value.shape)} does not match key {list(key.shape)}")
    if E not in api.HEAD_DIMS:
        raise ValueError(f"query head dim {E}: fa_lab's bf16 kernels take {api.HEAD_DIMS}")
    if not isinstance(enable_gqa, bool):
        raise TypeError(f"enable_gqa must be a bool, got {type(enable_gqa).__name__}")
    if Hkv != Hq and not (enable_gqa and Hq % Hkv == 0):
        raise ValueError(f"query has {Hq} heads and key {Hkv}: pass enable_gqa=True with Hq a "
                         "multiple of Hkv (as SDPA requires)")
    if not isinstance(dropout_p, (int, float)) or isinstance(dropout_p, bool) or dropout_p != 0:
        raise ValueError(f"dropout_p={dropout_p!r}: fa_lab's flash_attn_func has no dropout; "
                         "pass dropout_p=0.0 (e.g. evaluate the model with dropout off)")
    if not isinstance(is_causal, bool):
        raise TypeError(f"is_causal must be a bool, got {type(is_causal).__name__}")
    if is_causal and L != S:
        raise ValueError(f"is_causal with L={L} != S={S}: SDPA's causal mask is top-left "
                         "aligned and fa_lab's bottom-right; they agree only when L == S")
    if is_causal and attn_mask is not None:
        raise ValueError("attn_mask together with is_causal=True (SDPA refuses the pair too)")
    if scale is not None:
        if not isinstance(scale, (int, float)) or isinstance(scale, bool):
            raise TypeError(f"scale must be a float or None, got {type(scale).__name__}")
        if not math.isclose(scale, 1 / math.sqrt(E), rel_tol=1e-9, abs_tol=0.0):
            raise ValueError(f"scale={scale!r}: fa_lab's kernels fix the softmax scale at "
                             f"1/sqrt(D) = {1 / math.sqrt(E)!r}; fold another scale into query")
    return _bias(attn_mask, B, Hq, L, S, query.dtype, query.device)


def _attention(rec: Recorder, query, key, value, attn_mask=None, dropout_p=0.0,
               is_causal=False, scale=None, enable_gqa=False):
    """The patched SDPA: checked, run through flash_attn_func, its non-finite rows recorded."""
    bias = check(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    call, step, module = rec.calls, rec.step, rec._module()
    rec.calls += 1
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))

    def report_inputs(grads):
        for name, g in zip(("dq", "dk", "dv"), grads):
            if g is not None:
                rec._check(call, step, module, "backward", name, g)

    def report_dout(grads):
        if grads[0] is not None:
            rec._check(call, step, module, "backward", "dout", grads[0])

    if grad:
        query, key, value = _Watch.apply(report_inputs, query, key, value)
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    if rec.capture:
        rec.inputs.append({"call": call, "step": step, "module": module, "q": q.detach().clone(),
                           "k": k.detach().clone(), "v": v.detach().clone(), "bias": bias,
                           "causal": is_causal})
    out, lse = api.flash_attn_func(q, k, v, causal=is_causal, bias=bias, return_lse=True,
                                   **rec.options)
    out = out.transpose(1, 2)
    rec._check(call, step, module, "forward", "out", out)
    rec._check(call, step, module, "forward", "lse", lse, lse=True)
    if grad and out.requires_grad:
        (out,) = _Watch.apply(report_dout, out)
    return out


@contextmanager
def patched(*, rescale=None, upstream=None, backend="auto", kernel=None, model=None,
            capture=False, **options):
    """Route ``torch.nn.functional.scaled_dot_product_attention`` through
    ``fa_lab.flash_attn_func`` inside the block; yields a ``Recorder``.

    ``rescale``, ``upstream``, ``backend``, ``kernel`` and any other ``options``
    (``rescale_threshold``, ``rebase_bound``, ...) go to every call (checked by
    ``fa_lab.api.check_call`` now, on a tiny call, so a bad one fails on entry).
    ``model``: an ``nn.Module`` whose ``named_modules`` name the calling modules in the
    events. ``capture``: keep every call's inputs (``Recorder.inputs``). Nesting raises
    RuntimeError; the original function is restored on exit, also on an exception."""
    if model is not None and not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module or None, got {type(model).__name__}")
    if not isinstance(capture, bool):
        raise TypeError(f"capture must be a bool, got {type(capture).__name__}")
    for name in ("q", "k", "v", "causal", "bias", "return_lse"):
        if name in options:
            raise ValueError(f"{name} is set per call by the patch (from SDPA's arguments)")
    opts = dict(rescale=rescale, upstream=upstream, backend=backend, kernel=kernel, **options)
    probe = torch.zeros(1, 1, 1, 64, dtype=torch.bfloat16)
    with torch.no_grad():
        api.check_call(probe, probe, probe, causal=False, **opts)  # bad options fail here
    names = {id(m): n for n, m in model.named_modules()} if model is not None else {}
    rec = Recorder(options=opts, names=names, capture=capture)
    with _LOCK:
        if _ACTIVE:
            raise RuntimeError("fa_lab.sdpa.patched is already active: nesting is refused "
                               "(one recorder owns scaled_dot_product_attention at a time)")
        _ACTIVE.append(rec)
    original = F.scaled_dot_product_attention

    def pre(module, args):
        rec._stack.append(module)

    def post(module, args, output):
        while rec._stack:
            if rec._stack.pop() is module:
                break

    def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
             enable_gqa=False):
        return _attention(rec, query, key, value, attn_mask, dropout_p, is_causal, scale,
                          enable_gqa)

    sdpa.__doc__ = f"fa_lab.sdpa.patched's SDPA ({opts})"
    hooks = []
    try:
        hooks = [torch.nn.modules.module.register_module_forward_pre_hook(pre),
                 torch.nn.modules.module.register_module_forward_hook(post)]
        F.scaled_dot_product_attention = sdpa
        yield rec
    finally:
        F.scaled_dot_product_attention = original
        for h in hooks:
            h.remove()
        rec._stack.clear()
        with _LOCK:
            _ACTIVE.clear()


def active() -> Recorder | None:
    """The recorder of the patch in force, or None."""
    return _ACTIVE[0] if _ACTIVE else None
