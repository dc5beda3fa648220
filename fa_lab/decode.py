"""Paged-attention decode with upstream's names: ``pa_decode_tile`` and ``pa_decode_ps_launch``.

Both take ROCm/FlyDSL's arguments (``kernels/attention/pa_decode_tile.py`` l.998-1014 and
``pa_decode_fp8.py`` l.270-290 at main 11c4174d), write ``output`` in place as upstream
does, and add three keywords: ``backend`` ("emulator": the exact model
``fa_lab.kernels.pa_decode.model``, or ``.swa`` for a sliding window; "interpret": its
faithful Triton port in Triton's CPU interpreter; "triton": the port compiled on a GPU),
``upstream`` (a name in ``fa_lab.upstream.DECODE_VERSIONS``; default ``"main-11c4174d"``)
and ``recorder`` (a dict that receives each partition's (max, sum, output) and the
merge's weights).

Every argument is checked before any work; errors name it. ``pa_decode_ps_launch`` runs
the small-page path (pages of 16 or 64 tokens, ``pa_decode_tile``) and, with
``sliding_window > 0``, the sliding-window kernel (``pa_decode_swa.compile_pa_decode_sw``,
1024-token pages only: it addresses no other size). ``pa_decode_fp8.py`` holds no kernel
body of its own: it is the launcher (l.343-455 the window, l.457-497 the tile kernel,
l.499-591 the metadata kernel of ``pa_metadata.py``). The metadata kernel (1024-token pages
without a window) is not modelled and is refused by name.
"""

from __future__ import annotations

import math

import torch

from fa_lab import kernels
from fa_lab.kernels import pa_decode
from fa_lab.kernels.pa_decode import model
from fa_lab.upstream import check_decode

swa = pa_decode.swa  # the sliding-window kernel's model, through the family's face

BACKENDS = ("emulator", "interpret", "triton")
HEAD_DIMS = (64, 128, 256)   # multiples of 64 that the Q-quant loads cover (l.89, l.213-218)
MI355X_CUS = 256             # the CU count upstream's default split count reads
FP8 = torch.float8_e4m3fn


