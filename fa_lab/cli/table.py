"""``fa-lab table``: the bug report's bf16 and fp8 tables, reproduced at the CPU's sizes or
(``--full``, on a GPU) the report's."""

from __future__ import annotations

import os
import re
import sys

import pandas as pd

from fa_lab import results
from fa_lab.studies import experiments as ex

from .args import (UsageError, add_bool_flag, add_import_flag, add_out_dir_flag, device_arg,
                   import_policies, policy_list, positive_int, result_name, seed_int,
                   upstream_name)

PROG = "fa-lab"
HELP = "reproduce the bug report's bf16 / fp8 tables"


def _fmt_rel(x):
    return "—" if x is None or pd.isna(x) else f"{x:.3e}"


def _fmt_pct(x):
    return "—" if x is None or pd.isna(x) else f"{x:.2f}%"


def format_policies(table: pd.DataFrame) -> str:
    """Any bf16 table: per K scale, each policy's rel-L2 and NaN % of output elements."""
    pols = list(dict.fromkeys(table.policy))
    lines = [f"{'K':>4} | " + " | ".join(f"{p[:22]:>22}" for p in pols),
             f"{'':>4} | " + " | ".join(f"{'rel-L2':>11} {'NaN':>10}" for _ in pols)]
    for K, g in table.groupby("k_scale", sort=True):
        by = g.set_index("policy")
        lines.append(f"{int(K):>4} | " + " | ".join(
            f"{_fmt_rel(by.rel_l2[p]):>11} {_fmt_pct(100 * by.nan_frac[p]):>10}" for p in pols))
    return "\n".join(lines)


def format_bf16(table: pd.DataFrame) -> str:
    """The bf16 table beside the seed's figures, as text (any other policy set: per policy)."""
    if set(table.policy) != set(ex.BF16_POLICIES):
        return format_policies(table)
    wide = ex.bf16_versus_seed(table)
    lines = [f"{'K':>4} | {'unfixed rel-L2':>14} {'NaN':>8} {'(seed)':>8} | "
             f"{'lazy rel-L2':>11} {'(seed)':>9} | {'eager rel-L2':>12} {'(seed)':>9}"]
    for _, r in wide.iterrows():
        lines.append(
            f"{int(r.k_scale):>4} | {_fmt_rel(r.get('lazy_unfixed_rel_l2')):>14} "
            f"{_fmt_pct(r.get('lazy_unfixed_nan_pct')):>8} {_fmt_pct(r.get('seed_unfixed_nan_pct')):>8} | "
            f"{_fmt_rel(r.get('lazy_rel_l2')):>11} {_fmt_rel(r.get('seed_lazy_rel_l2')):>9} | "
            f"{_fmt_rel(r.get('eager_rel_l2')):>12} {_fmt_rel(r.get('seed_eager_rel_l2')):>9}")
    unf = table[(table.policy == "lazy_unfixed") & (table.nan_rows > 0)]
    for _, r in unf.iterrows():
        lines.append(f"K x{int(r.k_scale)}: {r.nan_rows} NaN rows, LSE +inf on "
                     f"{r.nan_rows_lse_posinf}, NaN on {r.nan_rows_lse_nan}, finite on "
                     f"{r.nan_rows_lse_finite}; good rows' LSE in "
                     f"[{r.good_lse_min:.1f}, {r.good_lse_max:.1f}]")
    return "\n".join(lines)


def format_fp8(table: pd.DataFrame) -> str:
    wide = ex.fp8_versus_seed(table)
    lines = [f"{'k':>6} {'variant':>10} | {'mean|o-1|':>9} {'(seed)':>7} | {'NaN':>12} {'(seed)':>10}"]
    for _, r in wide.iterrows():
        sm = "" if r.seed_mean_abs_dev is None or pd.isna(r.seed_mean_abs_dev) else f"{r.seed_mean_abs_dev:.4f}"
        sn = "" if r.seed_nan is None or pd.isna(r.seed_nan) else f"{r.seed_nan:,.0f}"
        mad = "nan" if pd.isna(r.mean_abs_dev) else f"{r.mean_abs_dev:.4f}"
        lines.append(f"{int(r.k_scale):>6} {r.variant:>10} | {mad:>9} {sm:>7} | {int(r.nan):>12,} {sn:>10}")
    return "\n".join(lines)


