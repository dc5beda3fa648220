"""The split reduce's faithful Triton port (``reduce.py``), shared by the tile kernel's port
(``faithful.py``) and the sliding-window kernel's (``faithful_swa.py``): one program per
(sequence, kv head, query row), the partitions merged in partition order, NaN maxima
propagated; fp32 sums in Triton's order (the model keeps the butterfly's)."""

from __future__ import annotations

import triton
import triton.language as tl

from .._triton.util import exp2_ieee, round_bf16, round_f16


@triton.jit
def _reduce_kernel(PMAX, PSUM, POUT, OUT, log2e, R: tl.constexpr, NP: tl.constexpr,
                   NPP: tl.constexpr, D: tl.constexpr,
                   OUT_BF16: tl.constexpr, OUT_F16: tl.constexpr):
    seq = tl.program_id(0)
    h = tl.program_id(1)
    row = tl.program_id(2)
    nkv = tl.num_programs(1)
    p = tl.arange(0, NPP)
    ok = p < NP
    idx = ((seq * nkv + h) * NP + p) * R + row
    pm = tl.load(PMAX + idx, mask=ok, other=float("-inf"))
    ps = tl.load(PSUM + idx, mask=ok, other=0.0)
    has_nan = tl.max((pm != pm).to(tl.int32), axis=0) > 0
    gm = tl.where(has_nan, float("nan"), tl.max(pm, axis=0))
    part_scale = tl.where(ok, exp2_ieee((pm - gm) * log2e), 0.0)
    scaled = ps * part_scale
    gsum = tl.sum(scaled, axis=0)
    inv = tl.math.div_rn(tl.full([1], 1.0, tl.float32), tl.where(gsum > 0, gsum, 1.0) + tl.zeros([1], tl.float32))
    w = scaled * inv
    d = tl.arange(0, D)
    acc = tl.zeros([D], tl.float32)
    for i in range(NP):
        wi = tl.sum(tl.where(p == i, w, 0.0), axis=0)
        x = tl.load(POUT + (((seq * nkv + h) * NP + i) * R + row) * D + d)
        acc = acc + x * wi
    if OUT_BF16:
        acc = round_bf16(acc)
    if OUT_F16:
        acc = round_f16(acc)
    tl.store(OUT + ((seq * nkv + h) * R + row) * D + d, acc)
