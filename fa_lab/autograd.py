"""Gradients through ``fa_lab.flash_attn_func``: FlyDSL's gfx950 backward (``kernels/bwd``)
behind a ``torch.autograd.Function``.

A call whose q, k or v requires grad (in grad mode) runs its forward as any other call and
returns an output that carries a gradient function. Its backward is upstream's backward
pass: ``delta = rowsum(dO * O)`` from the forward's own output, then the dQ and dK/dV
kernels, which recompute P from the forward's own LSE (``fa_lab.kernels.bwd``). Whatever
the forward's policy did to O and the LSE (a NaN, a -inf, a saturated row) is what the
backward reads: that is how forward failures reach the gradients. The backward runs on the
forward's backend: ``"emulator"`` the exact models, ``"interpret"`` and ``"triton"`` the
faithful port.

Refused, by name, before any work: fp8 inputs (upstream has no fp8 backward), varlen
calls, ``alibi_slopes`` and ``sink`` (upstream's backward takes neither), a bias together
with causal (upstream refuses the pair), a bias, slope or sink that itself requires grad
(no dB is returned), and the ``"fast"`` and ``"flydsl"`` backends. The LSE output of
``return_lse=True`` carries no gradient (upstream's backward takes none).

``nonfinite_report`` says which rows of which gradient hold NaN or inf.
"""

from __future__ import annotations

import torch

from fa_lab import dispatch

#: The forward backends whose calls can be differentiated, and the backward's backend.
GRAD_BACKENDS = ("emulator", "interpret", "triton")


def records(q, k, v, bias=None, alibi_slopes=None, sink=None) -> bool:
    """Will this call be differentiated: grad mode, and q, k or v requires grad? Refuses
    (ValueError naming it) a bias, alibi_slopes or sink that requires grad."""
    if not torch.is_grad_enabled():
        return False
    wants = False  # (a loop, not any(): this runs on every call, see tests/api/test_call_path.py)
    for t in (q, k, v):
        if not isinstance(t, torch.Tensor):
            return False  # check_call says which
        wants = wants or t.requires_grad
    for name, t in (("bias", bias), ("alibi_slopes", alibi_slopes), ("sink", sink)):
        if isinstance(t, torch.Tensor) and t.requires_grad:
            raise ValueError(f"{name} requires grad, but fa_lab's backward (FlyDSL's) returns no "
                             f"gradient for {name}; pass it detached")
    return wants


def check_plan(planned: dispatch.Plan) -> None:
    """Refuse, naming the argument, a planned call that upstream's backward cannot run."""
    call = planned.call
    if call.fp8:
        raise ValueError("requires_grad on float8_e4m3fn inputs: upstream FlyDSL has no fp8 "
                         "backward kernel; differentiate bf16/f16 inputs")
    if call.packing is not None:
        raise ValueError("requires_grad with varlen (cu_seqlens_q/kv) is not supported: the "
                         "backward runs dense calls")
    if "paged" in call.mods:
        raise ValueError("requires_grad with paged KV (block_table, seqlen_k) is not supported: "
                         "upstream's paged path is forward only (it returns no LSE)")
    for name in ("alibi_slopes", "sink"):
        if name in call.mods:
            raise ValueError(f"requires_grad with {name}: upstream's backward kernels take no "
                             f"{name} (their config refuses it by name)")
    if "bias" in call.mods and call.causal:
        raise ValueError("requires_grad with a bias and causal=True: upstream's backward refuses "
                         "a bias together with a causal mask; pass causal=False")
    if planned.backend not in GRAD_BACKENDS:
        raise ValueError(f"requires_grad on backend={planned.backend!r}: gradients run on "
                         f"{GRAD_BACKENDS} (the models and the faithful port)")


class _FlashAttn(torch.autograd.Function):
    """out, lse = the planned forward; backward: FlyDSL's dQ and dK/dV."""

    @staticmethod
    def forward(ctx, q, k, v, planned):
        out, lse = dispatch.run(planned)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.planned = planned
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        if dout is None:
            return None, None, None, None
        return (*backward(ctx.planned, q, k, v, out, dout.to(q.dtype), lse), None)


def backward(planned: dispatch.Plan, q, k, v, out, dout, lse):
    """(dq, dk, dv) of a planned call, on its backend's backward implementation."""
    call = planned.call
    bias = call.mods.get("bias")
    impl = dispatch.entry("bwd", planned.backend).load()
    kw = {} if planned.backend == "emulator" else {"interpret": planned.backend == "interpret"}
    return impl.backward(q, k, v, out, dout, lse, causal=call.causal, bias=bias, **kw)


def attach(planned: dispatch.Plan, q, k, v, return_lse: bool):
    """Run ``planned`` (checked with ``check_plan``) so that its output carries gradients
    for q, k and v; returns out, or (out, lse) with ``return_lse``."""
    check_plan(planned)
    out, lse = _FlashAttn.apply(q, k, v, planned)
    return (out, lse) if return_lse else out


def nonfinite_report(**grads) -> dict:
    """For each named gradient [B, S, H, D] (e.g. ``dq=q.grad, dk=k.grad``): the rows that
    hold NaN or inf, as {name: {"rows": [(batch, head, row), ...], "nan": n, "inf": n}}
    (``n``: element counts). A gradient with no such row maps to empty rows and zeros."""
    report = {}
    for name, g in grads.items():
        if not isinstance(g, torch.Tensor) or g.dim() != 4:
            raise ValueError(f"{name} must be a [B, S, H, D] tensor, got "
                             f"{list(g.shape) if isinstance(g, torch.Tensor) else type(g).__name__}")
        bad = ~torch.isfinite(g.float()).all(-1)  # [B, S, H]
        idx = bad.nonzero().tolist()
        report[name] = {"rows": sorted((b, h, s) for b, s, h in idx),
                        "nan": int(torch.isnan(g).sum()), "inf": int(torch.isinf(g).sum())}
    return report
