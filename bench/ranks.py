"""One rank of the four-rank case: its own process, its own state and Checkpointer.

    RANK=r WORLD_SIZE=4 python -m bench.ranks URL RUN ATTEMPT SIZE_BYTES

Prints {"ready": ..., "bytes": ...} once the state is built; then for every line
"save STEP" on stdin saves synchronously (save + wait, i.e. to the acknowledged commit)
and prints {"t0": ..., "t1": ...} (time.time(), comparable across processes); "quit" ends.
"""

from __future__ import annotations

import json
import sys
import time

from bench.common import build_state, state_bytes


def main() -> None:
    url, run, attempt, size = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    import lastgood

    model, opt = build_state(size, seed=int(__import__("os").environ.get("RANK", "0")))
    state = lastgood.TrainState(model=model, optimizer=opt)
    ckpt = lastgood.Checkpointer(url, run=run, attempt=attempt)
    print(json.dumps({"ready": True, "bytes": state_bytes(model, opt)}), flush=True)
    for line in sys.stdin:
        cmd = line.split()
        if not cmd or cmd[0] == "quit":
            break
        step = int(cmd[1])
        t0 = time.time()
        ckpt.save(step, state)
        ckpt.wait()
        t1 = time.time()
        print(json.dumps({"t0": t0, "t1": t1, "checkpoint_id": ckpt.last_saved.checkpoint_id}), flush=True)
    ckpt.close()


if __name__ == "__main__":
    main()
