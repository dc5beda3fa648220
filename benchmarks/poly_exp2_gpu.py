"""The split exp2 (``kernels/_triton/exp2.py``: one element of every k through a cubic on
the FMA units) on the GPU.

1. Accuracy: ``exp2_split`` at every k against fp64 exp2 over [-140, 140] and the special
   values, and against ``poly_exp2`` (its NumPy arithmetic).
2. Speed: at the dense suite's D128 shapes, the fp8 kernel (lazy at its two tuned tilings,
   eager at one) and the Gluon bf16 kernel (lazy and eager at each of its launches) at
   every k, all pinned, bare kernel launches, interleaved rounds; each row carries the
   output's rel-L2 against the fp32 reference and whether its NaN rows match k = 0's.

Writes $OUT/poly_exp2.json: ms per round and, per shape, kernel and policy, the k = 0
median over each k's (> 1: the split is faster)."""
import argparse
import json
import os

import numpy as np
import torch
import triton
import triton.language as tl
from triton.testing import do_bench

from fa_lab import bench, policies
from fa_lab.kernels._triton import fast as common
from fa_lab.kernels._triton.exp2 import POLY_EVERY, exp2_split, poly_exp2
from fa_lab.kernels.swp_bf16 import hopper
from fa_lab.kernels.swp_fp8 import fast as fp8

parser = argparse.ArgumentParser()
parser.add_argument("--rounds", type=int, default=3)
parser.add_argument("--shapes", default="", help="comma-separated shape names (default: D128)")
cli = parser.parse_args()
OUT = os.environ["OUT"]
sms = torch.cuda.get_device_properties(0).multi_processor_count


def save(out):
    tmp = os.path.join(OUT, "poly_exp2.json.tmp")
    with open(tmp, "w") as f:
        json.dump(out, f, indent=1)
    os.replace(tmp, os.path.join(OUT, "poly_exp2.json"))


@triton.jit
def _exp2_kernel(X, Y, n, E: tl.constexpr, BLOCK: tl.constexpr):
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(X + o, mask=o < n, other=0.0)
    tl.store(Y + o, exp2_split(x, E), mask=o < n)


out = {"rounds": cli.rounds, "accuracy": {}, "rows": []}
x = np.concatenate([np.linspace(-140, 140, 1 << 20, dtype=np.float32),
                    np.float32([np.nan, np.inf, -np.inf, 128, 127.99, -127, -126.5, -126, 0])])