# ---- fa-lab table ---------------------------------------------------------------------------

#: Seconds per B*H*S^2*D "unit" for one whole table on a CPU with the emulator (all its K
#: scales and policies/variants), on 2 idle cores (the rates' measurements:
#: docs/performance.md). The cost grows as S^2; on cores shared with other work it grows by
#: up to CPU_BUSY_FACTOR, so the warning gives the range.
CPU_SECONDS_PER_UNIT = {"bf16": 9e-9, "fp8": 3e-9}
#: a CPU run estimated above this many seconds warns even without --full
CPU_WARN_S = 600
#: the upper end of the warning's range, for cores shared with other work
CPU_BUSY_FACTOR = 3


def table_units(kind: str, sizes: dict) -> int:
    return sizes["B"] * sizes["H"] * sizes["S"] ** 2 * sizes.get("D", 128)


def cpu_estimate_s(plan) -> float:
    """Rough CPU seconds for the tables in ``plan`` ([(kind, sizes)]), see CPU_SECONDS_PER_UNIT."""
    return sum(CPU_SECONDS_PER_UNIT[kind] * table_units(kind, sizes) for kind, sizes in plan)


def _duration(s: float) -> str:
    if s < 90:
        return f"{max(1, round(s))} seconds"
    if s < 90 * 60:
        return f"{round(s / 60)} minutes"
    return f"{s / 3600:.1f} hours"


def _int_list(text: str) -> tuple:
    import argparse

    try:
        xs = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints, got {text!r}") from None
    if not xs:
        raise argparse.ArgumentTypeError("expected at least one int")
    return xs


def _float_list(text: str) -> tuple:
    import argparse

    try:
        xs = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
    if not xs:
        raise argparse.ArgumentTypeError("expected at least one number")
    return xs


def _word_list(text: str) -> tuple:
    return tuple(x.strip() for x in text.split(",") if x.strip())


