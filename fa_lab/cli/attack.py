"""``fa-lab attack``: search for inputs on which a policy's output goes non-finite, and
shrink them (``fa_lab.studies.adversary``). The run is saved as an attack record
(``adversary.record``: the schema of the lab's reference ``attack_<policy>.json``) in the
results folder, and its repro line runs as printed."""

from __future__ import annotations

import re

from fa_lab import results

from .args import (UsageError, add_bool_flag, add_import_flag, add_out_dir_flag, import_policies,
                   nonnegative_int, positive_int, result_name)

HELP = ("search for inputs on which a policy's output goes non-finite, and shrink them "
        "(fa_lab.studies.adversary)")


def add_arguments(p) -> None:
    from fa_lab.studies.adversary import OPTIMIZERS, SPACES

    p.add_argument("policy_pos", nargs="?", metavar="POLICY",
                   help="the registered policy to attack (or --policy)")
    p.add_argument("--policy", dest="policy_opt", help="the policy (instead of POLICY)")
    p.add_argument("--budget", type=float, default=60.0,
                   help="seconds of search (shrinking a find takes up to as much again)")
    p.add_argument("--space", choices=(*SPACES, "decode"), default=None,
                   help="the search space: scores (|V| <= 4; the default), values (V up to "
                        "2^126), zoo (KV caches, sentinels, masked rows and tiles; the "
                        "default for the failure zoo's presets) or decode (paged-decode calls; "
                        "the default, and the only space, for a decode version such as "
                        "main-11c4174d or flydsl-985c653a^ given as POLICY)")
    p.add_argument("--classes", default=None, metavar="LIST",
                   help="classes of failure to count, comma-separated: nonfinite, empty, "
                        "silent, saturation, nan_factor (default: a zoo preset's own, "
                        "nonfinite for the FlyDSL policies)")
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
    add_import_flag(p)
    add_bool_flag(p, "--json", help="print one JSON record instead of the summary")
    add_bool_flag(p, "--no-save", dest="no_save",
                  help="write no <out-dir>/attack_<policy>.json")
    p.add_argument("--name", type=result_name, default=None,
                   help="result file name: <out-dir>/<name>.json (default attack_<policy>, with "
                        "a suffix for a space, mods, random starts or optimizer other than the "
                        "default's)")
    add_out_dir_flag(p, "attack_<policy>.json")
    p.add_argument("--regression", metavar="PATH",
                   help="also write the shrunk input (or the near miss) as a .npz regression file")


#: Saved params that do not change what the attack finds (``results.check_same_run``).
VOLATILE = ("mods", "classes", "imports", "machine", "command")


def _options(args) -> dict:
    """The options that change the attack's record, as saved in its params."""
    return {"seed": args.seed, "budget_s": args.budget, "space": args.space,
            "optimizer": args.optimizer, "structured": not args.random_starts,
            "baseline": args.baseline, "threshold": args.threshold,
            "tolerance": args.tolerance, "max_evals": args.max_evals,
            "mods_asked": args.mods, "classes_asked": args.classes}


def default_name(policy: str, args) -> str:
    """attack_<policy>, with a suffix for each option away from its default: the space,
    mods, random starts, the optimizer, --threshold, --seed, --baseline, --tolerance,
    --classes, --max-evals (--budget is not: a longer search of the same attack)."""
    def word(x):
        return re.sub(r"[^A-Za-z0-9_.-]", "-", str(x))
    parts = [f"attack_{word(policy)}"]
    parts += [args.space] if args.space not in (None, "scores", "zoo") else []
    parts += ["mods"] if args.mods else []
    parts += ["random_starts"] if args.random_starts else []
    parts += [args.optimizer] if args.optimizer != "cma" else []
    parts += [f"thr{args.threshold:g}"] if args.threshold is not None else []
    parts += [f"seed{args.seed}"] if args.seed else []
    parts += [f"vs-{word(args.baseline)}"] if args.baseline is not None else []
    parts += [f"tol{args.tolerance:g}"] if args.tolerance is not None else []
    parts += [f"classes-{word(args.classes)}"] if args.classes is not None else []
    parts += [f"evals{args.max_evals}"] if args.max_evals is not None else []
    return results.check_name("_".join(parts))


