"""Every relative link in the README and docs/ names a file that is there (and an anchor
that is there, for links into a markdown file), and no document links outside the repository."""

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
    for md in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
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
