"""The memory tier in the catalog (docs/memory-tier.md, "In the catalog"): node agents
register, report the copies they hold, and a memory checkpoint commits only once each file
is held with its declared digest on `1 + replicas` distinct hosts. A real service process;
the agents' REST calls are made here with plain HTTP, as an agent makes them."""

from __future__ import annotations

import time

import grpc
import pytest

from lastgood.wire import tiers
from lastgood.wire.v1 import lastgood_pb2 as pb

from .helpers import ATTEMPT, RPC_TIMEOUT, events, http, json_error, rpc_error

D1, D2 = "1" * 32, "2" * 32


def register(svc, host: str, port: int = 7000) -> dict:
    r = http(svc).post("/api/v1/agents", json={"host": host, "address": f"127.0.0.1:{port}"})
    assert r.status_code == 200, r.text
    return r.json()


def begin(cl, run: str, step: int = 1, world: int = 1, replicas: int = 1, parent: int = 0) -> int:
    return cl.stub.BeginCheckpoint(pb.BeginCheckpointRequest(
        run=run, step=step, world_size=world, attempt=ATTEMPT, tier="memory", replicas=replicas, parent_id=parent),
        timeout=RPC_TIMEOUT).checkpoint_id


def vote(cl, cid: int, rank: int, files: dict[str, str], size: int = 10):
    return cl.stub.CommitRank(pb.CommitRankRequest(
        checkpoint_id=cid, rank=rank, memory_files=[pb.MemoryFile(name=n, size=size, xxh3_128=d)
                                                    for n, d in files.items()]), timeout=RPC_TIMEOUT)


def report(svc, agent: dict, cid: int, rank: int, files: dict[str, str], size: int = 10, key: str | None = None):
    return http(svc).post(f"/api/v1/checkpoints/{cid}/copies",
                          headers={tiers.AGENT_KEY_HEADER: key or agent["key"]},
                          json={"agent_id": agent["agent_id"], "rank": rank,
                                "files": [{"name": n, "size": size, "xxh3_128": d} for n, d in files.items()]})


def status(svc, cid: int) -> str:
    r = http(svc).get(f"/api/v1/checkpoints/{cid}")
    assert r.status_code == 200, r.text
    return r.json()["status"]


def test_register_lists_and_a_second_registration_retires_the_first(svc):
    a = register(svc, "node-a", 7101)
    assert len(a["key"]) == tiers.AGENT_KEY_HEX and a["agent_id"] > 0
    again = register(svc, "node-a", 7101)
    listed = http(svc).get("/api/v1/agents").json()["agents"]
    ids = [x["agent_id"] for x in listed]
    assert again["agent_id"] in ids and a["agent_id"] not in ids  # the old one stops counting
    mine = next(x for x in listed if x["agent_id"] == again["agent_id"])
    assert mine == {"agent_id": again["agent_id"], "host": "node-a", "rack": "", "switch": "",
                    "address": "127.0.0.1:7101"}
    # bad labels: a clear 400, nothing registered
    for body in ({"host": "../x", "address": "h:1"}, {"host": "n", "address": "no-port"},
                 {"host": "n", "address": "h:99999"}, {"host": "n", "rack": "a b", "address": "h:1"}):
        json_error(http(svc).post("/api/v1/agents", json=body), (400, 422))
    assert len(http(svc).get("/api/v1/agents").json()["agents"]) == len(listed)


def listed(svc) -> set[int]:
    return {x["agent_id"] for x in http(svc).get("/api/v1/agents").json()["agents"]}


def live(svc, agent: dict):
    r = http(svc).get(f"/api/v1/agents/{agent['agent_id']}/live", headers={tiers.AGENT_KEY_HEADER: agent["key"]})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("ttl", [2.0, 3600.0], ids=["ttl", "control-long-ttl"])
def test_an_agent_not_heard_from_leaves_the_placement_list_until_its_next_call(make_service, ttl):
    """A dead node's agent stops asking for its live list; once LASTGOOD_AGENT_TTL_SECONDS have
    passed no rank's placement sees it (on main it was listed forever, and a ring could pick a
    dead partner). With a TTL longer than the test (the control) it stays listed."""
    svc = make_service(LASTGOOD_AGENT_TTL_SECONDS=str(ttl))
    alive, dead = register(svc, "node-alive"), register(svc, "node-dead")
    assert listed(svc) == {alive["agent_id"], dead["agent_id"]}
    end = time.monotonic() + 3.0
    while time.monotonic() < end:  # the live one beats as an agent does (every --live-every)
        live(svc, alive)
        time.sleep(0.4)
    if ttl < 3:
        assert listed(svc) == {alive["agent_id"]}
        live(svc, dead)  # back: its call marks it seen again
    assert listed(svc) == {alive["agent_id"], dead["agent_id"]}


