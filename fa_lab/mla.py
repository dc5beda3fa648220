"""MLA decode with upstream's names: ``flydsl_mla_fwd_decode`` (FlyDSL's launcher,
``kernels/attention/mla_fwd_decode.py`` at 11c4174d), ``mla_reduce_v1`` (the split merge
upstream's test pairs with it, ROCm/aiter's) and ``mla_decode`` (fa_lab's one call:
schedule, kernel, merge).

The kernel is the ``mla_decode`` family (docs/semantics.md §14): fp8 Q and KV, 128 heads,
576-wide rows (512 latent + 64 rope), pages of one token, 64-key tiles, eager, and P cast
to e4m3 in (0, 1] with no headroom. ``p_headroom`` (default 0: upstream) lifts P by 2**H
before that cast, the fix #1020 made in the prefill kernel. Backends: ``"emulator"`` (the
model), ``"interpret"`` (the faithful port in Triton's interpreter, CPU tensors),
``"triton"`` (the port compiled, GPU tensors), ``"auto"`` (triton on a GPU, else emulator).

Every argument is checked before any work; errors name it. Where upstream would run and
silently drop or misread (a ``partial_qo_loc`` outside ``split_output``, which aiter uses
for unsplit items; a page index past ``kv_buffer``), fa_lab refuses.
"""

from __future__ import annotations

import math

import torch

from fa_lab import kernels
from fa_lab.checks import check_int
from fa_lab.kernels.mla_decode import VERSIONS
from fa_lab.kernels.mla_decode import model as _model
from fa_lab.kernels.mla_decode.model import NUM_HEADS, QK_HEAD_DIM, V_HEAD_DIM, WORK_INFO_DW

__all__ = ["BACKENDS", "flydsl_mla_fwd_decode", "mla_reduce_v1", "mla_decode", "check_call",
           "MAX_HEADROOM"]

BACKENDS = ("auto", "emulator", "interpret", "triton")
_FP8 = torch.float8_e4m3fn
#: The largest lift that keeps the top P (1 * 2**H) inside e4m3's 448.
MAX_HEADROOM = math.log2(448.0)


def _tensor(name, t, dtypes, ndim=None):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        names = " or ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{name} has dtype {t.dtype}; the MLA decode kernel takes {names}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {list(t.shape)}")
    return t


def _scalar(name, x, lo=None, hi=None) -> float:
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        raise TypeError(f"{name} must be a float, got {type(x).__name__}")
    x = float(x)
    if not math.isfinite(x) or (lo is not None and x < lo) or (hi is not None and x > hi):
        rng = "" if lo is None else f" in [{lo}, {hi:.4f}]"
        raise ValueError(f"{name} must be finite{rng}, got {x!r}")
    return x


