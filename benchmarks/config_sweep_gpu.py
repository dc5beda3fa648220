"""Pinned timings of the fast kernels' tilings at three dense shapes (D64, short causal,
the seed's), and the fp8 V transpose alone: data/results/bench_configs_h200.json.
Run on a CUDA GPU with OUT set to a directory."""
import json
import os
import sys
import time

from fa_lab.kernels._triton.fast import Config
from fa_lab.kernels.swp_fp8 import fast as f8
from triton.testing import do_bench

from fa_lab import bench

out = {}
S = bench.SHAPES
bf16_cfgs = (Config(128,128,8,2,True), Config(128,64,8,3,True), Config(128,128,8,3,True), Config(128,64,8,4,True),
             Config(64,128,4,3,True), Config(128,64,4,3,True), Config(128,128,4,2,True))
fp8_cfgs = (Config(128,128,8,3,True), Config(128,128,8,4,True), Config(64,128,4,3,True),
            Config(64,128,4,4,True), Config(128,128,4,3,True), Config(128,128,8,3,False))
for shp, do_bf16, do_fp8 in ((S[3], True, False), (S[4], True, True), (S[0], True, True)):
    t = time.time()
    df = bench.config_sweep(shp, configs=bf16_cfgs if do_bf16 else (), fp8_configs=fp8_cfgs if do_fp8 else (),
                            bf16_policies=("eager","lazy"), fp8_policies=("lazy",), progress=False)
    out[shp.name] = df.to_dict("records")
    print(shp.name, round(time.time()-t), "s"); print(df.to_string())
    sys.stdout.flush()
    json.dump(out, open(os.path.join(os.environ['OUT'], 'probe_configs.json'), 'w'), indent=1, default=str)
for shp in (S[4], S[0]):
    inp = bench._inputs(shp, "cuda", 0, fp8=True)
    (q8,k8,v8),_ = inp.fp8
    ms = do_bench(lambda: f8.transpose_v(v8), return_mode="median")
    out[shp.name + " transpose_v_ms"] = ms
    print(shp.name, "transpose_v ms", ms)
json.dump(out, open(os.path.join(os.environ["OUT"], "probe_configs.json"), "w"), indent=1, default=str)