def recommended_splits(num_seqs: int, num_kv_heads: int, block_size: int,
                       num_cu: int = MI355X_CUS) -> int:
    """Upstream's default ``num_partitions`` (``pa_decode_fp8.get_recommended_splits``
    l.235-262 with ``split_kv_blocks = 256 // block_size``), for an MI355X by default."""
    split = model.TILE_TOK // block_size
    n = -(-(num_cu * 2) // max(1, num_seqs * num_kv_heads * split)) * split
    return max(4, min(n, 8))


def _tensor(name, t):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    return t


def _scale(name, s, shape_tok, device):
    if s is None or isinstance(s, (int, float)) and not isinstance(s, bool):
        return torch.tensor([float(s or 1.0)], device=device)
    _tensor(name, s)
    if s.dtype != torch.float32:
        raise TypeError(f"{name} must be float32, got {s.dtype}")
    if s.dim() <= 1:
        if s.numel() != 1:
            raise ValueError(f"{name}: a per-tensor scale has one element, got shape {tuple(s.shape)}")
        return s
    if tuple(s.shape) != shape_tok:
        raise ValueError(f"{name}: a per-token scale must be [num_blocks, num_kv_heads, block_size] "
                         f"= {list(shape_tok)}, got {list(s.shape)}")
    return s


def _check_inputs(output, query, key_cache, value_cache, block_tables, context_lengths,
                  key_scale, value_scale, softmax_scale, backend, upstream, *, head_dims,
                  block_sizes, kernel):
    """The checks both decode kernels share; returns (key_scale, value_scale,
    softmax_scale, version, context lengths [num_seqs] int64, page size)."""
    for name, t in (("output", output), ("query", query), ("key_cache", key_cache),
                    ("value_cache", value_cache), ("block_tables", block_tables),
                    ("context_lengths", context_lengths)):
        _tensor(name, t)
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    version = check_decode(upstream)
    if query.dtype not in (torch.bfloat16, torch.float16):
        raise TypeError(f"query must be bf16 or f16, got {query.dtype}")
    if query.dim() != 3:
        raise ValueError(f"query must be [num_seqs * query_length, num_q_heads, head_dim], got {list(query.shape)}")
    if output.shape != query.shape or output.dtype != query.dtype:
        raise ValueError(f"output must have query's shape and dtype {list(query.shape)} {query.dtype}, "
                         f"got {list(output.shape)} {output.dtype}")
    total, hq, d = query.shape
    if d not in head_dims:
        raise ValueError(f"query: head_dim {d} is not supported by {kernel} (one of {head_dims})")
    if key_cache.dtype != FP8 or value_cache.dtype != FP8:
        raise TypeError(f"key_cache and value_cache must be float8_e4m3fn, got {key_cache.dtype}, "
                        f"{value_cache.dtype}")
    if key_cache.dim() != 5 or key_cache.shape[2] != d // 16 or key_cache.shape[4] != 16:
        raise ValueError(f"key_cache must be [num_blocks, num_kv_heads, {d // 16}, block_size, 16], "
                         f"got {list(key_cache.shape)}")
    nb, hkv, _, bs, _ = key_cache.shape
    if bs not in block_sizes:
        raise ValueError(f"key_cache: page size {bs} is not supported by {kernel} "
                         f"(one of {block_sizes})")
    vshape = [nb, hkv, bs // 16, d, 16] if value_cache.dim() == 5 else [nb, hkv, d, bs]
    if list(value_cache.shape) != vshape:
        raise ValueError(f"value_cache must be {vshape} (or the other layout), got {list(value_cache.shape)}")
    if hkv < 1 or hq % hkv:
        raise ValueError(f"query: num_q_heads {hq} must be a multiple of num_kv_heads {hkv}")
    if context_lengths.dtype != torch.int32 or context_lengths.dim() != 1 or context_lengths.numel() < 1:
        raise TypeError(f"context_lengths must be a non-empty 1-D int32 tensor, got "
                        f"{context_lengths.dtype} {list(context_lengths.shape)}")
    num_seqs = context_lengths.shape[0]
    if total % num_seqs:
        raise ValueError(f"query: {total} rows is not a multiple of num_seqs {num_seqs}")
    ql = total // num_seqs
    if not 1 <= ql <= model.MAX_QUERY_LENGTH:
        raise ValueError(f"query: query_length {ql} must be 1..{model.MAX_QUERY_LENGTH}")
    ctx = context_lengths.cpu().long()
    if (ctx < 0).any():
        raise ValueError(f"context_lengths must be >= 0, got {ctx.tolist()}")
    if block_tables.dtype != torch.int32 or block_tables.dim() != 2 or block_tables.shape[0] != num_seqs:
        raise TypeError(f"block_tables must be int32 [num_seqs={num_seqs}, max_blocks_per_seq], got "
                        f"{block_tables.dtype} {list(block_tables.shape)}")
    mbps = block_tables.shape[1]
    need = (ctx + bs - 1) // bs
    if (need > mbps).any():
        raise ValueError(f"block_tables: {mbps} pages per sequence are too few for context_lengths "
                         f"(needs {int(need.max())})")
    ks = _scale("key_scale", key_scale, (nb, hkv, bs), query.device)
    vs = _scale("value_scale", value_scale, (nb, hkv, bs), query.device)
    if (ks.dim() > 1) != (vs.dim() > 1):
        raise ValueError("key_scale and value_scale must both be per-tensor or both per-token")
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(d)
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)) \
            or not math.isfinite(softmax_scale):
        raise TypeError(f"softmax_scale must be a finite number, got {softmax_scale!r}")
    return ks, vs, float(softmax_scale), version, ctx, bs


