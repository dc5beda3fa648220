"""The closing table (``fa_lab.zoo.closing``): docs/findings/index.md holds the table that
the committed data and the findings pages generate, with a row per finding and per zoo
entry, each with numbers, sources and an attack time."""

import json
import re

import pytest

from fa_lab.zoo import ENTRIES, closing


def test_the_index_holds_the_generated_table():
    assert closing.in_index() == closing.table(), (
        "docs/findings/index.md is stale: run python -m fa_lab.zoo.closing")


def test_a_row_per_finding_and_per_entry_with_numbers():
    pages = {p.stem for p in closing.FINDINGS.glob("*.md")} - {"index"}
    found = closing.finding_rows()
    assert {r["name"] for r in found} == pages and len(pages) >= 9
    entries = closing.entry_rows()
    assert [r["name"] for r in entries] == list(ENTRIES) and len(entries) >= 20
    for r in found + entries:
        assert re.search(r"\d", r["symptom"]), r
        assert r["sources"] and r["attack"], r
    for r in found:   # every page names its lines, or says why it has none
        assert re.search(r"l\.\d", r["sources"]) or r["sources"].startswith("no lines: "), r


def test_the_rows_read_the_records():
    """The decode finding's attack time is its record's slowest first find; an entry's is
    the slowest over its seeds; a shrunk symptom's numbers are the record's."""
    rec = json.loads((closing.RESULTS / "attack_decode_main.json").read_text())
    slowest = max(rec["timing"]["time_to_first_s"])
    row = next(r for r in closing.finding_rows() if r["name"] == "pa_decode_inf_path")
    assert row["attack"].startswith(f"{slowest:.1f} s wall")
    assert "pa_decode_tile.py" in row["sources"] and "747-748" in row["sources"]
    zoo = json.loads((closing.RESULTS / "zoo_attack.json").read_text())
    runs = [r for r in zoo["runs"] if r["entry"] == "fa4_fp8_saturation" and not r["fix"]
            and r["starts"] == "random only"]
    row = next(r for r in closing.entry_rows() if r["name"] == "fa4_fp8_saturation")
    assert f"{max(r['time_to_first_s'] for r in runs):.1f} s (3/3) from random" in row["attack"]
    s = next(r for r in runs if r["seed"] == 0)["symptom"]
    assert row["symptom"].startswith(f"{', '.join(s['classes'])}: {len(s['bad_rows'])}")


def test_the_page_parser():
    text = ("# t\n\n**Symptom:** NaN in 3 rows.\n\n**Attack:** not run: no space.\n\n"
            "## Where\n\n`a/b.py` l.1-2 and l.7; `a/c.cuh` l.7\n\n## Mechanism\n\nl.99\n")
    assert closing.sources_read(text) == "a/b.py, a/c.cuh: l.1-2, l.7"
    assert closing._line(text, "Symptom") == "NaN in 3 rows"
    assert closing.finding_attack("x", text) == "not run: no space"
    assert closing.sources_read("## Where\n\nRead in an index (no commit): `f(x)`.\n") == \
        "no lines: Read in an index (no commit)"
    with pytest.raises(ValueError, match="Symptom"):
        closing._line("# t\n", "Symptom")