def _check_decode(query, kv_buffer, kv_page_indices, work_indptr, work_info_set,
                  final_output, split_output, split_lse, softmax_scale, p_headroom, upstream):
    if not isinstance(upstream, str) or upstream not in VERSIONS:
        raise ValueError(f"upstream={upstream!r}; the MLA decode kernel has {list(VERSIONS)}")
    _tensor("query", query, (_FP8,), 3)
    if query.size(1) != NUM_HEADS:
        raise ValueError(f"query has num_heads={query.size(1)}; upstream's MLA decode runs only "
                         f"{NUM_HEADS} heads with fp8 Q and KV (it raises NotImplementedError)")
    if query.size(2) != QK_HEAD_DIM:
        raise ValueError(f"query has head_dim={query.size(2)}, expected {QK_HEAD_DIM} "
                         "(kv_lora_rank 512 + rope 64)")
    _tensor("kv_buffer", kv_buffer, (_FP8,), 4)
    if kv_buffer.size(1) * kv_buffer.size(2) != 1:
        raise ValueError(f"kv_buffer: page_size * num_kv_heads must be 1, got page_size="
                         f"{kv_buffer.size(1)}, num_kv_heads={kv_buffer.size(2)}")
    if kv_buffer.size(3) != QK_HEAD_DIM:
        raise ValueError(f"kv_buffer has head_dim={kv_buffer.size(3)}, expected {QK_HEAD_DIM}")
    _tensor("kv_page_indices", kv_page_indices, (torch.int32,), 1)
    _tensor("work_indptr", work_indptr, (torch.int32,), 1)
    _tensor("work_info_set", work_info_set, (torch.int32,))
    S = query.size(0)
    _tensor("final_output", final_output, (torch.bfloat16, torch.float16))
    if tuple(final_output.shape) != (S, NUM_HEADS, V_HEAD_DIM):
        raise ValueError(f"final_output: expected shape [{S}, {NUM_HEADS}, {V_HEAD_DIM}], got "
                         f"{list(final_output.shape)}")
    _tensor("split_output", split_output, (torch.float32,), 4)
    if tuple(split_output.shape[1:]) != (1, NUM_HEADS, V_HEAD_DIM):
        raise ValueError(f"split_output: expected [N, 1, {NUM_HEADS}, {V_HEAD_DIM}], got "
                         f"{list(split_output.shape)}")
    _tensor("split_lse", split_lse, (torch.float32,), 4)
    N = split_output.size(0)
    if tuple(split_lse.shape) != (N, 1, NUM_HEADS, 1):
        raise ValueError(f"split_lse: expected [{N}, 1, {NUM_HEADS}, 1] (N from split_output), "
                         f"got {list(split_lse.shape)}")
    for name, t in (("kv_buffer", kv_buffer), ("kv_page_indices", kv_page_indices),
                    ("work_indptr", work_indptr), ("work_info_set", work_info_set),
                    ("final_output", final_output), ("split_output", split_output),
                    ("split_lse", split_lse)):
        if t.device != query.device:
            raise ValueError(f"{name} is on {t.device} but query is on {query.device}")
    for name, t in (("final_output", final_output), ("split_output", split_output),
                    ("split_lse", split_lse)):
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous (the kernel writes through a view)")
    scale = _scalar("softmax_scale", softmax_scale)
    headroom = _scalar("p_headroom", p_headroom, 0.0, MAX_HEADROOM)
    _check_work(work_indptr, work_info_set, kv_page_indices, S, N, kv_buffer.size(0))
    return scale, headroom


def _check_work(work_indptr, work_info_set, kv_page_indices, S, N, num_pages):
    """The metadata: work_indptr a non-decreasing CSR over work_info_set's 8-word items, and
    every item's token, positions, pages and partial row inside their tensors."""
    if work_info_set.numel() % WORK_INFO_DW:
        raise ValueError(f"work_info_set must hold {WORK_INFO_DW} int32 words per work item, "
                         f"got {work_info_set.numel()} words")
    n_items = work_info_set.numel() // WORK_INFO_DW
    ptr = work_indptr.tolist()
    if not ptr or ptr[0] < 0 or any(b < a for a, b in zip(ptr, ptr[1:])) or ptr[-1] > n_items:
        raise ValueError(f"work_indptr must be a non-decreasing CSR pointer in [0, {n_items}] "
                         f"(work items in work_info_set), got {ptr[:8]}{'...' if len(ptr) > 8 else ''}")
    items = _model.work_items(work_indptr, work_info_set)
    n_pos = kv_page_indices.numel()
    seen = set()
    for i, (loc, qo, k0, k1) in enumerate(items):
        if not 0 <= qo < S:
            raise ValueError(f"work_info_set item {i}: qo_start={qo} is outside query's {S} tokens")
        if not 0 <= k0 <= k1 <= n_pos:
            raise ValueError(f"work_info_set item {i}: kv_start={k0}, kv_end={k1} must satisfy "
                             f"0 <= kv_start <= kv_end <= {n_pos} (kv_page_indices' length)")
        if not 0 <= loc < N:
            raise ValueError(
                f"work_info_set item {i}: partial_qo_loc={loc} is outside split_output's {N} rows; "
                "upstream's kernel would drop its stores silently (aiter marks unsplit items -1, "
                "which this kernel, writing only split outputs, does not handle)")
        if loc in seen:
            raise ValueError(f"work_info_set item {i}: partial_qo_loc={loc} is written by an "
                             "earlier item too (the result would depend on the workers' order)")
        seen.add(loc)
        if k1 > k0:
            pages = kv_page_indices[k0:k1]
            lo, hi = int(pages.min()), int(pages.max())
            if lo < 0 or hi >= num_pages:
                raise ValueError(f"kv_page_indices[{k0}:{k1}] (work item {i}) holds page "
                                 f"{lo if lo < 0 else hi}, outside kv_buffer's {num_pages} pages")


