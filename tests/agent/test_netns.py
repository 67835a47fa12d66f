"""The memory tier across nodes that fail like machines (tests/netns.py): each node is a
network namespace with its own `lastgood agent` on its veth address and its own shm root;
the service listens on the bridge; a rank's agent calls run as a process inside its node
(tests/agent/netns_rank.py); killing a node SIGKILLs every process in it and removes its
namespace and shm root."""

from __future__ import annotations

import json
from pathlib import Path

import grpc
import httpx
import pytest

from lastgood.wire import tiers
from lastgood.wire.v1 import lastgood_pb2 as pb
from lastgood.wire.v1 import lastgood_pb2_grpc as pb_grpc

from ..netns import fabric  # noqa: F401 - the fixture
from ..service.helpers import ATTEMPT, RPC_TIMEOUT
from .test_agent import _wait

pytestmark = pytest.mark.slow
RANK = str(Path(__file__).with_name("netns_rank.py"))
SIZE = 3 << 20


class Catalog:
    """The catalog calls of a memory checkpoint (begin, the rank's vote) over the bridge."""

    def __init__(self, fab) -> None:
        self.fab = fab
        self.channel = grpc.insecure_channel(fab.service.grpc_target)
        self.stub = pb_grpc.CheckpointsStub(self.channel)
        self.md = (("authorization", f"Bearer {fab.token}"),)
        self.http = httpx.Client(base_url=fab.service.url, headers={"Authorization": f"Bearer {fab.token}"}, timeout=30)

    def begin(self, run: str, step: int, tier: str = "memory", replicas: int = 1) -> int:
        return self.stub.BeginCheckpoint(pb.BeginCheckpointRequest(run=run, step=step, world_size=1, attempt=ATTEMPT,
                                                                   tier=tier, replicas=replicas),
                                         timeout=RPC_TIMEOUT, metadata=self.md).checkpoint_id

    def vote(self, cid: int, name: str, size: int, digest: str) -> None:
        self.stub.CommitRank(pb.CommitRankRequest(checkpoint_id=cid, rank=0, memory_files=[
            pb.MemoryFile(name=name, size=size, xxh3_128=digest)]), timeout=RPC_TIMEOUT, metadata=self.md)

    def status(self, cid: int) -> str:
        return self.http.get(f"/api/v1/checkpoints/{cid}").json()["status"]

    def holders(self, cid: int) -> dict[str, str]:
        [entry] = self.http.get(f"/api/v1/checkpoints/{cid}/copies").json()["copies"]
        return {a["host"]: a["address"] for a in entry["agents"]}

    def close(self) -> None:
        self.http.close()
        self.channel.close()


def _rank(node, op: str, **args) -> tuple[int, dict]:
    got = node.python(RANK, op, json.dumps(args))
    assert got.stdout or op == "save", f"{op} in {node.label}: rc {got.returncode}: {got.stderr[-2000:]}"
    if not got.stdout:
        return got.returncode, {"stderr": got.stderr[-1500:]}
    return got.returncode, json.loads(got.stdout.strip().splitlines()[-1])


def _memory_checkpoint(cat: Catalog, node, run: str, step: int, seed: int) -> tuple[int, dict]:
    """What one rank on `node` does for a memory checkpoint: begin, its files into its own
    agent (which replicates them to its partner), its vote; committed from the agents' reports."""
    cid = cat.begin(run, step)
    rc, saved = _rank(node, "save", agent=node.agent_address, run=run, cid=cid, rank=0, name="model.lgs",
                      size=SIZE, seed=seed)
    assert rc == 0, (saved, httpx.get(f"http://{node.agent_address}{tiers.AGENT_STATUS_PATH}", timeout=10).json())
    cat.vote(cid, "model.lgs", saved["size"], saved["xxh3_128"])
    _wait(lambda: cat.status(cid) == "COMMITTED", timeout=30)
    return cid, saved


def _read(node, copies: list[str], run: str, cid: int, saved: dict) -> tuple[int, dict]:
    return _rank(node, "read", copies=copies, run=run, cid=cid, rank=0, name="model.lgs", size=saved["size"],
                 digest=saved["xxh3_128"])


@pytest.fixture
def cat(fabric):  # noqa: F811
    c = Catalog(fabric)
    yield c
    c.close()


def test_a_memory_checkpoint_across_two_nodes_survives_one_node_lost_and_not_both(fabric, cat, run_name):  # noqa: F811
    a = fabric.node("node-a").start_agent()
    b = fabric.node("node-b").start_agent()
    cid, saved = _memory_checkpoint(cat, a, run_name, 1, seed=1)
    holders = cat.holders(cid)
    assert holders == {"node-a": a.agent_address, "node-b": b.agent_address}
    assert (a.shm_root / run_name / str(cid) / "0" / "model.lgs").is_file()
    a.kill()
    # node A failed like a machine: no process, no namespace, no segment left of it
    assert not a.shm_root.exists() and a.ns not in fabric_namespaces()
    # the restoring rank (here on the survivor) tries the lost node's agent first: refused, B's copy read
    rc, got = _read(b, [holders["node-a"], holders["node-b"]], run_name, cid, saved)
    assert rc == 0, got
    assert got["source"] == b.agent_address and got["xxh3_128"] == saved["xxh3_128"]
    # the partner lost too: read_verified (from a spare node) raises CorruptCheckpoint naming
    # every copy tried, which is where the restorer turns to the newest good ancestor (the
    # durable tier); the read above is its control
    b.kill()
    rc, got = _read(fabric.node("node-c"), [holders["node-a"], holders["node-b"]], run_name, cid, saved)
    assert rc == 3 and got["error"] == "CorruptCheckpoint", got
    assert holders["node-a"] in got["detail"] and holders["node-b"] in got["detail"]


def test_a_spare_node_takes_the_lost_ones_place_and_partners_new_checkpoints(fabric, cat, run_name):  # noqa: F811
    a = fabric.node("node-a").start_agent()
    b = fabric.node("node-b").start_agent()
    cid, _ = _memory_checkpoint(cat, b, run_name, 1, seed=3)
    assert set(cat.holders(cid)) == {"node-a", "node-b"}
    lost = a.agent_id
    a.kill()
    # the spare is a fresh namespace; it takes the lost node's label and address, so its
    # registration replaces the dead agent's in the placement
    spare = fabric.node("node-a", replaces=a).start_agent()
    assert spare.agent_id != lost
    listed = {x["agent_id"] for x in cat.http.get("/api/v1/agents").json()["agents"]}
    assert spare.agent_id in listed and b.agent_id in listed
    try:
        cid2, saved2 = _memory_checkpoint(cat, b, run_name, 2, seed=4)
    except AssertionError:
        st = lambda n: httpx.get(f"http://{n.agent_address}{tiers.AGENT_STATUS_PATH}", timeout=10).json()  # noqa: E731
        raise AssertionError((st(b)["events"], st(spare)["events"], st(spare)["segments"],
                              cat.http.get("/api/v1/agents").json())) from None
    assert cat.holders(cid2) == {"node-a": spare.agent_address, "node-b": b.agent_address}
    assert (spare.shm_root / run_name / str(cid2) / "0" / "model.lgs").is_file()
    b.kill()
    rc, got = _read(spare, [b.agent_address, spare.agent_address], run_name, cid2, saved2)
    assert rc == 0 and got["source"] == spare.agent_address, got


def fabric_namespaces() -> set[str]:
    import subprocess

    return set(subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split())
