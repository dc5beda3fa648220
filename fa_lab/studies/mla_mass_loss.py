"""The MLA decode kernel's mass loss from its unscaled e4m3 P cast, in closed form and
as the model computes it (docs/findings/mla_decode_p_cast.md).

The kernel computes P = 2**(-d) in (0, 1], d the key's spread below the running max in log2
units, sums the fp32 P into ``l`` and casts P to e4m3 for the PV product. e4m3 is normal
down to 2**-6 and subnormal on a 2**-9 grid below it, so (round to nearest even):

  d <  6 + H        P keeps 4 significant bits (relative error <= 2**-4)
  6 + H <= d < 10 + H   subnormal: absolute error <= 2**-10 (relative up to 2**(d - H - 10))
  d >= 10 + H       P * 2**H <= 2**-10 rounds to 0: the key's mass leaves O but stays in l

with H the headroom lift (0 upstream; the #1020 fix lifts P by 2**H before the cast and
divides it out through ``l``). One dominant key plus n keys at spread d, V = 1:

  out = (1 + n q(2**-d)) / (1 + n 2**-d),   deficit = n (2**-d - q(2**-d)) / (1 + n 2**-d)

and past the flush point the deficit is n 2**-d / (1 + n 2**-d): the flushed keys' share of
the softmax. A key is measured against the running max of its own 64-key tile, not the
final max (``deficit_predicted``): a dominant key that arrives last costs only its own
tile's keys.
"""

from __future__ import annotations

import math

import torch

from fa_lab.kernels.mla_decode import model as M
from fa_lab.numerics import e4m3, f32

#: e4m3's smallest normal and the largest P that rounds to 0 (2**-10, the tie, goes to 0).
SMALLEST_NORMAL = 2.0 ** -6
FLUSH_AT = 2.0 ** -10


def onset(headroom: float = 0.0) -> dict:
    """Spreads (log2 units below the running max) where P goes subnormal and where it
    flushes to 0, for a lift of 2**headroom."""
    return {"subnormal": -math.log2(SMALLEST_NORMAL) + headroom,
            "flush": -math.log2(FLUSH_AT) + headroom}


def cast_p(p: torch.Tensor, headroom: float = 0.0) -> torch.Tensor:
    """What the PV product sees of P, in P's units: e4m3(P * 2**H) / 2**H (fp64 in)."""
    lift = 2.0 ** headroom
    return e4m3((p.double() * lift).float()).double() / lift


def deficit_closed_form(d, n, headroom: float = 0.0) -> torch.Tensor:
    """The relative output deficit of one dominant key plus ``n`` keys at spread ``d``
    (log2 units), V = 1: n (2**-d - q(2**-d)) / (1 + n 2**-d)."""
    d = torch.as_tensor(d, dtype=torch.float64)
    p = torch.exp2(-d)
    return n * (p - cast_p(p, headroom)) / (1 + n * p)


def deficit_predicted(x_log2: torch.Tensor, headroom: float = 0.0,
                      block_n: int = M.BLOCK_N) -> torch.Tensor:
    """The deficit, per row, for scores ``x_log2`` [rows, N] in log2 units (fp64), with
    each key measured against the running max of its tile: sum (P - q(P)) c / sum P c,
    P = 2**(x - M_t), c = 2**(M_t - M)."""
    x = x_log2.double()
    run = torch.full(x.shape[:-1], -math.inf, dtype=torch.float64)
    num = torch.zeros_like(run)
    den = torch.zeros_like(run)
    for t0 in range(0, x.shape[-1], block_n):
        tile = x[..., t0:t0 + block_n]
        new = torch.maximum(run, tile.amax(-1))
        shrink = torch.exp2(run - new)  # 0 before the first tile
        num, den = num * shrink, den * shrink
        p = torch.exp2(tile - new[..., None])
        num = num + (p - cast_p(p, headroom)).sum(-1)
        den = den + p.sum(-1)
        run = new
    return num / den


def canonical_inputs(spreads, n_keys: int, dominant: str = "first"):
    """One token, 128 heads; head h sees one dominant key and ``n_keys - 1`` keys at spread
    ``spreads[h]`` (log2 units, each a sum of two e4m3 values; with softmax_scale =
    f32(ln 2) the kernel's spread is exactly that sum). V = 1. Returns (query [1, 128, 576],
    kv_buffer [n_keys, 1, 1, 576], kv_page_indices, softmax_scale, dominant position)."""
    if len(spreads) > M.NUM_HEADS:
        raise ValueError(f"at most {M.NUM_HEADS} spreads (one per head), got {len(spreads)}")
    q = torch.zeros(M.NUM_HEADS, M.QK_HEAD_DIM)
    for h, d in enumerate(spreads):
        a = float(e4m3(torch.tensor([float(d)]))[0])
        b = float(d) - a
        if float(e4m3(torch.tensor([b]))[0]) != b:
            raise ValueError(f"spread {d} is not a sum of two e4m3 values")
        q[h, M.KV_LORA_RANK], q[h, M.KV_LORA_RANK + 1] = a, b
    kv = torch.zeros(n_keys, M.QK_HEAD_DIM)
    kv[:, :M.KV_LORA_RANK] = 1.0
    pos = 0 if dominant == "first" else n_keys - 1
    kv[pos, M.KV_LORA_RANK:M.KV_LORA_RANK + 2] = 1.0
    fp8 = torch.float8_e4m3fn
    return (q.to(fp8)[None], kv.to(fp8).reshape(n_keys, 1, 1, M.QK_HEAD_DIM),
            torch.arange(n_keys, dtype=torch.int32), f32(math.log(2.0)), pos)