def add_arguments(t):
    t.add_argument("--which", choices=["bf16", "fp8", "both", "decode"], default="both",
                   help="the bug report's tables (bf16, fp8, both) or the paged decode's "
                        "(decode: over the axes below)")
    add_bool_flag(t, "--full", help="the seed's sizes (a GPU-size run: use --device cuda)")
    t.add_argument("--B", type=positive_int, help="batch (default: the CPU size, or the seed's with --full)")
    t.add_argument("--S", type=positive_int, help="sequence length")
    t.add_argument("--H", type=positive_int,
                   help="heads (--which decode: query heads per kv head, default 2)")
    add_bool_flag(t, "--causal", help="causal mask (the seed's tables are not)")
    t.add_argument("--seed", type=seed_int, default=0, help="input seed, 0 .. 2**63 - 1")
    t.add_argument("--device", type=device_arg, default="cpu", help="cpu (default) or cuda[:N]")
    t.add_argument("--backend", default="auto", choices=_backends(),
                   help="flash_attn_func's backend (default auto)")
    add_bool_flag(t, "--fp8-saturate", dest="fp8_saturate", default=None,
                  help="fp8 P cast saturates at 448 (true, the default) or gives NaN (false)")
    t.add_argument("--name", type=result_name,
                   help="result file name: <out-dir>/<name>.json (with --which both, "
                        "<name>_bf16 and <name>_fp8)")
    add_out_dir_flag(t)
    add_bool_flag(t, "--no-save", dest="no_save", help="print only, write no result file")
    t.add_argument("--policies", type=policy_list,
                   help="comma-separated registered policies for the bf16 table (default "
                        "lazy_unfixed,lazy,eager) and, each with its own settings, the fp8 table")
    add_import_flag(t)
    t.add_argument("--upstream", type=upstream_name, default=None,
                   help="FlyDSL version whose defaults bare calls take "
                        "(fa_lab.upstream.VERSIONS; default: fixed)")
    g = t.add_argument_group("--which decode: the paged decode's axes (comma-separated)")
    g.add_argument("--contexts", type=_int_list, default=None, help="context lengths (257,700)")
    g.add_argument("--query-lens", dest="query_lens", type=_int_list, default=None,
                   help="query lengths, MTP 1..16 (1,4)")
    g.add_argument("--partitions", type=_int_list, default=None, help="partition counts (1,2)")
    g.add_argument("--page-sizes", dest="page_sizes", type=_int_list, default=None,
                   help="page sizes: 16 or 64 for window 0, 1024 for a window (16)")
    g.add_argument("--windows", type=_int_list, default=None,
                   help="sliding windows in tokens; 0: none, pa_decode_tile; W > 0: "
                        "pa_decode_swa over 1024-token pages (0)")
    g.add_argument("--scales", type=_word_list, default=None,
                   help="per_tensor, per_token (both)")
    g.add_argument("--decode-versions", dest="decode_versions", type=_word_list, default=None,
                   help="pa_decode versions (fa_lab.upstream.DECODE_VERSIONS; both)")
    g.add_argument("--spreads", type=_float_list, default=None,
                   help="score spreads: K times each, the logits' standard deviation (1)")
    g.add_argument("--head-dim", dest="head_dim", type=positive_int, default=None,
                   help="head dim: 64, 128 or 256 (64; 64 or 128 with a window)")
    g.add_argument("--kernels", type=_word_list, default=None,
                   help="pa_decode (the paged decode), mla_decode (the MLA decode: contexts, "
                        "partitions as KV splits, spreads, --p-headrooms; the paged decode's "
                        "other axes do not apply to it) (both)")
    g.add_argument("--p-headrooms", dest="p_headrooms", type=_float_list, default=None,
                   help="mla_decode: lifts of P by 2^H before its e4m3 cast, 0 = upstream's "
                        "(0,8)")




#: backends that run on GPU tensors only
GPU_BACKENDS = ("triton", "flydsl")


def _backends():
    from fa_lab import api
    return getattr(api, "BACKENDS", None)


