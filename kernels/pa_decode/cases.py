"""Inputs for the paged decode: a paged fp8 KV cache built from logical K/V, in upstream's
layouts, with the page table shuffled or not; and the fp64 reference it is checked
against. Shared by the tests, the onset search and (later) the lessons.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from fa_lab.numerics import E4M3_MAX, e4m3

from . import swa
from .model import logical_kv, quantize_q, row_bounds


@dataclass
class Case:
    """One decode call's arguments (``fa_lab.decode.pa_decode_tile`` order) and sizes."""

    query: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    block_tables: torch.Tensor
    context_lengths: torch.Tensor
    key_scale: torch.Tensor
    value_scale: torch.Tensor

    def args(self):
        out = torch.empty_like(self.query)
        return (out, self.query, self.key_cache, self.value_cache, self.block_tables,
                self.context_lengths, self.key_scale, self.value_scale)


def _quant(x: torch.Tensor, per_token: bool):
    """x [nb, hkv, bs, D] fp32 -> (fp8, scale): one scale (absmax / 448) per tensor or per
    (block, head, token)."""
    if per_token:
        s = (x.abs().amax(dim=-1) / E4M3_MAX).clamp_min(1e-12)
        return e4m3(x / s[..., None]).to(torch.float8_e4m3fn), s.float()
    s = (x.abs().amax() / E4M3_MAX).clamp_min(1e-12).reshape(1)
    return e4m3(x / s).to(torch.float8_e4m3fn), s.float()


#: What the cache holds past each sequence's context (``make``'s ``tail``): fresh N(0, 1)
#: values; stale ones at the format's largest magnitude (448, a per-token scale of 1e4); or
#: NaN (the e4m3 NaN code, and NaN per-token scales), as uninitialised memory may.
TAILS = ("finite", "stale", "nan")
_STALE_SCALE = 1e4


