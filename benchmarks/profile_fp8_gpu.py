"""The launches behind an Nsight Compute profile of the fp8 Triton kernel under lazy, each
called twice (the first call compiles). Run it under ncu, e.g.

    ncu -k regex:attn_fwd --section SpeedOfLight --section ComputeWorkloadAnalysis
        --section WarpStateStats --section SchedulerStats --section Occupancy --csv
        --page details python3 benchmarks/profile_fp8_gpu.py

and read the second launch of each.

By default (``data/results/ncu_fp8_h200.json``): the fp8 target shape of the dense suite,
B2 S8192 H32 D128, with the fp8 kernel at its tuned tiling (BM64 BN128, 4 warps, 3 stages,
TMA, row-sum filter) and the Gluon bf16 kernel under lazy at a pinned launch (BN128,
2 stages, persistent: the tuner's pick there in bench_h200.json at 1a2da9a).

``--shape "B16 S1024 H16 D128 causal" --occupancy``: the fp8 kernel alone at that tiling and at the register-capped 2-stage launch that fits three
programs per multiprocessor (``maxnreg`` 168), without the row-sum filter (the tuner's
pick at that shape).
"""
import argparse

import torch

from fa_lab import policies
from fa_lab.studies import bench
from fa_lab.kernels._triton.fast import Config
from fa_lab.kernels.swp_bf16 import hopper
from fa_lab.kernels.swp_bf16.hopper import HopperConfig
from fa_lab.kernels.swp_fp8 import fast as fp8

ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
ap.add_argument("--shape", default="B2 S8192 H32 D128", choices=[s.name for s in bench.SHAPES])
ap.add_argument("--occupancy", action="store_true",
                help="fp8 only: the 3-stage tiling, then the capped 2-stage one (no row-sum filter)")
args = ap.parse_args()

shape = next(s for s in bench.SHAPES if s.name == args.shape)
if shape.D != fp8.HEAD_DIM:
    ap.error(f"--shape {shape.name}: the fp8 kernel takes D = {fp8.HEAD_DIM}")
inp = bench.impls._inputs(shape, "cuda", 0, fp8=True)
(q8, k8, v8), (qd, kd, vd) = inp.fp8
pol8 = policies.resolve(fp8=True, seqlen_kv=shape.seqlen_kv, rescale="lazy")
pol = policies.resolve(fp8=False, seqlen_kv=shape.seqlen_kv, rescale="lazy")
fp8_configs = ([Config(64, 128, 4, 3, True, False), Config(64, 128, 4, 2, True, False, 168)]
               if args.occupancy else [Config(64, 128, 4, 3, True, True)])
for config in fp8_configs:
    for _ in range(2):
        fp8.forward(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd, causal=shape.causal,
                    policy=pol8, config=config)
if not args.occupancy:
    for _ in range(2):
        hopper.forward(inp.q, inp.k, inp.v, causal=shape.causal, policy=pol,
                       config=HopperConfig(128, 2, False, True))
torch.cuda.synchronize()
print(shape.name, [c.describe() for c in fp8_configs])
