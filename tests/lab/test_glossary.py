"""Every glossary term has its own anchor (notebooks/glossary.ipynb: one ``###`` heading
each), and each lesson links a term at its first use in the lesson's Markdown
(``[deficit](glossary.ipynb#deficit)``).

A term is found by the words a reader would meet in prose, not by its heading's exact
text: ``running max `m``` is met as "running max", ``drag, dragged row`` as "drag" or
"dragged". Matches skip code, math, links, headings and HTML. A few terms are not looked for
in prose (single letters such as ``P``, and names that appear only in code); they still
have their anchors.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GLOSSARY = ROOT / "notebooks" / "glossary.ipynb"
#: The lessons whose first uses are linked.
LESSONS = ["00_tour", "01_online_softmax", "02_lazy_rescale", "03_fp8", "04_kernel_set",
           "06_atlas_and_attack", "07_failure_zoo", "08_decode", "09_training"]

#: heading -> the regular expression of its prose forms (None: not looked for in prose).
#: Unlisted headings are found as their own words, case-insensitively, plural or not.
FORMS = {
    "the bug report": r"bug report", "K scale": r"K scale", "rel-L2": r"rel-L2",
    "mean |o − 1|": None, "lane, in a trace": None, "P": None, "l": None, "O": None,
    "LSE": r"LSE", "SWA": r"SWA", "TMA": r"TMA", "OCP": r"OCP", "CMA-ES": r"CMA-ES",
    "Dask": r"Dask", "R (score spread)": None, "rocdl.ballot": None, "exec_mask": None,
    "running max `m`": r"running max(?:es|ima)?", "tile max `mt`": r"tile max(?:es|ima)?",
    "correction `corr`": r"corrections?", "merge ⊕": r"merges?",
    "threshold `THR`": r"thresholds?", "swept (below base, wave fired)": r"swept",
    "drag, dragged row": r"drag(?:s|ged)?", "prologue, loop, epilogue": r"prologue",
    "tile level, exact level": r"tile level", "eager / lazy": None,
    "`Semantics` field": r"`Semantics`", "`ls`": r"`ls`", "fire": r"fire[sd]?",
    "vote": r"vote[sd]?", "rebase": r"rebase[sd]?", "shrinking": r"shrinking|shrunk",
    "record": r"(?<!attack's )records?",
    "fmax": r"`fmax`|fmax", "predictor": r"predictors?", "policy": r"polic(?:y|ies)",
    "tile (online model)": None, "FA4's split": None, "upstream version": None,
    "binade": r"binades?", "hazard": r"hazards?", "partition": r"partitions?",
    "page, block table": r"block tables?",
    "FlyDSL (the repository)": r"FlyDSL",
}
#: Words that must not follow a match (a longer term starts there): "tile" in "tile max".
_LONGER = {"tile": r"(?!\s+(?:max|pair|level))", "block": r"(?!\s+tables?)", "record": r"(?!\s+key)",
           "sentinel": r"(?!\s+cancellation)", "rebase": r"(?!\s+bound)"}
#: What a link may not be inside: fenced code, inline code, math, links, headings, HTML.
_PROTECTED = re.compile(r"```.*?```|`[^`\n]+`|\$\$.*?\$\$|\$[^$\n]+\$|\[[^\]]*\]\([^)]*\)"
                        r"|^#[^\n]*$|<[^>\n]+>", re.S | re.M)


def slug(heading: str) -> str:
    """The anchor MyST and GitHub give a heading (tests/project/test_links.py's rule)."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def terms() -> list[str]:
    cells = json.loads(GLOSSARY.read_text(encoding="utf-8"))["cells"]
    text = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown")
    return re.findall(r"^### (.+?)\s*$", text, flags=re.M)


def pattern(heading: str) -> re.Pattern | None:
    """The prose forms of ``heading``, or None where it is not looked for in prose."""
    if heading in FORMS:
        form = FORMS[heading]
        if form is None:
            return None
    elif heading.startswith("`"):                       # a policy or backend name: as code
        form = re.escape(heading)
    else:
        form = re.escape(heading) + r"(?:s|es)?"
    case = 0 if heading[:1].isupper() or form.startswith("`") else re.I
    tail = _LONGER.get(heading, "")
    return re.compile(rf"(?<![\w`/#-]){form}(?![\w-]){tail}", case)


def _free(text: str, code_ok: bool) -> list[tuple[int, int]]:
    """The stretches of ``text`` a link may go in (with inline code, for a code pattern)."""
    spans, at = [], 0
    for m in _PROTECTED.finditer(text):
        if code_ok and m[0].startswith("`") and not m[0].startswith("```"):
            continue
        spans.append((at, m.start()))
        at = m.end()
    return spans + [(at, len(text))]


def first_use(text: str, heading: str) -> re.Match | None:
    """The first prose use of ``heading`` in Markdown ``text``, outside code and links."""
    pat = pattern(heading)
    if pat is None:
        return None
    form = FORMS.get(heading, re.escape(heading) if heading.startswith("`") else "")
    for start, end in _free(text, code_ok="`" in (form or "")):
        m = pat.search(text, start, end)
        if m:
            return m
    return None


def link(heading: str, word: str) -> str:
    return f"[{word}](glossary.ipynb#{slug(heading)})"


def linked_terms(text: str) -> set[str]:
    """The slugs ``text`` links in the glossary."""
    return set(re.findall(r"\]\(glossary\.ipynb#([^)\s]+)\)", text))


def markdown_cells(lesson: str) -> list[str]:
    nb = json.loads((ROOT / "notebooks" / f"{lesson}.ipynb").read_text(encoding="utf-8"))
    return ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "markdown"]


