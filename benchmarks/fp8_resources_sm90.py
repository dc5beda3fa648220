"""How many fp8 programs share an H100/H200 SM: registers, spills and shared memory of
the fast fp8 kernel's sm_90 build, per tiling, policy and register cap.

Builds ``fast_fp8._attn_fwd_fp8`` for sm_90 as a launch on contiguous tensors builds it
(``fast_fp8.compile_only``; Triton's back end and its ptxas run on the CPU) for every
tiling in ``CANDIDATE_CONFIGS``, eager and lazy (with and without the row-sum filter),
causal, with no register cap and with ``maxnreg`` 232, 200 and 168 (168: the most that
lets three 4-warp programs share the register file). Each build is read from the cubin
Triton made (its own ptxas and flags): registers, stack frame bytes, the local-memory
stores and loads in its SASS (spills: ``STL``, ``LDL``), the shared memory Triton
allocates, and the programs per SM that each limit allows on sm_90 (65,536 registers,
allocated per warp in units of 256; 228 KiB of shared memory, 1 KiB of it reserved per
program; 64 warps). The counts are those of the Triton that compiled (its version is in
the provenance); another version's ptxas may allocate differently.

    make test-triton-floor   # once: .venv-triton3.6.0, Triton 3.6 as on the lent H200
    .venv-triton3.6.0/bin/python benchmarks/fp8_resources_sm90.py --out data/results/fp8_resources_sm90.json
"""

from __future__ import annotations

import argparse
import dataclasses

from ptx_barriers import cubin_usage, write_sm90_result
from triton.backends.compiler import GPUTarget

from fa_lab.kernels._triton.fast import Config
from fa_lab.kernels.swp_fp8 import fast as fast_fp8

SM90 = dict(registers=65536, register_unit=256, shared_bytes=228 * 1024,
            shared_reserved_per_program=1024, warps=64)
CAPS = (None, 232, 200, 168)


def programs_per_sm(registers: int, shared: int, warps: int) -> dict:
    """Programs of ``warps`` warps that fit on one sm_90 SM, by each limit."""
    unit = SM90["register_unit"]
    per_warp = -(-registers * 32 // unit) * unit
    return {"by_registers": SM90["registers"] // (per_warp * warps),
            "by_shared_memory": SM90["shared_bytes"] // (shared + SM90["shared_reserved_per_program"]),
            "by_warps": SM90["warps"] // warps}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="JSON to write (atomically)")
    args = ap.parse_args()
    target = GPUTarget("cuda", 90, 32)
    rows = []
    for base in fast_fp8.CANDIDATE_CONFIGS:
        for lazy, row_sum in ((False, False), (True, True), (True, False)):
            for cap in CAPS:
                config = Config(base.block_m, base.block_n, base.num_warps, base.num_stages,
                                base.use_tma, row_sum, cap)
                kernel = fast_fp8.compile_only(target, config, lazy=lazy, causal=True)
                if cap and f".maxnreg {cap}" not in kernel.asm["ptx"]:  # ptxas reads it there
                    raise RuntimeError(f"the PTX carries no .maxnreg {cap}")
                usage = cubin_usage(kernel.asm["cubin"])
                row = {"tiling": dataclasses.replace(config, maxnreg=None).describe(lazy), "policy": "lazy" if lazy else "eager",
                       "maxnreg": cap, "shared_bytes": kernel.metadata.shared, **usage}
                row["programs_per_sm"] = programs_per_sm(usage["registers"], kernel.metadata.shared,
                                                         config.num_warps)
                print(row, flush=True)
                rows.append(row)
    if args.out:
        write_sm90_result(args.out, "fp8_resources_sm90.py", rows,
                          what=__doc__.split("\n\n")[1].replace("\n", " "), sm90_limits=SM90)


if __name__ == "__main__":
    main()
