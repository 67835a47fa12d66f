"""The rank side of bench.memory_tier, run inside node A's namespace (one process, a world of one).

    python -m bench.memory_tier_rank measure '{"size": .., "reps": .., "own": A, "partner": B, "dcp": DIR}'
    python -m bench.memory_tier_rank sink PORT            (in node B: receives, prints the bytes)
    python -m bench.memory_tier_rank send HOST:PORT BYTES (in node A: the link's own throughput)

`measure` prints one JSON line: per rep, in a rotating order, the plain copy (the snapshot floor),
a durable and a memory save (the stall: save() until it returns; and until wait() returns, the
save committed), DCP's save to a local directory; then each restore of that rep's checkpoints
(memory from the own agent, memory from the partner's agent, durable from the store through
the service's spool as a rank on the service's host reads it, durable streamed over the veth as a
rank on another host reads it, DCP from the local directory) and the memory checkpoint's files read raw from each agent, verified."""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from pathlib import Path

CHUNK = 1 << 20


def sink(port: int) -> None:
    srv = socket.create_server(("0.0.0.0", port))
    print("ready", flush=True)
    conn, _ = srv.accept()
    buf, got = bytearray(CHUNK), 0
    view = memoryview(buf)
    while n := conn.recv_into(view):
        got += n
    conn.sendall(b"k")
    print(got, flush=True)


def send(address: str, nbytes: int) -> None:
    host, _, port = address.rpartition(":")
    block = memoryview(bytes(CHUNK))
    conn = socket.create_connection((host, int(port)), timeout=60)
    start, left = time.perf_counter(), nbytes
    while left > 0:
        conn.sendall(block[:min(left, CHUNK)])
        left -= CHUNK
    conn.shutdown(socket.SHUT_WR)
    assert conn.recv(1) == b"k"
    print(json.dumps({"bytes": nbytes, "seconds": time.perf_counter() - start}), flush=True)


def measure(a: dict) -> dict:
    import lastgood
    from bench.common import build_state, order_of, state_bytes, state_tensors
    from bench.peers import CopyFloor, dcp_load, dcp_save
    from lastgood.datapath.agents import read_verified
    from lastgood.remote import config

    model, opt = build_state(a["size"])
    state = lastgood.TrainState(model=model, optimizer=opt)
    floor = CopyFloor(state_tensors(model, opt))
    times: dict[str, list[float]] = {}
    reads: dict[str, list] = {"memory_own": [], "memory_partner": []}

    def note(name: str, seconds: float) -> None:
        times.setdefault(name, []).append(seconds)

    ck = lastgood.Checkpointer(run=a["run"], memory=lastgood.Interval(every_steps=1), agent=a["own"])
    step, ids = 0, {}

    def save(tier: str) -> None:
        nonlocal step
        step += 1
        t0 = time.perf_counter()
        ck.save(step, state, tier=tier)
        note(f"{tier}_stall", time.perf_counter() - t0)
        ck.wait()
        note(f"{tier}_commit", time.perf_counter() - t0)
        ids[tier] = ck.last_saved.checkpoint_id if tier == "durable" else ck.parent_id

    saves = {"copy": lambda: note("copy", floor.once()), "durable": lambda: save("durable"),
             "memory": lambda: save("memory"), "dcp_save": lambda: note("dcp_save", dcp_save(model, opt, Path(a["dcp"])))}

    def restore(name: str, agent: str | None, cid: int, spool: bool = True) -> None:
        if not spool:  # the store read over the network, as from a store on other hosts
            os.environ[config.ENV_SPOOL] = "0"
        try:
            reader = lastgood.Checkpointer(run=a["run"], read_only=True, agent=agent)
        finally:
            os.environ.pop(config.ENV_SPOOL, None)
        with reader:
            t0 = time.perf_counter()
            got = reader.restore(state, checkpoint_id=cid)
            note(f"restore_{name}", time.perf_counter() - t0)
            if name.startswith("memory"):
                reads[name].append(reader.restore_reads)
            assert got is not None

    scratch = bytearray(0)

    def raw(name: str, agent: str, cid: int) -> None:
        """The transfer path alone: into a buffer already touched (as the link case's), so a
        new buffer's page faults, which every restore pays alike, are not counted here."""
        nonlocal scratch
        manifest = ck.transport.manifest(cid)
        files = manifest.files(0)
        if len(scratch) < max(f.size for f in files):
            scratch = bytearray(max(f.size for f in files))
        t0, total = time.perf_counter(), 0
        for f in files:
            data, source = read_verified([agent], a["run"], cid, 0, f.name, f.size, f.xxh3_128, into=scratch)
            assert source == agent
            total += f.size
        note(f"read_{name}", time.perf_counter() - t0)
        times.setdefault("read_bytes", [total])

    for i in range(a["reps"]):
        for case in order_of(list(saves), i):
            saves[case]()
        mem, dur = ids["memory"], ids["durable"]
        restores = {"memory_own": lambda: restore("memory_own", a["own"], mem),
                    "memory_partner": lambda: restore("memory_partner", a["partner"], mem),
                    "durable": lambda: restore("durable", None, dur),
                    "durable_streamed": lambda: restore("durable_streamed", None, dur, spool=False),
                    "dcp_local": lambda: note("restore_dcp_local", dcp_load(model, opt, Path(a["dcp"]))),
                    "read_own": lambda: raw("own", a["own"], mem),
                    "read_partner": lambda: raw("partner", a["partner"], mem)}
        for case in order_of(list(restores), i):
            restores[case]()
    stats = dict(ck.memory.stats)
    ck.close()
    return {"state_bytes": state_bytes(model, opt), "times": times, "memory_stats": stats, "reads": reads}


if __name__ == "__main__":
    op = sys.argv[1]
    if op == "sink":
        sink(int(sys.argv[2]))
    elif op == "send":
        send(sys.argv[2], int(sys.argv[3]))
    else:
        print(json.dumps(measure(json.loads(sys.argv[2]))), flush=True)