def run(args) -> int:
    import torch

    from fa_lab import policies, upstream

    import_policies(args.imports)
    if args.which == "decode":
        return _run_decode(args)
    decode_only = [f for f in ("contexts", "query_lens", "partitions", "page_sizes", "scales",
                               "windows", "decode_versions", "spreads", "head_dim", "kernels",
                               "p_headrooms")
                   if getattr(args, f) is not None]
    if decode_only:
        raise UsageError(f"--{decode_only[0].replace('_', '-')} is an axis of --which decode")
    if args.policies is not None:
        unknown = [n for n in args.policies if n not in policies.names()]
        if unknown:
            raise UsageError(f"--policies: {unknown[0]!r} is not a registered policy; registered: "
                             f"{', '.join(policies.names())} (register yours in a file given to "
                             "--import)")
    version = upstream.get(args.upstream)
    print(f"upstream: {version.name} ({version.description}); bare calls take its defaults")

    if args.backend in GPU_BACKENDS and torch.device(args.device).type != "cuda":
        raise UsageError(f"--backend {args.backend!r} runs on a GPU (--device cuda); "
                         f"on {args.device!r} use auto, emulator or interpret")
    which = ["bf16", "fp8"] if args.which == "both" else [args.which]
    plan = []
    for kind in which:
        sizes = dict(ex.SEED_SIZES[kind] if args.full else ex.CPU_SIZES[kind])
        for key in ("B", "S", "H"):
            if getattr(args, key) is not None:
                sizes[key] = getattr(args, key)
        plan.append((kind, sizes))
    saves = {}
    if not args.no_save:  # the files, checked before any table runs
        results.check_folder(args.out_dir)
        for kind, sizes in plan:
            name, params = result_name_and_params(args, kind, sizes, len(plan), version.name)
            results.check_same_run(name, params, root=args.out_dir)
            saves[kind] = name, params
    if torch.device(args.device).type == "cpu":
        est = cpu_estimate_s(plan)
        if args.full or est > CPU_WARN_S:
            shown = "; ".join(f"{k} " + " ".join(f"{a}={b}" for a, b in sz.items())
                              for k, sz in plan)
            rates = ", ".join(f"{k} {CPU_SECONDS_PER_UNIT[k]:.0e} s" for k, _ in plan)
            slower = ("; the Triton interpreter is slower still" if args.backend == "interpret"
                      else "")
            print(f"{PROG} table: warning: a GPU-size run on the CPU "
                  f"({'--full: ' if args.full else ''}{shown}) will take roughly "
                  f"{_duration(est)} on idle cores, up to {_duration(CPU_BUSY_FACTOR * est)} on "
                  f"busy ones, with the emulator{slower} (estimated from "
                  f"B*H*S^2*D at a rate measured at small sizes on 2 CPU cores: {rates} per "
                  f"unit; this machine has {os.cpu_count()} cores). Use --device cuda on a GPU"
                  f"{', or drop --full for the CPU sizes' if args.full else ', or smaller sizes'}.",
                  file=sys.stderr, flush=True)
    for kind, sizes in plan:
        common = dict(causal=args.causal, seed=args.seed, device=args.device, backend=args.backend)
        print(f"\n== {kind} table: {sizes}, causal={args.causal}, seed={args.seed}, device={args.device}")
        if args.policies is not None:
            common["policies" if kind == "bf16" else "variants"] = (
                args.policies if kind == "bf16" else tuple((n, n, None) for n in args.policies))
        if kind == "bf16":
            with upstream.using_upstream(version.name):
                table = ex.bf16_table(**sizes, **common)
            print(format_bf16(table))
            seed = ex.SEED_SIZES["bf16"]
        else:
            with upstream.using_upstream(version.name):
                table = ex.fp8_table(**sizes, **common, saturate=args.fp8_saturate)
            print(format_fp8(table))
            seed = ex.SEED_SIZES["fp8"]
        versions = ex.seed_table(kind)["upstream"]
        print("(the seed's columns ran under: " + "; ".join(f"{k}: {v}" for k, v in versions.items())
              + ")")
        if {k: sizes[k] for k in seed} != seed:
            print("(sizes differ from the seed's: NaN onset and counts scale with S, "
                  "since a longer KV walk gives more chances to be dragged)")
        if kind in saves:
            name, params = saves[kind]
            path = ex.save_result(name, table, device=args.device, directory=args.out_dir,
                                  params=params)
            print(f"saved {path}")
    return 0


def _word(text: str) -> str:
    """``text`` as a piece of a file name (characters other than letters, digits, '.',
    '_' and '-' become '-')."""
    return re.sub(r"[^A-Za-z0-9_.-]", "-", text)


