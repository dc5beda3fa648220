"""Add a GPU pytest run (its junit XML) to data/results/gpu_tests_h200.json.

The record keeps each GPU-marked test's latest outcome under ``results`` (an earlier
outcome of a test that ran again moves to ``superseded``), every run's commit, command
and purpose under ``provenance.runs``, and a ``summary`` counted from ``results``.

    python3 benchmarks/record_gpu_tests.py --junit gpu.xml --commit 8b75863+wt:1af04dc842 \
        --what "fast kernels after block_any" --command "python3 -m pytest -q -m gpu ..."
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


def junit_results(path: Path, run: str) -> list[dict]:
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


def merge(record: dict, rows: list[dict], run: str, meta: dict) -> dict:
    """``record`` with ``rows`` as run ``run``: their tests' earlier rows move to superseded."""
    runs = record["provenance"]["runs"]
    if run in runs:
        raise ValueError(f"run {run!r} is already recorded")
    runs[run] = meta
    new = {r["test"] for r in rows}
    kept = [r for r in record["results"] if r["test"] not in new]
    record["superseded"] = record.get("superseded", []) + [r for r in record["results"] if r["test"] in new]
    record["results"] = sorted(kept + rows, key=lambda r: r["test"])
    counts = collections.Counter(r["outcome"] for r in record["results"])
    for r in record["results"]:  # a row standing for several tests ("... (3 tests)")
        if "(" in r["test"] and r["test"].endswith(" tests)"):
            counts[r["outcome"]] += int(r["test"].rsplit("(", 1)[1].split()[0]) - 1
    record["summary"] = dict(sorted(counts.items()))
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
    args = ap.parse_args(argv)
    record = json.loads(args.record.read_text())
    run = str(max(int(k) for k in record["provenance"]["runs"]) + 1)
    rows = junit_results(args.junit, int(run))
    meta = {"commit": args.commit, "what": args.what, "command": args.command, "date": args.date}
    merge(record, rows, run, meta)
    atomic_write_json(args.record, record)
    print(f"run {run}: {collections.Counter(r['outcome'] for r in rows)}; summary {record['summary']}")


if __name__ == "__main__":
    sys.exit(main())