def test_commits_with_two_hosts_reports_and_not_with_one(svc, cl, run_name):
    a, b = register(svc, "host-a"), register(svc, "host-b")
    cid = begin(cl, run_name)
    assert report(svc, a, cid, 0, {"model.bin": D1}).json()["status"] == "PENDING"  # before the vote
    assert vote(cl, cid, 0, {"model.bin": D1}).status == "PENDING"  # one host only: no commit (control)
    assert status(svc, cid) == "PENDING"
    # the same host again (another agent on it) does not count twice
    a2 = register(svc, "host-a", 7002)
    assert report(svc, a2, cid, 0, {"model.bin": D1}).json()["status"] == "PENDING"
    assert report(svc, b, cid, 0, {"model.bin": D1}).json()["status"] == "COMMITTED"
    view = http(svc).get(f"/api/v1/checkpoints/{cid}").json()
    assert view["tier"] == "memory"
    copies = http(svc).get(f"/api/v1/checkpoints/{cid}/copies").json()
    assert copies["tier"] == "memory" and copies["replicas"] == 1
    (entry,) = copies["copies"]
    assert {x["host"] for x in entry["agents"]} == {"host-a", "host-b"} and entry["rank"] == 0


def test_reports_after_the_vote_commit_a_two_rank_checkpoint(svc, cl, run_name):
    a, b = register(svc, "host-c"), register(svc, "host-d")
    cid = begin(cl, run_name, world=2)
    for r in (0, 1):
        assert vote(cl, cid, r, {f"r{r}.bin": D1}).status == "PENDING"
    for r in (0, 1):
        report(svc, a, cid, r, {f"r{r}.bin": D1})
    assert status(svc, cid) == "PENDING"
    assert report(svc, b, cid, 0, {"r0.bin": D1}).json()["status"] == "PENDING"
    assert report(svc, b, cid, 1, {"r1.bin": D1}).json()["status"] == "COMMITTED"


def test_a_copy_of_other_bytes_abandons_it(svc, cl, run_name):
    a, b = register(svc, "host-e"), register(svc, "host-f")
    cid = begin(cl, run_name)
    vote(cl, cid, 0, {"m.bin": D1})
    report(svc, a, cid, 0, {"m.bin": D1})
    assert report(svc, b, cid, 0, {"m.bin": D2}).json()["status"] == "ABANDONED"
    mism = [e for e in events(svc, run_name) if e["kind"] == "hash_mismatch"]
    assert mism and mism[0]["data"]["agent_id"] == b["agent_id"], mism


def test_a_mismatch_reported_before_the_vote_abandons_it_at_the_vote(svc, cl, run_name):
    a = register(svc, "host-g")
    cid = begin(cl, run_name)
    report(svc, a, cid, 0, {"m.bin": D2})
    e = rpc_error(grpc.StatusCode.FAILED_PRECONDITION, vote, cl, cid, 0, {"m.bin": D1})
    assert "ABANDONED" in e.details()
    assert status(svc, cid) == "ABANDONED"


def test_a_wrong_key_is_refused_recorded_and_changes_nothing(svc, cl, run_name):
    a, b = register(svc, "host-h"), register(svc, "host-i")
    cid = begin(cl, run_name)
    vote(cl, cid, 0, {"m.bin": D1})
    report(svc, a, cid, 0, {"m.bin": D1})
    json_error(report(svc, b, cid, 0, {"m.bin": D1}, key=a["key"]), 403)  # another agent's key
    json_error(report(svc, b, cid, 0, {"m.bin": D2}, key="0" * 64), 403)  # a mismatch, refused first
    assert status(svc, cid) == "PENDING"
    assert [x["host"] for x in http(svc).get(f"/api/v1/checkpoints/{cid}/copies").json()["copies"][0]["agents"]] \
        == ["host-h"]
    assert len([e for e in events(svc, run_name) if e["kind"] == "copy_report_refused"]) == 2
    # control: the right key commits it
    assert report(svc, b, cid, 0, {"m.bin": D1}).json()["status"] == "COMMITTED"


def test_durable_checkpoints_refuse_reports_and_memory_ones_refuse_bytes(svc, cl, run_name):
    a = register(svc, "host-j")
    durable, _ = cl.save(run_name, 1)
    json_error(report(svc, a, durable, 0, {"m.bin": D1}), 409)
    json_error(http(svc).get(f"/api/v1/checkpoints/{durable}/copies"), 409)
    assert http(svc).get(f"/api/v1/checkpoints/{durable}").json()["tier"] == "durable"


def test_live_names_the_pending_and_held_memory_checkpoints(svc, cl, run_name):
    a, b = register(svc, "host-k"), register(svc, "host-l")
    held = begin(cl, run_name, step=1)
    vote(cl, held, 0, {"m.bin": D1})
    report(svc, a, held, 0, {"m.bin": D1})
    report(svc, b, held, 0, {"m.bin": D1})
    pending = begin(cl, run_name, step=2)
    live = http(svc).get(f"/api/v1/agents/{a['agent_id']}/live", headers={tiers.AGENT_KEY_HEADER: a["key"]})
    assert live.status_code == 200, live.text
    got = {(x["run"], x["checkpoint_id"]) for x in live.json()["live"]}
    assert {(run_name, held), (run_name, pending)} <= got
    json_error(http(svc).get(f"/api/v1/agents/{a['agent_id']}/live", headers={tiers.AGENT_KEY_HEADER: b["key"]}), 403)