x = np.concatenate([x, np.zeros(-len(x) % 1024, np.float32)])
ref = np.exp2(x.astype(np.float64))
normal = (ref >= 2.0 ** -126) & (ref <= np.finfo(np.float32).max)
mirror = poly_exp2(x)
for e in POLY_EVERY:
    xt = torch.from_numpy(x).cuda()
    y = torch.empty_like(xt)
    _exp2_kernel[(len(x) // 1024,)](xt, y, len(x), E=e, BLOCK=1024)
    y = y.cpu().numpy()
    rel = np.abs(y[normal] / ref[normal] - 1)
    special = ~normal
    out["accuracy"][e] = {
        "max_rel_err_normal": float(rel.max()),
        "nan_where_nan": bool(np.array_equal(np.isnan(y), np.isnan(x))),
        "inf_where_overflow": bool(np.array_equal(np.isinf(y), ref > np.finfo(np.float32).max)),
        "zero_or_subnormal_below_2^-126": bool((y[special & (ref < 2.0 ** -126)] < 2.0 ** -126).all()),
        "zero_where_x<=-127": bool((y[x <= -127] == 0).all()),
        "cubic_elements_equal_mirror": None if e == 0 else int(np.sum(
            (y.view(np.uint32) == mirror.view(np.uint32)) | (np.isnan(y) & np.isnan(mirror)))),
        "elements": len(x),
    }
    print("accuracy", e, out["accuracy"][e], flush=True)
save(out)


def fp8_runner(inp, shp, pol, cfg, e):
    captured = {}

    def capture(kernel, tuned, grid, args, meta, config, interpret):
        captured.update(kernel=kernel, grid=grid(config.block_m), args=args, meta=meta)
    real = common.launch_fast
    common.launch_fast = capture
    try:
        (q8, k8, v8), (qd, kd, vd) = inp.fp8
        o, _ = fp8.forward(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd,
                           causal=shp.causal, policy=pol, config=cfg)
    finally:
        common.launch_fast = real
    c = captured
    meta = dict(c["meta"], **cfg.meta(pol.lazy), POLY_EVERY=e)

    def run():
        c["kernel"][c["grid"]](*c["args"], **meta)
        return o
    return run


def gluon_runner(inp, shp, pol, cfg, e):
    grid, args, meta, o, _ = hopper.launch_args(inp.q, inp.k, inp.v, shp.causal, pol, cfg, sms)
    meta = dict(meta, POLY_EVERY=e)

    def run():
        hopper._attn_fwd[grid](*args, **meta, num_warps=4)
        return o
    return run


wanted = [s for s in cli.shapes.split(",") if s]
shapes = [s for s in bench.SHAPES if s.D == 128 and (not wanted or s.name in wanted)]
for shp in shapes:
    inp = bench._inputs(shp, "cuda", 0, fp8=True)
    heads = bench.reference_heads(shp)
    refs = {False: bench._reference(shp, inp, heads), True: bench._reference(shp, inp, heads, fp8=True)}
    groups = []
    for rescale in ("lazy", "eager"):
        pol8 = policies.resolve(fp8=True, seqlen_kv=shp.seqlen_kv, rescale=rescale)
        cfgs8 = ([common.Config(64, 128, 4, 3, True, True), common.Config(64, 128, 4, 3, True, False)]
                 if rescale == "lazy" else [common.Config(64, 128, 4, 3, True, False)])
        for cfg in cfgs8:
            groups.append((f"fp8 {rescale} {cfg.describe(rescale == 'lazy')}", True,
                           {e: fp8_runner(inp, shp, pol8, cfg, e) for e in POLY_EVERY}))
        pol = policies.resolve(fp8=False, seqlen_kv=shp.seqlen_kv, rescale=rescale)
        for cfg in hopper.CONFIGS:
            groups.append((f"gluon {rescale} {cfg.describe()}", False,
                           {e: gluon_runner(inp, shp, pol, cfg, e) for e in POLY_EVERY}))
    fns, checks = {}, {}
    for name, is_fp8, runs in groups:
        base = None
        for e, f in runs.items():
            o = f().clone()
            torch.cuda.synchronize()
            if base is None:
                base = o
            checks[f"{name} k{e}"] = {
                "rel_l2": bench._rel_l2(o, refs[is_fp8], heads),
                "nan_rows_as_k0": bool(torch.equal(o.isnan().any(-1), base.isnan().any(-1))),
            }
            fns[f"{name} k{e}"] = f
    times = {n: [] for n in fns}
    names = list(fns)
    for rnd in range(cli.rounds):
        for n in names[rnd % len(names):] + names[:rnd % len(names)]:
            times[n].append(do_bench(fns[n], warmup=10, rep=50, return_mode="median"))
    med = {n: float(np.median(v)) for n, v in times.items()}
    for name, _, runs in groups:
        line = []
        for e in runs:
            n = f"{name} k{e}"
            line.append(f"k{e} {med[n]:.4f} ({med[f'{name} k0'] / med[n]:.3f}x, "
                        f"rel-L2 {checks[n]['rel_l2']:.2e})")
        print(f"{shp.name:30s} {name:40s} " + "; ".join(line), flush=True)
    out["rows"].append({"shape": shp.name, "ms": times, "checks": checks,
                        "k0_over_k": {n: med[n.rsplit(' k', 1)[0] + " k0"] / med[n] for n in med}})
    save(out)
