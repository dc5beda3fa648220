"""Repro for mla_decode_p_cast.md: FlyDSL's MLA decode (fp8 Q and KV, 128 heads) casts
P = exp2(x - m) to e4m3 with no headroom while l sums the fp32 P, so keys 10 or more log2
units below their tile's running max drop out of the output but not out of l.

One dominant key and 1023 keys exactly 10 log2 units below it, V = 1: the exact output is 1.
Upstream (``p_headroom=0``) gives about 0.5; the #1020-style lift (``p_headroom=8``) gives 1.
The LSE is exact either way.

Run: python docs/findings/mla_decode_p_cast.py
"""

import math

import torch

from fa_lab import mla

N = 1024


def repro() -> dict:
    """{p_headroom: (out, lse)} for one head of the case above, and the exact LSE."""
    fp8 = torch.float8_e4m3fn
    q = torch.zeros(1, 128, 576)
    q[0, :, 512] = 10.0                      # every head: score 10 on key 0's rope lane
    kv = torch.zeros(N, 1, 1, 576)
    kv[..., :512] = 1.0                      # V = 1 for every key
    kv[0, 0, 0, 512] = 1.0                   # key 0 is the dominant one
    q, kv = q.to(fp8), kv.to(fp8)
    scale = math.log(2.0)                    # the other keys sit 10 log2 units below
    pages = torch.arange(N, dtype=torch.int32)
    work_indptr = torch.tensor([0, 1], dtype=torch.int32)
    work_info_set = torch.tensor([[0, 0, 0, 1, 0, N, 0, 0]], dtype=torch.int32)
    final = torch.zeros(1, 128, 512, dtype=torch.bfloat16)
    out = {}
    for h in (0.0, 8.0):
        so, sl = torch.zeros(1, 1, 128, 512), torch.zeros(1, 1, 128, 1)
        mla.flydsl_mla_fwd_decode(q, kv, pages, work_indptr, work_info_set, final, so, sl, scale,
                                  p_headroom=h)
        out[h] = (so[0, 0, 0, 0].item(), sl[0, 0, 0, 0].item())
    out["exact_lse"] = 10 * math.log(2.0) + math.log(1 + (N - 1) * 2.0 ** -10)
    return out


if __name__ == "__main__":
    r = repro()
    for h in (0.0, 8.0):
        o, lse = r[h]
        print(f"p_headroom={h:g}: out = {o:.6f} (exact 1), lse = {lse:.6f} (exact {r['exact_lse']:.6f})")
