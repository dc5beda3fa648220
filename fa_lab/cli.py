"""``fa-lab``: the lab's command line.

    fa-lab table [--which bf16|fp8|both] [--full] [--device cuda] [--B .. --S .. --H ..]
    fa-lab bench [--suite dense,splitk,varlen] [--shapes 0,1,..] [--impls a,b,..] [--sweep]
                 [--out-dir DIR] [--no-save]
    fa-lab lab                       JupyterLab on notebooks/

Boolean flags take an optional value: ``--causal`` alone means true, and ``--causal false``
(true/false, 1/0, yes/no, on/off, any case) sets it. A bad value exits with status 2 and a
one-line message naming the flag; so does a value the library refuses
(``fa-lab: error: ...``). Results go to data/results/<name>.json, or to
``$FA_LAB_RESULTS_DIR``; ``--name`` is a plain file name.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import pandas as pd

from fa_lab.studies import experiments as ex
from fa_lab import results
from fa_lab.checks import parse_bool

PROG = "fa-lab"


# ---- argument types: one parser per kind of value, shared by every subcommand --------------
# (booleans: fa_lab.checks.parse_bool, which fa-lab sweep shares)

def _int_at_least(lo: int, what: str, hi: int | None = None):
    def parse(text) -> int:
        try:
            x = int(str(text).strip(), 10)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if x < lo or (hi is not None and x > hi):
            raise argparse.ArgumentTypeError(f"expected {what}, got {x}")
        return x
    parse.__name__ = what
    return parse


positive_int = _int_at_least(1, "a positive integer")
nonnegative_int = _int_at_least(0, "an integer >= 0")
#: torch.Generator.manual_seed takes 0 .. 2**63 - 1 here without wrapping
seed_int = _int_at_least(0, "an integer in 0 .. 2**63 - 1", hi=2**63 - 1)


def result_name(text) -> str:
    """A result file name, confined to the results directory (``fa_lab.results.check_name``)."""
    try:
        results.check_name(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def device_arg(text) -> str:
    """``cpu`` or ``cuda[:N]``, and a CUDA device must exist on this machine."""
    import torch

    try:
        dev = torch.device(text)
    except (RuntimeError, ValueError, TypeError):
        raise argparse.ArgumentTypeError(f"expected cpu or cuda[:N], got {text!r}") from None
    if dev.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"expected cpu or cuda[:N], got {text!r}")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise argparse.ArgumentTypeError(
                f"{text!r} asks for a CUDA GPU and none is available on this machine "
                f"(torch.cuda.is_available() is False); use --device cpu")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise argparse.ArgumentTypeError(
                f"{text!r}: this machine has {torch.cuda.device_count()} CUDA device(s), "
                f"cuda:0..cuda:{torch.cuda.device_count() - 1}")
    return text


def add_bool_flag(parser, flag: str, *, default=False, help=None, dest=None):
    """A boolean flag: ``--flag`` alone is true, ``--flag VALUE`` goes through parse_bool."""
    kw = {"dest": dest} if dest else {}
    parser.add_argument(flag, nargs="?", const=True, default=default, type=parse_bool,
                        metavar="BOOL", help=help, **kw)


class _Parser(argparse.ArgumentParser):
    """argparse, with errors on one line: ``fa-lab table: error: argument --S: ...``."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


class UsageError(Exception):
    """A bad flag value found after parsing; main prints it as the subcommand's error."""


class CliError(SystemExit):
    """Exit status 2 once the one-line message is on stderr, as argparse's errors do;
    ``str()`` is that message (so a caller of ``main`` can read it)."""

    def __init__(self, message: str):
        super().__init__(2)
        self.message = message

    def __str__(self):
        return self.message


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
#: scales and policies/variants), measured with the default K scales on 2 otherwise idle CPU
#: cores, torch with 2 threads: bf16 8.9e-9 (19 s at the CPU size S=2048, 4.8 s at S=1024),
#: fp8 3.1e-9 (3.3 s at S=2048). The cost grows as S^2 (fp8 at S=4096 kept the per-unit rate
#: of S=2048). On cores shared with other work (load 5-8) the same runs took 1.5-3x longer,
#: so the warning gives the range; lower with more cores, higher with the Triton interpreter.
CPU_SECONDS_PER_UNIT = {"bf16": 9e-9, "fp8": 3e-9}
#: a CPU run estimated above this many seconds warns even without --full
CPU_WARN_S = 600
#: the upper end of the warning's range: shared cores measured up to ~3x slower
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