_GLOSSARY_LINK = re.compile(r"\[([^\]]*)\]\(glossary\.ipynb#([^)\s]+)\)")


def unlinked(text: str) -> tuple[str, dict[int, str]]:
    """``text`` with its glossary links replaced by their words, and where each link's
    words now start -> the slug it linked."""
    out, starts, at = [], {}, 0
    for m in _GLOSSARY_LINK.finditer(text):
        out.append(text[at:m.start()])
        starts[sum(map(len, out))] = m[2]
        out.append(m[1])
        at = m.end()
    out.append(text[at:])
    return "".join(out), starts


def test_every_term_has_its_own_anchor():
    heads = terms()
    assert len(heads) >= 80, heads
    slugs = [slug(h) for h in heads]
    assert len(set(slugs)) == len(slugs), sorted(s for s in slugs if slugs.count(s) > 1)
    for word in ("deficit", "onset rule", "binade", "Dask", "rcp", "OCP", "persistent grid",
                 "rocdl.ballot", "exec_mask", "R (score spread)"):
        assert word in heads, word


def test_the_finder_skips_code_links_and_math():
    text = "`deficit` and $deficit$ and [deficit](x.md)\n# a deficit\nthe deficits here"
    m = first_use(text, "deficit")
    assert m and m[0] == "deficits" and m.start() == text.index("deficits")
    assert first_use("the tile max moved", "tile") is None       # "tile max" is its own term
    assert first_use("the tile max moved", "tile max `mt`")[0] == "tile max"
    # a prose term inside inline code is code (a link there would print as text)
    text = "`max(m, tile max)` and the tile max"
    assert first_use(text, "tile max `mt`").start() == text.rindex("tile max")
    assert first_use("`fmax(m, x)` and `fmax`", "fmax").start() == 1     # a code form: code too


@pytest.mark.parametrize("lesson", LESSONS)
def test_each_term_is_linked_at_its_first_use(lesson):
    unlinked_first, linked = [], 0
    heads = terms()
    seen: set[str] = set()
    for cell in markdown_cells(lesson):
        text, links = unlinked(cell)
        for head in heads:
            if head in seen:
                continue
            m = first_use(text, head)
            if m is None:
                continue
            seen.add(head)
            if links.get(m.start()) == slug(head):
                linked += 1
            else:
                unlinked_first.append(f"{head!r} first used as {m[0]!r} unlinked")
    assert not unlinked_first, unlinked_first
    assert linked >= 10, linked
