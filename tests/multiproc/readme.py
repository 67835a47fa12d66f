"""The README's training snippet as a test runs it: the placeholders it leaves to the reader
(a model, a dataset, one step, the number of steps) filled by a prelude placed right after
the process group starts, and the values a test changes substituted, each exactly once."""

from __future__ import annotations

import re

from tests.conftest import ROOT


def readme_snippet(prelude: str, replace: dict[str, str]) -> str:
    """`replace`: regex -> text, each of which must match the snippet once (else the README
    moved and the test would silently run something else)."""
    code = re.search(r"## Use it in your training loop\n.*?```python\n(.*?)```", (ROOT / "README.md").read_text(),
                     re.S).group(1)
    for pattern, value in replace.items():
        code, n = re.subn(pattern, value, code)
        assert n == 1, f"the README's snippet no longer has {pattern!r} once"
    lines = code.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("dist.init_process_group"))
    return "\n".join(lines[:at + 1] + prelude.splitlines() + lines[at + 1:]) + "\n"