def _table_args(t):
    t.add_argument("--which", choices=["bf16", "fp8", "both"], default="both")
    add_bool_flag(t, "--full", help="the seed's sizes (a GPU-size run: use --device cuda)")
    t.add_argument("--B", type=positive_int, help="batch (default: the CPU size, or the seed's with --full)")
    t.add_argument("--S", type=positive_int, help="sequence length")
    t.add_argument("--H", type=positive_int, help="heads")
    add_bool_flag(t, "--causal", help="causal mask (the seed's tables are not)")
    t.add_argument("--seed", type=seed_int, default=0, help="input seed, 0 .. 2**63 - 1")
    t.add_argument("--device", type=device_arg, default="cpu", help="cpu (default) or cuda[:N]")
    t.add_argument("--backend", default="auto", choices=_backends(),
                   help="flash_attn_func's backend (default auto)")
    add_bool_flag(t, "--fp8-saturate", dest="fp8_saturate", default=None,
                  help="fp8 P cast saturates at 448 (true, the default) or gives NaN (false)")
    t.add_argument("--name", type=result_name,
                   help="result file name: data/results/<name>.json (with --which both, "
                        "<name>_bf16 and <name>_fp8)")
    add_bool_flag(t, "--no-save", dest="no_save", help="print only, write no result file")
    t.add_argument("--policies", type=policy_list,
                   help="comma-separated registered policies for the bf16 table (default "
                        "lazy_unfixed,lazy,eager) and, each with its own settings, the fp8 table")
    t.add_argument("--import", dest="imports", action="append", default=[], metavar="FILE",
                   help="a Python file (or module) to import first, e.g. one that calls "
                        "fa_lab.policies.register(...); repeatable")
    t.add_argument("--upstream", type=upstream_name, default=None,
                   help="FlyDSL version whose defaults bare calls take "
                        "(fa_lab.upstream.VERSIONS; default: fixed)")


def policy_list(text) -> tuple[str, ...]:
    """Comma-separated policy names; checked against the registry after ``--import``."""
    names = tuple(n.strip() for n in str(text).split(","))
    if not all(names):
        raise argparse.ArgumentTypeError(f"empty policy name in {text!r}")
    return names


def upstream_name(text) -> str:
    from fa_lab import upstream
    if text not in upstream.VERSIONS:
        raise argparse.ArgumentTypeError(f"{text!r} is not a FlyDSL version; choose one of "
                                         f"{', '.join(upstream.VERSIONS)}")
    return text


def import_policies(paths) -> None:
    """Import each file or module, so that the policies it registers exist."""
    import importlib
    import importlib.util
    from pathlib import Path

    for p in paths:
        path = Path(p)
        try:
            if path.suffix == ".py" or path.exists():
                if not path.is_file():
                    raise UsageError(f"--import {p!r}: no such file")
                spec = importlib.util.spec_from_file_location(f"fa_lab_user_{path.stem}", path)
                module = importlib.util.module_from_spec(spec)
                spec.loader.exec_module(module)
            else:
                importlib.import_module(p)
        except UsageError:
            raise
        except Exception as e:  # the user's code: say where it failed, in one line
            raise UsageError(f"--import {p!r} failed: {type(e).__name__}: {e}") from None


#: backends that run on GPU tensors only
GPU_BACKENDS = ("triton", "flydsl")


def _backends():
    from fa_lab import api
    return getattr(api, "BACKENDS", None)


def _table(args) -> int:
    import torch

    from fa_lab import policies, upstream

    import_policies(args.imports)
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
        if not args.no_save:
            if args.name is None:
                name = f"table_{kind}_{args.device.split(':')[0]}_S{sizes['S']}"
            else:  # both tables under one --name would overwrite each other
                name = args.name if len(plan) == 1 else f"{results.check_name(args.name)}_{kind}"
            path = ex.save_result(name, table, device=args.device,
                                  params={**sizes, "causal": args.causal, "seed": args.seed,
                                          "backend": args.backend, "upstream": version.name,
                                          **({"policies": list(args.policies)}
                                             if args.policies is not None else {}),
                                          **({"fp8_saturate": args.fp8_saturate} if kind == "fp8" else {})})
            print(f"saved {path}")
    return 0


