"""Where the faithful bf16 port, run on Triton's interpreter, differs from the model it ports.

The interpreter sums every dot product exactly, as the model does, so the two should differ
only where the order of other fp32 operations does. On the seed's recipe (B1 S512 H2,
K x8, lazy) for each of three seeds, bf16 and f16, head dims 64 and 128, non-causal, this
records the NaN/inf masks of both (equal or not), how many output elements differ, and the
largest difference in units of the output dtype's last place (ulp at the model's value).

    python benchmarks/interpret_vs_model.py --out data/results/interpret_vs_model_cpu.json
"""

from __future__ import annotations

import argparse
import math

import torch
from tqdm.auto import tqdm

import fa_lab
from fa_lab.studies.experiments import atomic_write_json, bf16_inputs, provenance

SEEDS, DTYPES, HEAD_DIMS = (0, 1, 2), (torch.bfloat16, torch.float16), (64, 128)
#: stored mantissa bits of each output dtype
MANTISSA = {torch.bfloat16: 7, torch.float16: 10}
B, S, H, K_SCALE = 1, 512, 2, 8.0


def ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """|a - b| in last places of ``b``'s dtype at ``b`` (both finite)."""
    b32 = b.float().abs().clamp_min(torch.finfo(b.dtype).tiny)
    return (a.float() - b.float()).abs() / torch.exp2(torch.floor(torch.log2(b32)) - MANTISSA[b.dtype])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(1)
    rows = []
    cases = [(s, dt, d) for dt in DTYPES for d in HEAD_DIMS for s in SEEDS]
    for seed, dtype, D in tqdm(cases, desc="interpret vs model"):
        q, k, v = bf16_inputs(B, S, H, D, K_SCALE, seed=seed, dtype=dtype)
        kw = dict(causal=False, rescale="lazy", return_lse=True)
        model, model_lse = fa_lab.flash_attn_func(q, k, v, backend="emulator", **kw)
        port, port_lse = fa_lab.flash_attn_func(q, k, v, backend="interpret", **kw)
        finite = torch.isfinite(model) & torch.isfinite(port)
        differ = finite & (model != port)
        rows.append({
            "seed": seed, "dtype": str(dtype).removeprefix("torch."), "D": D,
            "elements": model.numel(),
            "masks_equal": bool(torch.equal(torch.isfinite(model), torch.isfinite(port))
                                and torch.equal(torch.isnan(model), torch.isnan(port))),
            "elements_differ": int(differ.sum()),
            "max_ulps": float(ulps(port[differ], model[differ]).max()) if differ.any() else 0.0,
            "lse_max_abs_diff": float((port_lse - model_lse).abs().nan_to_num(0.0).max()),
        })
    atomic_write_json(args.out, {
        "name": "interpret_vs_model_cpu",
        "what": __doc__.split("\n\n")[1].replace("\n", " "),
        "shape": {"B": B, "S": S, "H": H, "k_scale": K_SCALE, "causal": False, "rescale": "lazy"},
        "provenance": provenance("cpu"),
        "rows": rows})
    for r in rows:
        print(r)
    assert all(math.isfinite(r["max_ulps"]) for r in rows)


if __name__ == "__main__":
    main()
