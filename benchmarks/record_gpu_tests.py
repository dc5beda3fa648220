"""Add a GPU pytest run (its junit XML) to data/results/gpu_tests_h200.json.

The record keeps each GPU-marked test's latest outcome under ``results`` (an earlier
outcome of a test that ran again moves to ``superseded``; a skip does not replace a pass
or a failure, since a skipped test says nothing about the code), every run's commit,
command and purpose under ``provenance.runs``, and a ``summary`` counted from ``results``.
With ``--collected`` (the ids that ``pytest --collect-only -q -m gpu tests`` prints), rows
of tests that no longer exist move to ``retired``, and collected tests with no row are
listed under ``unrecorded``, so the summary speaks for today's tests.

    python3 benchmarks/record_gpu_tests.py --junit gpu.xml --commit 8b75863+wt:1af04dc842 \
        --what "fast kernels after block_any" --command "python3 -m pytest -q -m gpu ..." \
        --date 2026-12-05 --collected gpu_ids.txt
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

from fa_lab.experiments import RESULTS_DIR, atomic_write_json

RECORD = RESULTS_DIR / "gpu_tests_h200.json"


def junit_results(path: Path, run: int) -> list[dict]:
    """One row per test case: test (module::name), run, outcome, seconds."""
    rows = []
    for case in ET.parse(path).getroot().iter("testcase"):
        outcome = "passed"
        for tag in ("failure", "error", "skipped"):
            if case.find(tag) is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
        rows.append({"test": f"{case.get('classname')}::{case.get('name')}", "run": run,
                     "outcome": outcome, "seconds": round(float(case.get("time", 0.0)), 2)})
    if not rows:
        raise ValueError(f"--junit {path} holds no test cases")
    return rows


def collected_ids(path: Path) -> set[str]:
    """The test ids (``module::name``, as ``results`` spells them) in pytest's
    ``--collect-only -q`` output: lines ``tests/test_x.py::name``."""
    ids = {line.strip() for line in path.read_text().splitlines() if "::" in line}
    if not ids:
        raise ValueError(f"--collected {path} lists no test ids")
    # junit's classname is the module's dotted path, then any test classes
    return {".".join([parts[0].removesuffix(".py").replace("/", "."), *parts[1:-1]]) + "::" + parts[-1]
            for parts in (i.split("::") for i in ids)}


def retire(record: dict, ids: set[str]) -> list[dict]:
    """Move the rows of ``results`` whose test is not in ``ids`` to ``retired``; return them."""
    gone = [r for r in record["results"] if r["test"] not in ids]
    record["results"] = [r for r in record["results"] if r["test"] in ids]
    record["retired"] = record.get("retired", []) + gone
    return gone


def count(record: dict) -> dict:
    counts = collections.Counter(r["outcome"] for r in record["results"])
    for r in record["results"]:  # a row standing for several tests ("... (3 tests)")
        if "(" in r["test"] and r["test"].endswith(" tests)"):
            counts[r["outcome"]] += int(r["test"].rsplit("(", 1)[1].split()[0]) - 1
    return dict(sorted(counts.items()))


def merge(record: dict, rows: list[dict], run: str, meta: dict) -> dict:
    """``record`` with ``rows`` as run ``run``: their tests' earlier rows move to superseded,
    except that a skip leaves an earlier pass or failure in place (and is not recorded)."""
    runs = record["provenance"]["runs"]
    if run in runs:
        raise ValueError(f"run {run!r} is already recorded")
    runs[run] = meta
    earlier = {r["test"]: r for r in record["results"]}
    rows = [r for r in rows if not (r["outcome"] == "skipped" and r["test"] in earlier
                                    and earlier[r["test"]]["outcome"] != "skipped")]
    new = {r["test"] for r in rows}
    kept = [r for r in record["results"] if r["test"] not in new]
    record["superseded"] = record.get("superseded", []) + [r for r in record["results"] if r["test"] in new]
    record["results"] = sorted(kept + rows, key=lambda r: r["test"])
    record["summary"] = count(record)
    record["provenance"]["date"] = meta["date"]
    return record


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--junit", required=True, type=Path)
    ap.add_argument("--commit", required=True)
    ap.add_argument("--what", required=True)
    ap.add_argument("--command", required=True)
    ap.add_argument("--date", required=True, help="the run's date, YYYY-MM-DD")
    ap.add_argument("--record", type=Path, default=RECORD)
    ap.add_argument("--collected", type=Path,
                    help="pytest --collect-only -q -m gpu output: retire rows of tests not in it")
    args = ap.parse_args(argv)
    ids = collected_ids(args.collected) if args.collected is not None else None
    record = json.loads(args.record.read_text())
    run = str(max(int(k) for k in record["provenance"]["runs"]) + 1)
    rows = junit_results(args.junit, int(run))
    meta = {"commit": args.commit, "what": args.what, "command": args.command, "date": args.date}
    merge(record, rows, run, meta)
    if ids is not None:
        unknown = sorted({r["test"] for r in rows} - ids)
        if unknown:
            raise ValueError(f"--junit {args.junit} holds tests that --collected lacks: {unknown[:3]}")
        gone = retire(record, ids)
        record["summary"] = count(record)
        record["unrecorded"] = sorted(ids - {r["test"] for r in record["results"]})
        print(f"retired {len(gone)} row(s) of tests no longer collected; "
              f"{len(record['unrecorded'])} collected test(s) have no row")
    atomic_write_json(args.record, record)
    print(f"run {run}: {collections.Counter(r['outcome'] for r in rows)}; summary {record['summary']}")


if __name__ == "__main__":
    sys.exit(main())
