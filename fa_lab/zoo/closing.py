"""Issue 39's closing table: per finding and per zoo entry, the symptom (numbers), the
sources read and the attack time, generated from the committed data.

* a finding (``docs/findings/<name>.md``): its ``**Symptom:**`` line; the files and line
  numbers its ``## Where`` section names; the attack time from the record its
  ``**Attack:**`` line names (the ``findings_attack`` record: the runs for that page;
  another attack record: its ``timing``), or the line's reason for none;
* a zoo entry: the reports it was checked against (``Entry.sources``); the shrunk input's
  symptom of the first run before the fix that found it (random starts, seed 0, where one
  did) in the ``zoo_attack`` record; the slowest first find over the seeds, from the zoo's
  starting points and from random starts only; and what the search against the fix found.

``table()`` is the Markdown that ``docs/findings/index.md`` holds between its
``closing-table`` markers (``tests/studies/test_zoo_closing.py`` checks that it still
does); ``python -m fa_lab.zoo.closing`` rewrites it there.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FINDINGS = ROOT / "docs" / "findings"
RESULTS = ROOT / "data" / "results"
BEGIN, END = "<!-- closing-table:begin -->", "<!-- closing-table:end -->"


def _section(text: str, heading: str) -> str:
    m = re.search(rf"^## {re.escape(heading)}.*?$(.*?)(?=^## |\Z)", text, re.S | re.M)
    return m.group(1) if m else ""


def _line(text: str, label: str) -> str:
    m = re.search(rf"^\*\*{label}:\*\* (.+?)\.?$", text, re.M)
    if m is None:
        raise ValueError(f"no **{label}:** line")
    return m.group(1).strip()


def sources_read(text: str) -> str:
    """The files (backticked paths) and line numbers (``l.N`` / ``l.N-M``) a page's
    ``## Where`` section names, in order, each once; where it names no line, its first
    sentence (why)."""
    where = _section(text, "Where")
    files = list(dict.fromkeys(re.findall(r"`([\w./+-]+/[\w.+-]+\.(?:py|cuh|cu|cpp|h))`", where)))
    lines = list(dict.fromkeys(re.findall(r"l\.(\d+(?:-\d+)?)", where)))
    if lines:
        return f"{', '.join(files)}: l.{', l.'.join(lines)}"
    # a page that read no lines says why in its first sentence
    return "no lines: " + " ".join(where.split()).split(":")[0].split(". ")[0]


def _fmt_s(xs) -> str:
    return f"{max(xs):.1f} s" if xs else "-"


def finding_attack(name: str, text: str) -> str:
    """The attack time a finding's ``**Attack:**`` line points at, or its reason for none."""
    att = _line(text, "Attack")
    m = re.search(r"data/results/([\w]+\.json)", att)
    if m is None:
        return att
    rec = json.loads((RESULTS / m.group(1)).read_text())
    note = att.split(". ", 1)[1] if ". " in att else ""
    return _record_time(name, m.group(1), rec) + (f"; {note}" if note else "")


def _record_time(name: str, file: str, rec: dict) -> str:
    if file == "findings_attack.json":
        runs = [r for r in rec["runs"] if r["finding"] == name]
        found = [r["time_to_first_s"] for r in runs if r["found"]]
        classes = ", ".join(runs[0]["classes"]) if runs else "-"
        if not found:
            return (f"not found in {len(runs)} random-start runs of {rec['budget_s']:g} s "
                    f"(class {classes})")
        return (f"{_fmt_s(found)} (slowest of {len(found)}/{len(runs)} random-start runs "
                f"that found it, class {classes}, {rec['budget_s']:g} s budget)")
    t = rec["timing"]
    found = [x for x in t["time_to_first_s"] if x is not None]
    if not found:
        return f"not found in {t['runs']} runs of {rec['params']['budget_s']:g} s"
    cpu = [c for c, e in zip(t["cpu_s"], t["evals_to_first"]) if e is not None]
    return (f"{_fmt_s(found)} wall, {max(cpu):.1f} s CPU (slowest of the "
            f"{t['found']}/{t['runs']} runs that found it, {rec['params']['budget_s']:g} s "
            "budget)")


