"""The launches behind an Nsight Compute profile of the fp8 target shape of the dense suite
(B2 S8192 H32 D128): the fp8 Triton kernel under lazy at its tuned tiling (BM64 BN128,
4 warps, 3 stages, TMA, row-sum filter) and the Gluon bf16 kernel under lazy at a pinned
launch (BN128, 2 stages, persistent: the tuner's pick there in bench_h200.json at
1a2da9a), each called twice (the first call compiles). Run it
under ncu, e.g.

    ncu -k regex:attn_fwd --section SpeedOfLight --section ComputeWorkloadAnalysis
        --section WarpStateStats --section SchedulerStats --csv --page details
        python3 benchmarks/profile_fp8_gpu.py

and read the second launch of each (data/results/ncu_fp8_h200.json)."""
import torch

from fa_lab import bench, policies
from fa_lab.kernels._triton.fast import Config
from fa_lab.kernels.swp_bf16 import hopper
from fa_lab.kernels.swp_bf16.hopper import HopperConfig
from fa_lab.kernels.swp_fp8 import fast as fp8

shape = next(s for s in bench.SHAPES if s.name == "B2 S8192 H32 D128")
inp = bench._inputs(shape, "cuda", 0, fp8=True)
(q8, k8, v8), (qd, kd, vd) = inp.fp8
pol8 = policies.resolve(fp8=True, seqlen_kv=shape.seqlen_kv, rescale="lazy")
pol = policies.resolve(fp8=False, seqlen_kv=shape.seqlen_kv, rescale="lazy")
for _ in range(2):
    fp8.forward(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd, causal=False, policy=pol8,
                config=Config(64, 128, 4, 3, True, True))
for _ in range(2):
    hopper.forward(inp.q, inp.k, inp.v, causal=False, policy=pol,
                   config=HopperConfig(128, 2, False, True))
torch.cuda.synchronize()
print(shape.name)
