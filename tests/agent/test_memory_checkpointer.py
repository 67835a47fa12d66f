"""The Checkpointer's memory tier end to end (docs/memory-tier.md): a real service, two real
agents on loopback with different --host labels, one rank. A memory save commits from the
agents' copy reports and restores bit-exact from the own agent; with the own agent's copy
damaged the partner's is read; with both damaged the restore falls back to the durable
ancestor, bit-exact; an agent that is away gives the memory save up with an event while the
durable saves go on."""

from __future__ import annotations

import contextlib
import tempfile
from pathlib import Path

import httpx
import pytest
import torch
from torch import nn

import lastgood
from lastgood.common.interval import Interval

from ..conftest import FAST, ServiceProc
from .test_agent import AgentProc, _free_port, _wait


@pytest.fixture(scope="module")
def nodes(tmp_path_factory):
    svc = ServiceProc(tmp_path_factory.mktemp("memck-svc"), dict(FAST)).start()
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else None
    with tempfile.TemporaryDirectory(prefix="lastgood-memck-", dir=base) as d:
        a = AgentProc("node-a", _free_port(), Path(d) / "a", {}, "--live-every", "0.3", url=svc.url)
        b = AgentProc("node-b", _free_port(), Path(d) / "b", {}, "--live-every", "0.3", url=svc.url)
        yield svc, a, b
        a.stop()
        b.stop()
    svc.stop()


class _Nodes:
    """A service of a test's own and two agents on loopback (node-a, node-b) under a tmpfs."""

    def __init__(self, svc, a, b, root: Path) -> None:
        self.svc, self.a, self.b, self.root = svc, a, b, root


@contextlib.contextmanager
def own_nodes(tmp_path: Path, env: dict, prefix: str):
    """_Nodes, every process stopped at the end (of an agent a test replaced, the one it left in
    the object)."""
    svc = ServiceProc(tmp_path / "svc", {**FAST, **env}).start()
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else None
    try:
        with tempfile.TemporaryDirectory(prefix=prefix, dir=base) as d:
            n = _Nodes(svc, AgentProc("node-a", _free_port(), Path(d) / "a", {}, "--live-every", "0.3", url=svc.url),
                       AgentProc("node-b", _free_port(), Path(d) / "b", {}, "--live-every", "0.3", url=svc.url),
                       Path(d))
            try:
                yield n
            finally:
                n.a.stop()
                n.b.stop()
    finally:
        svc.stop()


def _held(agent) -> set[int]:
    return {s["checkpoint_id"] for s in agent.status()["segments"]}


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Linear(64, 64)


def _same(m1: nn.Module, m2: nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(m1.state_dict().values(), m2.state_dict().values()))


