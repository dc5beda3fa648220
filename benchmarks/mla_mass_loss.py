"""The MLA decode kernel's mass loss from its unscaled e4m3 P cast, against fp64.

On the exact model (FlyDSL main 11c4174d, ``mla_fwd_decode_m16x8_fp8_fp8``), one split per
token, V = 1 so that the output's deficit 1 - mean(out) is the softmax mass the PV product
lost (the fp64 reference gives 1). Two input families: one dominant key plus N - 1 keys at
spread d below it (log2 units), the dominant key first or last in the sequence; and
N(0, sigma^2) logits per head (128 heads, mean over heads). Each for headroom H = 0
(upstream) and H = 8 (P lifted by 2^8 before the cast, as #1020 did for prefill), with the
closed form and the tile-aware prediction beside the model.

    python benchmarks/mla_mass_loss.py --out data/results/mla_mass_loss.json
"""

from __future__ import annotations

import argparse

import torch
from tqdm.auto import tqdm

from fa_lab.studies import mla_mass_loss as study
from fa_lab.results import atomic_write_json, provenance

SPREADS = (0.5, 2, 4, 6, 7, 8, 9, 9.5, 10 - 2 ** -7, 10, 10 + 2 ** -7, 11, 12, 14, 16, 17,
           18 - 2 ** -7, 18, 18 + 2 ** -7, 20, 24)
KEYS = (64, 1024, 8192)
HEADROOMS = (0.0, 8.0)
SIGMAS = (1.0, 2.0, 3.0, 4.0)
GAUSS_KEYS = (1024, 8192)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(1)
    canonical = []
    cases = [(n, dom, h) for n in KEYS for dom in ("first", "last") for h in HEADROOMS]
    for n, dom, h in tqdm(cases, desc="canonical"):
        canonical += study.canonical_rows(SPREADS, n, dom, h)
    gaussian = [study.gaussian_row(s, n, h) for n in GAUSS_KEYS for s in SIGMAS
                for h in tqdm(HEADROOMS, desc=f"gaussian N={n} sigma={s}")]
    cf = [r for r in canonical if r["closed_form_deficit"] is not None]
    summary = {
        "onset": {f"H={h:g}": study.onset(h) for h in HEADROOMS},
        "max_abs_model_minus_closed_form": max(abs(r["model_deficit"] - r["closed_form_deficit"])
                                               for r in cf),
        "max_abs_model_minus_predicted": max(abs(r["model_deficit"] - r["predicted_deficit"])
                                             for r in canonical + gaussian),
        "max_abs_reference_deficit": max(abs(r["reference_deficit"]) for r in canonical),
    }
    atomic_write_json(args.out, {
        "name": "mla_mass_loss",
        "what": __doc__.split("\n\n")[1].replace("\n", " "),
        "upstream": {"repo": "ROCm/FlyDSL", "commit": "11c4174d82b7491c2d08d5828a254183f2a8b959",
                     "file": "kernels/attention/mla_fwd_decode_m16x8_fp8_fp8.py",
                     "lines": "934-947 (P pack), 915-930 (exp2, l)"},
        "summary": summary,
        "provenance": provenance("cpu"),
        "canonical": canonical,
        "gaussian": gaussian})
    print(summary)
    for r in canonical:
        if r["dominant"] == "first" and r["spread"] in (9.5, 10.0, 12.0, 18.0):
            print(r)
    for r in gaussian:
        print(r)


if __name__ == "__main__":
    main()