# ---- fa-lab bench ---------------------------------------------------------------------------

def _bench_args(b):
    b.add_argument("--suite", default="dense",
                   help="comma-separated suites of fa_lab.studies.bench.SUITES: dense (default), splitk, varlen")
    b.add_argument("--shapes", help="comma-separated indices into the suites' shapes (default: all)")
    b.add_argument("--impls", help="comma-separated implementations (default: each suite's own; "
                   "given ones run where they apply)")
    add_bool_flag(b, "--sweep",
                  help="time each pinned launch config of the fast kernels at the first shape instead")
    b.add_argument("--rounds", type=positive_int, default=5,
                   help="interleaved rounds per shape: each times every implementation once, in an "
                   "order rotated from round to round (default 5; fewer make the min-max spread "
                   "a weak guide)")
    b.add_argument("--min-calls", dest="min_calls", type=positive_int, default=10,
                   help="calls per implementation per round, at least (default 10)")
    b.add_argument("--rep", type=positive_int, default=100,
                   help="ms of calls per implementation per round, at least (default 100; "
                   "with --sweep: do_bench's repetition time)")
    b.add_argument("--warmup", type=nonnegative_int, default=25,
                   help="ms of untimed calls per implementation before the first round (default 25; "
                   "with --sweep: do_bench's warm-up)")
    b.add_argument("--device", type=device_arg, default=None,
                   help="cuda (default), cuda:N, or cpu (perf_counter timing, for trying the harness "
                   "on small shapes: the fast kernels need a GPU)")
    b.add_argument("--seed", type=seed_int, default=0, help="input seed, 0 .. 2**63 - 1")
    b.add_argument("--name", type=result_name,
                   help="result file name (default bench_h200, or bench_sweep)")
    b.add_argument("--out-dir", dest="out_dir", help="directory for the JSON (default data/results)")
    add_bool_flag(b, "--no-save", dest="no_save", help="print only, write no result file")


def _bench(args) -> int:
    import time

    import torch

    from fa_lab.studies import bench

    suites = tuple(x.strip() for x in args.suite.split(",") if x.strip())
    unknown = [s for s in suites if s not in bench.SUITES]
    if not suites or unknown:
        raise UsageError(f"--suite: unknown suites {unknown or [args.suite]}; "
                         f"choose from {', '.join(bench.SUITES)}")
    impls = None
    if args.impls is not None:
        impls = tuple(x.strip() for x in args.impls.split(",") if x.strip())
        unknown = [i for i in impls if i not in bench.ALL_IMPLS]
        if not impls or unknown:
            raise UsageError(f"--impls: unknown implementations "
                             f"{unknown or [args.impls]}; choose from {', '.join(bench.ALL_IMPLS)}")
    jobs = bench.suite_jobs(suites, impls)
    if args.shapes is not None:
        try:
            idx = [int(i) for i in args.shapes.split(",")]
            if not idx or any(not 0 <= i < len(jobs) for i in idx):
                raise IndexError
        except (ValueError, IndexError):
            raise UsageError(f"--shapes takes indices 0..{len(jobs) - 1} into the "
                             f"shapes of --suite {','.join(suites)}, got {args.shapes!r}") from None
        jobs = [jobs[i] for i in idx]
    device = args.device or "cuda"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise UsageError("the benchmark times GPU kernels: it needs a CUDA GPU and none is "
                         "available on this machine (torch.cuda.is_available() is False)")
    if args.sweep and not device.startswith("cuda"):
        raise UsageError(f"--sweep times pinned GPU launch configs: it needs a CUDA device, "
                         f"got --device {device}")
    shapes = [shape for _, shape, _ in jobs]
    params = {"suites": list(suites), "shapes": [s.name for s in shapes],
              "impls": sorted({i for _, _, chosen in jobs for i in chosen},
                              key=bench.ALL_IMPLS.index),
              "warmup_ms": args.warmup, "rep_ms": args.rep, "seed": args.seed}
    if args.sweep:
        table = bench.config_sweep(shapes[0], warmup=args.warmup, rep=args.rep, seed=args.seed)
        print(table.to_string(index=False))
        name = args.name if args.name is not None else "bench_sweep"
        if not args.no_save:
            path = bench.save(table, name, directory=args.out_dir, params=params)
            print(f"saved {path}")
        return 0
    name = args.name if args.name is not None else "bench_h200"
    params.update(rounds=args.rounds, min_calls=args.min_calls, device=device)
    if args.rounds < 5:
        print(f"note: {args.rounds} round(s), as asked: with fewer than 5 the min-max spread is "
              f"a weak guide to the noise", file=sys.stderr, flush=True)
    if device == "cpu":
        print("note: --device cpu times the harness with perf_counter; the fast kernels need a GPU "
              "and the suites' shapes are GPU-sized", file=sys.stderr, flush=True)
    tuning = []
    started = time.perf_counter()

    def save(table):  # after every shape: a cut-short run keeps what it measured
        if not args.no_save:
            done = list(dict.fromkeys(table["shape"]))
            return bench.save(table, name, directory=args.out_dir, device=device, tuning=tuning,
                              params={**params, "completed_shapes": done,
                                      "seconds": round(time.perf_counter() - started, 1)})
    table = bench.run(jobs=jobs, device=device, rounds=args.rounds, min_calls=args.min_calls,
                      warmup=args.warmup, rep=args.rep, seed=args.seed, on_shape=save,
                      tuning=tuning)
    print(bench.format_table(table))
    print(f"{len(shapes)} shape(s) in {time.perf_counter() - started:.0f} s")
    if not args.no_save:
        print(f"saved {save(table)}")
    return 0


