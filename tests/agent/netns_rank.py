"""What a rank does against the agents, run as a process inside a node (tests/netns.py):
`save` writes a file into its own agent's segment and makes it ready; `read` reads a held
file back from the copies in order, verified (lastgood.datapath.agents.read_verified).
One JSON argument in, one JSON line out; a read with no good copy exits 3."""

from __future__ import annotations

import json
import random
import sys
import time
from pathlib import Path

from lastgood.datapath.agents import AgentClient, read_verified
from lastgood.errors import CorruptCheckpoint
from lastgood.wire.hashing import hash_bytes


def payload(seed: int, size: int) -> bytes:
    return random.Random(seed).randbytes(size)


def main(op: str, a: dict) -> int:
    if op == "save":
        data = payload(a["seed"], a["size"])
        own = AgentClient(a["agent"])
        Path(own.reserve(a["run"], a["cid"], a["rank"], len(data)), a["name"]).write_bytes(data)
        held = own.ready(a["run"], a["cid"], a["rank"], [a["name"]], replicas=a.get("replicas", 1))
        print(json.dumps({"xxh3_128": hash_bytes(data), "size": len(data), "held": held}))
        return 0
    start = time.perf_counter()
    try:
        data, source = read_verified(a["copies"], a["run"], a["cid"], a["rank"], a["name"], a["size"], a["digest"])
    except CorruptCheckpoint as e:
        print(json.dumps({"error": "CorruptCheckpoint", "detail": str(e)}))
        return 3
    print(json.dumps({"source": source, "xxh3_128": hash_bytes(bytes(data)), "seconds": time.perf_counter() - start}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], json.loads(sys.argv[2])))
