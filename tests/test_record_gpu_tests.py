"""benchmarks/record_gpu_tests.py: a junit file becomes a run of the GPU test record; later
outcomes supersede earlier ones, tests that no longer exist retire, the summary counts
what is left, and the committed record is consistent with itself."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("record_gpu_tests", ROOT / "benchmarks" / "record_gpu_tests.py")
record_gpu_tests = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(record_gpu_tests)

JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">
<testcase classname="tests.test_a" name="test_ok[1]" time="1.234"/>
<testcase classname="tests.test_a" name="test_bad" time="2"><failure message="x"/></testcase>
<testcase classname="tests.test_b" name="test_skip" time="0"><skipped message="y"/></testcase>
<testcase classname="tests.test_b" name="test_was_run" time="0"><skipped message="y"/></testcase>
<testcase classname="tests.test_c.TestK" name="test_m" time="0.5"/>
</testsuite></testsuites>"""


def _record():
    return {"provenance": {"runs": {"1": {"commit": "c1"}}, "date": "2026-01-01"},
            "summary": {"passed": 2},
            "results": [{"test": "tests.test_a::test_bad", "run": 1, "outcome": "passed", "seconds": 1.0},
                        {"test": "tests.test_b::test_was_run", "run": 1, "outcome": "failed", "seconds": 1.0},
                        {"test": "tests.test_old::test_gone", "run": 1, "outcome": "passed", "seconds": 1.0}]}


def _run(tmp_path, *extra, junit=JUNIT):
    (tmp_path / "j.xml").write_text(junit)
    (tmp_path / "r.json").write_text(json.dumps(_record()))
    record_gpu_tests.main(["--junit", str(tmp_path / "j.xml"), "--commit", "c2", "--what", "w",
                           "--command", "cmd", "--date", "2026-02-02",
                           "--record", str(tmp_path / "r.json"), *extra])
    return json.loads((tmp_path / "r.json").read_text())


def test_a_run_supersedes_earlier_outcomes_and_counts_them(tmp_path):
    rec = _run(tmp_path)
    by_test = {r["test"]: r for r in rec["results"]}
    assert by_test["tests.test_a::test_ok[1]"] == {"test": "tests.test_a::test_ok[1]", "run": 2,
                                                   "outcome": "passed", "seconds": 1.23}
    assert by_test["tests.test_a::test_bad"]["outcome"] == "failed"
    assert by_test["tests.test_b::test_skip"]["outcome"] == "skipped"
    assert [r["outcome"] for r in rec["superseded"]] == ["passed"]  # test_bad's run 1
    # a skip says nothing about the code: test_was_run keeps its failure of run 1
    assert by_test["tests.test_b::test_was_run"] == _record()["results"][1]
    assert rec["summary"] == {"failed": 2, "passed": 3, "skipped": 1}  # test_gone still counts
    assert rec["provenance"]["runs"]["2"]["commit"] == "c2" and rec["provenance"]["date"] == "2026-02-02"


def test_collected_ids_retire_the_tests_that_are_gone(tmp_path):
    ids = ("tests/test_a.py::test_ok[1]\ntests/test_a.py::test_bad\ntests/test_b.py::test_skip\n"
           "tests/test_b.py::test_was_run\ntests/test_c.py::TestK::test_m\ntests/test_d.py::test_never_ran\n"
           "\n6 tests collected\n")
    (tmp_path / "ids.txt").write_text(ids)
    rec = _run(tmp_path, "--collected", str(tmp_path / "ids.txt"))
    assert [r["test"] for r in rec["retired"]] == ["tests.test_old::test_gone"]
    assert "tests.test_old::test_gone" not in {r["test"] for r in rec["results"]}
    assert rec["summary"] == {"failed": 2, "passed": 2, "skipped": 1}
    assert rec["unrecorded"] == ["tests.test_d::test_never_ran"]


def test_bad_inputs_are_refused_before_the_record_changes(tmp_path):
    (tmp_path / "ids.txt").write_text("tests/test_a.py::test_ok[1]\n")
    with pytest.raises(ValueError, match="--collected lacks"):
        _run(tmp_path, "--collected", str(tmp_path / "ids.txt"))
    assert json.loads((tmp_path / "r.json").read_text()) == _record()
    (tmp_path / "ids.txt").write_text("no tests ran\n")
    with pytest.raises(ValueError, match="lists no test ids"):
        _run(tmp_path, "--collected", str(tmp_path / "ids.txt"))
    with pytest.raises(ValueError, match="holds no test cases"):
        _run(tmp_path, junit="<testsuites><testsuite/></testsuites>")
    rec = _record()
    with pytest.raises(ValueError, match="already recorded"):
        record_gpu_tests.merge(rec, [], "1", {"date": "x"})


def test_the_committed_record_counts_its_own_results():
    rec = json.loads((ROOT / "data" / "results" / "gpu_tests_h200.json").read_text())
    assert rec["summary"] == record_gpu_tests.count(rec)
    runs = rec["provenance"]["runs"]
    for row in rec["results"] + rec["superseded"] + rec.get("retired", []):
        assert str(row["run"]) in runs, row
    assert len({r["test"] for r in rec["results"]}) == len(rec["results"])
