"""Where the fast kernel's lazy vote costs: CTA barriers per KV tile in the sm_90 PTX.

Compiles ``fast_bf16._attn_fwd`` for sm_90 on any machine (no GPU: Triton's NVIDIA back end
and ptxas run on the CPU), with the alignment hints a launch on the benchmark's shapes gets
(pointers and strides divisible by 16), and counts, in every loop of the PTX (a backward
branch), the ``bar.sync`` CTA barriers, the wgmma instructions and the ex2 calls, and reads
registers and spills from the cubin Triton made (``cubin_usage``). For each
tiling it reports eager and lazy (row-sum filter) side by side; a lazy loop shows twice:
the fast path alone, and with the rare rescale branch.

    python benchmarks/ptx_barriers.py --out data/results/ptx_barriers_sm90.json
"""

from __future__ import annotations

import argparse
import re
import subprocess
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget

from fa_lab.studies.experiments import atomic_write_json, provenance
from fa_lab.kernels._triton import fast as common
from fa_lab.kernels.swp_bf16 import fast as fast_bf16

TILINGS = ((128, 64, 8, 3), (128, 128, 8, 2))  # BLOCK_M, BLOCK_N, warps, stages (CONFIGS)
_SCALARS = ("H", "GROUP", "seqlen_q", "seqlen_kv", "rebase")


def compile_ptx(lazy: bool, block_m: int, block_n: int, warps: int, stages: int):
    fn = fast_bf16._attn_fwd
    types, aligned = {}, []
    for name in fn.arg_names:
        if name in ("Q", "K", "V", "Out"):
            types[name] = "*bf16"
        elif name == "Lse":
            types[name] = "*fp32"
        elif name in ("desc_k", "desc_v"):
            types[name] = f"tensordesc<bf16[{block_n}, 128]>"
        elif name.startswith("stride") or name in _SCALARS:
            types[name] = "i32"
        elif name in ("scale_log2", "threshold", "vote_limit"):
            types[name] = "fp32"
        if name in ("Q", "K", "V", "Out", "Lse") or name.startswith("stride"):
            aligned.append(name)
    constexprs = dict(D=128, CAUSAL=False, LAZY=lazy, INTERPRET=False, BLOCK_M=block_m,
                      BLOCK_N=block_n, USE_TMA=False, ROW_SUM_FILTER=lazy)
    kernel = common.compile_only(fn, GPUTarget("cuda", 90, 32), types=types, constexprs=constexprs,
                                 aligned=aligned, num_warps=warps, num_stages=stages,
                                 enable_fp_fusion=True)
    return kernel.asm["ptx"], kernel.metadata.shared, kernel.asm["cubin"]


def cubin_usage(cubin: bytes) -> dict:
    """Registers and stack frame (``cuobjdump -res-usage``) and spill instructions (local
    stores and loads in ``cuobjdump -sass``) of a one-kernel cubin."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        res = subprocess.run([str(tool), "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
        sass = subprocess.run([str(tool), "-sass", f.name], capture_output=True, text=True, check=True).stdout
    reg, stack = re.search(r"REG:(\d+) STACK:(\d+)", res).groups()
    return {"registers": int(reg), "stack_bytes": int(stack),
            "local_stores": len(re.findall(r"\bSTL(?:\.\w+)*\s", sass)),
            "local_loads": len(re.findall(r"\bLDL(?:\.\w+)*\s", sass))}


def write_sm90_result(out, script: str, rows: list, **fields) -> None:
    """``out`` (JSON, written atomically): its name, ``fields``, the provenance of a CPU
    compile for sm_90 by ``script`` and the rows."""
    atomic_write_json(Path(out), {
        "name": Path(out).stem, **fields,
        "provenance": provenance("cpu", triton_compiled_for="sm_90 (CPU compile, no GPU)",
                                 command=f"python benchmarks/{script} --out {Path(out).name}"),
        "rows": rows})


def loops(ptx: str) -> list[dict]:
    """Every backward branch: its body's barriers, wgmma instructions and ex2 calls."""
    lines = ptx.splitlines()
    labels = {m.group(1): i for i, line in enumerate(lines)
              if (m := re.match(r"^\$(L__BB\d+_\d+):", line.strip()))}
    out = []
    for i, line in enumerate(lines):
        m = re.search(r"bra(?:\.uni)?\s+\$(L__BB\d+_\d+);", line)
        if m and labels.get(m.group(1), i) < i:
            body = lines[labels[m.group(1)]:i + 1]
            out.append({"label": m.group(1), "lines": len(body),
                        "bar_sync": sum(bool(re.search(r"\bbar\.sync|barrier\.sync", x)) for x in body),
                        "wgmma": sum("wgmma.mma_async" in x for x in body),
                        "ex2": sum("ex2.approx" in x for x in body)})
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", help="JSON to write (atomically)")
    args = ap.parse_args()
    rows = []
    for bm, bn, warps, stages in TILINGS:
        for lazy in (False, True):
            ptx, shared, cubin = compile_ptx(lazy, bm, bn, warps, stages)
            row = {"tiling": f"BM{bm} BN{bn} w{warps} s{stages}", "policy": "lazy" if lazy else "eager",
                   "shared_bytes": shared, **cubin_usage(cubin), "loops": loops(ptx)}
            print(row, flush=True)
            rows.append(row)
    if args.out:
        write_sm90_result(args.out, "ptx_barriers.py", rows)


if __name__ == "__main__":
    main()