def flydsl_mla_fwd_decode(query, kv_buffer, kv_page_indices, work_indptr, work_info_set,
                          final_output, split_output, split_lse, softmax_scale, *,
                          backend: str = "auto", p_headroom: float = 0.0,
                          upstream: str = "main-11c4174d") -> None:
    """Upstream's launcher: query [S, 128, 576] and kv_buffer [pages, 1, 1, 576] in
    float8_e4m3fn; kv_page_indices (int32) maps KV positions to pages; work_indptr and
    work_info_set (int32, 8 words an item) are aiter's work list. Writes each item's
    partial into split_output [N, 1, 128, 512] (fp32, normalised) and split_lse
    [N, 1, 128, 1] (fp32, natural log). ``final_output`` is checked and left untouched,
    as upstream's kernel leaves it: ``mla_reduce_v1`` writes it."""
    scale, headroom = _check_decode(query, kv_buffer, kv_page_indices, work_indptr,
                                    work_info_set, final_output, split_output, split_lse,
                                    softmax_scale, p_headroom, upstream)
    backend = kernels.port_backend(backend, query.device, BACKENDS)
    args = (query, kv_buffer, kv_page_indices, work_indptr, work_info_set, split_output,
            split_lse, scale)
    if backend == "emulator":
        _model.forward(*args, p_headroom=headroom)
    else:
        kernels.module("mla_decode", "faithful").forward(*args, p_headroom=headroom,
                                                         interpret=backend == "interpret")


def mla_reduce_v1(partial_output, partial_lse, reduce_indptr, reduce_final_map,
                  reduce_partial_map, max_seqlen_q, num_kv_splits, final_output,
                  final_lse=None) -> None:
    """aiter's split merge (the model's ``reduce``): for each reduce tile i, the partial rows
    ``reduce_partial_map[reduce_indptr[i]:reduce_indptr[i+1]]`` merge by their LSE into
    final_output[reduce_final_map[i, 0]]; a tile with one split is skipped, as upstream's.
    Decode with one query token per sequence (``max_seqlen_q`` 1); ``final_lse`` is not
    modelled and must be None."""
    _tensor("partial_output", partial_output, (torch.float32,), 4)
    _tensor("partial_lse", partial_lse, (torch.float32,), 4)
    N = partial_output.size(0)
    if tuple(partial_output.shape[1:]) != (1, NUM_HEADS, V_HEAD_DIM):
        raise ValueError(f"partial_output: expected [N, 1, {NUM_HEADS}, {V_HEAD_DIM}], got "
                         f"{list(partial_output.shape)}")
    if tuple(partial_lse.shape) != (N, 1, NUM_HEADS, 1):
        raise ValueError(f"partial_lse: expected [{N}, 1, {NUM_HEADS}, 1], got {list(partial_lse.shape)}")
    _tensor("reduce_indptr", reduce_indptr, (torch.int32,), 1)
    _tensor("reduce_final_map", reduce_final_map, (torch.int32,), 2)
    _tensor("reduce_partial_map", reduce_partial_map, (torch.int32,), 1)
    _tensor("final_output", final_output, (torch.bfloat16, torch.float16), 3)
    if check_int("max_seqlen_q", max_seqlen_q, lo=1) != 1:
        raise ValueError(f"max_seqlen_q={max_seqlen_q}: the 128-head kernel decodes one token "
                         "per work item; only max_seqlen_q=1 is modelled")
    splits = check_int("num_kv_splits", num_kv_splits, lo=1)
    if final_lse is not None:
        raise ValueError("final_lse is not modelled; pass None")
    S = final_output.size(0)
    if tuple(final_output.shape[1:]) != (NUM_HEADS, V_HEAD_DIM):
        raise ValueError(f"final_output: expected [S, {NUM_HEADS}, {V_HEAD_DIM}], got "
                         f"{list(final_output.shape)}")
    ptr = reduce_indptr.tolist()
    tiles = len(ptr) - 1
    if (tiles < 0 or ptr[0] != 0 or any(b < a for a, b in zip(ptr, ptr[1:]))
            or ptr[-1] > reduce_partial_map.numel()):
        raise ValueError("reduce_indptr must be a non-decreasing CSR pointer from 0 over "
                         "reduce_partial_map")
    if any(b - a > splits for a, b in zip(ptr, ptr[1:])):
        raise ValueError(f"a reduce tile has more than num_kv_splits={splits} splits")
    if tuple(reduce_final_map.shape) != (tiles, 2):
        raise ValueError(f"reduce_final_map: expected [{tiles}, 2], got {list(reduce_final_map.shape)}")
    if tiles and not bool(((reduce_final_map[:, 0] >= 0) & (reduce_final_map[:, 0] < S)).all()):
        raise ValueError(f"reduce_final_map holds a token outside final_output's {S}")
    used = reduce_partial_map[:ptr[-1]]
    if used.numel() and (int(used.min()) < 0 or int(used.max()) >= N):
        raise ValueError(f"reduce_partial_map holds a row outside partial_output's {N}")
    _model.reduce(partial_output, partial_lse, reduce_indptr, reduce_final_map,
                  reduce_partial_map, final_output)