def result_name_and_params(args, kind: str, sizes: dict, tables: int, version: str):
    """A table's result name and the params saved with it. The default name carries every
    option that changes the table away from its default (sizes, --causal, --seed,
    --policies, --backend, --upstream, --fp8-saturate), so two different runs get two
    files; ``results.check_same_run`` refuses whatever else would overwrite another run."""
    params = {**sizes, "causal": args.causal, "seed": args.seed, "backend": args.backend,
              "upstream": version,
              **({"policies": list(args.policies)} if args.policies is not None else {}),
              **({"fp8_saturate": args.fp8_saturate} if kind == "fp8" else {})}
    if args.name is not None:  # both tables under one --name would overwrite each other
        return (args.name if tables == 1 else f"{results.check_name(args.name)}_{kind}"), params
    base = ex.CPU_SIZES[kind]
    parts = [f"table_{kind}_{args.device.split(':')[0]}", f"S{sizes['S']}"]
    parts += [f"{a}{sizes[a]}" for a in ("B", "H") if sizes[a] != base[a]]
    parts += ["causal"] if args.causal else []
    parts += [f"seed{args.seed}"] if args.seed else []
    parts += [_word("-".join(args.policies))] if args.policies is not None else []
    parts += [args.backend] if args.backend != "auto" else []
    parts += [_word(version)] if args.upstream is not None else []
    parts += ["nosat"] if kind == "fp8" and args.fp8_saturate is False else []
    return results.check_name("_".join(parts)), params




def _run_decode(args) -> int:
    """``fa-lab table --which decode``: ``fa_lab.studies.decode_table`` over the axes given,
    for the kernels given (``--kernels``: the paged decode and the MLA decode by default)."""
    from fa_lab.studies import decode_table as dt

    off = [flag for flag, val in (("--full", args.full), ("--causal", args.causal),
                                  ("--policies", args.policies), ("--upstream", args.upstream),
                                  ("--B", args.B), ("--S", args.S))
           if val not in (None, False)]
    if off or args.device != "cpu" or args.backend != "auto":
        raise UsageError(f"{', '.join(off) or '--device/--backend'} does not apply to "
                         "--which decode (the emulator on the CPU, over the decode's own axes)")
    kernels = args.kernels if args.kernels is not None else dt.KERNELS
    bad = [k for k in kernels if k not in dt.KERNELS]
    if bad or not kernels:
        raise UsageError(f"--kernels: {bad[0] if bad else ''!r} is not one of "
                         f"{', '.join(dt.KERNELS)}")
    if "pa_decode" not in kernels:
        off = [flag for flag, val in (("--query-lens", args.query_lens),
                                      ("--page-sizes", args.page_sizes),
                                      ("--scales", args.scales), ("--windows", args.windows),
                                      ("--decode-versions", args.decode_versions),
                                      ("--head-dim", args.head_dim), ("--H", args.H))
               if val is not None]
        if off:
            raise UsageError(f"{', '.join(off)} does not apply to --kernels mla_decode (one "
                             "token, one kv head of 576, pages of one token, no descales, one "
                             "version); its axes: --contexts, --partitions, --spreads, "
                             "--p-headrooms")
    if "mla_decode" not in kernels and args.p_headrooms is not None:
        raise UsageError("--p-headrooms applies to mla_decode alone; add it to --kernels")
    axes = {k: v for k, v in (("contexts", args.contexts), ("query_lengths", args.query_lens),
                              ("partitions", args.partitions), ("page_sizes", args.page_sizes),
                              ("scales", args.scales), ("windows", args.windows),
                              ("versions", args.decode_versions), ("spreads", args.spreads),
                              ("p_headrooms", args.p_headrooms))
            if v is not None}
    kw = {**axes, **({"group": args.H} if args.H is not None else {}),
          **({"head_dim": args.head_dim} if args.head_dim is not None else {}), "seed": args.seed,
          "kernels": tuple(kernels)}
    params = {k: list(v) if isinstance(v, tuple) else v for k, v in kw.items()}
    name = None
    if not args.no_save:
        results.check_folder(args.out_dir)
        name = args.name or "table_decode_cpu" + (f"_seed{args.seed}" if args.seed else "")
        results.check_same_run(name, params, root=args.out_dir)
    try:
        t = dt.table(**kw)
    except (TypeError, ValueError) as e:
        raise UsageError(str(e)) from None
    print(dt.format_table(t))
    if name is not None:
        print(f"saved {results.save(name, t, params=params, root=args.out_dir)}")
    return 0
