"""Every relative link a reader can follow resolves: in the README, the docs and the lessons'
Markdown cells, the file it names exists and, for a ``#anchor`` into a Markdown page, a heading
of that page has that slug. The docs build refuses a missing target too, but it runs late in CI
and only over what the site includes; this check names the file and the link at once."""

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
#: ``[text](target)`` or ``![alt](target "title")``: the target up to a space or ``)``
LINK = re.compile(r"\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
EXTERNAL = ("http://", "https://", "mailto:")


def _sources() -> list[Path]:
    return ([ROOT / "README.md"] + sorted((ROOT / "docs").rglob("*.md"))
            + sorted((ROOT / "notebooks").glob("*.ipynb")))


def _markdown(path: Path) -> str:
    if path.suffix != ".ipynb":
        return path.read_text()
    cells = json.loads(path.read_text())["cells"]
    return "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown")


def _without_code(text: str) -> str:
    """Markdown with fenced blocks and inline code removed: a link in code is not a link."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    return re.sub(r"`[^`\n]*`", "", text)


def _slug(heading: str) -> str:
    """The anchor MyST and GitHub give a heading: lower case, punctuation dropped, spaces to
    hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    headings = re.findall(r"^#{1,6}\s+(.+?)\s*#*$", _without_code(page.read_text()), flags=re.M)
    return {_slug(h) for h in headings}


def _links() -> list[tuple[Path, str]]:
    found = []
    for source in _sources():
        for target in LINK.findall(_without_code(_markdown(source))):
            if not target.startswith(EXTERNAL + ("#",)):
                found.append((source, target))
    return found


def test_the_check_finds_links():
    """The pattern must see the lessons' links at all, or the next test passes vacuously."""
    targets = {t for _, t in _links()}
    assert "glossary.ipynb" in targets and any(t.startswith("../docs/") for t in targets)


def test_slug_follows_the_heading_rule():
    assert _slug("7. How a row dies") == "7-how-a-row-dies"
    assert _slug("9.1 Rescale policies, as data") == "91-rescale-policies-as-data"


@pytest.mark.parametrize("source,target", _links(),
                         ids=lambda v: v.name if isinstance(v, Path) else v)
def test_relative_link_resolves(source, target):
    path, _, anchor = target.partition("#")
    resolved = (source.parent / path).resolve()
    where = f"{source.relative_to(ROOT)} links {target!r}"
    assert resolved.exists(), f"{where}: {resolved.relative_to(ROOT)} does not exist"
    if anchor and resolved.suffix == ".md":
        assert anchor in _anchors(resolved), f"{where}: no heading with slug {anchor!r}"
