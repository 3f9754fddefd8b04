"""README.md and docs/ are what a user reads on GitHub: every relative link resolves to a file in the
repository (and to a heading there, by GitHub's anchor rules, where it names one), nothing points at
a development-only path or at "this machine", and the README stays a front door (issue 44, item 5)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
_FENCE = re.compile(r"^(```|~~~)")


def prose(text: str) -> str:
    """The text outside fenced code blocks and inline code spans: links there are not links."""
    kept, fenced = [], False
    for line in text.splitlines():
        if _FENCE.match(line.lstrip()):
            fenced = not fenced
            continue
        if not fenced:
            kept.append(re.sub(r"`[^`]*`", "", line))
    return "\n".join(kept)


def github_slug(heading: str) -> str:
    """GitHub's anchor for a heading: its text without markup, lower case, punctuation other than
    hyphens and underscores dropped, spaces turned into hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text
    text = text.replace("`", "").replace("*", "").strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    found: set[str] = set()
    seen: dict[str, int] = {}
    fenced = False
    for line in path.read_text().splitlines():
        if _FENCE.match(line.lstrip()):
            fenced = not fenced
            continue
        match = re.match(r"#{1,6} +(.*?)\s*#*\s*$", line)
        if fenced or not match:
            continue
        slug = github_slug(match[1])
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        found.add(slug if count == 0 else f"{slug}-{count}")
    return found


def relative_links(path: Path) -> list[str]:
    return [target for target in _LINK.findall(prose(path.read_text()))
            if not re.match(r"[a-z][a-z0-9+.-]*:", target)]


def test_slugs_follow_github() -> None:
    assert github_slug("Restores and the codec (`kvgate bench ttft`, `kvgate bench codec`)") == (
        "restores-and-the-codec-kvgate-bench-ttft-kvgate-bench-codec")
    assert github_slug('Condensing long context ("Cascade")') == "condensing-long-context-cascade"
    assert github_slug("Single-flight, cache vocabulary, feedback") == "single-flight-cache-vocabulary-feedback"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page: Path) -> None:
    broken = []
    for target in relative_links(page):
        file_part, _, anchor = target.partition("#")
        resolved = (page.parent / file_part).resolve() if file_part else page
        if not resolved.is_relative_to(ROOT) or not resolved.exists():
            broken.append(f"{target}: no such file")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            broken.append(f"{target}: no heading #{anchor} in {resolved.relative_to(ROOT)}")
    assert not broken, broken


def test_the_readme_links_every_docs_page() -> None:
    linked = {(ROOT / target.partition("#")[0]).resolve() for target in relative_links(ROOT / "README.md")}
    assert set(PAGES[1:]) <= linked, [str(p.relative_to(ROOT)) for p in PAGES[1:] if p not in linked]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_nothing_points_outside_the_repository(page: Path) -> None:
    text = page.read_text()
    assert "../shared" not in text
    assert not re.search(r"this (\d+-core )?machine", text, re.IGNORECASE)


def test_the_readme_is_a_front_door() -> None:
    assert len((ROOT / "README.md").read_text().splitlines()) <= 260
