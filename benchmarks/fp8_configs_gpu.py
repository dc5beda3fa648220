"""The fp8 kernel's tilings, pinned, at the dense suite's D128 shapes (fp8 lazy, each
forward with its V^T copy): median ms per interleaved round (bench.time_rounds,
CudaTimer) and each tiling's speed over the autotuner's first candidate. Writes
$OUT/fp8_configs.json (data/results/fp8_configs_h200.json)."""
import os
import time

from fa_lab import policies
from fa_lab import timing
from fa_lab.studies import bench
from fa_lab.kernels._triton.fast import Config
from fa_lab.kernels.swp_fp8 import fast as f8
from fa_lab.results import atomic_write_json, provenance

ROUNDS = 5
CONFIGS = (Config(64, 128, 4, 3, True), Config(64, 128, 4, 2, True), Config(64, 128, 4, 4, True),
           Config(64, 128, 4, 3, True, False), Config(128, 128, 8, 3, True),
           Config(128, 128, 8, 2, True), Config(128, 128, 8, 3, False))
BASE = CONFIGS[0].describe(True)
out = {"name": "fp8_configs_h200", "what": __doc__.split("Writes")[0].strip(), "rounds": ROUNDS,
       "rows": []}
timer = timing.CudaTimer()
t0 = time.time()
for shp in (s for s in bench.SHAPES if s.D == 128):
    (q8, k8, v8), (qd, kd, vd) = bench.impls._inputs(shp, "cuda", 0, fp8=True).fp8
    pol = policies.resolve(fp8=True, seqlen_kv=shp.seqlen_kv, rescale="lazy")
    fns = {c.describe(True): (lambda c=c: f8.forward(q8, k8, v8, q_descale=qd, k_descale=kd,
                                                      v_descale=vd, causal=shp.causal,
                                                      policy=pol, config=c))
           for c in CONFIGS}
    res = bench.time_rounds(fns, rounds=ROUNDS, timer=timer, min_ms=40.0)
    over = {n: [b / t if b and t else None for b, t in zip(res.ms[BASE], v)]
            for n, v in res.ms.items()}
    med = {n: sorted(x for x in v if x)[len([x for x in v if x]) // 2] if any(v) else None
           for n, v in over.items()}
    out["rows"].append({"shape": shp.name, "ms": res.ms, "errors": res.errors,
                        "over_base": over, "over_base_median": med})
    print(shp.name, {n: round(m, 3) if m else None for n, m in med.items()}, res.errors,
          f"{time.time() - t0:.0f}s", flush=True)
out["provenance"] = provenance("cuda", timer=timer.name)
atomic_write_json(os.path.join(os.environ["OUT"], "fp8_configs.json"), out)
