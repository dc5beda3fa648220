"""Split-K for the faithful DUALWAVE_SWP bf16/f16 port (``faithful``): where each split's
tiles start and end, and the pass that combines the splits.

Same semantics as ``fa_lab.kernels.swp_bf16.model._split_k``: the forward kernel runs one program
per (rows, batch x head, split); each split walks its own tiles [t0, t_end) of the block's
N with the full schedule (its own prologue, lazy loop and eager epilogue) and stores its
partial output rounded to the 16-bit dtype, normalised by its own l, plus its fp32 running
max m and l. An empty split stores nothing: its buffers keep m = -1e30, l = 0, O = 0. The
combine, per row:

  m_max = maxNum over splits of m_s (then of the sink's logit, if any)
  den   = sum_s w_s l_s (splits in order, 0 where l_s <= 0), w_s = exp2(m_s - m_max)
  acc   = sum_s w_s l_s O_s;  den += exp2(sink - m_max)   (the sink, once)
  out   = round(acc * rcp(den)),  lse = m_max ln 2 + ln(den)   (-inf where den = 0)
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from fa_lab.numerics import LN2, LOG2E, f32

from .._triton.util import exp2_ieee, fmax, launch, round_bf16, round_f16

#: What an empty split stores as its running max (the model's value).
EMPTY_M = -1e30


@triton.jit
def split_range(n_tiles, split, num_splits):
    """[t0, t_end) of ``split`` among ``num_splits`` over a block's ``n_tiles`` (even)
    tiles, as ``fa_lab.kernels.swp_bf16.model.split_ranges``: chunks of ceil(N / splits) rounded
    up to even, at least 6; a remainder under 4 tiles joins the split before it; a split
    that would start with fewer than 4 tiles left is empty (t0 == t_end)."""
    chunk = tl.maximum(((n_tiles + num_splits - 1) // num_splits + 1) // 2 * 2, 6)
    t0 = split * chunk
    t_end = tl.minimum(t0 + chunk, n_tiles)
    t_end = tl.where(n_tiles - t_end < 4, n_tiles, t_end)
    t_end = tl.where(t0 + 4 > n_tiles, t0, t_end)
    return t0, t_end


@triton.jit(do_not_specialize=["H", "Sq", "num_splits"])
def _combine(
    PartO, PartM, PartL, Sink, Out, Lse,
    stride_ps, stride_pb, stride_pq, stride_ph, stride_pd,
    stride_ms, stride_mb, stride_mh,
    stride_ob, stride_os, stride_oh, stride_od,
    stride_lb, stride_lh,
    H, Sq, num_splits,
    HEAD_DIM: tl.constexpr, ROWS: tl.constexpr, HAS_SINK: tl.constexpr, IS_BF16: tl.constexpr,
    LN2_F32: tl.constexpr, LOG2E_F32: tl.constexpr,
):
    chunk = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    rows = chunk * ROWS + tl.arange(0, ROWS)
    ok = rows < Sq
    rows64 = rows.to(tl.int64)
    offs_d = tl.arange(0, HEAD_DIM)
    ml_off = b * stride_mb + h * stride_mh + rows64
    o_off = b * stride_pb + h * stride_ph + rows64[:, None] * stride_pq + offs_d[None, :] * stride_pd

    m_max = tl.load(PartM + ml_off, mask=ok, other=0.0)
    for s in range(1, num_splits):
        m_max = fmax(m_max, tl.load(PartM + s * stride_ms + ml_off, mask=ok, other=0.0))
    den = tl.zeros([ROWS], dtype=tl.float32)
    if HAS_SINK:
        sk = tl.where(rows >= 0, tl.load(Sink + h) * LOG2E_F32, 0.0)  # the sink's logit, per row
        m_max = fmax(m_max, sk)
        sink_w = exp2_ieee(sk - m_max)
    acc = tl.zeros([ROWS, HEAD_DIM], dtype=tl.float32)
    for s in range(0, num_splits):
        m_s = tl.load(PartM + s * stride_ms + ml_off, mask=ok, other=0.0)
        l_s = tl.load(PartL + s * stride_ms + ml_off, mask=ok, other=0.0)
        # partials are 16-bit values: widened at once (the interpreter's bf16 math is wrong)
        o_s = tl.load(PartO + s * stride_ps + o_off, mask=ok[:, None], other=0.0).to(tl.float32)
        wl = tl.where(l_s > 0, exp2_ieee(m_s - m_max) * l_s, 0.0)
        den = den + wl
        acc = acc + wl[:, None] * o_s
    if HAS_SINK:
        den = den + sink_w

    rcp = tl.where(den > 0, tl.math.div_rn(tl.full([ROWS], 1.0, tl.float32), den), 0.0)
    out = acc * rcp[:, None]
    if IS_BF16:
        out = round_bf16(out)
    else:
        out = round_f16(out)
    o_ptrs = Out + b * stride_ob + h * stride_oh + rows64[:, None] * stride_os + offs_d[None, :] * stride_od
    tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=ok[:, None])
    lse = tl.where(den == 0, float("-inf"), m_max * LN2_F32 + tl.log(den))
    tl.store(Lse + b * stride_lb + h * stride_lh + rows64, lse, mask=ok)


def partials(num_splits: int, B: int, Sq: int, H: int, D: int, dtype, device):
    """The split buffers, as an empty split leaves them: O [S, B, Sq, H, D] in the
    16-bit dtype (0), m and l [S, B, H, Sq] fp32 (-1e30 and 0)."""
    part_o = torch.zeros(num_splits, B, Sq, H, D, dtype=dtype, device=device)
    part_m = torch.full((num_splits, B, H, Sq), EMPTY_M, dtype=torch.float32, device=device)
    part_l = torch.zeros(num_splits, B, H, Sq, dtype=torch.float32, device=device)
    return part_o, part_m, part_l


def combine(part_o, part_m, part_l, sink, out, lse, *, rows: int, interpret: bool):
    """Merge the splits into ``out`` [B, Sq, H, D] and ``lse`` [B, H, Sq] (written in
    place); ``sink`` [H] fp32 or None, natural-log units."""
    S, B, Sq, H, D = part_o.shape
    assert part_m.stride() == part_l.stride()
    grid = (triton.cdiv(Sq, rows), B * H)
    dev = part_o.device
    sink_arg = sink if sink is not None else torch.empty(1, dtype=torch.float32, device=dev)
    device_ctx = torch.cuda.device(dev) if dev.type == "cuda" else contextlib.nullcontext()
    with device_ctx:
        launch(
            _combine, grid, interpret,
            part_o, part_m, part_l, sink_arg, out, lse,
            *part_o.stride(), *part_m.stride()[:3], *out.stride(), *lse.stride()[:2],
            H, Sq, S,
            HEAD_DIM=D, ROWS=rows, HAS_SINK=sink is not None,
            IS_BF16=out.dtype == torch.bfloat16, LN2_F32=f32(LN2), LOG2E_F32=f32(LOG2E),
            enable_fp_fusion=False,
        )
