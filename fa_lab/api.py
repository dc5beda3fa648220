"""``flash_attn_func``, ``trace``, ``count_rescales`` and ``swa_attn_func``.

The signature follows upstream's ``flydsl_flash_attn_func`` ([B, S, H, D] tensors, causal by
default, softmax scale fixed at 1/sqrt(D), fp8 selected by float8_e4m3fn inputs), so a
repro written against FlyDSL runs unchanged after
``from fa_lab import flash_attn_func as flydsl_flash_attn_func``. One path for every call:
``check_call`` checks every argument once, before any work, into one ``dispatch.Call``
(errors name the argument); ``dispatch.plan`` routes it to a family, resolves the policy
for that family and checks what the backend can do; ``dispatch.run`` runs it.

Gradients: ``flash_attn_func`` in grad mode with q, k or v requiring grad returns an
output whose backward runs FlyDSL's backward kernels (``fa_lab.autograd``). ``trace`` and
``count_rescales`` compute no gradients and refuse such inputs.
"""

from __future__ import annotations

import inspect
import math
import warnings

import torch

from fa_lab import (autograd, dispatch, paged, policies, routing, upstream as upstream_versions,
                    varlen)
from fa_lab.checks import (check_descale, check_int, check_mod, check_qkv, layout_hint,
                           layout_problem, warn_layout, warn_nonfinite_inputs)
from fa_lab.dispatch import BACKENDS, Call
from fa_lab.kernels import FAMILIES
from fa_lab.kernels._common.geometry import BLOCK_N
from fa_lab.numerics import CAUSAL_FLOOR, E4M3_MAX, f32, log2_scale
from fa_lab.trace import Trace, TraceRecorder, normalize_rows

FP8 = torch.float8_e4m3fn
HALF_DTYPES = (torch.bfloat16, torch.float16)
HEAD_DIMS = (64, 128)
#: The head dims a call's q may have: the bf16/f16 kernels' and the fp8 kernel's (D 192 is
#: fp8's only: routing refuses a bf16/f16 call of it by name).
QK_HEAD_DIMS = tuple(sorted(set(HEAD_DIMS) | set(routing.FP8_HEAD_DIMS)))
#: V/output head dims a call may give where Dv differs from D (a family's Caps.head_dims_v
#: says which it runs; dispatch refuses the rest by name).
V_HEAD_DIMS = (64, 96, 128, 160, 192)

__all__ = ["BACKENDS", "Call", "check_call", "plan", "flash_attn_func", "trace", "count_rescales",
           "swa_attn_func"]


def check_forward_only(*tensors) -> None:
    """Refuse a call that autograd would record: fa_lab's kernels are forward only."""
    if not torch.is_grad_enabled():
        return
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.requires_grad:
            raise ValueError("fa_lab's attention is forward only (no gradients): an input requires "
                             "grad; wrap the call in torch.no_grad() or pass detached tensors")


def _check_mods(q, fp8, B, Sq, H, Skv, packing, bias, alibi_slopes, sink) -> dict:
    """bias / alibi_slopes / sink: tensors of the shapes and dtypes upstream takes (bias in
    q's dtype, slopes and sink fp32) on q's device; the bf16/f16 kernel only."""
    bias_shape = (Sq, Skv) if packing is None else (q.shape[0], packing.max_seqlen_kv)
    mods = {}
    for name, x, shapes, dtype in (("bias", bias, [bias_shape], q.dtype),
                                   ("alibi_slopes", alibi_slopes, [(H,), (B, H)], torch.float32),
                                   ("sink", sink, [(H,)], torch.float32)):
        if x is None:
            continue
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if fp8:
            raise ValueError(f"{name} is not supported with float8_e4m3fn inputs "
                             f"(the fp8 BN128 kernel has no {name} path)")
        check_mod(name, x, shapes, dtype, q.device)
        if name == "sink" and not torch.isfinite(x).all():
            raise ValueError("sink must be finite: it is one more logit per head in the softmax "
                             "denominator, and a NaN or infinite logit has no such meaning")
        mods[name] = x
    return mods


