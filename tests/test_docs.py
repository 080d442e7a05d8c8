"""README.md and docs/*.md: links that resolve, a short README, and no notes about particular test machines."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
README_MAX_LINES = 150

FENCE = re.compile(r"^```.*?^```", re.S | re.M)
CODE_SPAN = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"\[[^\]\n]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$", re.M)
# how the docs would narrate a particular machine someone borrowed, its calls and their time limits
MACHINE_NOTES = re.compile(
    r"\blent\b|\blease\b|\bsession \d+|\brun \d+\b|device (call|time|budget)|carry \[|\.gpu/p\d|shared/gpu"
    r"|two-call|\b15 minutes\b|\bbudget\b",
    re.I,
)


def _prose(text: str) -> str:
    """The text without fenced code blocks or code spans, where brackets are code, not links."""
    return CODE_SPAN.sub("", FENCE.sub("", text))


def _anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens, repeats numbered."""
    seen: dict[str, int] = {}
    out = set()
    for title in HEADING.findall(FENCE.sub("", page.read_text())):
        slug = re.sub(r"[^\w\- ]", "", title.replace("`", "").strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def _links(page: Path) -> list[str]:
    return [t for t in LINK.findall(_prose(page.read_text())) if not re.match(r"[a-z][a-z0-9+.-]*:", t)]


def test_there_are_pages():
    assert README.exists() and len(PAGES) > 5


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_point_at_existing_files_and_headings(page):
    broken = []
    for target in _links(page):
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{target}: no such file")
        elif anchor and file.suffix == ".md" and anchor not in _anchors(file):
            broken.append(f"{target}: no heading #{anchor} in {file.relative_to(ROOT)}")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


def test_readme_is_short():
    lines = len(README.read_text().splitlines())
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines: move detail into docs/*.md"


def test_readme_links_every_docs_page():
    linked = {(README.parent / t.partition("#")[0]).resolve() for t in _links(README)}
    missing = [p.name for p in PAGES[1:] if p.resolve() not in linked]
    assert not missing, f"docs pages the README's index does not link: {missing}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_notes_about_particular_test_machines(page):
    hits = [f"{page.relative_to(ROOT)}:{i}: {line.strip()}" for i, line in enumerate(page.read_text().splitlines(), 1)
            if MACHINE_NOTES.search(line)]
    assert not hits, "the docs describe the product, not the machines it was tested on:\n" + "\n".join(hits)


def test_the_checks_catch_what_they_are_for(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# A title, `code`\n\nSee [x](missing.md), [y](#a-title-code), [z](#nope), "
                    "`[not](a-link.md)` and [web](https://example.com).\n\n```\n[nor](this.md)\n```\n")
    assert _links(page) == ["missing.md", "#a-title-code", "#nope"]
    assert _anchors(page) == {"a-title-code"}
    for line in ("on the lent H200", "session 11 ran it", "a device call", "in run 7", "carry [\".gpu/p0\"]"):
        assert MACHINE_NOTES.search(line), line
    for line in ("measured on an H100 with torch 2.11+cu130", "run the suite", "excellent", "silently"):
        assert not MACHINE_NOTES.search(line), line
