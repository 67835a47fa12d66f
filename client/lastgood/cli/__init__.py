"""`lastgood`, the command line: runs, checkpoints, lineage, tags, GC, verify, download, export,
import-dcp, supervise, agent.

    lastgood runs
    lastgood ls gpt-small --status COMMITTED
    lastgood lineage gpt-small
    lastgood download gpt-small@last-good ./ckpt
    lastgood export gpt-small@last-good ./gpt-small-hf --dtype bf16

REST only and torch-free (see app.py for the output and exit-code contract), but for
`export --format dcp` and `import-dcp`, which import torch when they run.
"""

from __future__ import annotations

from lastgood.cli import agent, commands, download, export, supervise  # noqa: F401 - registers the commands on `cli`
from lastgood.cli.app import EXIT_HELP, Exit, cli, main

__all__ = ["EXIT_HELP", "Exit", "cli", "main"]

if __name__ == "__main__":  # pragma: no cover - `python -m lastgood.cli` runs __main__.py
    main()
