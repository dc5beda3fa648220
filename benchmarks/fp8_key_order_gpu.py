"""fp8 lazy at the dense D128 shapes: the Triton fp8 kernel with V^T's keys in the fp8
operand's order and P reordered to match (8e1a26f) against the same kernel before it
(plain key order), and the Gluon fp8 schedule of 42dc92a with and without the same
reordering (P through ``gl.convert_layout(..., assert_trivial=True)``); each forward
includes its V^T copy; all pinned; beside bf16 fast lazy (autotuned) and the two V^T
copies alone. Interleaved rounds (bench.time_rounds, CudaTimer) and call-alternated pairs
(bench.time_paired); also whether the variants' outputs are bit-equal. Writes
$OUT/fp8_key_order.json (data/results/fp8_key_order_h200.json)."""
import importlib.util
import os
import subprocess
import sys
import time

import torch

from fa_lab import policies
from fa_lab import timing
from fa_lab.studies import bench
from fa_lab.kernels._triton.fast import Config
from fa_lab.kernels.swp_bf16 import fast as bf16
from fa_lab.kernels.swp_fp8 import fast as new
from fa_lab.kernels.swp_fp8.model import log2_scale
from fa_lab.results import atomic_write_json, provenance

#: The Gluon fp8 P operand, as 42dc92a had it and reordered like the Triton kernel's.
PLAIN_P = "        return gl.convert_layout(p.to(dtype), p_layout)"
KEYED_P = """        if FP8:
            p8 = gl.reshape(p.to(dtype), [64, p.shape[1] // 16, 2, 4, 2])
            p8 = gl.reshape(gl.permute(p8, [0, 1, 3, 2, 4]), [64, p.shape[1]])
            return gl.convert_layout(p8, p_layout, assert_trivial=True)
""" + PLAIN_P


def load(commit, path, name, subst=None):
    """The module ``path`` as ``commit`` had it (relative imports made absolute), from a
    file of its own (Triton and Gluon read a kernel's source back)."""
    src = subprocess.run(["git", "show", f"{commit}:{path}"], check=True, capture_output=True,
                         text=True).stdout.replace("from .._triton", "from fa_lab.kernels._triton")
    for a, b in (subst or {}).items():
        assert a in src, a
        src = src.replace(a, b)
    p = f"/tmp/{name}.py"
    with open(p, "w") as f:
        f.write(src)
    spec = importlib.util.spec_from_file_location(name, p)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # (dataclasses look their module up)
    spec.loader.exec_module(mod)
    return mod


old = load("8e1a26f~1", "kernels/swp_fp8/fast.py", "fast_fp8_plain")
g_plain = load("42dc92a", "kernels/_gluon/hopper.py", "gluon42_plain")
g_key = load("42dc92a", "kernels/_gluon/hopper.py", "gluon42_key", {PLAIN_P: KEYED_P})
SMS = torch.cuda.get_device_properties(0).multi_processor_count


