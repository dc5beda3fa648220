"""Faithful Triton port of the sliding-window paged-attention decode (``swa.py``,
docs/semantics.md §13).

One program per (sequence, kv head, partition), as upstream's grid: the partition's one
256-token tile (``tail + p``; ``tail`` alone on the fused path), or an empty partition
written without reading anything. The split reduce is the tile port's
(``faithful_reduce._reduce_kernel``), the same kernel upstream launches for both.

Where the GPU, the interpreter and the model would otherwise part ways, as ``faithful.py``:
e4m3 and bf16 roundings on the bit patterns, fp8 loads set NaN from the bits, exp2 through
fp64 (``exp2_ieee``), reciprocals ``div_rn``, no fp32 contraction; maxima put NaN back
explicitly (upstream's ``maximumf`` propagates it). Dots widen fp8 to fp32
(``input_precision="ieee"``): products exact, only the fp32 summation order differs from
the model's exact sums, as do the wave sums. Masks (which P is 0, which value is NaN or
inf) do not depend on those orders.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fa_lab.numerics import f32
from fa_lab.upstream import DecodeVersion

from .faithful_reduce import _reduce_kernel
from .reduce import LOG2E
from .._triton.util import exp2_ieee, launch, round_bf16
from ..swp_fp8.faithful import _load_e4m3, _round_e4m3


@triton.jit
def _nanmax(x, axis: tl.constexpr):
    """IEEE maximum over ``axis``: NaN wherever an entry is NaN."""
    has_nan = tl.max((x != x).to(tl.int32), axis=axis) > 0
    return tl.where(has_nan, float("nan"), tl.max(x, axis=axis))


@triton.jit
def _sw_kernel(Q, KC, VC, BT, CTX, KS, VS, PMAX, PSUM, POUT,
               sq0, sq1, sk0, sk1, sk2, sk3, sk4, sv0, sv1, sv2, sv3, sv4, ss0, ss1,
               mbps, sm, k_scale, v_scale, window,
               ROWS: tl.constexpr, R: tl.constexpr, D: tl.constexpr, QL: tl.constexpr,
               G: tl.constexpr, NP: tl.constexpr, PER_TOKEN: tl.constexpr,
               TRANS_V: tl.constexpr):
    seq = tl.program_id(0)
    h = tl.program_id(1)
    part = tl.program_id(2)
    nkv = tl.num_programs(1)
    ctx = tl.load(CTX + seq)
    r = tl.arange(0, ROWS)
    qi = r // G
    row_ok = r < R
    d = tl.arange(0, D)
    start = tl.maximum(ctx - QL - window, 0)
    tail = start // 256
    vis = (ctx + 255) // 256 - tail
    if NP == 1:
        tt = tl.where(vis > 0, tail, 0)
        ctx_m = tl.where(vis > 0, ctx, 0)
        run = part == 0
    else:
        tt = tail + part
        ctx_m = ctx
        run = part < vis
    base = ((seq * nkv + h) * NP + part) * R + r
    if run:
        q = tl.load(Q + (seq * QL + qi)[:, None] * sq0 + (h * G + r % G)[:, None] * sq1 + d[None, :],
                    mask=row_ok[:, None], other=0.0).to(tl.float32)
        absmax = _nanmax(tl.abs(q), 1)
        qs = tl.where(absmax > 0, absmax * 0.004166666666666667, 1.0)
        inv = tl.math.div_rn(tl.full([ROWS], 1.0, tl.float32), qs)
        q8 = _round_e4m3(q * inv[:, None], 0)
        qk = qs * sm
        j = tl.arange(0, 256)
        tok = tt * 256 + j
        phys = tl.load(BT + seq * mbps + tt // 4).to(tl.int64)
        slot = (tt % 4) * 256 + j
        k = _load_e4m3(KC + phys * sk0 + h * sk1 + (d // 16)[None, :] * sk2
                       + slot[:, None] * sk3 + (d % 16)[None, :] * sk4, j[:, None] >= 0)
        acc = tl.dot(q8, tl.trans(k), input_precision="ieee")
        if PER_TOKEN:
            ks = tl.load(KS + phys * ss0 + h * ss1 + slot)
            s = acc * (ks[None, :] * qk[:, None])
        else:
            s = acc * (qk * k_scale)[:, None]
        hi = ctx_m + 1 - QL + qi
        lo = ctx_m - QL - window + qi
        inside = (tok[None, :] < hi[:, None]) & (tok[None, :] >= lo[:, None])
        masked = tl.reshape(tl.where(inside, s, float("-inf")), [ROWS, 4, 64])
        wmax = _nanmax(masked, 2)                                   # [ROWS, 4]
        safe = tl.where(wmax > float("-inf"), wmax, 0.0)
        p = exp2_ieee((masked - safe[:, :, None]) * 1.4426950408889634)
        wsum = tl.sum(p, axis=2)
        pmax = _nanmax(wmax, 1)
        diff = tl.where(pmax[:, None] > float("-inf"), wmax - pmax[:, None], 0.0)
        wf = exp2_ieee(diff * 1.4426950408889634)
        psum = tl.sum(wsum * wf, axis=1)
        ptn = tl.where(pmax > float("-inf"), exp2_ieee((pmax - pmax) * 1.4426950408889634), 0.0)
        rsum = psum * ptn
        if TRANS_V:
            vptr = VC + phys * sv0 + h * sv1 + (slot // 16)[:, None] * sv2 + d[None, :] * sv3 \
                + (slot % 16)[:, None] * sv4
        else:
            vptr = VC + phys * sv0 + h * sv1 + d[None, :] * sv2 + slot[:, None] * sv3
        v = _load_e4m3(vptr, j[:, None] >= 0)
        if PER_TOKEN:
            vs = tl.load(VS + phys * ss0 + h * ss1 + slot)
            vsel = tl.where(tok < ctx_m, vs, 0.0)
            vmax = tl.where(tl.max((vsel != vsel).to(tl.int32), axis=0) > 0, float("nan"),
                            tl.maximum(tl.max(vsel, axis=0), 0.0))
            vms = tl.zeros([ROWS], tl.float32) + vmax * 0.004166666666666667
            norm = tl.math.div_rn(tl.full([ROWS], 1.0, tl.float32), vms + 4.166666666666667e-11)
            pscale = tl.reshape(vs, [4, 64])[None, :, :] * (wf * norm[:, None])[:, :, None]
            p8 = _round_e4m3(p * pscale, 0)
            corr = vms * ptn
        else:
            p8 = _round_e4m3(p * (wf * ptn[:, None])[:, :, None], 0)
            corr = tl.zeros([ROWS], tl.float32) + v_scale
        pv = tl.dot(tl.reshape(p8, [ROWS, 256]), v, input_precision="ieee")
        out = pv * corr[:, None]
        inv_l = tl.math.div_rn(tl.full([ROWS], 1.0, tl.float32), tl.where(rsum > 0, rsum, 1.0))
        o = round_bf16(out * inv_l[:, None])
        tl.store(PMAX + base, pmax, mask=row_ok)
        tl.store(PSUM + base, rsum, mask=row_ok)
        tl.store(POUT + base[:, None] * D + d[None, :], o, mask=row_ok[:, None])
    else:
        tl.store(PMAX + base, tl.full([ROWS], float("-inf"), tl.float32), mask=row_ok)
        tl.store(PSUM + base, tl.zeros([ROWS], tl.float32), mask=row_ok)
        tl.store(POUT + base[:, None] * D + d[None, :], tl.zeros([ROWS, D], tl.float32),
                 mask=row_ok[:, None])


def forward(query, key_cache, value_cache, block_tables, context_lengths, key_scale,
            value_scale, *, softmax_scale: float, sliding_window: int, num_partitions: int,
            version: DecodeVersion, out_dtype: torch.dtype, interpret: bool,
            recorder: dict | None = None) -> torch.Tensor:
    """Same contract as ``swa.forward`` (checked inputs; ``fa_lab.decode`` checks them), on
    CPU tensors through the interpreter (``interpret=True``) or compiled on a GPU."""
    del version  # the versions' sliding-window kernels compute the same
    dev = query.device
    num_seqs = context_lengths.shape[0]
    ql = query.shape[0] // num_seqs
    hq, d = query.shape[1], query.shape[2]
    hkv = key_cache.shape[1]
    group = hq // hkv
    rows = ql * group
    per_token = key_scale.dim() > 1
    npart = num_partitions
    ksc = 1.0 if per_token else f32(float(key_scale.reshape(-1)[0]))
    vsc = 1.0 if per_token else f32(float(value_scale.reshape(-1)[0]))
    pmax = torch.empty(num_seqs, hkv, npart, rows, device=dev)
    psum = torch.empty_like(pmax)
    pout = torch.empty(num_seqs, hkv, npart, rows, d, device=dev)
    q = query.contiguous()
    sv = list(value_cache.stride()) + [0] * (5 - value_cache.dim())
    ss = key_scale.stride()[:2] if per_token else (0, 0)
    bt = block_tables.contiguous()
    launch(_sw_kernel, (num_seqs, hkv, npart), interpret, q, key_cache, value_cache, bt,
           context_lengths, key_scale.contiguous(), value_scale.contiguous(), pmax, psum, pout,
           q.stride(0), q.stride(1), *key_cache.stride(), *sv, *ss, bt.shape[1],
           f32(softmax_scale), ksc, vsc, sliding_window,
           ROWS=max(16, triton.next_power_of_2(rows)), R=rows, D=d, QL=ql, G=group, NP=npart,
           PER_TOKEN=per_token, TRANS_V=value_cache.dim() == 5, enable_fp_fusion=False)
    if npart == 1:
        res = pout[:, :, 0]
    else:
        res = torch.empty(num_seqs, hkv, rows, d, device=dev)
        launch(_reduce_kernel, (num_seqs, hkv, rows), interpret, pmax, psum, pout, res,
               f32(LOG2E), R=rows, NP=npart, NPP=max(2, triton.next_power_of_2(npart)), D=d,
               OUT_BF16=out_dtype == torch.bfloat16, OUT_F16=out_dtype == torch.float16,
               enable_fp_fusion=False)
    out = res.reshape(num_seqs, hkv, ql, group, d).permute(0, 2, 1, 3, 4).reshape(num_seqs * ql, hq, d)
    if recorder is not None:
        recorder.update(pmax=pmax, psum=psum, pout=pout, pmax_units="natural")
    return out.to(out_dtype)
