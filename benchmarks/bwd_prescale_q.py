"""What rounding the pre-scaled Q to bf16 costs, in dQ and in the forward's O.

Upstream's dQ kernel (ROCm/FlyDSL ``flash_attn_gfx950_dq.py`` 1fa54fa3,
``BwdDqSoftmaxHelper.sub_lse``) measured, at B1 H4 S512 d64, the max error of dQ against
an fp64 reference with Q folded (``Q * sm_scale * log2 e`` rounded to bf16 before the
dot) and with the scale applied to the fp32 scores: 1.8e-4 / 1.6e-4 at sm_scale 0.05,
4.3e-2 / 2.0e-2 at 0.25, 6.9e-1 / 6.8e-2 at 1.0. This reruns that comparison on fa_lab's
dQ model (``fa_lab.kernels.bwd.dq``, ``prescale_q`` True/False) on q, k, v, dO ~ N(0, 1)
in bf16, with the fp64 LSE and the fp64 O rounded to bf16 as the backward's inputs, and
measures the same fold in a forward (exact dots, fp32 softmax against the fp64 row max,
P and O rounded to bf16 as the DUALWAVE_SWP forward does, ``fa_lab.kernels.swp_bf16``
folds Q at 11c4174d).

    python benchmarks/bwd_prescale_q.py --out data/results/bwd_prescale_q.json
"""

from __future__ import annotations

import argparse

import torch

from fa_lab.kernels.bwd.common import scales
from fa_lab.kernels.bwd.dq import backward_dq
from fa_lab.numerics import bf16, exact_dot, exp2
from fa_lab.studies.experiments import atomic_write_json, provenance

B, H, S, D = 1, 4, 512, 64
SCALES = (0.05, 0.25, 1.0)
UPSTREAM = {0.05: (1.8e-4, 1.6e-4), 0.25: (4.3e-2, 2.0e-2), 1.0: (6.9e-1, 6.8e-2)}


def reference(q, k, v, do, sm):
    """fp64 attention and its gradients: (O, LSE, dQ), [B, S, H, D] / [B, H, S]."""
    qq, kk, vv = (x.double().permute(0, 2, 1, 3).requires_grad_() for x in (q, k, v))
    s = qq @ kk.transpose(-1, -2) * sm
    lse = torch.logsumexp(s, -1)
    o = torch.softmax(s, -1) @ vv
    o.backward(do.double().permute(0, 2, 1, 3))
    return o.detach().permute(0, 2, 1, 3), lse.detach(), qq.grad.permute(0, 2, 1, 3)


def forward_o(q, k, v, sm, fold: bool):
    """O of a one-pass forward at the exact row max: scores folded or scaled, P and O
    rounded to bf16, l summed unrounded (the DUALWAVE_SWP rounding points)."""
    _, c = scales(D, sm)
    qh, kh, vh = (x.float().permute(0, 2, 1, 3) for x in (q, k, v))
    s = exact_dot(bf16(qh * c), kh.transpose(-1, -2)) if fold else exact_dot(qh, kh.transpose(-1, -2)) * c
    m = s.amax(-1, keepdim=True)
    p = exp2(s - m)
    o = exact_dot(bf16(p), vh) / p.sum(-1, keepdim=True)
    return bf16(o).permute(0, 2, 1, 3)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--seeds", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    rows = []
    for seed in range(args.seeds):
        g = torch.Generator().manual_seed(seed)
        q, k, v, do = (torch.randn(B, S, H, D, generator=g).bfloat16() for _ in range(4))
        for sm in SCALES:
            o64, lse64, dq64 = reference(q, k, v, do, sm)
            row = {"seed": seed, "sm_scale": sm, "upstream_dq_folded": UPSTREAM[sm][0],
                   "upstream_dq_scaled": UPSTREAM[sm][1], "dq_max_abs": dq64.abs().max().item()}
            for fold in (True, False):
                dq = backward_dq(q, k, v, do, lse64.float(), (o64 * do.double()).sum(-1)
                                 .float().permute(0, 2, 1).contiguous(), causal=False,
                                 prescale_q=fold, softmax_scale=sm)
                key = "folded" if fold else "scaled"
                row[f"dq_err_{key}"] = (dq.double() - dq64).abs().max().item()
                row[f"o_err_{key}"] = (forward_o(q, k, v, sm, fold).double() - o64).abs().max().item()
            rows.append(row)
            print({k: (f"{x:.3g}" if isinstance(x, float) else x) for k, x in row.items()})
    atomic_write_json(args.out, {"name": "bwd_prescale_q", "provenance": provenance(),
                                 "params": {"B": B, "H": H, "S": S, "D": D, "dtype": "bfloat16"},
                                 "rows": rows})


if __name__ == "__main__":
    main()