def check_call(output, query, key_cache, value_cache, block_tables, context_lengths,
               key_scale, value_scale, softmax_scale, num_partitions, backend, upstream):
    """All checks of a ``pa_decode_tile`` call, before any work; returns the resolved
    (key_scale, value_scale, softmax_scale, num_partitions, version)."""
    ks, vs, sm, version, ctx, bs = _check_inputs(
        output, query, key_cache, value_cache, block_tables, context_lengths, key_scale,
        value_scale, softmax_scale, backend, upstream, head_dims=HEAD_DIMS,
        block_sizes=model.BLOCK_SIZES, kernel="pa_decode_tile")
    num_seqs, mbps, nb = ctx.shape[0], block_tables.shape[1], key_cache.shape[0]
    flat = block_tables.cpu().reshape(-1).long()
    for seq in range(num_seqs):  # every entry the kernel reads: the tiles' pages, flat
        tiles = -(-int(ctx[seq]) // model.TILE_TOK)
        idx = seq * mbps + torch.arange(tiles * model.TILE_TOK // bs)
        ids = flat[idx[idx < flat.numel()]]
        bad = (ids < 0) | (ids >= nb)
        if bad.any():
            raise ValueError(f"block_tables: sequence {seq} reads block id {int(ids[bad][0])}, "
                             f"outside 0..{nb - 1}")
    hkv = key_cache.shape[1]
    if num_partitions is None or num_partitions == 0:
        num_partitions = recommended_splits(num_seqs, hkv, bs)
    if isinstance(num_partitions, bool) or not isinstance(num_partitions, int) \
            or not 1 <= num_partitions <= model.MAX_PARTITIONS:
        raise ValueError(f"num_partitions must be an int in 1..{model.MAX_PARTITIONS}, got {num_partitions!r}")
    return ks, vs, sm, num_partitions, version


def pa_decode_tile(output, query, key_cache, value_cache, block_tables, context_lengths,
                   key_scale, value_scale, softmax_scale=None, stream=None, *,
                   num_partitions=None, pmax=None, psum=None, pout=None,
                   backend="emulator", upstream=None, recorder=None):
    """Upstream's ``pa_decode_tile``: writes ``output`` [num_seqs * QL, Hq, D]; with
    ``pmax``/``psum``/``pout`` given (and NP > 1) fills them as the kernel does. ``stream``
    is accepted and unused. Returns ``output``."""
    ks, vs, sm, npart, version = check_call(output, query, key_cache, value_cache, block_tables,
                                            context_lengths, key_scale, value_scale,
                                            softmax_scale, num_partitions, backend, upstream)
    if recorder is not None and not isinstance(recorder, dict):
        raise TypeError(f"recorder must be a dict or None, got {type(recorder).__name__}")
    rows = (query.shape[0] // context_lengths.shape[0]) * (query.shape[1] // key_cache.shape[1])
    shape = (context_lengths.shape[0], key_cache.shape[1], npart, rows)
    for name, t, want in (("pmax", pmax, shape), ("psum", psum, shape),
                          ("pout", pout, (*shape, query.shape[2]))):
        if t is not None and (not isinstance(t, torch.Tensor) or tuple(t.shape) != want):
            raise ValueError(f"{name} must be a tensor of shape {list(want)}")
    rec = {} if (recorder is not None or pmax is not None or psum is not None or pout is not None) else None
    args = (query, key_cache, value_cache, block_tables, context_lengths, ks, vs)
    backend = kernels.port_backend(backend, query.device, BACKENDS)
    if backend == "emulator":
        cpu = [a.cpu() for a in args]
        out = model.forward(*cpu, softmax_scale=sm, num_partitions=npart, version=version,
                            out_dtype=output.dtype, recorder=rec)
    else:
        port = kernels.module("pa_decode", "faithful")
        out = port.forward(*args, softmax_scale=sm, num_partitions=npart, version=version,
                           out_dtype=output.dtype, interpret=backend == "interpret", recorder=rec)
    output.copy_(out.to(output.device))
    if rec is not None:
        for name, t in (("pmax", pmax), ("psum", psum), ("pout", pout)):
            if t is not None and npart > 1:
                t.copy_(rec[name].to(t.device, t.dtype))
        if recorder is not None:
            recorder.update(rec)
    return output


def check_sw_call(output, query, key_cache, value_cache, block_tables, context_lengths,
                  key_scale, value_scale, softmax_scale, sliding_window, num_partitions,
                  backend, upstream):
    """All checks of a sliding-window call (``pa_decode_ps_launch`` with
    ``sliding_window > 0``), before any work; returns the resolved (key_scale, value_scale,
    softmax_scale, num_partitions, version)."""
    if isinstance(sliding_window, bool) or not isinstance(sliding_window, int) or sliding_window <= 0:
        raise ValueError(f"sliding_window must be a positive int, got {sliding_window!r}")
    ks, vs, sm, version, ctx, _ = _check_inputs(
        output, query, key_cache, value_cache, block_tables, context_lengths, key_scale,
        value_scale, softmax_scale, backend, upstream, head_dims=swa.HEAD_DIMS,
        block_sizes=(swa.PAGE,), kernel="pa_decode_swa (its pages are 1024 tokens)")
    ql = query.shape[0] // ctx.shape[0]
    npart = num_partitions
    if npart == 0 and version.sw_partitions_default:
        npart = swa.recommended_partitions(sliding_window, ql)
    if isinstance(npart, bool) or not isinstance(npart, int) or not 1 <= npart <= model.MAX_PARTITIONS:
        raise ValueError(f"max_context_partition_num must be an int in 1..{model.MAX_PARTITIONS} for "
                         f"sliding-window decode (upstream={version.name!r}), got {num_partitions!r}")
    if npart == 1 and output.dtype != torch.bfloat16:
        raise ValueError(f"output: the fused sliding-window path (max_context_partition_num 1) "
                         f"stores bf16 whatever the output's dtype; got {output.dtype}")
    nb = key_cache.shape[0]
    for seq, c in enumerate(ctx.tolist()):  # the table entries the kernel reads: one per tile
        for tt in swa.partition_tiles(c, ql, sliding_window, npart):
            if tt is None:
                continue
            if tt // swa.TILES_PER_PAGE >= block_tables.shape[1]:
                raise ValueError(f"block_tables: sequence {seq} reads entry {tt // swa.TILES_PER_PAGE}, "
                                 f"past its {block_tables.shape[1]} entries")
            bid = int(block_tables[seq, tt // swa.TILES_PER_PAGE])
            if not 0 <= bid < nb:
                raise ValueError(f"block_tables: sequence {seq} reads block id {bid}, outside 0..{nb - 1}")
    return ks, vs, sm, npart, version


def _sliding_window(output, query, key_cache, value_cache, block_tables, context_lengths,
                    key_scale, value_scale, softmax_scale, *, sliding_window, num_partitions,
                    exp_sums, max_logits, temporary_output, backend, upstream, recorder) -> str:
    """The sliding-window kernel and, with several partitions, the split reduce."""
    ks, vs, sm, npart, version = check_sw_call(
        output, query, key_cache, value_cache, block_tables, context_lengths, key_scale,
        value_scale, softmax_scale, sliding_window, num_partitions, backend, upstream)
    if recorder is not None and not isinstance(recorder, dict):
        raise TypeError(f"recorder must be a dict or None, got {type(recorder).__name__}")
    rows = (query.shape[0] // context_lengths.shape[0]) * (query.shape[1] // key_cache.shape[1])
    shape = (context_lengths.shape[0], key_cache.shape[1], npart, rows)
    given = (("max_logits", "pmax", max_logits, shape), ("exp_sums", "psum", exp_sums, shape),
             ("temporary_output", "pout", temporary_output, (*shape, query.shape[2])))
    for name, _, t, want in given:
        if t is not None and (not isinstance(t, torch.Tensor) or tuple(t.shape) != want):
            raise ValueError(f"{name} must be a tensor of shape {list(want)}")
    rec = {}
    args = (query, key_cache, value_cache, block_tables, context_lengths, ks, vs)
    kw = dict(softmax_scale=sm, sliding_window=sliding_window, num_partitions=npart,
              version=version, out_dtype=output.dtype, recorder=rec)
    backend = kernels.port_backend(backend, query.device, BACKENDS)
    if backend == "emulator":
        out = swa.forward(*[a.cpu() for a in args], **kw)
    else:
        port = kernels.module("pa_decode", "faithful")
        out = port.forward_sw(*args, interpret=backend == "interpret", **kw)
    output.copy_(out.to(output.device))
    if npart > 1:
        for _, key, t, _ in given:
            if t is not None:
                t.copy_(rec[key].to(t.device, t.dtype))
    if recorder is not None:
        recorder.update(rec)
    return "ps_sw_fused_partitioned" if npart == 1 else "ps_sw_partitioned"


def pa_decode_ps_launch(output, query, key_cache, value_cache, context_lengths, kv_page_indices,
                        kv_indptr, softmax_scale, key_scale=None, value_scale=None, *,
                        sliding_window=0, metadata=None, block_tables=None,
                        max_context_partition_num=0, exp_sums=None, max_logits=None,
                        temporary_output=None, stream=None, backend="emulator", upstream=None,
                        recorder=None) -> str:
    """Upstream's ``pa_decode_ps_launch`` on its modelled paths, returning upstream's path
    name. ``sliding_window > 0``: the sliding-window kernel over 1024-token pages
    (``"ps_sw_partitioned"``, or ``"ps_sw_fused_partitioned"`` with one partition), which
    runs ``max_context_partition_num`` 256-token tiles from the window's first (0: refused
    in main, the recommended count before 985c653a). Else pages of 16 or 64 tokens run
    ``pa_decode_tile`` with ``max_context_partition_num`` partitions
    (``"ps_small_block"``). ``kv_page_indices``, ``kv_indptr`` and ``metadata`` belong to
    the 1024-token metadata path and are unused."""
    if isinstance(sliding_window, bool) or not isinstance(sliding_window, int) or sliding_window < 0:
        raise ValueError(f"sliding_window must be an int >= 0, got {sliding_window!r}")
    if sliding_window > 0:
        if block_tables is None:
            raise ValueError("block_tables is required for sliding-window decode")
        return _sliding_window(output, query, key_cache, value_cache, block_tables,
                               context_lengths, key_scale, value_scale, softmax_scale,
                               sliding_window=sliding_window,
                               num_partitions=max_context_partition_num, exp_sums=exp_sums,
                               max_logits=max_logits, temporary_output=temporary_output,
                               backend=backend, upstream=upstream, recorder=recorder)
    if isinstance(max_context_partition_num, bool) or not isinstance(max_context_partition_num, int) \
            or max_context_partition_num <= 0:
        raise ValueError(f"max_context_partition_num must be a positive int, got {max_context_partition_num!r}")
    _tensor("key_cache", key_cache)
    if key_cache.dim() == 5 and key_cache.shape[-2] not in model.BLOCK_SIZES:
        if key_cache.shape[-2] == swa.PAGE:
            raise NotImplementedError("key_cache: 1024-token pages without a sliding window run "
                                      "upstream's metadata kernel (pa_metadata), which fa_lab does "
                                      "not model")
        raise ValueError(f"key_cache: page size {key_cache.shape[-2]} is not supported upstream "
                         f"(16, 64 or 1024)")
    if block_tables is None:
        raise ValueError("block_tables is required for pages of 16 or 64 tokens")
    pa_decode_tile(output, query, key_cache, value_cache, block_tables, context_lengths,
                   key_scale, value_scale, softmax_scale, stream,
                   num_partitions=max_context_partition_num, pmax=max_logits, psum=exp_sums,
                   pout=temporary_output, backend=backend, upstream=upstream, recorder=recorder)
    return "ps_small_block"


def partitions(query, key_cache, value_cache, block_tables, context_lengths, key_scale=None,
               value_scale=None, softmax_scale=None, *, num_partitions=None, sliding_window=0,
               backend="emulator", upstream=None) -> dict:
    """One decode call's partitions and their merge, for inspection: a dict with the
    output and, per (sequence, kv head, partition, row), ``pmax`` (in ``pmax_units``),
    ``psum`` and ``pout``; the tile range of each partition (``tiles``, the model only);
    and, with more than one partition, the reduce's ``global_max``, ``part_scale``,
    ``weights`` and ``global_sum`` (the model only). ``sliding_window > 0`` runs the
    sliding-window kernel (``num_partitions`` its ``max_context_partition_num``; None: the
    recommended count), whose record adds ``dropped``: visible tiles no partition ran."""
    out = torch.empty_like(query) if isinstance(query, torch.Tensor) else None
    rec: dict = {}
    if sliding_window:
        if num_partitions is None and isinstance(query, torch.Tensor) and isinstance(context_lengths, torch.Tensor) \
                and isinstance(sliding_window, int):
            num_partitions = swa.recommended_partitions(sliding_window, query.shape[0] // context_lengths.shape[0])
        _sliding_window(out, query, key_cache, value_cache, block_tables, context_lengths,
                        key_scale, value_scale, softmax_scale, sliding_window=sliding_window,
                        num_partitions=num_partitions, exp_sums=None, max_logits=None,
                        temporary_output=None, backend=backend, upstream=upstream, recorder=rec)
        rec["output"] = out
        return rec
    pa_decode_tile(out, query, key_cache, value_cache, block_tables, context_lengths, key_scale,
                   value_scale, softmax_scale, num_partitions=num_partitions, backend=backend,
                   upstream=upstream, recorder=rec)
    rec["output"] = out
    return rec