def check_call(query, kv_buffer, kv_indptr, kv_page_indices, softmax_scale, *,
               num_kv_splits: int = 1, backend: str = "auto", p_headroom: float = 0.0,
               upstream: str = "main-11c4174d") -> dict:
    """All checks of an ``mla_decode`` call, before any work (errors name the argument):
    its own arguments, then the launcher's checks on the work list it schedules. Returns
    the schedule (``model.schedule``: the work and reduce metadata, int32 on the CPU)."""
    _tensor("query", query, (_FP8,), 3)
    _tensor("kv_indptr", kv_indptr, (torch.int32, torch.int64), 1)
    splits = check_int("num_kv_splits", num_kv_splits, lo=1)
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if kv_indptr.numel() != query.size(0) + 1:
        raise ValueError(f"kv_indptr must have num_seqs + 1 = {query.size(0) + 1} entries, got "
                         f"{kv_indptr.numel()}")
    ind = kv_indptr.tolist()
    if ind[0] != 0 or any(b < a for a, b in zip(ind, ind[1:])):
        raise ValueError(f"kv_indptr must be non-decreasing from 0, got {ind[:8]}")
    sch = _model.schedule(ind, splits)
    N, dev = sch["num_partial"], query.device
    _check_decode(query, kv_buffer, kv_page_indices, sch["work_indptr"].to(dev),
                  sch["work_info_set"].to(dev),
                  torch.empty(query.size(0), NUM_HEADS, V_HEAD_DIM, dtype=torch.bfloat16, device=dev),
                  torch.empty(N, 1, NUM_HEADS, V_HEAD_DIM, dtype=torch.float32, device=dev),
                  torch.empty(N, 1, NUM_HEADS, 1, dtype=torch.float32, device=dev),
                  softmax_scale, p_headroom, upstream)
    return sch


def mla_decode(query, kv_buffer, kv_indptr, kv_page_indices, softmax_scale, *,
               num_kv_splits: int = 1, backend: str = "auto", p_headroom: float = 0.0,
               upstream: str = "main-11c4174d"):
    """fa_lab's one call: sequence b's KV positions are the entries ``kv_indptr[b]`` up to
    ``kv_indptr[b+1]`` (excluded) of kv_page_indices. Schedules (``model.schedule``), runs
    the kernel and merges; returns (out [S, 128, 512] bf16, split_lse [N, 1, 128, 1]). A
    sequence with one split gets
    bf16 of its partial (upstream's reduce skips it; the HIP kernel writes it directly).
    Every argument is checked first (``check_call``)."""
    sch = check_call(query, kv_buffer, kv_indptr, kv_page_indices, softmax_scale,
                     num_kv_splits=num_kv_splits, backend=backend, p_headroom=p_headroom,
                     upstream=upstream)
    splits = int(num_kv_splits)
    dev = query.device
    N = sch["num_partial"]
    out = torch.zeros(query.size(0), NUM_HEADS, V_HEAD_DIM, dtype=torch.bfloat16, device=dev)
    so = torch.empty(N, 1, NUM_HEADS, V_HEAD_DIM, dtype=torch.float32, device=dev)
    sl = torch.empty(N, 1, NUM_HEADS, 1, dtype=torch.float32, device=dev)
    meta = {k: v.to(dev) for k, v in sch.items() if isinstance(v, torch.Tensor)}
    flydsl_mla_fwd_decode(query, kv_buffer, kv_page_indices, meta["work_indptr"],
                          meta["work_info_set"], out, so, sl, softmax_scale, backend=backend,
                          p_headroom=p_headroom, upstream=upstream)
    mla_reduce_v1(so, sl, meta["reduce_indptr"], meta["reduce_final_map"],
                  meta["reduce_partial_map"], 1, splits, out)
    ptr = sch["reduce_indptr"].tolist()
    for b in range(len(ptr) - 1):
        if ptr[b + 1] - ptr[b] == 1:
            out[b] = so[int(sch["reduce_partial_map"][ptr[b]]), 0].to(torch.bfloat16)
    return out, sl
