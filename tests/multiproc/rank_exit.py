"""How the rank scripts end: flush, then leave without interpreter finalization.

torch 2.13 + gloo: a gloo worker thread may still be releasing a finished collective
(`ProcessGroupGloo::runLoop` -> `~AsyncAllgatherCoalescedWork` -> the tensors' Python
objects) while the main thread is in `Py_FinalizeEx`. The worker then needs the GIL, the
finalizing interpreter ends that thread with pthread_exit, the forced unwind meets a
noexcept frame, and the rank aborts with "terminate called without an active exception"
after all its work is done (seen in a core dump of dcp_rank.py, about one run in fifteen
under load). The scripts have closed their Checkpointers and flushed their files by then,
so they exit here instead; a failure inside main() still exits with its traceback.
"""

from __future__ import annotations

import os
import sys


def run(main) -> None:
    main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