def make(context_lengths, *, query_length=1, num_q_heads=4, num_kv_heads=1, head_dim=64,
         block_size=16, per_token=False, k_mult=1.0, seed=0, shuffle=True, spare_pages=2,
         trans_v=True, dtype=torch.bfloat16, tail_pages=None, tail="finite",
         outlier=None) -> Case:
    """A case: q, K, V ~ N(0, 1) (K times ``k_mult``); each sequence gets
    ``ceil(ctx / bs) + spare_pages`` pages of its own (``tail_pages`` forces that count),
    taken from a shuffled (or contiguous) pool; the table's unused entries point at pages of
    the pool too, so the kernel's over-read of its last tile reads real pages.

    ``tail`` (``TAILS``): what every cache slot past its sequence's context holds (the
    slots of its own pages past ``ctx``, and the pool's page no table names), K, V and
    per-token scales alike. ``outlier``: None or ``(which, at, factor)``: token
    ``int(at * (ctx0 - 1))`` of sequence 0 has its K (``which="k"``) or V (``"v"``) times
    ``factor`` in every kv head before quantization (its per-token scale grows with it; a
    per-tensor scale takes it for every token)."""
    g = torch.Generator().manual_seed(seed)
    ctx = [int(c) for c in context_lengths]
    per_seq = tail_pages or max(-(-c // block_size) for c in ctx) + spare_pages
    num_seqs = len(ctx)
    nb = num_seqs * per_seq + 1
    k = torch.randn(nb, num_kv_heads, block_size, head_dim, generator=g) * k_mult
    v = torch.randn(nb, num_kv_heads, block_size, head_dim, generator=g)
    pool = torch.randperm(nb, generator=g) if shuffle else torch.arange(nb)
    table = pool[:num_seqs * per_seq].reshape(num_seqs, per_seq).to(torch.int32)
    if outlier is not None and ctx[0] > 0:
        which, at, factor = outlier
        t = int(at * (ctx[0] - 1))
        (k if which == "k" else v)[int(table[0, t // block_size]), :, t % block_size] *= factor
    past = _past_context(table, ctx, nb, block_size)  # [nb, bs] bool
    if tail == "stale":  # the quantizer sees nothing there; the bytes are written below
        k[past[:, None, :].expand_as(k[..., 0])] = 0.0
        v[past[:, None, :].expand_as(v[..., 0])] = 0.0
    k8, ks = _quant(k, per_token)
    v8, vs = _quant(v, per_token)
    if tail != "finite":
        code, sval = (0x7E, _STALE_SCALE) if tail == "stale" else (0x7F, float("nan"))
        sel = past[:, None, :].expand(nb, num_kv_heads, block_size)
        k8.view(torch.uint8)[sel] = code
        v8.view(torch.uint8)[sel] = code
        if per_token:
            ks[sel] = sval
            vs[sel] = sval
    kc = k8.reshape(nb, num_kv_heads, block_size, head_dim // 16, 16).permute(0, 1, 3, 2, 4).contiguous()
    if trans_v:
        vc = v8.reshape(nb, num_kv_heads, block_size // 16, 16, head_dim).permute(0, 1, 2, 4, 3).contiguous()
    else:
        vc = v8.permute(0, 1, 3, 2).contiguous()
    q = torch.randn(num_seqs * query_length, num_q_heads, head_dim, generator=g).to(dtype)
    return Case(q, kc, vc, table, torch.tensor(ctx, dtype=torch.int32), ks, vs)


def _past_context(table: torch.Tensor, ctx: list, nb: int, block_size: int) -> torch.Tensor:
    """[nb, bs] bool: the slots past their sequence's context (of the pages its table row
    names) and every slot of a page no table row names."""
    past = torch.ones(nb, block_size, dtype=torch.bool)
    for seq, c in enumerate(ctx):
        t = torch.arange(c)
        past[table[seq, t // block_size].long(), t % block_size] = False
    return past


def reference(case: Case, softmax_scale: float | None = None, *,
              sliding_window: int = 0) -> torch.Tensor:
    """fp64 softmax attention over each row's gathered context (t < bound), with the
    dequantized fp8 K and V and the dequantized fp8 Q (the kernel's input casts), and no
    other rounding: [num_seqs * QL, Hq, D] fp64; NaN for a row that sees no token.
    ``sliding_window`` W > 0: row r sees only bound(r) - 1 - W <= t < bound(r), and Q is
    quantized as the sliding-window kernel does (``swa.quantize_q``)."""
    q = case.query.float()
    num_seqs = case.context_lengths.shape[0]
    ql, hq, d = q.shape[0] // num_seqs, q.shape[1], q.shape[2]
    k8, v8 = logical_kv(case.key_cache, case.value_cache)
    hkv, bs = k8.shape[1], k8.shape[2]
    group = hq // hkv
    per_token = case.key_scale.dim() > 1
    ks = case.key_scale[..., None] if per_token else case.key_scale.reshape(1, 1, 1, 1)
    vs = case.value_scale[..., None] if per_token else case.value_scale.reshape(1, 1, 1, 1)
    kd, vd = (k8 * ks).double(), (v8 * vs).double()
    sm = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    out = torch.full(q.shape, float("nan"), dtype=torch.float64)
    for seq in range(num_seqs):
        ctx = int(case.context_lengths[seq])
        bounds = torch.tensor(row_bounds(ctx, ql, group))
        if ctx == 0 or not (bounds > 0).any():
            continue
        t = torch.arange(ctx)
        pages = case.block_tables[seq, t // bs].long()
        seen = t[None, :] < bounds[:, None]  # [rows, ctx]: only seen tokens are gathered
        if sliding_window:
            seen &= t[None, :] >= bounds[:, None] - 1 - sliding_window
        live = bounds > 0
        for h in range(hkv):
            kk, vv = kd[pages, h, t % bs], vd[pages, h, t % bs]
            rows = q[seq * ql:(seq + 1) * ql, h * group:(h + 1) * group].reshape(-1, d)
            q8, qs = (swa.quantize_q if sliding_window else quantize_q)(rows)
            qd = q8.double() * qs.double()[:, None]
            s = (qd @ kk.T * sm).masked_fill(~seen, float("-inf"))
            o = torch.softmax(s[live], dim=1) @ vv
            res = torch.full((rows.shape[0], d), float("nan"), dtype=torch.float64)
            res[live] = o
            out[seq * ql:(seq + 1) * ql, h * group:(h + 1) * group] = res.reshape(ql, group, d)
    return out