def run_model(query, kv_buffer, pages, scale, headroom: float = 0.0):
    """One item over all keys (one split) on the model: (o [128, 512], lse [128])."""
    q = query[0].float()
    kv = kv_buffer.float().reshape(-1, M.QK_HEAD_DIM)[pages.long()]
    return M.work_item(q, kv, scale, p_headroom=headroom)


def canonical_rows(spreads, n_keys: int, dominant: str, headroom: float) -> list[dict]:
    """Per spread: the model's deficit (1 - mean output, V = 1), the fp64 reference's, the
    closed form's (dominant first) and the tile-aware prediction's."""
    query, kv_buffer, pages, scale, pos = canonical_inputs(spreads, n_keys, dominant)
    o, _ = run_model(query, kv_buffer, pages, scale, headroom)
    q, kv = query[0].float(), kv_buffer.float().reshape(-1, M.QK_HEAD_DIM)
    ref, _ = M.reference(q, kv, scale)
    x = torch.zeros(len(spreads), n_keys, dtype=torch.float64)
    x[:, pos] = torch.tensor([float(d) for d in spreads], dtype=torch.float64)
    pred = deficit_predicted(x, headroom)
    rows = []
    for h, d in enumerate(spreads):
        rows.append({
            "keys": n_keys, "dominant": dominant, "headroom": headroom, "spread": float(d),
            "model_deficit": 1.0 - float(o[h].double().mean()),
            "reference_deficit": 1.0 - float(ref[h].mean()),
            "closed_form_deficit": float(deficit_closed_form(d, n_keys - 1, headroom))
            if dominant == "first" else None,
            "predicted_deficit": float(pred[h]),
        })
    return rows


def gaussian_inputs(sigma: float, n_keys: int, seed: int = 0):
    """Scores with N(0, sigma**2) logits per head (rope part of Q and K; V = 1 from the
    latent part): (query, kv_buffer, pages, softmax_scale)."""
    g = torch.Generator().manual_seed(seed)
    fp8 = torch.float8_e4m3fn
    q = torch.zeros(M.NUM_HEADS, M.QK_HEAD_DIM)
    q[:, M.KV_LORA_RANK:] = torch.randn(M.NUM_HEADS, M.QK_ROPE_HEAD_DIM, generator=g)
    kv = torch.zeros(n_keys, M.QK_HEAD_DIM)
    kv[:, :M.KV_LORA_RANK] = 1.0
    kv[:, M.KV_LORA_RANK:] = torch.randn(n_keys, M.QK_ROPE_HEAD_DIM, generator=g)
    scale = f32(sigma / math.sqrt(M.QK_ROPE_HEAD_DIM))
    return (q.to(fp8)[None], kv.to(fp8).reshape(n_keys, 1, 1, M.QK_HEAD_DIM),
            torch.arange(n_keys, dtype=torch.int32), scale)


def gaussian_row(sigma: float, n_keys: int, headroom: float, seed: int = 0) -> dict:
    """Mean over 128 heads of the model's deficit, the tile-aware prediction and the
    flushed share of the softmax (keys more than 10 + H below the final max)."""
    query, kv_buffer, pages, scale = gaussian_inputs(sigma, n_keys, seed)
    o, _ = run_model(query, kv_buffer, pages, scale, headroom)
    q, kv = query[0].double(), kv_buffer.double().reshape(-1, M.QK_HEAD_DIM)
    x = (q @ kv.T) * scale * (1 / math.log(2.0))  # log2 units
    w = torch.softmax(x * math.log(2.0), -1)
    flushed = (x.amax(-1, keepdim=True) - x) >= onset(headroom)["flush"]
    return {"keys": n_keys, "sigma": sigma, "headroom": headroom,
            "model_deficit": float(1.0 - o.double().mean(-1).mean()),
            "predicted_deficit": float(deficit_predicted(x, headroom).mean()),
            "flushed_share": float((w * flushed).sum(-1).mean()),
            "max_head_deficit": float((1.0 - o.double().mean(-1)).max())}
