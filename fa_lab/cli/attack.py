"""``fa-lab attack``: search for inputs on which a policy's output goes non-finite, and
shrink them (``fa_lab.studies.adversary``). The run is saved as an attack record
(``adversary.record``: the schema of the lab's reference ``attack_<policy>.json``) in the
results folder, and its repro line runs as printed.

A kernel target instead of a policy runs that kernel's own space (``KERNEL_SPACES``): a
decode version (``decode``, ``decode_v_outliers``, ``decode_swa``), a paged fp8 version
(``paged_fp8``) or ``mla_decode`` (``--p-headroom``); ``--space`` picks among them."""

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
                   help="the registered policy to attack (or --policy), or a kernel target: "
                        "a decode version, a paged fp8 version, mla_decode")
    p.add_argument("--policy", dest="policy_opt", help="the policy (instead of POLICY)")
    p.add_argument("--budget", type=float, default=60.0,
                   help="seconds of search (shrinking a find takes up to as much again)")
    p.add_argument("--space", choices=(*SPACES, *KERNEL_SPACES), default=None,
                   help="the search space: scores (|V| <= 4; the default), values (V up to "
                        "2^126), zoo (KV caches, sentinels, masked rows and tiles; the "
                        "default for the failure zoo's presets); for a decode version "
                        "(main-11c4174d, flydsl-985c653a^) as POLICY: decode (paged-decode "
                        "calls, its default), decode_v_outliers (outliers in V only) or "
                        "decode_swa (the sliding-window kernel); paged_fp8 (the paged fp8 "
                        "prefill, the default for flydsl-6aeb4321); mla_decode (the MLA decode, "
                        "the default for POLICY mla_decode)")
    p.add_argument("--p-headroom", dest="p_headroom", type=float, default=None, metavar="H",
                   help="mla_decode only: lift P by 2^H before its e4m3 cast (0, upstream's "
                        "cast, by default; 8: the fix)")
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
    space = kernel_space(name, args.space)
    if space is not None:
        return _run_kernel(args, name, space)
    if args.p_headroom is not None:
        raise UsageError("--p-headroom is the mla_decode space's (fa-lab attack mla_decode)")
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


#: The kernel spaces' targets and searches (``fa-lab attack TARGET [--space S]``): space ->
#: (what the target is, the module in fa_lab.studies.adversary).
KERNEL_SPACES = {"decode": "decode_search", "decode_v_outliers": "decode_search",
                 "decode_swa": "decode_search", "paged_fp8": "paged_fp8", "mla_decode": "mla"}


def kernel_space(name, space):
    """The kernel space ``fa-lab attack NAME [--space SPACE]`` runs (None: the policy
    attack): ``space`` when it is one, else the space of the kind of target NAME is (a
    decode version, a paged fp8 version, or ``mla_decode``)."""
    from fa_lab.studies.adversary import decode as decode_space
    from fa_lab.studies.adversary import mla
    from fa_lab.upstream import FP8_PAGED_VERSIONS

    if space in KERNEL_SPACES:
        return space
    own = ("decode" if decode_space.is_decode_target(name) else
           "paged_fp8" if name in FP8_PAGED_VERSIONS else
           "mla_decode" if name == mla.TARGET else None)
    if own is not None and space is not None:
        spaces = [s for s, m in KERNEL_SPACES.items() if m == KERNEL_SPACES[own]]
        raise UsageError(f"{name!r} is a {own} target: its spaces are {', '.join(spaces)}, "
                         f"not {space!r}")
    return own


def _check_target(name, space):
    """UsageError unless ``name`` is a target of the kernel space ``space``; returns the
    target as the search takes it (the MLA decode's is its p_headroom, given apart)."""
    from fa_lab.kernels.mla_decode import VERSIONS as MLA_VERSIONS
    from fa_lab.studies.adversary import decode as decode_space
    from fa_lab.studies.adversary import mla
    from fa_lab.upstream import DECODE_VERSIONS, FP8_PAGED_VERSIONS

    if space == "mla_decode":
        if name not in (mla.TARGET, *MLA_VERSIONS):
            raise UsageError(f"--space mla_decode attacks the MLA decode: name it "
                             f"{mla.TARGET} (or its version, {', '.join(MLA_VERSIONS)}); got {name!r}")
    elif space == "paged_fp8":
        if name not in FP8_PAGED_VERSIONS:
            raise UsageError(f"--space paged_fp8 attacks a paged fp8 version, one of "
                             f"{', '.join(FP8_PAGED_VERSIONS)}; got {name!r}")
    elif not decode_space.is_decode_target(name):
        raise UsageError(f"--space {space} attacks a decode version, one of "
                         f"{', '.join(DECODE_VERSIONS)}; got {name!r}")


def _target_file(name, space, args) -> str:
    """The kernel attack's default result name: attack_<target>, the space when it is not
    the target's own, --p-headroom, --seed, --classes, --max-evals (--budget is not: a
    longer search of the same attack)."""
    def word(x):
        return re.sub(r"[^A-Za-z0-9_.-]", "-", str(x))
    target = "mla_decode" if space == "mla_decode" else name
    parts = [f"attack_{word(target)}"]
    parts += [space] if space not in ("decode", "paged_fp8", "mla_decode") else []
    parts += [f"h{args.p_headroom:g}"] if args.p_headroom else []
    parts += [f"seed{args.seed}"] if args.seed else []
    parts += [f"classes-{word(args.classes)}"] if args.classes is not None else []
    parts += [f"evals{args.max_evals}"] if args.max_evals is not None else []
    return results.check_name("_".join(parts))


