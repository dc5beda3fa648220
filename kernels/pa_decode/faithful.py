"""Faithful Triton port of the paged-attention fp8 decode (``model.py``, docs/semantics.md §13).

Two kernels, as upstream launches them: the tile kernel, one program per (sequence, kv
head, partition), walking its partition's 256-token tiles with the page gather, the
sentinel, the e4m3 P pack and the per-token V-scale normalization of the version asked
for; and the split reduce, one program per (sequence, kv head, query row), merging the
partitions in partition order. One partition writes the output directly.

Where the GPU, the interpreter and the model would otherwise part ways:
- fp32 -> e4m3 and fp32 -> bf16 are rounded on the bit patterns (``swp_fp8``'s
  ``_round_e4m3``, ``_triton.util.round_bf16``); fp8 loads set NaN from the bits;
- exp2 is ``exp2_ieee`` (through fp64), reciprocals are ``div_rn``, fp32 contraction is off;
- dots widen fp8 to fp32 with ``input_precision="ieee"``: the products are exact, only the
  fp32 summation order differs from the model's exact sums, as do the sums of P and of
  the reduce (the model keeps the kernel's lane order). Masks (which P is 0, which value
  is NaN or inf) do not depend on those orders.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fa_lab.numerics import E4M3_MAX, f32
from fa_lab.upstream import DecodeVersion

from . import model
from .faithful_reduce import _reduce_kernel
from .reduce import LOG2E
from .._triton.util import exp2_ieee, fmax, launch, round_bf16, round_f16
from ..swp_fp8.faithful import _load_e4m3, _round_e4m3


@triton.jit
def _tile_kernel(Q, KC, VC, BT, CTX, KS, VS, PMAX, PSUM, POUT,
                 sq0, sq1, sk0, sk1, sk2, sk3, sk4, sv0, sv1, sv2, sv3, sv4,
                 ss0, ss1, bt_numel, mbps, scale_qk, vfac, tpp_div,
                 ROWS: tl.constexpr, R: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
                 QL: tl.constexpr, G: tl.constexpr, NP: tl.constexpr,
                 PER_TOKEN: tl.constexpr, TRANS_V: tl.constexpr, INF_PATH: tl.constexpr,
                 REMASK: tl.constexpr, VMAX_VALID: tl.constexpr, PMAX_NATURAL: tl.constexpr,
                 L_FIRST: tl.constexpr, OUT_BF16: tl.constexpr, OUT_F16: tl.constexpr):
    seq = tl.program_id(0)
    h = tl.program_id(1)
    part = tl.program_id(2)
    nkv = tl.num_programs(1)
    ctx = tl.load(CTX + seq)
    r = tl.arange(0, ROWS)
    qi = r // G
    row_ok = r < R
    d = tl.arange(0, D)
    # Q: per-row fp8 quantization (absmax / 448, rcp of its max with 1e-20)
    q = tl.load(Q + (seq * QL + qi)[:, None] * sq0 + (h * G + r % G)[:, None] * sq1 + d[None, :],
                mask=row_ok[:, None], other=0.0).to(tl.float32)
    qs = tl.max(tl.abs(q), axis=1) * 0.002232142857142857
    inv = tl.math.div_rn(tl.full([ROWS], 1.0, tl.float32), tl.maximum(qs, 1e-20))
    q8 = _round_e4m3(q * inv[:, None], 0)
    scale = scale_qk * qs
    if QL == 1:
        bound = tl.zeros([ROWS], tl.int32) + ctx
    else:
        bound = ctx - (QL - 1) + qi
    race_bound = ctx - (QL - 1) + ((r // 16) * 16) // G
    if QL == 1:
        race_bound = tl.zeros([ROWS], tl.int32) + ctx
    num_tiles = (ctx + 255) // 256
    tpp = (num_tiles + tpp_div - 1) // tpp_div
    t0 = tl.minimum(part * tpp, num_tiles)
    t1 = tl.minimum(part * tpp + tpp, num_tiles)
    m = tl.full([ROWS], float("-inf"), tl.float32)
    l = tl.zeros([ROWS], tl.float32)
    o = tl.zeros([ROWS, D], tl.float32)
    j = tl.arange(0, 256)
    for tt in range(t0, t1):
        tok = tt * 256 + j
        flat = seq * mbps + tok // BS
        phys = tl.load(BT + flat, mask=flat < bt_numel, other=0).to(tl.int64)
        slot = tok % BS
        k = _load_e4m3(KC + phys[:, None] * sk0 + h * sk1 + (d // 16)[None, :] * sk2
                       + slot[:, None] * sk3 + (d % 16)[None, :] * sk4, j[:, None] >= 0)
        s = tl.dot(q8, tl.trans(k), input_precision="ieee")
        if PER_TOKEN:
            ks = tl.load(KS + phys * ss0 + h * ss1 + slot)
            vs = tl.load(VS + phys * ss0 + h * ss1 + slot)
            s = s * ks[None, :]
        valid = tok[None, :] < bound[:, None]
        if INF_PATH:
            masked = tl.where(valid, s, float("-inf"))
        else:
            masked = tl.where(valid, s, -1e30)
        wave = tl.max(tl.reshape(masked, [ROWS, 4, 64]), axis=2) * scale[:, None]
        m_new = fmax(m, tl.max(wave, axis=1))
        if INF_PATH:
            base = tl.where(m_new > float("-inf"), m_new, 0.0)
            p = exp2_ieee(masked * scale[:, None] - base[:, None])
            corr = exp2_ieee(tl.where(m > float("-inf"), m, 0.0) - base)
        else:
            p = exp2_ieee(masked * scale[:, None] - m_new[:, None])
            if REMASK:
                p = tl.where(masked > -1e29, p, 0.0)
            corr = exp2_ieee(m - m_new)
        gsum = tl.sum(p, axis=1)
        if TRANS_V:
            vptr = VC + phys[:, None] * sv0 + h * sv1 + (slot // 16)[:, None] * sv2 \
                + d[None, :] * sv3 + (slot % 16)[:, None] * sv4
        else:
            vptr = VC + phys[:, None] * sv0 + h * sv1 + d[None, :] * sv2 + slot[:, None] * sv3
        v = _load_e4m3(vptr, j[:, None] >= 0)
        if PER_TOKEN:
            if VMAX_VALID:
                sel = tl.where(tok[None, :] < race_bound[:, None], vs[None, :], 0.0)
                vmax = fmax(tl.max(sel, axis=1), 0.0)
            else:
                vmax = tl.zeros([ROWS], tl.float32) + fmax(tl.max(vs, axis=0), 0.0)
            vmax_scaled = vmax * 0.002232142857142857
            norm = tl.math.div_rn(tl.full([ROWS], 1.0, tl.float32), vmax_scaled + 2.2321428571428572e-11)
            p8 = _round_e4m3((p * vs[None, :]) * norm[:, None], 0)
            op = tl.dot(p8, v, input_precision="ieee") * vmax_scaled[:, None]
        else:
            p8 = _round_e4m3(p * 448.0, 0)
            op = tl.dot(p8, v, input_precision="ieee")
        l = l * corr + gsum
        o = o * corr[:, None] + op
        m = m_new
    inv_l = tl.math.div_rn(tl.full([ROWS], 1.0, tl.float32), tl.where(l > 0, l, 1.0))
    if L_FIRST:
        if PER_TOKEN:
            o = o * inv_l[:, None]
        else:
            o = o * (inv_l * vfac)[:, None]
    else:
        if not PER_TOKEN:
            o = o * vfac
        o = o * inv_l[:, None]
    if OUT_BF16:
        o = round_bf16(o)
    if OUT_F16:
        o = round_f16(o)
    base = ((seq * nkv + h) * NP + part) * R + r
    if PMAX_NATURAL:
        m = m * 0.6931471805599453
    tl.store(PMAX + base, m, mask=row_ok)
    tl.store(PSUM + base, l, mask=row_ok)
    tl.store(POUT + base[:, None] * D + d[None, :], o, mask=row_ok[:, None])


def forward(query, key_cache, value_cache, block_tables, context_lengths, key_scale,
            value_scale, *, softmax_scale: float, num_partitions: int, version: DecodeVersion,
            out_dtype: torch.dtype, interpret: bool, recorder: dict | None = None) -> torch.Tensor:
    """Same contract as ``model.forward`` (checked inputs; ``fa_lab.decode`` checks them),
    on CPU tensors through the interpreter (``interpret=True``) or compiled on a GPU."""
    dev = query.device
    num_seqs = context_lengths.shape[0]
    ql = query.shape[0] // num_seqs
    hq, d = query.shape[1], query.shape[2]
    hkv, bs = key_cache.shape[1], key_cache.shape[3]
    group = hq // hkv
    rows = ql * group
    rows_p = max(16, triton.next_power_of_2(rows))
    per_token = key_scale.dim() > 1
    npart = num_partitions
    scale_qk = f32(softmax_scale * model.LOG2E)
    vfac = 1.0
    if not per_token:
        scale_qk = f32(scale_qk * f32(float(key_scale.reshape(-1)[0])))
        vfac = f32(f32(float(value_scale.reshape(-1)[0])) * f32(1.0 / E4M3_MAX))
    pmax = torch.empty(num_seqs, hkv, npart, rows, device=dev)
    psum = torch.empty_like(pmax)
    pout = torch.empty(num_seqs, hkv, npart, rows, d, device=dev)
    q = query.contiguous()
    sv = list(value_cache.stride()) + [0] * (5 - value_cache.dim())
    ss = key_scale.stride()[:2] if per_token else (0, 0)
    out_bf16, out_f16 = out_dtype == torch.bfloat16, out_dtype == torch.float16
    bt = block_tables.contiguous()
    launch(_tile_kernel, (num_seqs, hkv, npart), interpret, q, key_cache, value_cache, bt,
           context_lengths, key_scale.contiguous(), value_scale.contiguous(), pmax, psum, pout,
           q.stride(0), q.stride(1), *key_cache.stride(), *sv, *ss, bt.numel(), bt.shape[1],
           scale_qk, vfac, npart,
           ROWS=rows_p, R=rows, D=d, BS=bs, QL=ql, G=group, NP=npart, PER_TOKEN=per_token,
           TRANS_V=value_cache.dim() == 5, INF_PATH=rows > model.MTILE_ROWS and version.split_mtile_inf,
           REMASK=version.remask_p and rows <= model.MTILE_ROWS,
           VMAX_VALID=version.vmax_valid_only, PMAX_NATURAL=version.pmax_natural,
           L_FIRST=version.epilogue_l_first, OUT_BF16=out_bf16, OUT_F16=out_f16,
           enable_fp_fusion=False)
    if npart == 1:
        res = pout[:, :, 0]
    else:
        res = torch.empty(num_seqs, hkv, rows, d, device=dev)
        launch(_reduce_kernel, (num_seqs, hkv, rows), interpret, pmax, psum, pout, res,
               f32(LOG2E), R=rows, NP=npart, NPP=max(2, triton.next_power_of_2(npart)), D=d,
               OUT_BF16=out_bf16, OUT_F16=out_f16, enable_fp_fusion=False)
    out = res.reshape(num_seqs, hkv, ql, group, d).permute(0, 2, 1, 3, 4).reshape(num_seqs * ql, hq, d)
    if recorder is not None:
        recorder.update(pmax=pmax, psum=psum, pout=pout,
                        pmax_units="natural" if version.pmax_natural else "log2")
    return out.to(out_dtype)


def forward_sw(*args, **kwargs) -> torch.Tensor:
    """The sliding-window kernel's port (``faithful_swa.forward``, same arguments), reached
    through this module as the family's one faithful implementation."""
    from . import faithful_swa
    return faithful_swa.forward(*args, **kwargs)