def test_memory_bytes_through_the_service_are_refused(svc, cl, run_name):
    a, b = register(svc, "host-m"), register(svc, "host-n")
    cid = begin(cl, run_name)
    vote(cl, cid, 0, {"m.bin": D1})
    report(svc, a, cid, 0, {"m.bin": D1})
    assert report(svc, b, cid, 0, {"m.bin": D1}).json()["status"] == "COMMITTED"
    err = json_error(http(svc).get(f"/api/v1/checkpoints/{cid}/ranks/0/files/m.bin"), 409)
    assert "memory checkpoint" in err["message"]
    e = rpc_error(grpc.StatusCode.FAILED_PRECONDITION, cl.read, cid, 0, "m.bin")
    assert "read it from its agents" in e.details()


def _durable_tag(svc, run: str) -> list[int]:
    items = http(svc).get(f"/api/v1/runs/{run}/checkpoints", params={"limit": 100}).json()["items"]
    return [c["id"] for c in items if any(t["name"] == tiers.LAST_GOOD_DURABLE_TAG for t in c["tags"])]


def test_the_last_good_durable_tag_moves_with_durable_commits(svc, cl, run_name):
    a, b = register(svc, "host-o"), register(svc, "host-p")
    first, _ = cl.save(run_name, 1)
    assert _durable_tag(svc, run_name) == []  # control: a run of durable checkpoints only has none
    mem = begin(cl, run_name, step=2)
    vote(cl, mem, 0, {"m.bin": D1})
    report(svc, a, mem, 0, {"m.bin": D1})
    assert report(svc, b, mem, 0, {"m.bin": D1}).json()["status"] == "COMMITTED"
    assert _durable_tag(svc, run_name) == [first]  # the first memory commit names the newest durable one
    last_good = http(svc).get(f"/api/v1/runs/{run_name}/last-good").json()
    assert last_good["id"] == mem and last_good["tier"] == "memory"  # last-good: the newest of either tier
    second, _ = cl.save(run_name, 3)
    assert _durable_tag(svc, run_name) == [second]


def _memory_chain(svc, cl, run: str, parent: int, steps) -> list[int]:
    a, b = register(svc, f"gc-a-{run[-6:]}"), register(svc, f"gc-b-{run[-6:]}")
    mems = []
    for step in steps:
        cid = begin(cl, run, step=step, parent=mems[-1] if mems else parent)
        vote(cl, cid, 0, {"m.bin": D1})
        report(svc, a, cid, 0, {"m.bin": D1})
        assert report(svc, b, cid, 0, {"m.bin": D1}).json()["status"] == "COMMITTED"
        mems.append(cid)
    return mems


def _gc(svc, run: str, spec: str) -> list[int]:
    r = http(svc).put(f"/api/v1/runs/{run}/retention", json={"retention": spec})
    assert r.status_code == 200, r.text
    return http(svc).post("/api/v1/gc").json()["result"]["deleted"]


def test_gc_keeps_the_last_good_durable_checkpoint_and_deletes_memory_rows(svc, cl, run_name):
    durable, _ = cl.save(run_name, 1)
    mems = _memory_chain(svc, cl, run_name, durable, (2, 3))
    deleted = _gc(svc, run_name, "latest:0,last-good,branch-heads,memory:latest:1")
    assert mems[0] in deleted and mems[1] not in deleted  # memory:latest:1 keeps the newest memory checkpoint
    assert durable not in deleted  # latest:0 would delete it: the last-good-durable tag keeps it
    assert status(svc, durable) == "COMMITTED" and status(svc, mems[0]) == "DELETED"


def test_gc_keeps_the_default_number_of_memory_checkpoints(svc, cl, run_name):
    durable, _ = cl.save(run_name, 1)
    mems = _memory_chain(svc, cl, run_name, durable, (2, 3, 4))
    deleted = _gc(svc, run_name, "latest:1,last-good,branch-heads")  # no memory rule: tiers.DEFAULT_MEMORY_KEEP
    assert tiers.DEFAULT_MEMORY_KEEP == 2
    assert deleted == [mems[0]]  # latest:1 counts durable checkpoints: the durable one stays too


def test_the_lineage_names_each_checkpoint_s_tier(svc, cl, run_name):
    durable, _ = cl.save(run_name, 1)
    mem = _memory_chain(svc, cl, run_name, durable, [2])[0]
    r = http(svc).get(f"/api/v1/runs/{run_name}/lineage")
    assert r.status_code == 200, r.text
    nodes = {n["id"]: n for n in r.json()["nodes"]}
    assert nodes[durable]["tier"] == "durable"  # control: a durable save is named durable
    assert nodes[mem]["tier"] == "memory" and nodes[mem]["parent_id"] == durable and nodes[mem]["last_good"]