# ---- fa-lab lab -----------------------------------------------------------------------------

def _lab(args) -> int:
    root = ["--allow-root"] if hasattr(os, "geteuid") and os.geteuid() == 0 else []
    return subprocess.call([sys.executable, "-m", "jupyter", "lab", *root, str(ex.ROOT / "notebooks")])


# ---- subcommands ----------------------------------------------------------------------------

#: name -> (help, add_arguments(subparser), run(args) -> exit status). A new subcommand is
#: one ``register`` call; it gets the shared argument types above, one-line parse errors,
#: UsageError for checks after parsing, and main's handling of library errors.
COMMANDS: dict = {}


def register(name: str, help: str, add_arguments, run) -> None:
    COMMANDS[name] = (help, add_arguments, run)


register("table", "reproduce the seed's bf16 / fp8 tables", _table_args, _table)
register("bench", "forward TFLOP/s of the fast kernels beside SDPA and flex (CUDA)",
         _bench_args, _bench)
register("lab", "JupyterLab on notebooks/", lambda p: None, _lab)


def _sweep_args(p):
    from fa_lab.studies import sweep
    sweep.add_arguments(p)


def _sweep(args) -> int:
    from fa_lab.studies import sweep
    return sweep.run_cli(args)


register("sweep", "run a grid of points on Dask (results in data/atlas/<name>/)", _sweep_args,
         _sweep)


def _attack_args(p) -> None:
    from fa_lab.studies.adversary import OPTIMIZERS, SPACES

    p.add_argument("policy_pos", nargs="?", metavar="POLICY",
                   help="the registered policy to attack (or --policy)")
    p.add_argument("--policy", dest="policy_opt", help="the policy (instead of POLICY)")
    p.add_argument("--budget", type=float, default=60.0,
                   help="seconds of search (shrinking a find takes up to as much again)")
    p.add_argument("--space", choices=tuple(SPACES), default="scores",
                   help="the search space: scores (|V| <= 4, default) or values (V up to 2^126)")
    p.add_argument("--mods", default=None, metavar="LIST",
                   help="score modifiers the search also draws, comma-separated: bias (key "
                        "padding, left padding, block masks with -inf entries, dense), alibi, "
                        "sink (default: none)")
    p.add_argument("--seed", type=nonnegative_int, default=0, help="search seed")
    p.add_argument("--threshold", type=float, default=None,
                   help="the policy's threshold (default: the policy's own)")
    p.add_argument("--tolerance", type=float, default=None,
                   help="also count a finite row whose max error exceeds TOL * max|ref| (off)")
    p.add_argument("--max-evals", dest="max_evals", type=positive_int, default=None,
                   help="stop after this many model runs")
    p.add_argument("--baseline", default=None, metavar="POLICY",
                   help="count only failures where this policy stays finite (e.g. eager)")
    p.add_argument("--optimizer", choices=OPTIMIZERS, default="cma",
                   help="what climbs after the starting points: cma (mixed-integer CMA-ES with "
                        "restarts, the default) or es (the (1 + lambda) evolution strategy)")
    add_bool_flag(p, "--random-starts", dest="random_starts",
                  help="skip the structured starting points (the optimiser alone)")
    p.add_argument("--import", dest="imports", action="append", default=[], metavar="FILE",
                   help="a Python file (or module) that registers a user policy; repeatable")
    add_bool_flag(p, "--json", help="print one JSON record instead of the summary")
    add_bool_flag(p, "--no-save", dest="no_save",
                  help="write no data/results/attack_<policy>.json")
    p.add_argument("--regression", metavar="PATH",
                   help="also write the shrunk input (or the near miss) as a .npz regression file")


