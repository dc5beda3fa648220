"""Pinned timings of the fast kernels' tilings (fa_lab.studies.bench.config_sweep, no autotune):
data/results/bench_configs_h200.json. Run on a CUDA GPU with OUT set to a directory.

    python benchmarks/config_sweep_gpu.py           # candidate tilings at D64, the short
                                                    # causal and the seed's shape, and the
                                                    # fp8 V transpose alone
    python benchmarks/config_sweep_gpu.py --lists   # the kernels' autotune lists at the
                                                    # short causal and the GQA shape
"""
import json
import os
import sys
import time

from triton.testing import do_bench

from fa_lab.studies import bench
from fa_lab.kernels._triton.fast import Config
from fa_lab.kernels.swp_bf16 import fast as b16
from fa_lab.kernels.swp_fp8 import fast as f8

S = bench.SHAPES
LISTS = "--lists" in sys.argv[1:]
OUT = os.path.join(os.environ["OUT"], "probe4.json" if LISTS else "probe_configs.json")
BF16 = (Config(128, 128, 8, 2, True), Config(128, 64, 8, 3, True), Config(128, 128, 8, 3, True),
        Config(128, 64, 8, 4, True), Config(64, 128, 4, 3, True), Config(128, 64, 4, 3, True),
        Config(128, 128, 4, 2, True))
FP8 = (Config(128, 128, 8, 3, True), Config(128, 128, 8, 4, True), Config(64, 128, 4, 3, True),
       Config(64, 128, 4, 4, True), Config(128, 128, 4, 3, True), Config(128, 128, 8, 3, False))
if LISTS:
    jobs = [(S[4], b16.CONFIGS, f8.CONFIGS), (S[2], b16.CONFIGS, f8.CONFIGS)]
else:
    jobs = [(S[3], BF16, ()), (S[4], BF16, FP8), (S[0], BF16, FP8)]
out = {}
for shape, bf16_configs, fp8_configs in jobs:
    t = time.time()
    df = bench.config_sweep(shape, configs=bf16_configs, fp8_configs=fp8_configs,
                            bf16_policies=("eager", "lazy"), fp8_policies=("lazy",), progress=False)
    out[shape.name] = df.to_dict("records")
    print(shape.name, round(time.time() - t), "s")
    print(df.to_string(), flush=True)
    with open(OUT, "w") as f:
        json.dump(out, f, indent=1, default=str)
if not LISTS:
    for shape in (S[4], S[0]):
        (_, _, v8), _ = bench.impls._inputs(shape, "cuda", 0, fp8=True).fp8
        out[shape.name + " transpose_v_ms"] = do_bench(lambda: f8.transpose_v(v8), return_mode="median")
        print(shape.name, "transpose_v ms", out[shape.name + " transpose_v_ms"])
    with open(OUT, "w") as f:
        json.dump(out, f, indent=1, default=str)
