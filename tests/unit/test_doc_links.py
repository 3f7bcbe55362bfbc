"""Every link between the docs resolves: README.md, CHANGELOG.md and docs/*.md, each relative link
to a file that exists and, with a #fragment, to a heading of that file (GitHub's anchors)."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PAGES = [REPO / "README.md", REPO / "CHANGELOG.md", *sorted((REPO / "docs").glob("*.md"))]
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")


def prose(text: str) -> list[str]:
    """The lines outside fenced code blocks."""
    lines, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced:
            lines.append(line)
    return lines


def anchors(path: Path) -> set[str]:
    """GitHub's anchor of every heading: lower case, punctuation out, spaces to hyphens, -1, -2 ...
    after repeats."""
    seen: dict[str, int] = {}
    out = set()
    for line in prose(path.read_text()):
        match = re.match(r"#{1,6} (.+)", line)
        if not match:
            continue
        slug = re.sub(r"[^\w\- ]", "", match[1].strip().lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        out.add(slug if count == 0 else f"{slug}-{count}")
    return out


def broken_links(page: Path) -> list[str]:
    broken = []
    for line in prose(page.read_text()):
        for match in LINK.finditer(line):
            target = match[1] or match[2]
            if re.match(r"[a-z]+:", target):  # http(s), mailto: not checked here
                continue
            file, _, fragment = target.partition("#")
            path = (page.parent / file).resolve() if file else page
            where = f"{page.relative_to(REPO)}: ({target})"
            if not path.exists():
                broken.append(f"{where}: no file {path.relative_to(REPO) if path.is_relative_to(REPO) else path}")
            elif fragment and path.suffix == ".md" and fragment not in anchors(path):
                broken.append(f"{where}: no heading #{fragment} in {path.relative_to(REPO)}")
    return broken


def test_every_link_between_the_docs_resolves() -> None:
    broken = [problem for page in PAGES for problem in broken_links(page)]
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_anchors_follow_github() -> None:
    page = REPO / "README.md"
    assert "use-with-vllm" in anchors(page)
    assert "the-demo-make-demo-and-layerkv-demo" in anchors(REPO / "docs" / "performance.md")
