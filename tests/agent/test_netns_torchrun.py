"""The memory tier's node-failure scenarios with real torchrun jobs (docs/memory-tier.md, "How it is
tested"): two nodes (network namespaces, tests/netns.py), each with its own `lastgood agent` and
one torchrun rank, joined by a multi-node rendezvous over the veth addresses; the job trains
(tests/agent/netns_train.py: a memory checkpoint every 2 steps, a durable one every 5) and stops
mid-run after step 9, when the newest memory checkpoint is step 8 and the newest durable one
step 5. Then nodes fail the way machines do, and the job is relaunched:

(a) one node lost, relaunched on the survivor and a spare: resumes from the memory tier at step
    8 (one step lost, less than one memory interval), the lost rank's shard read from its
    partner's agent, and ends bit-exact with a run that never failed;
(b) both nodes lost (a node and its replica): falls back to the durable step 5, bit-exact.

The reference is the same job with no Checkpointer, under torchrun on loopback."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from lastgood.remote import config

from ..conftest import ROOT
from ..multiproc.launch import inherited_env, torchrun, why
from ..netns import fabric  # noqa: F401 - the fixture

pytestmark = pytest.mark.slow
SCRIPT = Path(__file__).with_name("netns_train.py")
RDZV_PORT = 29500  # in the first node's own port space
HANG_AFTER, LAST_MEMORY, LAST_DURABLE, MEMORY_EVERY = 9, 8, 5, 2


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> list[str]:
    """Each rank's fingerprint of the final state of a run that never failed."""
    out = tmp_path_factory.mktemp("netns-reference")
    done = torchrun(SCRIPT, ["reference", str(out)], nproc=2, timeout=240)
    assert done.returncode == 0, why(done)
    return [json.loads((out / f"reference-rank{r}.json").read_text())["fingerprint"] for r in range(2)]


class Job:
    """One launch: a torchrun on each node (node rank = its place in `nodes`), the first node
    the rendezvous host; each node's output in a log file."""

    def __init__(self, fab, nodes: list, run: str, out: Path, *args: str) -> None:
        self.nodes, self.out = nodes, out
        out.mkdir(parents=True, exist_ok=True)
        self.procs, self.logs = [], []
        for i, node in enumerate(nodes):
            cmd = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={len(nodes)}", "--nproc-per-node=1",
                   f"--node-rank={i}", f"--master-addr={nodes[0].ip}", f"--master-port={RDZV_PORT}",
                   str(SCRIPT), "train", str(out), *args]
            env = {**inherited_env(), "OMP_NUM_THREADS": "1", "GRPC_VERBOSITY": "ERROR", "PYTHONFAULTHANDLER": "1",
                   "GLOO_SOCKET_IFNAME": "eth0", config.ENV_URL: fab.service.url, config.ENV_RUN: run,
                   config.ENV_TOKEN: fab.token, config.ENV_AGENT: node.agent_address}
            log = out / f"{node.label}.log"
            self.logs.append(log)
            with open(log, "w") as f:
                self.procs.append(node.popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT))

    def output(self) -> str:
        return "\n".join(f"--- {log.name}\n{log.read_text()[-4000:]}" for log in self.logs)

    def wait_files(self, name: str, timeout: float = 240) -> list[dict]:
        """Every rank's OUT/<name>-rank<R>.json, failing with the logs if a launcher ends first."""
        paths = [self.out / f"{name}-rank{r}.json" for r in range(len(self.nodes))]
        deadline = time.monotonic() + timeout
        while not all(p.exists() for p in paths):
            ended = [p.poll() for p in self.procs]
            assert time.monotonic() < deadline, f"no {name} files after {timeout} s:\n{self.output()}"
            assert name != "hung" or all(rc is None for rc in ended), f"a launcher ended: {ended}\n{self.output()}"
            time.sleep(0.2)
        time.sleep(0.2)  # written whole: each file is one write_text of a short JSON
        return [json.loads(p.read_text()) for p in paths]

    def finish(self, timeout: float = 240) -> list[dict]:
        for p in self.procs:
            try:
                p.wait(timeout)
            except subprocess.TimeoutExpired:
                raise AssertionError(f"the job did not end in {timeout} s:\n{self.output()}") from None
        assert all(p.returncode == 0 for p in self.procs), f"{[p.returncode for p in self.procs]}\n{self.output()}"
        return self.wait_files("train", timeout=5)

    def reap(self) -> None:
        for p in self.procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                pass


def _get(fab, path: str) -> dict:
    r = httpx.get(f"{fab.service.url}{path}", headers={"Authorization": f"Bearer {fab.token}"}, timeout=30)
    assert r.status_code == 200, (path, r.status_code, r.text[:300])
    return r.json()


def _stopped_mid_run(fab, run: str, tmp_path: Path):
    """Nodes A and B, the job trained to step 9 and waiting: (a, b, the first job)."""
    a = fab.node("node-a").start_agent()
    b = fab.node("node-b").start_agent()
    job = Job(fab, [a, b], run, tmp_path / "first", str(HANG_AFTER))
    hung = job.wait_files("hung")
    assert all(h["step"] == HANG_AFTER and h["memory"]["memory_given_up"] == 0 for h in hung), hung
    lg = _get(fab, f"/api/v1/runs/{run}/last-good")
    assert (lg["step"], lg["tier"]) == (LAST_MEMORY, "memory"), lg
    durable = [c for c in _get(fab, f"/api/v1/runs/{run}/checkpoints")["items"]
               if c["tier"] == "durable" and c["status"] == "COMMITTED"]
    assert max(c["step"] for c in durable) == LAST_DURABLE, durable
    return a, b, job


def test_a_node_lost_relaunched_on_the_survivor_and_a_spare_resumes_from_memory_bit_exact(
        fabric, run_name, tmp_path, reference):  # noqa: F811
    a, b, first = _stopped_mid_run(fabric, run_name, tmp_path)
    b.kill()        # node B fails: its rank, its agent, its shared memory
    a.kill_job()    # the survivor's torchrun group goes with the job; its agent keeps its segments
    first.reap()
    spare = fabric.node("node-c").start_agent()
    done = Job(fabric, [a, spare], run_name, tmp_path / "second").finish()
    for rank, got in enumerate(done):
        assert got["restored"] == LAST_MEMORY, (rank, got)  # not the durable step 5
        assert got["fingerprint"] == reference[rank], (rank, got)
        # rank 0 from its own agent; rank 1's own node is gone: its shard from A, B's partner
        assert got["reads"] == {"memory_copies": [a.agent_address]}, (rank, got)
    assert HANG_AFTER - done[0]["restored"] < MEMORY_EVERY  # lost less than one memory interval


def test_a_node_and_its_replica_lost_fall_back_to_the_durable_tier_bit_exact(
        fabric, run_name, tmp_path, reference):  # noqa: F811
    a, b, first = _stopped_mid_run(fabric, run_name, tmp_path)
    a.kill()
    b.kill()
    first.reap()
    c, d = fabric.node("node-c").start_agent(), fabric.node("node-d").start_agent()
    done = Job(fabric, [c, d], run_name, tmp_path / "second").finish()
    for rank, got in enumerate(done):
        assert got["restored"] == LAST_DURABLE, (rank, got)
        assert got["fingerprint"] == reference[rank], (rank, got)