def _run_kernel(args, name, space) -> int:
    """``fa-lab attack TARGET [--space S]`` on a kernel space: the paged decode's
    (``decode``, ``decode_v_outliers``, ``decode_swa``: ``adversary.decode_search``), the
    paged fp8 prefill's (``paged_fp8``) or the MLA decode's (``mla_decode``, with
    ``--p-headroom``), saved as an attack record."""
    import importlib
    import json
    import math
    import time

    import torch

    _check_target(name, space)
    off = [flag for flag, val in (("--mods", args.mods), ("--baseline", args.baseline),
                                  ("--threshold", args.threshold),
                                  ("--tolerance", args.tolerance),
                                  ("--regression", args.regression),
                                  ("--random-starts", args.random_starts),
                                  ("--optimizer", args.optimizer != "cma")) if val]
    if space != "mla_decode" and args.p_headroom is not None:
        off.append("--p-headroom")
    if off:
        raise UsageError(f"{', '.join(off)} does not apply to the {space} space (random "
                         "starts and an evolution strategy, no modifiers"
                         + ("; --p-headroom is the mla_decode space's)" if "--p-headroom" in off
                            else ")"))
    if not (args.budget > 0 and math.isfinite(args.budget)):
        raise UsageError(f"--budget must be a positive number of seconds, got {args.budget}")
    mod = importlib.import_module(f"fa_lab.studies.adversary.{KERNEL_SPACES[space]}")
    try:
        if space == "mla_decode":
            classes = mod.check_classes(args.classes)
            headroom = mod.check_headroom(args.p_headroom or 0.0)
        elif space == "paged_fp8":
            classes = mod.check_classes(args.classes)
        else:
            from fa_lab.studies.adversary import decode as decode_space
            classes = decode_space.check_decode_classes(args.classes)
    except (TypeError, ValueError) as e:
        raise UsageError(str(e)) from None
    opts = {"seed": args.seed, "budget_s": args.budget, "space": space,
            "max_evals": args.max_evals, "classes_asked": args.classes}
    if space == "mla_decode":
        opts["p_headroom"] = headroom
    saved_as = None
    if not args.no_save:  # the file, checked before the search
        results.check_folder(args.out_dir)
        saved_as = args.name or _target_file(name, space, args)
        results.check_same_run(saved_as, opts, root=args.out_dir, ignore=VOLATILE)
    started = time.perf_counter()
    common = dict(budget_s=args.budget, seed=args.seed, classes=classes, max_evals=args.max_evals)
    if space == "mla_decode":
        res = mod.search(headroom, **common)
    elif space == "paged_fp8":
        res = mod.search(name, **common)
    else:
        res = mod.search(name, space=space, **common)
    wall = time.perf_counter() - started
    params = {**opts, "classes": list(res.classes),
              "machine": f"CPU, {torch.get_num_threads()} torch thread(s)",
              "command": "fa-lab attack"}
    if space == "mla_decode":
        rec = mod.record([(res, wall)], params=params)
    elif space == "paged_fp8":
        rec = _paged_record(name, res, wall, params)
    else:
        rec = mod.record(name, [(res, wall)], params=params)
    saved = None if saved_as is None else results.save(saved_as, rec, root=args.out_dir)
    if args.json:
        run = rec["runs"][0]
        slim = {k: run[k] for k in ("policy", "found", "size", "repro", "budget_s", "evals",
                                    "time_to_first_s", "bad_rows", "classes", "found_classes")}
        slim.update(space=space, repro_command=res.repro_command,
                    saved=None if saved is None else str(saved))
        print(json.dumps(slim, default=str))
    else:
        print(_summary(res, space))
        if saved is not None:
            print(f"saved {saved}")
    return 0


def _paged_record(version, res, wall, params) -> dict:
    """The attack record of one paged fp8 run (``record.RECORD_KEYS``)."""
    from fa_lab.studies.adversary.record import summary_row
    from fa_lab.upstream import FP8_PAGED_VERSIONS

    run = {**res.to_dict(), "wall_s": float(wall)}
    return {"policy": version, "found": run["found"], "repro": run["repro"], "size": run["size"],
            "mods": [], "description": f"paged fp8 prefill {version}: "
                                       f"{FP8_PAGED_VERSIONS[version].description}",
            "user_policy": False, "summary": [summary_row(run)], "runs": [run],
            "params": dict(params)}


def _summary(res, space) -> str:
    from fa_lab.studies.adversary import decode_search, mla

    if space == "mla_decode":
        return mla.summary(res)
    if space != "paged_fp8":
        return decode_search.summary(res)
    if res.found:
        return (f"{res.policy}: FAILS ({', '.join(res.found_classes)}). First failure after "
                f"{res.time_to_first_s:.1f} s ({res.evals_to_first} model runs) in space "
                f"'paged_fp8'; shrunk in {res.shrink_evals} runs to {res.shrunk.size}\n"
                f"  repro: {res.repro_command}")
    return (f"{res.policy}: nothing in {res.evals} runs found a failure ({res.search_s:.1f} s, "
            f"budget {res.budget_s:g} s, space 'paged_fp8', classes {', '.join(res.classes)})")