def _attack(args) -> int:
    import json
    import math

    from fa_lab import policies
    from fa_lab.studies.adversary import save_regression, search, summary

    import_policies(args.imports)
    name = args.policy_opt or args.policy_pos
    if name is None:
        raise UsageError("name the policy to attack: fa-lab attack POLICY (or --policy NAME)")
    if args.policy_opt and args.policy_pos and args.policy_opt != args.policy_pos:
        raise UsageError(f"two policies given: {args.policy_pos!r} and --policy {args.policy_opt!r}")
    if name not in policies.names():
        raise UsageError(f"{name!r} is not a registered policy; registered: "
                         f"{', '.join(policies.names())} (register yours in a file given to --import)")
    if not (args.budget > 0 and math.isfinite(args.budget)):
        raise UsageError(f"--budget must be a positive number of seconds, got {args.budget}")
    if args.baseline is not None and args.baseline not in policies.names():
        raise UsageError(f"--baseline {args.baseline!r} is not a registered policy")
    res = search(name, space=args.space, mods=args.mods, budget_s=args.budget, seed=args.seed,
                 threshold=args.threshold, tolerance=args.tolerance, max_evals=args.max_evals,
                 baseline=args.baseline, structured=not args.random_starts,
                 optimizer=args.optimizer)
    rec = res.to_dict()
    if args.regression:
        rec["regression"] = str(save_regression(res, args.regression))
    if not args.no_save:
        suffix = ("" if args.space == "scores" else f"_{args.space}") + \
            ("_mods" if res.mods else "") + ("_random_starts" if args.random_starts else "") + \
            ("" if args.optimizer == "cma" else f"_{args.optimizer}")
        rec["saved"] = str(results.save(f"attack_{name}{suffix}", rec))
    if args.json:
        slim = {k: rec[k] for k in ("policy", "found", "size", "repro", "budget_s", "evals",
                                    "time_to_first_s", "bad_rows", "space", "baseline", "mods",
                                    "input_mods", "optimizer")}
        slim["space"] = rec["space"]["name"]
        print(json.dumps(slim, default=str))
    else:
        print(summary(res))
    return 0


register("attack", "search for inputs on which a policy's output goes non-finite, and shrink "
         "them (fa_lab.studies.adversary)", _attack_args, _attack)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True, parser_class=_Parser)
    for name, (help, add_arguments, run) in COMMANDS.items():
        sp = sub.add_parser(name, help=help, description=help)
        add_arguments(sp)
        sp.set_defaults(_run=run)
    return p


def _backend_unavailable():
    """flydsl's "cannot run here" error (a RuntimeError): a refused --backend, not a bug."""
    try:
        from fa_lab.flydsl import BackendUnavailable
    except ImportError:  # pragma: no cover
        return ValueError
    return BackendUnavailable


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


def _fail(message: str):
    print(message, file=sys.stderr, flush=True)
    raise CliError(message) from None


def main(argv=None) -> int:
    """Run the CLI; returns the exit status. A bad value raises ``SystemExit(2)`` after a
    one-line message on stderr: argparse's for a value it parses, ``fa-lab <cmd>: error:``
    for one checked after parsing, ``fa-lab: error:`` for one the library refuses."""
    args = build_parser().parse_args(argv)
    try:
        return args._run(args)
    except UsageError as e:
        _fail(f"{PROG} {args.cmd}: error: {_one_line(e)}")
    except (ValueError, TypeError, NotImplementedError, _backend_unavailable()) as e:
        # a value the library refuses: its message names the argument; no traceback
        # (FA_LAB_TRACEBACK=1 shows it, for debugging the library itself)
        if os.environ.get("FA_LAB_TRACEBACK"):
            raise
        _fail(f"{PROG}: error: {_one_line(e)}")


if __name__ == "__main__":
    sys.exit(main())