def _check_dense_qkv(q, k, v):
    """``check_qkv`` for dense q, k, v, then ``warn_layout``; an error on shapes that look
    like another layout says so (``layout_problem``)."""
    try:
        sizes = check_qkv(q, k, v, dtypes=(*HALF_DTYPES, FP8), head_dims=QK_HEAD_DIMS,
                          v_head_dims=V_HEAD_DIMS)
    except ValueError as e:
        if not all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in (q, k, v)):
            raise
        problem = layout_problem(q.shape, k.shape)
        if problem is None:
            try:   # shapes that make a call once read as [B, H, S, D]
                check_qkv(*(t.transpose(1, 2) for t in (q, k, v)),
                          dtypes=(*HALF_DTYPES, FP8), head_dims=QK_HEAD_DIMS,
                          v_head_dims=V_HEAD_DIMS)
            except (ValueError, TypeError):
                raise e from None
            problem = (f"read as [B, H, S, D] (SDPA's layout), q {list(q.shape)} and k "
                       f"{list(k.shape)} would make a valid call")
        raise ValueError(f"{e}; {layout_hint(problem)}") from None
    warn_layout(q, k)
    return sizes


def _check_paged(q, k, v, packing, block_table, seqlen_k, kv_cache_layout) -> paged.PagedKV:
    """block_table / seqlen_k / kv_cache_layout (``fa_lab.paged``) on a dense bf16/f16 q;
    varlen paged calls are refused, naming the argument (fp8 paged calls go to
    ``paged.check_fp8``)."""
    if packing is not None:
        raise ValueError("block_table with cu_seqlens_q/kv (varlen paged KV) is not modelled; "
                         "pass dense q [B, Sq, H, D] with a block_table")
    if not isinstance(q, torch.Tensor):
        raise TypeError(f"q must be a torch.Tensor, got {type(q).__name__}")
    if q.dtype not in HALF_DTYPES:
        raise TypeError(f"q has dtype {q.dtype}; paged KV takes bfloat16 or float16")
    # (neither table given: paged.check refuses a kv_cache_layout other than "linear")
    return paged.check(q, k, v, block_table, seqlen_k, kv_cache_layout, head_dims=HEAD_DIMS)