def finding_rows() -> list[dict]:
    rows = []
    for page in sorted(FINDINGS.glob("*.md")):
        if page.stem == "index":
            continue
        text = page.read_text()
        rows.append({"name": page.stem, "symptom": _line(text, "Symptom"),
                     "sources": sources_read(text), "attack": finding_attack(page.stem, text)})
    return rows


def _num(x) -> str:
    """A recorded number; None is how the record stores a non-finite value."""
    return "non-finite" if x is None else f"{x:.4g}"


def _symptom(s: dict, n_rows: int) -> str:
    rows = s["bad_rows"]
    more = "+" if len(rows) >= 8 else ""
    out = f"{', '.join(s['classes'])}: {len(rows)}{more} of {n_rows} rows"
    if "out" in s:
        out += f"; row {s['row']}: {_num(s['out'][0])} for {_num(s['ref'][0])}"
    return out + f"; error {_num(s['max_err_over_vmax'])} max|V|"


def entry_rows() -> list[dict]:
    from fa_lab.zoo import ENTRIES

    rec = json.loads((RESULTS / "zoo_attack.json").read_text())
    rows = []
    for name, e in ENTRIES.items():
        runs = [r for r in rec["runs"] if r["entry"] == name]
        before = [r for r in runs if not r["fix"]]
        first = next((r for r in sorted(before, key=lambda r: (r["starts"] != "random only",
                                                              r["seed"])) if r["found"]), None)
        symptom = "not found" if first is None else _symptom(
            first["symptom"], first["shrunk"]["n_rows"])
        times = []
        for starts in ("structured", "random only"):
            rs = [r for r in before if r["starts"] == starts]
            hit = [r["time_to_first_s"] for r in rs if r["found"]]
            times.append(f"{_fmt_s(hit)} ({len(hit)}/{len(rs)})")
        fix = [r for r in runs if r["fix"]]
        fixed = "; ".join(f"found {', '.join(r['found_classes'])}" if r["found"]
                          else f"nothing in {r['evals']} runs" for r in fix)
        rows.append({"name": name, "symptom": symptom, "sources": "; ".join(e.sources),
                     "attack": f"{times[0]} from the zoo's starts, {times[1]} from random "
                               f"starts; after the fix: {fixed}"})
    return rows


def _cell(s: str) -> str:
    return s.replace("|", "\\|").replace("\n", " ")


def table() -> str:
    """The Markdown of both tables (module docstring)."""
    out = ["| finding | symptom | source lines read | attack time |", "|---|---|---|---|"]
    out += [f"| [{r['name']}]({r['name']}.md) | {_cell(r['symptom'])} | {_cell(r['sources'])} "
            f"| {_cell(r['attack'])} |" for r in finding_rows()]
    out += ["", "| zoo entry | symptom (shrunk input, before the fix) | reports read | "
                "attack time (slowest first find, runs that found it) |", "|---|---|---|---|"]
    out += [f"| `{r['name']}` | {_cell(r['symptom'])} | {_cell(r['sources'])} "
            f"| {_cell(r['attack'])} |" for r in entry_rows()]
    return "\n".join(out)


def in_index() -> str:
    """The table as ``docs/findings/index.md`` holds it now."""
    text = (FINDINGS / "index.md").read_text()
    return text.split(BEGIN, 1)[1].split(END, 1)[0].strip("\n")


def write_index() -> None:
    path = FINDINGS / "index.md"
    text = path.read_text()
    head, rest = text.split(BEGIN, 1)
    path.write_text(f"{head}{BEGIN}\n{table()}\n{END}{rest.split(END, 1)[1]}")


if __name__ == "__main__":
    write_index()
