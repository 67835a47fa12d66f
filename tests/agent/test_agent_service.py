"""The node agent against a real service (the contract of docs/memory-tier.md): two agents
on loopback with different --host labels register, a rank's memory checkpoint commits only
from the agents' own copy reports, its copies are listed and read back verified per file,
and a checkpoint the service no longer lists live is freed by the agent."""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

import httpx
import pytest

from lastgood.datapath.agents import AgentClient, read_verified
from lastgood.wire.hashing import hash_bytes
from lastgood.wire.v1 import lastgood_pb2 as pb

from ..conftest import FAST, ServiceProc
from ..service.helpers import ATTEMPT, RPC_TIMEOUT, Client
from .test_agent import AgentProc, _free_port, _wait


@pytest.fixture(scope="module")
def nodes(tmp_path_factory):
    """A service of the module's own (its agent list holds only these two) and two agents."""
    svc = ServiceProc(tmp_path_factory.mktemp("agent-svc"), dict(FAST)).start()
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else None
    with tempfile.TemporaryDirectory(prefix="lastgood-agent-test-", dir=base) as d:
        a = AgentProc("node-a", _free_port(), Path(d) / "a", {}, "--live-every", "0.3", url=svc.url)
        b = AgentProc("node-b", _free_port(), Path(d) / "b", {}, "--live-every", "0.3", url=svc.url)
        cl = Client(svc.grpc_target)
        yield svc, cl, a, b
        cl.close()
        a.stop()
        b.stop()
    svc.stop()


def _status(svc, cid: int) -> str:
    return httpx.get(f"{svc.url}/api/v1/checkpoints/{cid}", timeout=10).json()["status"]


def _memory_save(cl, a: AgentProc, run: str, step: int, data: bytes) -> int:
    cid = cl.stub.BeginCheckpoint(pb.BeginCheckpointRequest(run=run, step=step, world_size=1, attempt=ATTEMPT,
                                                            tier="memory", replicas=1), timeout=RPC_TIMEOUT).checkpoint_id
    own = AgentClient(a.address)
    Path(own.reserve(run, cid, 0, len(data)), "model.lgs").write_bytes(data)
    own.ready(run, cid, 0, ["model.lgs"], replicas=1)
    cl.stub.CommitRank(pb.CommitRankRequest(checkpoint_id=cid, rank=0, memory_files=[
        pb.MemoryFile(name="model.lgs", size=len(data), xxh3_128=hash_bytes(data))]), timeout=RPC_TIMEOUT)
    return cid


def test_a_memory_checkpoint_commits_from_the_agents_reports_and_reads_back_verified(nodes, run_name):
    svc, cl, a, b = nodes
    assert a.agent_id and b.agent_id and a.agent_id != b.agent_id
    data = os.urandom(2 << 20)
    cid = _memory_save(cl, a, run_name, 1, data)
    _wait(lambda: _status(svc, cid) == "COMMITTED")
    copies = httpx.get(f"{svc.url}/api/v1/checkpoints/{cid}/copies", timeout=10).json()
    [entry] = copies["copies"]
    holders = {x["host"]: x["address"] for x in entry["agents"]}
    assert holders == {"node-a": a.address, "node-b": b.address}
    # the own node's copy first; a byte flipped in it is caught and the partner's read
    own = a.root / run_name / str(cid) / "0" / "model.lgs"
    raw = bytearray(own.read_bytes())
    raw[777] ^= 0x80
    own.write_bytes(bytes(raw))
    got, source = read_verified([holders["node-a"], holders["node-b"]], run_name, cid, 0, "model.lgs",
                                len(data), hash_bytes(data))
    assert got == data and source == b.address
    assert not [e for e in a.status()["events"] + b.status()["events"] if e["kind"] != "placement_unknown"]


def test_a_checkpoint_no_longer_live_is_freed_and_a_live_one_kept(nodes, run_name):
    svc, cl, a, b = nodes
    keep = _memory_save(cl, a, run_name, 1, b"k" * 1000)
    _wait(lambda: _status(svc, keep) == "COMMITTED")
    gone = cl.stub.BeginCheckpoint(pb.BeginCheckpointRequest(run=run_name, step=2, world_size=1, attempt=ATTEMPT,
                                                             tier="memory", replicas=1), timeout=RPC_TIMEOUT).checkpoint_id
    own = AgentClient(a.address)
    Path(own.reserve(run_name, gone, 0, 10), "f").write_bytes(b"0123456789")
    own.ready(run_name, gone, 0, ["f"], replicas=1)
    _wait(lambda: any(s["checkpoint_id"] == gone for s in b.status()["segments"]))
    cl.stub.AbortCheckpoint(pb.AbortCheckpointRequest(checkpoint_id=gone, reason="test", rank=0), timeout=RPC_TIMEOUT)
    for agent in (a, b):
        _wait(lambda: [run_name, gone] in agent.status()["freed"])
        held = {s["checkpoint_id"] for s in agent.status()["segments"]}
        assert keep in held and gone not in held, agent.status()
    assert not (a.root / run_name / str(gone)).exists()
    time.sleep(1)   # several live polls later the committed one is still held (control of the rule)
    assert keep in {s["checkpoint_id"] for s in a.status()["segments"]}
