"""The fp8 kernel reading V as given ([B, Skv, Hkv, D] tiles, ``V_ROWS``: Triton
transposes each tile on its way to shared memory, as Hopper's fp8 wgmma reads V K-major)
against the per-call transposed copy (``transpose_v`` + the kernel), at the dense suite's
D128 shapes, lazy and eager at pinned tilings, interleaved rounds; outputs compared bit
for bit. Writes $OUT/vrows.json (data/results/fp8_v_rows_h200.json)."""
import json
import os

import numpy as np
import torch
import triton
from triton.testing import do_bench

from fa_lab import bench, policies
from fa_lab.kernels._triton import fast as common
from fa_lab.kernels._triton.fast import Config
from fa_lab.kernels.swp_fp8 import fast as fp8
def captured_launch(q8, k8, v8, qd, kd, vd, causal, pol, cfg, interpret, v_rows):
    cap = {}

    def capture(kernel, tuned, grid, args, meta, config, interpret_):
        cap.update(kernel=kernel, grid=grid(config.block_m), args=list(args), meta=dict(meta))
    real = common.launch_fast
    common.launch_fast = capture
    try:
        out, lse = fp8.forward(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd, causal=causal,
                               policy=pol, config=cfg, interpret=interpret)
    finally:
        common.launch_fast = real
    meta = dict(cap["meta"], **cfg.meta(pol.lazy))
    args = cap["args"]
    if v_rows:
        v = v8.contiguous()
        B, Skv, Hkv, D = v.shape
        args[2] = v
        args[6] = common.make_descriptor(v.view(B * Skv, Hkv * D), [cfg.block_n, D]) if not interpret else None
        meta["V_ROWS"] = True
    if interpret:
        if args[6] is None:
            args[5] = None
        def run():
            common.run_interpreted(cap["kernel"], cap["grid"], *args, **meta)
            return out
    else:
        def run():
            cap["kernel"][cap["grid"]](*args, **meta)
            return out
    return run, out, lse

print(torch.__version__, triton.__version__, torch.cuda.get_device_name(), flush=True)
OUT = os.environ["OUT"]
res = {"rows": []}
for shp in (s for s in bench.SHAPES if s.D == 128):
    inp = bench._inputs(shp, "cuda", 0, fp8=True)
    (q8, k8, v8), (qd, kd, vd) = inp.fp8
    heads = bench.reference_heads(shp)
    ref = bench._reference(shp, inp, heads, fp8=True)
    fns, chk = {}, {}
    for rescale, cfgs in (("lazy", [Config(64, 128, 4, 3, True, True), Config(64, 128, 4, 3, True, False)]),
                          ("eager", [Config(64, 128, 4, 3, True, False), Config(128, 128, 8, 3, True, False)])):
        pol = policies.resolve(fp8=True, seqlen_kv=shp.seqlen_kv, rescale=rescale)
        for cfg in cfgs:
            outs = {}
            for vr in (False, True):
                run, out, _ = captured_launch(q8, k8, v8, qd, kd, vd, shp.causal, pol, cfg, False, vr)
                name = f"{rescale} {cfg.describe(rescale == 'lazy')} {'v_rows' if vr else 'vt_copy'}"
                if vr:
                    fns[name] = run
                else:
                    fns[name] = (lambda run: (lambda: (fp8.transpose_v(v8), run())))(run)
                outs[vr] = run().clone()
            torch.cuda.synchronize()
            chk[f"{rescale} {cfg.describe(rescale == 'lazy')}"] = {
                "bit_equal": bool(torch.equal(outs[0].view(torch.int16), outs[1].view(torch.int16))),
                "rel_l2_vt_copy": bench._rel_l2(outs[False], ref, heads),
                "rel_l2_v_rows": bench._rel_l2(outs[True], ref, heads)}
    times = {n: [] for n in fns}
    names = list(fns)
    for rnd in range(3):
        for n in names[rnd % len(names):] + names[:rnd % len(names)]:
            times[n].append(do_bench(fns[n], warmup=10, rep=50, return_mode="median"))
    med = {n: float(np.median(v)) for n, v in times.items()}
    ratio = {n[:-7]: med[n[:-7] + " vt_copy"] / med[n] for n in med if n.endswith("v_rows")}
    for n, r in ratio.items():
        print(f"{shp.name:30s} {n:32s} vt_copy {med[n + ' vt_copy']:.4f} v_rows {med[n + ' v_rows']:.4f}  copy/rows {r:.3f}  {chk[n]}", flush=True)
    res["rows"].append({"shape": shp.name, "ms": times, "checks": chk, "vt_copy_over_v_rows": ratio})
    json.dump(res, open(os.path.join(OUT, "vrows.json"), "w"), indent=1)