def _flip(root: Path, run: str, cid: int) -> None:
    for f in (root / run / str(cid) / "0").iterdir():
        raw = bytearray(f.read_bytes())
        raw[len(raw) // 2] ^= 0x01
        f.write_bytes(bytes(raw))


def _checkpoint(svc, cid: int) -> dict:
    return httpx.get(f"{svc.url}/api/v1/checkpoints/{cid}", timeout=10).json()


def _save_durable_then_memory(svc, a, run):
    """Step 1 durable (model seed 1), step 2 memory (seed 2): (durable, memory) checkpoints and models."""
    durable, memory = _model(1), _model(2)
    with lastgood.Checkpointer(svc.url, run=run, memory=Interval(every_steps=2), agent=a.address) as ck:
        ck.save(1, lastgood.TrainState(model=durable))
        ck.wait()
        d_id = ck.last_saved.checkpoint_id
        assert ck.due(2)  # the memory interval's step
        ck.save(2, lastgood.TrainState(model=memory))
        ck.wait()
        assert ck.memory.stats == {"memory_committed": 1, "memory_given_up": 0}
        m_id = ck.parent_id
    assert m_id != d_id and _checkpoint(svc, m_id)["tier"] == "memory" and _checkpoint(svc, d_id)["tier"] == "durable"
    assert _checkpoint(svc, m_id)["status"] == "COMMITTED"
    return d_id, m_id, durable, memory


def _restore(svc, a, run):
    fresh = _model(99)
    with lastgood.Checkpointer(svc.url, run=run, agent=a.address, memory=Interval(every_steps=2)) as ck:
        step = ck.restore(lastgood.TrainState(model=fresh))
        reads = ck.restore_reads
    return step, fresh, reads


@pytest.mark.slow
def test_memory_save_restores_from_own_agent_then_partner(nodes, run_name):
    svc, a, b = nodes
    _, m_id, _, memory = _save_durable_then_memory(svc, a, run_name)
    served = lambda agent: agent.status()["served_bytes"]  # noqa: E731
    before_a, before_b = served(a), served(b)
    step, fresh, reads = _restore(svc, a, run_name)
    assert step == 2 and _same(fresh, memory) and reads == {"memory_copies": [a.address]}
    # the own agent's copy was read from its path on this host, not through the agent's socket
    assert served(a) == before_a
    _flip(a.root, run_name, m_id)  # the own agent's copy damaged: the partner's is read
    step, fresh, reads = _restore(svc, a, run_name)
    assert step == 2 and _same(fresh, memory) and reads == {"memory_copies": [b.address]}
    assert served(b) > before_b  # CONTROL: a partner's copy comes over HTTP


def test_both_copies_damaged_falls_back_to_the_durable_ancestor(nodes, run_name):
    svc, a, b = nodes
    d_id, m_id, durable, memory = _save_durable_then_memory(svc, a, run_name)
    _flip(a.root, run_name, m_id)
    _flip(b.root, run_name, m_id)
    step, fresh, _ = _restore(svc, a, run_name)
    assert step == 1 and _same(fresh, durable) and not _same(fresh, memory)


def test_an_agent_away_gives_the_memory_save_up_and_durable_saves_go_on(nodes, run_name):
    svc, _, _ = nodes
    away = f"127.0.0.1:{_free_port()}"  # nothing listens there
    with lastgood.Checkpointer(svc.url, run=run_name, memory=Interval(every_steps=2), agent=away) as ck:
        ck.save(1, lastgood.TrainState(model=_model(1)))
        ck.save(2, lastgood.TrainState(model=_model(2)), tier="memory")
        ck.save(3, lastgood.TrainState(model=_model(3)))
        ck.wait()  # the memory save given up fails nothing
        assert ck.memory.stats == {"memory_committed": 0, "memory_given_up": 1}
        assert ck.last_saved.step == 3
    events = httpx.get(f"{svc.url}/api/v1/runs/{run_name}/events", params={"kind": "memory_given_up"},
                       timeout=10).json()
    items = events.get("events", events.get("items", events))
    assert len(items) == 1 and items[0]["data"]["step"] == 2, events


def _flip_rank(root: Path, run: str, cid: int, rank: int) -> None:
    for f in (root / run / str(cid) / str(rank)).iterdir():
        raw = bytearray(f.read_bytes())
        raw[len(raw) // 2] ^= 0x01
        f.write_bytes(bytes(raw))


@pytest.mark.slow
def test_two_torchrun_ranks_restore_from_memory_then_partner_then_durable(nodes, run_name):
    """Rank r saves into agent r; each agent's partner is the other. Restores: every rank
    from its own agent; rank 0's own copy damaged: rank 0 from the partner; every copy of
    rank 0 damaged: both ranks fall back to the durable step 1 alike."""
    from tests.multiproc.launch import torchrun, why

    svc, a, b = nodes
    script = Path(__file__).parents[1] / "multiproc" / "memory_ranks.py"
    agents = f"{a.address},{b.address}"
    saved = torchrun(script, ["save", svc.url, run_name, agents], timeout=180)
    assert saved.returncode == 0, why(saved)
    assert saved.stdout.count("'memory_committed': 1") == 2, why(saved)
    lg = httpx.get(f"{svc.url}/api/v1/runs/{run_name}/last-good", timeout=10).json()
    assert lg["step"] == 2 and lg["tier"] == "memory"

    def restored():
        res = torchrun(script, ["restore", svc.url, run_name, agents], timeout=180)
        assert res.returncode == 0, why(res)
        return res.stdout

    out = restored()
    assert f"[rank 0] restored step 2 weight 10.0 reads {{'memory_copies': ['{a.address}']}}" in out, out
    assert f"[rank 1] restored step 2 weight 11.0 reads {{'memory_copies': ['{b.address}']}}" in out, out
    _flip_rank(a.root, run_name, lg["id"], 0)
    out = restored()
    assert f"[rank 0] restored step 2 weight 10.0 reads {{'memory_copies': ['{b.address}']}}" in out, out
    _flip_rank(b.root, run_name, lg["id"], 0)
    out = restored()
    assert "[rank 0] restored step 1 weight 1.0" in out and "[rank 1] restored step 1 weight 2.0" in out, out


def test_the_service_refuses_to_verify_a_memory_checkpoint_with_409(nodes, run_name):
    """It holds none of the bytes: a clear 409 (never a 5xx a client would retry for minutes)."""
    svc, a, _ = nodes
    with lastgood.Checkpointer(svc.url, run=run_name, memory=Interval(every_steps=2), agent=a.address) as ck:
        ck.save(2, lastgood.TrainState(model=_model(2)), tier="memory")
        ck.wait()
        cid = ck.parent_id
    assert ck.memory.stats["memory_committed"] == 1
    r = httpx.post(f"{svc.url}/api/v1/checkpoints/{cid}/verify", timeout=10)
    assert r.status_code == 409 and "memory checkpoint" in r.text, (r.status_code, r.text[:300])
    assert _checkpoint(svc, cid)["status"] == "COMMITTED"  # changed nothing


@pytest.mark.slow
def test_fsdp2_memory_checkpoint_restores_at_another_world_size_from_the_agents(nodes, run_name, tmp_path):
    """(d) of the issue: an FSDP2 model with AdamW saved by 2 ranks, step 2 a memory
    checkpoint, restored on 1 and on 3 ranks from the agents' copies (every old rank's file
    read whole, verified), every full tensor identical and no sample repeated or skipped.
    Both copies of old rank 1's file damaged: every rank falls back to the durable step 1."""
    from tests.multiproc.launch import torchrun, why
    from tests.multiproc.test_reshard import SCRIPT, assert_round_trip, read

    svc, a, b = nodes
    agents = ["--agents", f"{a.address},{b.address}"]
    saved = torchrun(SCRIPT, ["save", svc.url, run_name, str(tmp_path / "save"), *agents], nproc=2, timeout=240)
    assert saved.returncode == 0, why(saved)
    lg = httpx.get(f"{svc.url}/api/v1/runs/{run_name}/last-good", timeout=10).json()
    assert (lg["step"], lg["tier"], lg["world_size"]) == (2, "memory", 2)
    for after in (1, 3):
        out = tmp_path / f"on{after}"
        res = torchrun(SCRIPT, ["restore", svc.url, run_name, str(out), "2", *agents], nproc=after, timeout=240)
        assert res.returncode == 0, why(res)
        assert_round_trip(tmp_path / "save", out, 2, after)
        for rank in range(after):
            reads = read(out, rank)["reads"]
            assert reads["saved_world_size"] == 2 and reads["memory_copies"], reads
            assert set(reads["memory_copies"]) <= {a.address, b.address}
    _flip_rank(a.root, run_name, lg["id"], 1)
    _flip_rank(b.root, run_name, lg["id"], 1)
    res = torchrun(SCRIPT, ["restore", svc.url, run_name, str(tmp_path / "fallback"), "1", *agents], nproc=1,
                   timeout=240)
    assert res.returncode == 0, why(res)


def test_a_reader_without_a_memory_interval_reads_the_agent_it_names_first(nodes, run_name):
    """Checkpointer(read_only=True, agent=B) restores a memory checkpoint from B's copy: the
    `agent` it is given is its own node's, whether or not it saves a memory tier (it was
    ignored without `memory=`, and the service's order read A's copy)."""
    svc, a, b = nodes
    _, _, _, memory = _save_durable_then_memory(svc, a, run_name)
    fresh = _model(99)
    with lastgood.Checkpointer(svc.url, run=run_name, read_only=True, agent=b.address) as ck:
        assert ck.restore(lastgood.TrainState(model=fresh)) == 2
        assert ck.restore_reads == {"memory_copies": [b.address]}, ck.restore_reads
    assert _same(fresh, memory)


@pytest.mark.slow
@pytest.mark.parametrize("memory_gc", ["0.3", "0"], ids=["prompt", "control-off"])
def test_memory_checkpoints_beyond_the_retention_leave_the_agents_within_seconds(tmp_path, run_name, memory_gc):
    """Six memory saves: with LASTGOOD_MEMORY_GC_SECONDS the memory checkpoints beyond
    memory:latest:2 are deleted from the catalog within seconds of the commits and both
    agents free their segments (into their pools), well before the hourly GC pass. Control,
    0: they stay committed and held, as before, until the scheduled pass."""
    from lastgood.wire import tiers

    with own_nodes(tmp_path, {"LASTGOOD_MEMORY_GC_SECONDS": memory_gc}, 'lastgood-memgc-') as n:
        svc, a, b = n.svc, n.a, n.b
        with lastgood.Checkpointer(svc.url, run=run_name, memory=Interval(every_steps=1), agent=a.address) as ck:
            for step in range(1, 7):
                ck.save(step, lastgood.TrainState(model=_model(step)), tier="memory")
                ck.wait()
            assert ck.memory.stats["memory_committed"] == 6

        def committed() -> list[int]:
            items = httpx.get(f"{svc.url}/api/v1/runs/{run_name}/checkpoints", timeout=10).json()["items"]
            return sorted(c["step"] for c in items if c["status"] == "COMMITTED")

        def held(agent) -> int:
            return len(agent.status()["segments"])

        want = tiers.DEFAULT_MEMORY_KEEP
        if memory_gc != "0":
            _wait(lambda: committed() == [5, 6] and held(a) == want and held(b) == want, timeout=30)
            assert a.status()["pooled_bytes"] > 0 and b.status()["pooled_bytes"] > 0
        else:
            import time

            time.sleep(3)  # ten live polls and ten would-be memory GC periods
            assert committed() == [1, 2, 3, 4, 5, 6] and held(a) == 6 and held(b) == 6


@pytest.mark.slow
def test_a_partner_that_cannot_be_reached_gives_the_memory_save_up_at_once(tmp_path, run_name):
    """Agent A's only partner (B, registered) is gone: A's copy to it fails, the rank asks
    its agent while it waits, and the memory save is given up within seconds with the reason,
    not after the commit timeout (45 s here), which held the save thread and every durable
    save queued behind it; the durable save after it commits."""
    import time

    # a lease of a production's order: the checkpoint is not abandoned by its lease meanwhile
    with own_nodes(tmp_path, {"LASTGOOD_LEASE_SECONDS": "120"}, 'lastgood-partner-') as n:
        svc, a, b = n.svc, n.a, n.b
        b.proc.kill()  # gone, but still listed within the agents' TTL: A's partner
        b.proc.wait(10)
        with lastgood.Checkpointer(svc.url, run=run_name, memory=Interval(every_steps=2), agent=a.address,
                                   commit_timeout=45) as ck:
            t0 = time.monotonic()
            ck.save(2, lastgood.TrainState(model=_model(2)), tier="memory")
            ck.save(3, lastgood.TrainState(model=_model(3)))
            ck.wait()
            took = time.monotonic() - t0
            assert ck.memory.stats == {"memory_committed": 0, "memory_given_up": 1}
            assert ck.last_saved.step == 3
        assert took < 20, took
        events = httpx.get(f"{svc.url}/api/v1/runs/{run_name}/events", params={"kind": "memory_given_up"},
                           timeout=10).json()["items"]
        assert len(events) == 1 and "partner" in events[0]["data"]["reason"], events
        assert b.address in events[0]["data"]["reason"]


@pytest.mark.slow
def test_a_service_outage_gives_memory_saves_up_and_the_agents_keep_the_last_committed(tmp_path, run_name):
    """Memory checkpoints need the catalog to commit, as durable ones do (docs/memory-tier.md,
    failure semantics): while the service is down a memory save is given up (its begin fails
    once the retries are spent) and training goes on; the agents, whose live polls fail, free
    nothing, so the last committed memory checkpoint stays in both nodes' memory; once the
    service is back the next memory save commits, and a restore reads it. The save before the
    outage, which commits, is the control that the given-up save is the outage's doing."""
    import time

    from lastgood.remote.retry import RetryPolicy

    with own_nodes(tmp_path, {}, 'lastgood-outage-') as n:
        svc, a, b = n.svc, n.a, n.b
        with lastgood.Checkpointer(svc.url, run=run_name, memory=Interval(every_steps=1), agent=a.address,
                                   retry=RetryPolicy(deadline=3.0), heartbeat_seconds=0) as ck:
            ck.save(1, lastgood.TrainState(model=_model(1)), tier="memory")
            ck.wait()
            assert ck.memory.stats == {"memory_committed": 1, "memory_given_up": 0}
            first = ck.parent_id
            _wait(lambda: first in _held(a) and first in _held(b))
            svc.stop()
            ck.save(2, lastgood.TrainState(model=_model(2)), tier="memory")
            ck.wait()
            assert ck.memory.stats == {"memory_committed": 1, "memory_given_up": 1}
            time.sleep(1.5)  # several failed live polls on each agent
            assert first in _held(a) and first in _held(b)
            svc.start(keep_ports=True)
            ck.save(3, lastgood.TrainState(model=_model(3)), tier="memory")
            ck.wait()
            assert ck.memory.stats == {"memory_committed": 2, "memory_given_up": 1}
        fresh = _model(99)
        with lastgood.Checkpointer(svc.url, run=run_name, read_only=True, agent=a.address) as reader:
            assert reader.restore(lastgood.TrainState(model=fresh)) == 3
        assert _same(fresh, _model(3))


@pytest.mark.slow
@pytest.mark.parametrize("fresh", [False, True], ids=["adopted", "control-fresh"])
def test_a_restarted_agent_adopts_its_predecessors_segments_and_serves_them(tmp_path, run_name, fresh):
    """An agent killed and started again on its node (same --shm-root, same address) holds
    what the killed one held: it hashes the segments, reports them as its copies, and the live
    list keeps them. Its partner is gone too, so only the restarted agent can serve the memory
    checkpoint: the restore reads it from there, bit-exact. Control: started with --fresh it
    removes them, and the restore falls back to the durable ancestor."""
    import time

    with own_nodes(tmp_path, {}, 'lastgood-adopt-') as n:
        svc, a, b = n.svc, n.a, n.b
        _, m_id, durable, memory = _save_durable_then_memory(svc, a, run_name)
        _wait(lambda: m_id in _held(a) and m_id in _held(b))
        a.proc.kill()  # SIGKILL: nothing of it runs on the way out
        a.proc.wait(10)
        b.stop()  # the partner's copy is gone with it
        a = n.a = AgentProc("node-a", int(a.address.rsplit(":", 1)[1]), n.root / "a", {}, "--live-every", "0.3",
                            *(["--fresh"] if fresh else []), url=svc.url)
        step, restored, reads = _restore(svc, a, run_name)
        if fresh:
            assert step == 1 and _same(restored, durable) and _held(a) == set()
            return
        assert step == 2 and _same(restored, memory) and reads == {"memory_copies": [a.address]}
        assert [e["kind"] for e in a.status()["events"]].count("adopted") == 1
        time.sleep(1.0)  # several live polls: an adopted checkpoint that is live stays
        assert m_id in _held(a)