def gluon_fn(mod, transpose, q8, k8, v8, qd, kd, vd, causal, pol, cfg):
    B, Sq, H, D = q8.shape
    Hkv = k8.shape[2]
    items = -(-Sq // 128) * B * H
    def run():
        vt = transpose(v8)
        out = torch.empty(B, Sq, H, D, device=q8.device, dtype=torch.bfloat16)
        lse = torch.empty(B, H, Sq, device=q8.device, dtype=torch.float32)
        q_desc, k_desc = mod.qkv_descriptors(q8, k8, 128)
        v_desc = mod.descriptor(vt.view(B * Hkv * D, vt.shape[-1]), [D, 128])
        c = pol.codes
        args = (q_desc, k_desc, v_desc, None, out, lse, B * H, H, H // Hkv, Sq, k8.shape[1], 1.0,
                c.threshold, c.rebase, c.bound, log2_scale(qd, kd, D), c.headroom, vd)
        meta = dict(D=D, BLOCK_N=128, STAGES=cfg.stages, CAUSAL=causal, LAZY=pol.lazy,
                    PINGPONG=cfg.pingpong, FP8=True, SATURATE=True)
        mod.launch(mod.grid(items, cfg, SMS), args, meta, q8.device)
        return out, lse
    return run


ROUNDS = 5
#: call-alternated pairs (a, b): per round, b's median ms over a's (> 1: a is faster)
PAIRS = [("triton_key", "triton_plain"), ("gluon_key", "triton_key"), ("triton_key", "bf16_lazy"),
         ("transpose_key", "transpose_plain")]
out = {"name": "fp8_key_order_h200", "what": __doc__.split("Writes")[0].strip(),
       "paired": "per round, b's median ms over a's in call-alternated cycles (> 1: a faster)",
       "rounds": ROUNDS, "rows": []}
timer = timing.CudaTimer()
shapes = [s for s in bench.SHAPES if s.D == 128]
t_start = time.time()
for shp in shapes:
    inp = bench.impls._inputs(shp, "cuda", 0, fp8=True)
    (q8, k8, v8), (qd, kd, vd) = inp.fp8
    pol = policies.resolve(fp8=True, seqlen_kv=shp.seqlen_kv, rescale="lazy")
    bpol = policies.resolve(fp8=False, seqlen_kv=shp.seqlen_kv, rescale="lazy")
    cfg = Config(64, 128, 4, 3, True, True)
    kw = dict(q_descale=qd, k_descale=kd, v_descale=vd, causal=shp.causal, policy=pol)
    gcfg = g_key.HopperConfig(128, 2, True, not shp.causal)
    fns = {
        "triton_plain": lambda: old.forward(q8, k8, v8, config=cfg, **kw),
        "triton_key": lambda: new.forward(q8, k8, v8, config=cfg, **kw),
        "gluon_plain": gluon_fn(g_plain, old.transpose_v, *inp.fp8[0], *inp.fp8[1], shp.causal,
                                pol, gcfg),
        "gluon_key": gluon_fn(g_key, new.transpose_v, *inp.fp8[0], *inp.fp8[1], shp.causal, pol,
                              gcfg),
        "bf16_lazy": lambda: bf16.forward(inp.q, inp.k, inp.v, causal=shp.causal, policy=bpol),
        "transpose_plain": lambda: old.transpose_v(v8),
        "transpose_key": lambda: new.transpose_v(v8),
    }
    # the same outputs: reordering the keys changes only the order of the fp32 sums
    ref = fns["triton_plain"]()[0].float()
    agree = {}
    for n in ("triton_key", "gluon_plain", "gluon_key"):
        o = fns[n]()[0].float()
        agree[n] = {"max_abs_vs_triton_plain": float((o - ref).abs().max()),
                    "nan_equal": bool(torch.equal(torch.isnan(o), torch.isnan(ref)))}
    res = bench.time_rounds(fns, rounds=ROUNDS, timer=timer, min_ms=60.0)
    pairs = bench.time_paired(fns, PAIRS, rounds=ROUNDS, timer=timer, min_ms=60.0)
    med = {n: sorted(v)[ROUNDS // 2] if None not in v else None for n, v in res.ms.items()}
    row = {"shape": shp.name, "triton_config": cfg.describe(True), "gluon_config": gcfg.describe(),
           "ms": res.ms, "errors": res.errors, "median_ms": med, "agree": agree,
           "paired": {f"{a} / {b}": v for (a, b), v in pairs.items()}}
    out["rows"].append(row)
    print(shp.name, {n: round(m, 4) if m else None for n, m in med.items()},
          {k: [round(x, 3) for x in v["rounds"] if x] for k, v in row["paired"].items()}, agree,
          f"{time.time() - t_start:.0f}s", flush=True)
out["provenance"] = provenance("cuda", timer=timer.name)
atomic_write_json(os.path.join(os.environ["OUT"], "fp8_key_order.json"), out)
