"""Inputs for the paged fp8 prefill (FlyDSL #1066, ``paged.py``): packed fp8 q and a
vectorized page-64 cache built from per-sequence K and V, the page table shuffled or not,
what the cache holds where the kernel reads past ``seqlen_k``, and the fp64 reference.
Shared by the tests, the onset bound's checks and the attack's paged space.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from fa_lab.numerics import E4M3_MAX

FP8 = torch.float8_e4m3fn
PAGE = 64
HEAD_DIM = 128
#: What the cache holds in the pages no sequence's keys fill (``make``'s ``tail``): fresh
#: N(0, 1) values, stale ones at e4m3's largest magnitude, or the e4m3 NaN code.
TAILS = ("finite", "stale", "nan")


@dataclass
class Case:
    """One paged fp8 call: ``q8`` packed [total_q, H, 128], ``k5`` and ``v5`` the
    vectorized cache, ``call`` the rest of ``flash_attn_func``'s arguments (descales
    included), ``dense`` each sequence's (k, v) as [1, seqlen_k, Hkv, 128] fp8, ``kc`` and
    ``vc`` the cache as [NumBlocks, 64, Hkv, 128]."""

    q8: torch.Tensor
    k5: torch.Tensor
    v5: torch.Tensor
    call: dict
    dense: list
    kc: torch.Tensor
    vc: torch.Tensor

    def with_cache(self, kc: torch.Tensor, vc: torch.Tensor) -> "Case":
        """The same call over another [NumBlocks, 64, Hkv, 128] cache."""
        k5, v5 = vectorized(kc, vc)
        return Case(self.q8, k5, v5, dict(self.call), self.dense, kc, vc)


def vectorized(kc: torch.Tensor, vc: torch.Tensor):
    """A linear fp8 cache [NB, 64, Hkv, D] in upstream's vectorized 5-D layout (16 per
    vector): K [NB, Hkv, D/16, 64, 16], V [NB, Hkv, 64/16, D, 16]."""
    nb, ps, hkv, d = kc.shape
    k5 = kc.reshape(nb, ps, hkv, d // 16, 16).permute(0, 2, 3, 1, 4).contiguous()
    v5 = vc.reshape(nb, ps // 16, 16, hkv, d).permute(0, 3, 1, 4, 2).contiguous()
    return k5, v5


def _fp8(x: torch.Tensor) -> torch.Tensor:
    return x.clamp(-E4M3_MAX, E4M3_MAX).to(FP8)


def make(lens_q, lens_k, *, H: int = 2, Hkv: int = 1, k_mult: float = 1.0, seed: int = 0,
         shuffle: bool = True, spare: int = 1, tail: str = "finite", q_descale=None,
         k_descale=None, v_descale=None, outlier=None) -> Case:
    """Sequence b has ``lens_q[b]`` query rows and ``lens_k[b]`` keys; q, V ~ N(0, 1), K ~
    ``k_mult`` N(0, 1), quantized per tensor (descale absmax / 448 unless given). Each
    sequence owns a table row of its pages rounded up to a pair plus ``spare`` entries,
    taken from a shuffled (or contiguous) pool that leaves page 0 unnamed; ``tail`` fills
    every slot that holds no key (``TAILS``). ``outlier`` = (which: "k" or "v", where in
    [0, 1) of sequence 0's keys, factor): that key's K or V times ``factor`` before the
    quantization (its scale then flushes the rest)."""
    if tail not in TAILS:
        raise ValueError(f"tail={tail!r}; choose one of {TAILS}")
    if len(lens_q) != len(lens_k) or not lens_q:
        raise ValueError("lens_q and lens_k must give the same, non-zero number of sequences")
    g = torch.Generator().manual_seed(int(seed))
    n = [math.ceil(s / PAGE) for s in lens_k]
    width = max(2 * math.ceil(max(n) / 2), 2) + spare
    n_blocks = 1 + len(lens_k) * width
    q = torch.randn(sum(lens_q), H, HEAD_DIM, generator=g)
    ks = [k_mult * torch.randn(s, Hkv, HEAD_DIM, generator=g) for s in lens_k]
    vs = [torch.randn(s, Hkv, HEAD_DIM, generator=g) for s in lens_k]
    if outlier is not None and lens_k[0] > 0:
        which, at, factor = outlier
        t = min(int(at * lens_k[0]), lens_k[0] - 1)
        (ks if which == "k" else vs)[0][t] *= float(factor)

    def descale(given, xs):
        if given is not None:
            return float(given)
        top = max((float(x.abs().max()) for x in xs if x.numel()), default=1.0)
        return max(top, 1e-30) / E4M3_MAX

    qd = descale(q_descale, [q])
    kd, vd = descale(k_descale, ks), descale(v_descale, vs)
    q8 = _fp8(q / qd)
    dense = [(_fp8(x / kd)[None], _fp8(y / vd)[None]) for x, y in zip(ks, vs)]
    fill = {"finite": lambda: torch.randn(n_blocks, PAGE, Hkv, HEAD_DIM, generator=g),
            "stale": lambda: torch.full((n_blocks, PAGE, Hkv, HEAD_DIM), E4M3_MAX),
            "nan": lambda: torch.full((n_blocks, PAGE, Hkv, HEAD_DIM), math.nan)}[tail]
    kc, vc = fill().to(FP8), fill().to(FP8)
    pool = (1 + torch.randperm(n_blocks - 1, generator=g)) if shuffle else torch.arange(1, n_blocks)
    bt = pool[: len(lens_k) * width].reshape(len(lens_k), width).to(torch.int32)
    for b, (kb, vb) in enumerate(dense):
        for t in range(n[b]):
            rows = kb[0, t * PAGE:(t + 1) * PAGE]
            kc[bt[b, t], : rows.shape[0]] = rows
            vc[bt[b, t], : rows.shape[0]] = vb[0, t * PAGE:(t + 1) * PAGE]
    k5, v5 = vectorized(kc, vc)
    cq = torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()], dtype=torch.int32)
    ck = torch.tensor([0, *torch.tensor(lens_k).cumsum(0).tolist()], dtype=torch.int32)
    call = dict(cu_seqlens_q=cq, cu_seqlens_kv=ck, max_seqlen_q=max(lens_q), block_table=bt,
                seqlen_k=torch.tensor(lens_k, dtype=torch.int32), kv_cache_layout="vectorized",
                q_descale=qd, k_descale=kd, v_descale=vd)
    return Case(q8, k5, v5, call, dense, kc, vc)


def reference(case: Case) -> torch.Tensor:
    """The fp64 causal (bottom-right) attention of each sequence's fp8 inputs, dequantized,
    packed [total_q, H, 128]; rows that see no key are NaN (undefined)."""
    c = case.call
    cq = c["cu_seqlens_q"].tolist()
    H = case.q8.shape[1]
    out = torch.full((cq[-1], H, HEAD_DIM), math.nan, dtype=torch.float64)
    for b, (kb, vb) in enumerate(case.dense):
        q = case.q8[cq[b]:cq[b + 1]].double() * c["q_descale"]
        k = kb[0].double() * c["k_descale"]
        v = vb[0].double() * c["v_descale"]
        sq, skv, g = q.shape[0], k.shape[0], H // k.shape[1]
        if sq == 0 or skv == 0:   # no key: every row undefined
            continue
        k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
        s = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(HEAD_DIM)
        vis = torch.arange(skv)[None, :] <= torch.arange(sq)[:, None] + (skv - sq)
        s = s.masked_fill(~vis, -math.inf)
        p = torch.softmax(s, dim=-1)
        out[cq[b]:cq[b + 1]] = torch.einsum("hqk,khd->qhd", p, v)
    return out