def check_call(q, k, v, *, causal=True, num_kv_heads=None, cu_seqlens_q=None,
               cu_seqlens_kv=None, max_seqlen_q=None, max_seqlen_kv=None, q_descale=None,
               k_descale=None, v_descale=None, dualwave_swp_lazy_rescale=None, rescale=None,
               rescale_threshold=None, rebase_bound=None, p_headroom=None, fp8_saturate=None,
               backend="auto", bias=None, alibi_slopes=None, sink=None, num_kv_splits=1,
               kernel=None, upstream=None, return_lse=False, block_table=None, seqlen_k=None,
               kv_cache_layout="linear") -> Call:
    """Validate every argument into one ``dispatch.Call`` (the rescale arguments as a
    ``policies.Request``, resolved by ``dispatch.plan`` once the family is known); raises
    ValueError/TypeError naming the argument. Does no work on the tensors' data.

    The arguments are ``flash_attn_func``'s (see there)."""
    for name, t in (("q", q), ("k", k), ("v", v), ("cu_seqlens_q", cu_seqlens_q),
                    ("cu_seqlens_kv", cu_seqlens_kv)):
        if isinstance(t, torch.Tensor) and t.device.type == "meta":
            raise ValueError(f"{name} is a meta tensor (no data); fa_lab runs on CPU or GPU tensors")
    fp8_paged = (isinstance(q, torch.Tensor) and q.dtype == FP8
                 and (block_table is not None or seqlen_k is not None))
    packing = None if fp8_paged else varlen.check(q, k, cu_seqlens_q, cu_seqlens_kv,
                                                   max_seqlen_q, max_seqlen_kv)
    if packing is not None:
        for name, t in (("v", v),):
            if not isinstance(t, torch.Tensor) or t.dim() != 3:
                shape = list(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise ValueError(f"varlen {name} must be packed [total, H, D], got {shape}")
        B, Sq = packing.batch, packing.max_seqlen_q
        _, _, H, D, _, Hkv = check_qkv(q[None], k[None], v[None], dtypes=(*HALF_DTYPES, FP8),
                                       head_dims=QK_HEAD_DIMS, v_head_dims=V_HEAD_DIMS)
        Skv = packing.max_seqlen_kv
        warn_layout(q[None], k[None])
    if fp8_paged:  # FlyDSL #1066: packed fp8 q over a vectorized page cache
        paged_kv = paged.check_fp8(q, k, v, causal=causal, cu_seqlens_q=cu_seqlens_q,
                                   cu_seqlens_kv=cu_seqlens_kv, max_seqlen_q=max_seqlen_q,
                                   max_seqlen_kv=max_seqlen_kv, block_table=block_table,
                                   seqlen_k=seqlen_k, kv_cache_layout=kv_cache_layout)
        B, Sq, (_, H, D) = paged_kv.batch, paged_kv.max_seqlen_q, q.shape
        Skv, Hkv = paged_kv.seqlen_kv, paged_kv.num_kv_heads
    elif block_table is not None or seqlen_k is not None or kv_cache_layout != "linear":
        paged_kv = _check_paged(q, k, v, packing, block_table, seqlen_k, kv_cache_layout)
        B, Sq, H, D = q.shape
        Skv, Hkv = paged_kv.seqlen_kv, paged_kv.num_kv_heads
    else:
        paged_kv = None
    if packing is None and paged_kv is None:
        B, Sq, H, D, Skv, Hkv = _check_dense_qkv(q, k, v)
    check_forward_only(q, k, v, bias, alibi_slopes, sink)
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    if num_kv_heads is not None:
        num_kv_heads = check_int("num_kv_heads", num_kv_heads)
        if num_kv_heads != Hkv:
            raise ValueError(f"num_kv_heads={num_kv_heads} but k and v have {Hkv} heads")
    fp8 = q.dtype == FP8
    given = {"q_descale": q_descale, "k_descale": k_descale, "v_descale": v_descale}
    if fp8:
        missing = [n for n, x in given.items() if x is None]
        if missing:
            raise ValueError(f"fp8 inputs need per-tensor descales; missing {', '.join(missing)}")
        descales = tuple(check_descale(n, x) for n, x in given.items())
    else:
        extra = () if q_descale is None and k_descale is None and v_descale is None else [
            n for n, x in given.items() if x is not None]
        if extra:
            raise ValueError(f"{', '.join(extra)} apply to float8_e4m3fn inputs only, got {q.dtype}")
        descales = None
    if fp8_saturate is None:
        fp8_saturate = True
    elif not fp8:
        raise ValueError("fp8_saturate applies to float8_e4m3fn inputs only")
    elif not isinstance(fp8_saturate, bool):
        raise TypeError(f"fp8_saturate must be a bool, got {type(fp8_saturate).__name__}")
    mods = _check_mods(q, fp8, B, Sq, H, Skv, packing, bias, alibi_slopes, sink)
    if paged_kv is not None:
        for name in ("alibi_slopes", "sink"):
            if name in mods:
                raise ValueError(f"{name} is not supported with paged KV (block_table), as upstream")
        if "bias" in mods and len(set(paged_kv.seqlen_k)) > 1:
            raise ValueError("bias with paged KV needs one seqlen_k for the whole batch: the dense "
                             "paged kernel receives only max(seqlen_k), as upstream")
        mods["paged"] = paged_kv
    if type(num_kv_splits) is not int or num_kv_splits != 1:
        num_kv_splits = check_int("num_kv_splits", num_kv_splits, lo=1)
    if num_kv_splits > 1:
        n_tiles = -(-Skv // BLOCK_N)
        if packing is not None and not fp8:  # upstream's fp8 kernel (#1097) takes both
            raise ValueError("varlen (cu_seqlens_q/kv) is not supported together with num_kv_splits > 1")
        if Sq < 384:
            raise ValueError(f"num_kv_splits > 1 (split-K) needs seq_len >= 384 as upstream; got Sq={Sq}")
        if num_kv_splits > n_tiles:
            raise ValueError(f"num_kv_splits={num_kv_splits} exceeds the {n_tiles} KV tiles of "
                             f"{BLOCK_N} columns (Skv={Skv}): every split past them is empty")
        mods["num_kv_splits"] = num_kv_splits
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise ValueError(f"backend={backend!r}; choose one of {BACKENDS}")
    if kernel is not None and (not isinstance(kernel, str) or kernel not in dispatch.ROUTED):
        raise ValueError(f"kernel={kernel!r} is not a kernel fa_lab routes; choose one of "
                         f"{dispatch.ROUTED} (the others have entry points of their own)")
    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse must be a bool, got {type(return_lse).__name__}")
    version = upstream_versions.get(upstream)
    # None: the upstream version's default (which the generic kernel ignores, as upstream
    # does); an explicit True/False is a request that routing must honour.
    if dualwave_swp_lazy_rescale is not None and not isinstance(dualwave_swp_lazy_rescale, bool):
        raise TypeError("dualwave_swp_lazy_rescale must be a bool, "
                        f"got {type(dualwave_swp_lazy_rescale).__name__}")
    if rescale is not None:
        # the one lookup of a name: a name the registry lacks, or not a Policy, is refused now
        rescale = policies.as_policy(rescale)
    request = policies.Request(rescale=rescale, lazy_flag=dualwave_swp_lazy_rescale,
                               rescale_threshold=rescale_threshold, rebase_bound=rebase_bound,
                               p_headroom=p_headroom)
    dtype = "fp8" if fp8 else "bf16" if q.dtype == torch.bfloat16 else "f16"
    features = (*mods, "varlen") if packing is not None else tuple(mods)
    return Call(q=q, k=k, v=v, causal=causal, request=request, fp8=fp8, descales=descales,
                fp8_saturate=fp8_saturate, backend=backend, mods=mods, head_dim=D, batch=B,
                seqlen_q=Sq, seqlen_kv=Skv, dtype=dtype, features=features, version=version,
                policy_asked=request.explicit(fp8=fp8, reads_flag=version.fp8_reads_flag),
                packing=packing, kernel_asked=kernel, return_lse=return_lse,
                head_dim_v=(paged_kv.head_dim_v if fp8_paged else D) if paged_kv is not None
                else v.shape[-1])


def warn_fp8_scale(call: Call) -> None:
    """Warn where fp8 descales can make the kernel's fp32 addend ``-ls * m`` go wrong, as it
    does on the GPU. Both checks read the descales and the shapes only (no pass over the
    inputs and no sync with the GPU):

    * it loses the row max: its rounding error reaches tens of log2 units once |ls * m|
      passes 2**32, and the kernel returns all-zero rows with an infinite LSE (NaN
      without saturation). A raw fp8 score is at most 448 x 448 x D (e4m3's largest
      value), so this warns where descales put that bound past 2**32 log2 units: where
      overflow is possible for some input, not only where it happens;
    * it overflows at the causal floor (-3e38; from ls = 1.1342746) of the rows that see
      no key (causal, seq_len_q > seq_len_kv), which then come out NaN."""
    if not call.fp8:
        return
    qd, kd, _ = call.descales
    ls = log2_scale(qd, kd, call.head_dim)
    bound = ls * E4M3_MAX * E4M3_MAX * call.head_dim
    if bound >= 2.0 ** 32:
        warnings.warn(f"q_descale * k_descale = {qd * kd:.3g} lets fp8 scores reach {bound:.3g} log2 "
                      "units (e4m3's largest values): past 2**32 the kernel's fp32 addend -ls*m "
                      "loses the row max, so rows may come out all-zero with an infinite LSE (NaN "
                      "with fp8_saturate=False), as on the GPU; check the descales",
                      RuntimeWarning, stacklevel=3)
    # causal rows above the bottom-right diagonal see no key and keep the floor as their
    # base; from ls = 1.1342746 the addend -ls * floor overflows and fma(-inf, ls, inf) is NaN
    if call.causal and call.seqlen_q > call.seqlen_kv and math.isinf(f32(ls * CAUSAL_FLOOR)):
        warnings.warn(f"q_descale * k_descale = {qd * kd:.4g} (ls = {ls:.8g}, at least 1.1342746) "
                      f"with causal seq_len_q {call.seqlen_q} > seq_len_kv {call.seqlen_kv}: the first "
                      f"{call.seqlen_q - call.seqlen_kv} rows of each head see no key, and the "
                      "kernel's -ls*m overflows at their floored max, so they come out NaN "
                      "(docs/semantics.md §1.2)", RuntimeWarning, stacklevel=3)


#: The keyword arguments every entry point passes on to ``check_call``, in its order.
CALL_OPTIONS = tuple(p for p in inspect.signature(check_call).parameters
                     if p not in ("q", "k", "v", "return_lse"))


def _options(local: dict) -> dict:
    """An entry point's own arguments that ``check_call`` takes, by name."""
    options = {}
    for name in CALL_OPTIONS:
        if name in local:
            options[name] = local[name]
    return options


def plan(q, k, v, **options) -> dispatch.Plan:
    """``check_call`` then ``dispatch.plan``: the call checked, routed, its policy resolved
    for the routed family and its backend chosen, with no work on the data. What
    ``flash_attn_func`` would run (``plan(...).family``, ``.backend``, ``.call.policy``)."""
    return dispatch.plan(check_call(q, k, v, **options))


def plan_decided(family: str, policy, q, k, v, **options) -> dispatch.Plan:
    """``plan`` for a call whose family and resolved policy an earlier ``plan`` of a call of
    the same shape, dtype and options decided (``dispatch.plan_decided``): a sweep plans
    each point once, when its grid is expanded, and its worker runs that decision on the
    point's tensors. The arguments are ``flash_attn_func``'s, checked as there."""
    return dispatch.plan_decided(check_call(q, k, v, **options), family, policy)


def flash_attn_func(q, k, v, *, causal=True, num_kv_heads=None, cu_seqlens_q=None,
                    cu_seqlens_kv=None, max_seqlen_q=None, max_seqlen_kv=None, block_table=None,
                    seqlen_k=None, kv_cache_layout="linear", num_kv_splits=1,
                    dualwave_swp_lazy_rescale=None, q_descale=None, k_descale=None,
                    v_descale=None, bias=None, alibi_slopes=None, sink=None, return_lse=False,
                    rescale=None, rescale_threshold=None, rebase_bound=None, p_headroom=None,
                    fp8_saturate=None, backend="auto", kernel=None, upstream=None):
    """Forward attention with the gfx950 kernels' semantics.

    Upstream FlyDSL's signature and names (``causal`` through ``sink``, ``return_lse``), then
    fa_lab's own arguments (``rescale`` on). Every argument is checked before any work: a bad
    one raises ValueError or TypeError naming it.

    Parameters
    ----------
    q, k, v : torch.Tensor
        q [B, Sq, H, D], k and v [B, Skv, Hkv, D] (H a multiple of Hkv); bf16/f16, or
        float8_e4m3fn with per-tensor descales. fp8 (FlyDSL #1097) also takes D = 192 and a
        v head dim Dv of its own (the output has Dv; ``docs/semantics.md`` §16). Shapes that
        look like another layout (SDPA's [B, H, S, D]: ``checks.layout_problem``) run as
        given, with a UserWarning.
    causal : bool
        Causal mask, default True; the causal diagonal is bottom-right aligned.
    num_kv_heads : int or None
        Checked against k's heads when given.
    cu_seqlens_q, cu_seqlens_kv : torch.Tensor or None
        Varlen: int32 [B+1] offsets of packed q [total_q, H, D] and k, v [total_kv, Hkv, D].
    max_seqlen_q, max_seqlen_kv : int or None
        Varlen: the longest sequence (``max_seqlen_kv`` when the kv lengths differ from q's).
    block_table, seqlen_k : torch.Tensor or None
        Paged KV (``fa_lab.paged``; bf16/f16, dense q): int32 [B, max_pages] page ids and
        int32 [B] key counts, with k and v the page cache (pages of 64). The kernel runs
        every sequence to max(seqlen_k) and reads whole pages (``docs/semantics.md`` §15).
        fp8 (FlyDSL #1066's paged prefill, ``docs/semantics.md`` §17): packed q
        [total_q, H, 128] with ``cu_seqlens_q``, ``cu_seqlens_kv`` (the per-sequence key
        counts, equal to ``seqlen_k``) and ``max_seqlen_q``, causal, the vectorized cache,
        an even number of 64-key pages; its lazy threshold defaults to 8.
    kv_cache_layout : str
        The page cache's layout: ``"linear"`` (default) [NumBlocks, 64, Hkv, D] or
        ``"vectorized"`` (aiter's 5-D).
    num_kv_splits : int
        Split-K: > 1 splits each row's keys into that many partials and runs the combine
        pass (needs Sq >= 384); default 1.
    dualwave_swp_lazy_rescale : bool or None
        None takes the upstream version's default (lazy); an explicit True/False is honoured.
    q_descale, k_descale, v_descale : float or None
        fp8 only: the per-tensor descales of float8_e4m3fn q, k and v.
    bias : torch.Tensor or None
        An additive score bias [Sq, Skv] (varlen: [total_q, max_seqlen_kv]) in q's dtype,
        natural-log units, applied as upstream's DUALWAVE_SWP path does
        (``docs/semantics.md`` §2.6).
    alibi_slopes : torch.Tensor or None
        ALiBi slopes [H] or [B, H], fp32.
    sink : torch.Tensor or None
        Attention-sink logits [H], fp32: one extra logit per head with no value row.
    return_lse : bool
        Also return the log-sum-exp; default False.
    rescale : str, fa_lab.Policy or None
        The rescale policy: a name (``fa_lab.policies.names()``: eager, lazy, lazy_unfixed,
        lazy_capped, fa4_row, the zoo's presets and any registered) or a ``fa_lab.Policy``;
        None takes the upstream version's default. A policy the routed kernel cannot run is
        not applied: the call warns once (``fa_lab.RoutingWarning``) and says which
        ``kernel=`` applies it. A policy that sets ``fa_lab.semantics`` fields (such as
        ``"fa4_fp8_saturation:before"``) runs on the online-softmax family.
    rescale_threshold : float, str or None
        Replaces the policy's threshold (log2 units; fp8 also ``"by_kv_len"``).
    rebase_bound : float or None
        The bound of a capped policy's rebase.
    p_headroom : bool, float or None
        fp8: True for PR #1020's lift of P, or a number (log2 units).
    fp8_saturate : bool or None
        fp8: the P cast clamps to 448 (True, the default) or gives NaN (False).
    backend : str
        ``"emulator"`` the exact model (CPU or GPU tensors); ``"triton"`` the faithful Triton
        ports (GPU tensors); ``"interpret"`` the same ports on CPU tensors through Triton's
        interpreter; ``"fast"`` the fast Triton kernels (their own tiling, so NaN onset can
        differ from the faithful path; GPU, or interpreted on CPU); ``"flydsl"`` upstream's
        kernel on an MI355X; ``"auto"`` (default) the faithful ports for GPU tensors and the
        model for CPU tensors.
    kernel : str or None
        A routed family's name instead of upstream's routing (``fa_lab.dispatch.ROUTED``:
        the bf16/f16 and fp8 DUALWAVE_SWP kernels, the generic kernel, the online-softmax
        model).
    upstream : str or None
        The FlyDSL version whose defaults a bare call takes (``fa_lab.upstream.VERSIONS``);
        None: ``"fixed"``, or what ``fa_lab.set_upstream`` chose.

    Returns
    -------
    out : torch.Tensor
        [B, Sq, H, D] in q's dtype (bf16 for fp8 inputs). In grad mode, when q, k or v
        requires grad, it carries gradients: FlyDSL's backward kernels on the forward's
        backend (``fa_lab.autograd``).
    lse : torch.Tensor
        Only if ``return_lse``: [B, H, Sq] fp32, natural log; it carries no gradient.

    Examples
    --------
    The bug report's inputs (k = N(0, 1) x 48) at a CPU size: the unfixed rebase gives NaN,
    the fix does not.

    >>> import fa_lab
    >>> from fa_lab.studies.experiments import bf16_inputs
    >>> q, k, v = bf16_inputs(1, 1024, 1, 64, k_scale=48)
    >>> out = fa_lab.flash_attn_func(q, k, v, causal=False, rescale="lazy_unfixed")
    >>> out.shape, out.dtype
    (torch.Size([1, 1024, 1, 64]), torch.bfloat16)
    >>> bool(out.isnan().any())
    True
    >>> bool(fa_lab.flash_attn_func(q, k, v, causal=False).isnan().any())   # the fix
    False
    >>> out, lse = fa_lab.flash_attn_func(q, k, v, causal=False, return_lse=True)
    >>> lse.shape, lse.dtype
    (torch.Size([1, 1, 1024]), torch.float32)
    """
    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse must be a bool, got {type(return_lse).__name__}")
    if autograd.records(q, k, v, bias, alibi_slopes, sink):  # gradients: fa_lab.autograd
        planned = plan(q.detach(), k.detach(), v.detach(), **_options(locals()))
        return autograd.attach(planned, q, k, v, return_lse)
    call = check_call(q, k, v, return_lse=return_lse, **_options(locals()))
    planned = dispatch.plan(call)
    if call.fp8:
        warn_fp8_scale(call)
    out, lse = dispatch.run(planned)
    return (out, lse) if return_lse else out


def count_rescales(q, k, v, *, causal=True, num_kv_heads=None, cu_seqlens_q=None,
                   cu_seqlens_kv=None, max_seqlen_q=None, max_seqlen_kv=None, block_table=None,
                   seqlen_k=None, kv_cache_layout="linear", num_kv_splits=1,
                   dualwave_swp_lazy_rescale=None, q_descale=None, k_descale=None, v_descale=None,
                   bias=None, alibi_slopes=None, sink=None, rescale=None, rescale_threshold=None,
                   rebase_bound=None, p_headroom=None, fp8_saturate=None, backend="emulator",
                   kernel=None, upstream=None) -> dict:
    """Run the call as ``flash_attn_func`` (same arguments) through the model and count its
    rescale work over the main loop (see ``fa_lab.counters``). The counts come from the
    model of a dense bf16/f16 call: any backend other than "emulator" (or "auto") is
    refused, as are fp8 inputs.

    Parameters
    ----------
    q, k, v : torch.Tensor
        As ``flash_attn_func``: bf16/f16 q [B, Sq, H, D], k and v [B, Skv, Hkv, D].
    causal, num_kv_heads, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv, num_kv_splits, dualwave_swp_lazy_rescale, q_descale, k_descale, v_descale, bias, alibi_slopes, sink, rescale, rescale_threshold, rebase_bound, p_headroom, fp8_saturate, kernel, upstream
        As ``flash_attn_func``.
    backend : str
        ``"emulator"`` (the default) or ``"auto"``; any other is refused.

    Returns
    -------
    dict
        ``row_steps`` (rows times loop steps), ``loop_wave_steps``, ``o_multiplies`` (wave
        steps that multiplied O), ``o_rescale_skip_frac``, ``rows_swept`` (row-steps whose
        wave fired while the row's tile max sat below its base), ``rows_scaled_up``
        (row-steps whose base moved down: the unfixed rebase's drag), and ``out``, ``lse``.

    Examples
    --------
    >>> import fa_lab
    >>> from fa_lab.studies.experiments import bf16_inputs
    >>> q, k, v = bf16_inputs(1, 1024, 1, 64, k_scale=48)
    >>> fixed = fa_lab.count_rescales(q[:, :256], k, v, causal=False, rescale="lazy")
    >>> unfixed = fa_lab.count_rescales(q[:, :256], k, v, causal=False, rescale="lazy_unfixed")
    >>> fixed["rows_scaled_up"], unfixed["rows_scaled_up"] > 0    # only the bug drags
    (0, True)
    >>> fixed["o_multiplies"] < fixed["loop_wave_steps"]            # lazy skips some
    True
    """
    from fa_lab.counters import RescaleCounter

    opts = {**_options(locals()), "backend": "emulator"}
    planned = plan(q, k, v, **opts)
    if backend not in ("emulator", "auto"):
        check_call(q, k, v, **{**opts, "backend": backend})  # a bad backend name says so first
        raise ValueError(f"count_rescales counts the model's loop: backend={backend!r} cannot "
                         "count; use backend='emulator'")
    if planned.call.fp8:
        raise ValueError("count_rescales counts the bf16/f16 kernel's loop; got float8_e4m3fn inputs")
    counter = RescaleCounter(planned.call.policy)
    out, lse = dispatch.run(planned, counter)
    return {**counter.summary(), "out": out, "lse": lse}


def trace(q, k, v, *, rows, batch=0, head=0, causal=True, num_kv_heads=None,
          cu_seqlens_q=None, cu_seqlens_kv=None, max_seqlen_q=None, max_seqlen_kv=None,
          block_table=None, seqlen_k=None, kv_cache_layout="linear",
          num_kv_splits=1, dualwave_swp_lazy_rescale=None, q_descale=None, k_descale=None,
          v_descale=None, bias=None, alibi_slopes=None, sink=None, rescale=None,
          rescale_threshold=None, rebase_bound=None, p_headroom=None, fp8_saturate=None,
          backend="auto", kernel=None, upstream=None) -> Trace:
    """Run the call as ``flash_attn_func`` (same arguments; dense calls) and record, for the
    chosen lanes, every step's running max, tile max, vote, wave decision, whether the row
    was swept, correction, l and finiteness (see ``fa_lab.trace.Trace``).

    Parameters
    ----------
    q, k, v : torch.Tensor
        As ``flash_attn_func``; dense calls only (a varlen call is refused).
    rows : int, range or list
        The lanes to record (``fa_lab.trace.normalize_rows``): query rows of (``batch``,
        ``head``) as an int, a range or a list of ints, or a list of (batch, head, row)
        tuples, one lane each.
    batch, head : int
        The batch and head of ``rows`` given as row numbers; default 0.
    causal, num_kv_heads, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv, num_kv_splits, dualwave_swp_lazy_rescale, q_descale, k_descale, v_descale, bias, alibi_slopes, sink, rescale, rescale_threshold, rebase_bound, p_headroom, fp8_saturate, backend, kernel, upstream
        As ``flash_attn_func``.

    Returns
    -------
    fa_lab.Trace
        ``steps``: one row per (lane, step); ``lanes``: one row per lane.

    Examples
    --------
    Four rows of the bug report's inputs under the unfixed rebase:

    >>> import fa_lab
    >>> from fa_lab.studies.experiments import bf16_inputs
    >>> q, k, v = bf16_inputs(1, 1024, 1, 64, k_scale=48)
    >>> t = fa_lab.trace(q[:, :256], k, v, rows=range(4), causal=False,
    ...                  rescale="lazy_unfixed")
    >>> len(t.lanes), t.steps["step"].nunique()          # 4 lanes, 1024 / 64 tiles
    (4, 16)
    >>> list(t.steps.columns[4:13])
    ['m', 'mt', 'vote', 'fire', 'swept', 'corr', 'l', 'o_finite', 'l_finite']
    """
    call = check_call(q, k, v, **_options(locals()))
    if call.packing is not None:
        raise ValueError("trace takes dense calls; trace one sequence of a varlen batch at a time")
    B, Sq, H, _ = q.shape
    triples = normalize_rows(rows, batch, head, (B, H, Sq))
    bad_inputs = warn_nonfinite_inputs(q, k, v)  # not the policy's doing: say so
    hkv = call.mods["paged"].num_kv_heads if "paged" in call.mods else k.shape[2]
    recorder = TraceRecorder(triples, group_size=H // hkv)
    planned = dispatch.plan(call)
    warn_fp8_scale(call)
    dispatch.run(planned, recorder)
    pol = planned.call.policy
    # a family that records raw fp8-product units (the fp8 kernel) is scaled to log2 units
    raw = call.fp8 and FAMILIES[planned.family].raw_units
    per_unit = log2_scale(call.descales[0], call.descales[1], call.head_dim) if raw else 1.0
    thr = pol.threshold / per_unit if pol.lazy else float("nan")
    tr = recorder.build(kernel=planned.family, policy=pol, log2_per_unit=per_unit,
                        threshold_units=thr)
    tr.meta.update(upstream=call.upstream, backend=planned.backend, nonfinite_inputs=bad_inputs)
    return tr


def swa_attn_func(q, k, v, *, window_left, window_right=0, causal=True, rescale="lazy",
                  rescale_threshold=None, return_lse=False, backend="auto"):
    """The SWA GQA sliding-window kernel (``swa_gfx950.py``), which upstream's
    ``flydsl_flash_attn_func`` does not route to: row i sees keys i - window_left ...
    i + window_right. ``rescale``: a policy with a wave vote and rebase ``"max"`` (its own
    deferred rescale, ``"lazy"``, correct by construction) or ``"tile"`` (the
    counterfactual ``"lazy_unfixed"``). ``rescale_threshold`` (log2 units) replaces the
    policy's threshold (8 for the built-ins); None keeps it. The kernel is the family that
    claims the ``"window"`` feature (``dispatch.serving``); its model's docstring has the
    details. ``backend`` as ``flash_attn_func``: the model (``"emulator"``), its faithful
    Triton port (``"triton"`` on GPU tensors, ``"interpret"`` on CPU tensors), or ``"auto"``."""
    family = dispatch.serving("window")
    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse must be a bool, got {type(return_lse).__name__}")
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise ValueError(f"backend={backend!r}; choose one of {BACKENDS}")
    window = {"window_left": window_left, "window_right": window_right}
    policy = family.check_args(q, k, v, **window, causal=causal,
                               rescale_threshold=rescale_threshold, rescale=rescale)
    # the same path as flash_attn_func's, on the family asked for by its entry point
    call = check_call(q, k, v, causal=causal, rescale=policy, backend=backend)
    call = call._with(kernel_asked=family.name, return_lse=return_lse,
                      features=(*call.features, "window"), options={**window, "rescale": policy})
    out, lse = dispatch.run(dispatch.plan(call))
    return (out, lse) if return_lse else out
