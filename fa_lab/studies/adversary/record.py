"""An attack's result file: one schema for every attack run (``fa-lab attack``, the
campaigns in benchmarks/), the one the lessons read from the lab's reference data.

    rec = adversary.record(policy, [(attack, wall_s), ...], params={...})
    results.save(f"attack_{policy}", rec)
    adversary.load_record("attack_lazy")            # a run of yours (the results folder)
    adversary.load_record("attack_lazy", reference=True)   # the lab's (data/results)

A record is a JSON object with ``RECORD_KEYS``: ``policy``; ``found``, ``repro`` and
``size`` (the first run's); ``mods`` (the score modifiers the first run drew);
``description`` (the policy as ``Policy.describe`` gives it) and ``user_policy`` (not a
built-in); ``summary`` (one row per run, ``summary_row``); ``runs`` (``Attack.to_dict()`` of
each run with its ``wall_s``); ``params`` (how the runs were asked for) and ``provenance``.
"""

from __future__ import annotations

from fa_lab import results

#: The keys every attack record has (older reference records lack ``mods`` only).
RECORD_KEYS = ("name", "policy", "found", "repro", "size", "mods", "description",
               "user_policy", "summary", "runs", "params", "provenance")
#: The keys of each of a record's runs that the lessons and the summary read.
RUN_KEYS = ("policy", "found", "space", "budget_s", "seed", "threshold", "evals",
            "search_s", "time_to_first_s", "evals_to_first", "shrink_evals", "structured",
            "baseline", "best_fitness", "bad_rows", "repro", "history", "first", "shrunk",
            "best", "size", "wall_s")
_OPTIONAL = ("mods",)


def summary_row(run: dict) -> dict:
    """One run (``Attack.to_dict()`` with ``wall_s``) as a row of the record's summary."""
    s = run["shrunk"]
    return {"space": run["space"]["name"], "mods": run.get("mods", []),
            "starts": "structured" if run["structured"] else "random only",
            "baseline": run["baseline"], "optimizer": run.get("optimizer", "cma"),
            "budget_s": run["budget_s"], "found": run["found"], "evals": run["evals"],
            "time_to_first_s": run["time_to_first_s"], "evals_to_first": run["evals_to_first"],
            "shrunk_size": None if s is None else s["size"], "shrink_evals": run["shrink_evals"],
            "best_fitness": run["best_fitness"], "input_mods": run.get("input_mods"),
            "repro_of": "the shrunk failing input" if run["found"] else "the near miss (best fitness)",
            "repro": run["repro"]}


def record(policy, runs, *, params: dict, provenance: dict | None = None) -> dict:
    """The record of one or more runs against ``policy`` (a registered name):
    ``runs`` is a list of ``(Attack, wall_s)``. ``params`` says how they were asked for.
    ``fa_lab.results.save`` adds ``name`` (and ``provenance`` where not given)."""
    from fa_lab import policies

    if not runs:
        raise ValueError("runs is empty: a record holds at least one attack run")
    name = getattr(policy, "name", policy)
    dicts = [{**attack.to_dict(), "wall_s": float(wall)} for attack, wall in runs]
    first = dicts[0]
    rec = {"policy": name, "found": first["found"], "repro": first["repro"],
           "size": first["size"], "mods": list(first["mods"]),
           "description": policies.as_policy(name).describe(),
           "user_policy": name not in policies.BUILTIN_NAMES,
           "summary": [summary_row(d) for d in dicts], "runs": dicts, "params": dict(params)}
    if provenance is not None:
        rec["provenance"] = provenance
    return rec


def check_record(rec, where) -> dict:
    """``rec`` if it has the record's schema, else ``ValueError`` naming ``where`` (the
    file) and what is missing."""
    if not isinstance(rec, dict):
        raise ValueError(f"{where}: not an attack record (a JSON object), a {type(rec).__name__}")
    missing = [k for k in RECORD_KEYS if k not in rec and k not in _OPTIONAL]
    if missing:
        raise ValueError(f"{where}: not an attack record: no {', '.join(map(repr, missing))} "
                         f"(an attack record has {', '.join(RECORD_KEYS)})")
    if not isinstance(rec["runs"], list) or not rec["runs"]:
        raise ValueError(f"{where}: not an attack record: 'runs' must be a non-empty list")
    for i, run in enumerate(rec["runs"]):
        gone = [k for k in RUN_KEYS if not isinstance(run, dict) or k not in run]
        if gone:
            raise ValueError(f"{where}: run {i} of the record lacks "
                             f"{', '.join(map(repr, gone))}")
    return rec


def load_record(name: str, *, reference: bool = False, root=None) -> dict:
    """The attack record ``name`` from the results folder (``root``: as
    ``fa_lab.results.load``) or, with ``reference``, the lab's reference data; checked
    (``check_record``)."""
    rec = results.reference(name) if reference else results.load(name, root=root)
    return check_record(rec, rec.path)