def run(args) -> int:
    import json
    import math
    import time

    import torch

    from fa_lab import policies
    from fa_lab.studies.adversary import record, save_regression, search, summary

    import_policies(args.imports)
    name = args.policy_opt or args.policy_pos
    if name is None:
        raise UsageError("name the policy to attack: fa-lab attack POLICY (or --policy NAME)")
    if args.policy_opt and args.policy_pos and args.policy_opt != args.policy_pos:
        raise UsageError(f"two policies given: {args.policy_pos!r} and --policy {args.policy_opt!r}")
    from fa_lab.studies.adversary import decode as decode_space

    if decode_space.is_decode_target(name) or args.space == "decode":
        return _run_decode(args, name)
    if name not in policies.names():
        raise UsageError(f"{name!r} is not a registered policy; registered: "
                         f"{', '.join(policies.names())} (register yours in a file given to --import)")
    if not (args.budget > 0 and math.isfinite(args.budget)):
        raise UsageError(f"--budget must be a positive number of seconds, got {args.budget}")
    if args.baseline is not None and args.baseline not in policies.names():
        raise UsageError(f"--baseline {args.baseline!r} is not a registered policy")
    saved_as = None
    if not args.no_save:  # the file, checked before the search
        results.check_folder(args.out_dir)
        saved_as = args.name or default_name(name, args)
        results.check_same_run(saved_as, _options(args), root=args.out_dir, ignore=VOLATILE)
    started = time.perf_counter()
    res = search(name, space=args.space, mods=args.mods, budget_s=args.budget, seed=args.seed,
                 threshold=args.threshold, tolerance=args.tolerance, max_evals=args.max_evals,
                 baseline=args.baseline, structured=not args.random_starts,
                 optimizer=args.optimizer, classes=args.classes)
    res.imports = tuple(args.imports)  # the repro registers the user's policy first
    wall = time.perf_counter() - started
    params = {**_options(args), "mods": res.mods, "classes": list(res.classes),
              "imports": list(args.imports),
              "machine": f"CPU, {torch.get_num_threads()} torch thread(s)",
              "command": "fa-lab attack"}
    rec = record(name, [(res, wall)], params=params)
    saved = regression = None
    if args.regression:
        regression = save_regression(res, args.regression)
        rec["regression"] = str(regression)
    if saved_as is not None:
        saved = results.save(saved_as, rec, root=args.out_dir)
    if args.json:
        run = rec["runs"][0]
        slim = {k: run[k] for k in ("policy", "found", "size", "repro", "budget_s", "evals",
                                    "time_to_first_s", "bad_rows", "space", "baseline", "mods",
                                    "input_mods", "optimizer", "classes", "found_classes")}
        slim["space"] = run["space"]["name"]
        slim["repro_command"] = res.repro_command
        slim["saved"] = None if saved is None else str(saved)
        slim["regression"] = None if regression is None else str(regression)
        print(json.dumps(slim, default=str))
    else:
        print(summary(res))
        if saved is not None:
            print(f"saved {saved}")
    return 0


def _run_decode(args, name) -> int:
    """``fa-lab attack VERSION [--space decode]``: the decode space's attack on a decode
    version (``adversary.decode_search``), saved as an attack record."""
    import json
    import math
    import time

    import torch

    from fa_lab.studies.adversary import decode as decode_space
    from fa_lab.studies.adversary import decode_search
    from fa_lab.upstream import DECODE_VERSIONS

    if not decode_space.is_decode_target(name):
        raise UsageError(f"--space decode attacks a decode version, one of "
                         f"{', '.join(DECODE_VERSIONS)}; got {name!r}")
    if args.space not in (None, "decode"):
        raise UsageError(f"{name!r} is a decode version: its space is decode, not {args.space!r}")
    off = [flag for flag, val in (("--mods", args.mods), ("--baseline", args.baseline),
                                  ("--threshold", args.threshold),
                                  ("--tolerance", args.tolerance),
                                  ("--regression", args.regression),
                                  ("--random-starts", args.random_starts)) if val]
    if off or args.optimizer != "cma":
        raise UsageError(f"{', '.join(off) or '--optimizer'} does not apply to the decode "
                         "space (random starts and an evolution strategy, no modifiers)")
    if not (args.budget > 0 and math.isfinite(args.budget)):
        raise UsageError(f"--budget must be a positive number of seconds, got {args.budget}")
    try:
        classes = decode_space.check_decode_classes(args.classes)
    except (TypeError, ValueError) as e:
        raise UsageError(str(e)) from None
    opts = {"seed": args.seed, "budget_s": args.budget, "space": "decode",
            "max_evals": args.max_evals, "classes_asked": args.classes}
    saved_as = None
    if not args.no_save:
        results.check_folder(args.out_dir)
        saved_as = args.name or default_name(name, args)
        results.check_same_run(saved_as, opts, root=args.out_dir, ignore=VOLATILE)
    started = time.perf_counter()
    res = decode_search.search(name, budget_s=args.budget, seed=args.seed, classes=classes,
                               max_evals=args.max_evals)
    wall = time.perf_counter() - started
    params = {**opts, "classes": list(res.classes),
              "machine": f"CPU, {torch.get_num_threads()} torch thread(s)",
              "command": "fa-lab attack"}
    rec = decode_search.record(name, [(res, wall)], params=params)
    saved = None if saved_as is None else results.save(saved_as, rec, root=args.out_dir)
    if args.json:
        run = rec["runs"][0]
        slim = {k: run[k] for k in ("policy", "found", "size", "repro", "budget_s", "evals",
                                    "time_to_first_s", "bad_rows", "classes", "found_classes")}
        slim.update(space="decode", repro_command=res.repro_command,
                    saved=None if saved is None else str(saved))
        print(json.dumps(slim, default=str))
    else:
        print(decode_search.summary(res))
        if saved is not None:
            print(f"saved {saved}")
    return 0
