"""A rank of a job for the supervisor's tests, started by torchrun (no torch, no training).

    fail        exit 3 at once
    finish S    sleep S seconds, exit 0
    linger DIR  start a child in a session of its own that ignores SIGTERM (the way torchrun
                starts its workers, plus a stubborn one), write DIR/rank{R} = "PID CHILD",
                then sleep until killed
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

STUBBORN = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN)\nwhile True: time.sleep(1)"


def main() -> None:
    mode = sys.argv[1]
    if mode == "fail":
        sys.exit(3)
    if mode == "finish":
        time.sleep(float(sys.argv[2]))
        return
    child = subprocess.Popen([sys.executable, "-c", STUBBORN], start_new_session=True)
    rank = os.environ["LOCAL_RANK"]
    part = Path(sys.argv[2]) / f"rank{rank}.part"
    part.write_text(f"{os.getpid()} {child.pid}")
    part.rename(part.with_suffix(""))
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    while True:
        time.sleep(1)


if __name__ == "__main__":
    main()
