"""Every relative link in the README and docs/ (its subfolders too) names a file that is there
(and an anchor that is there, for links into a markdown file), and no document links outside
the repository; the README stays short enough to read at once."""

from __future__ import annotations

import re
from pathlib import Path

from tests.conftest import ROOT

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def anchors(md: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    out = set()
    for line in md.read_text().splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            out.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return out


def test_every_relative_link_resolves():
    broken = []
    for md in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        for target in LINK.findall(md.read_text()):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue
            path, _, anchor = target.partition("#")
            dest = (md.parent / path).resolve()
            if not dest.exists():
                broken.append(f"{md.relative_to(ROOT)} -> {target}")
            elif ROOT not in dest.parents and dest != ROOT:
                broken.append(f"{md.relative_to(ROOT)} -> {target} (outside the repository)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                broken.append(f"{md.relative_to(ROOT)} -> {target} (no such heading)")
    assert broken == [], "\n".join(broken)


README_LINES = 150  # the README is the front page: what lastgood is, how to run it, where to read on


def test_the_readme_stays_short():
    lines = len((ROOT / "README.md").read_text().splitlines())
    assert lines <= README_LINES, f"README.md has {lines} lines, over {README_LINES}: move detail into docs/"
