"""The launches behind an Nsight Compute profile of the short causal shape of the dense
suite (B16 S1024 H16 D128, causal): the Gluon kernel under eager and lazy at a pinned
launch, and SDPA's cuDNN backend, each called twice (the first call compiles). Run it
under ncu, e.g.

    ncu -k regex:'attn_fwd|cudnn|sdpa|fmha' --launch-skip 0 --section SpeedOfLight
        --section ComputeWorkloadAnalysis --section WarpStateStats --section Occupancy
        --section LaunchStats --csv --page details python3 benchmarks/profile_short_causal_gpu.py

and read the second launch of each."""
import sys

import torch

from fa_lab import policies
from fa_lab.studies import bench
from fa_lab.kernels.swp_bf16 import hopper
from fa_lab.kernels.swp_bf16.hopper import HopperConfig

shape = next(s for s in bench.SHAPES if s.name == "B16 S1024 H16 D128 causal")
inp = bench.impls._inputs(shape, "cuda", 0)
config = HopperConfig(*map(int, sys.argv[1:3]), *(a == "1" for a in sys.argv[3:5])) \
    if len(sys.argv) > 1 else HopperConfig()
for rescale in ("eager", "lazy"):
    pol = policies.resolve(fp8=False, seqlen_kv=shape.seqlen_kv, rescale=rescale)
    for _ in range(2):
        hopper.forward(inp.q, inp.k, inp.v, causal=True, policy=pol, config=config)
cudnn = bench.impls._runner("sdpa_cudnn", shape, inp)
for _ in range(2):
    cudnn()
torch.cuda.synchronize()
print(shape.name, config.describe())
