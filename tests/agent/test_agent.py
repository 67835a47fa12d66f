"""The node agent (lastgood.agent) as real processes on loopback: two "nodes" are two agents
with different --host labels. A rank's files land in its agent's segment, are hashed, copied
to the partner (which hashes what it received), and read back by ranged reads; the budget
frees the oldest checkpoint that may go, else refuses; bad input is a bounded 4xx."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from lastgood.agent.replicate import TokenBucket
from lastgood.wire import tiers
from lastgood.wire.hashing import hash_bytes


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class AgentProc:
    def __init__(self, host: str, port: int, root: Path, peers: dict[str, int], *extra: str, url: str | None = None) -> None:
        self.host, self.address, self.root = host, f"127.0.0.1:{port}", root
        cmd = [sys.executable, "-m", "lastgood.cli", *(["--url", url] if url else []), "agent", "--host", host,
               "--listen", self.address, "--shm-root", str(root), *([] if url else ["--standalone"]), *extra]
        for h, p in peers.items():
            cmd += ["--peer", f"{h}=127.0.0.1:{p}"]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline()
        assert line, self.proc.stderr.read()
        started = json.loads(line)
        assert started["address"] == self.address
        self.agent_id = started["agent_id"]

    def call(self, method: str, path: str, body: dict | None = None, headers: dict | None = None):
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(f"http://{self.address}{path}", method=method, data=data,
                                     headers={"Content-Type": "application/json", **(headers or {})})
        try:
            with urllib.request.urlopen(req, timeout=10) as r:
                raw = r.read()
                return r.status, (raw if r.headers.get("Content-Type") != "application/json" else json.loads(raw)), r.headers
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read()), e.headers

    def status(self) -> dict:
        return self.call("GET", tiers.AGENT_STATUS_PATH)[1]

    def save(self, run: str, ckpt: int, rank: int, files: dict[str, bytes], replicas: int = 1):
        """What a rank does: reserve, write its files into the segment directory, tell the agent."""
        code, got, _ = self.call("POST", tiers.AGENT_RESERVE_PATH,
                                 {"run": run, "checkpoint_id": ckpt, "rank": rank, "bytes": sum(map(len, files.values()))})
        if code != 200:
            return code, got
        for name, data in files.items():
            Path(got["directory"], name).write_bytes(data)
        code, got, _ = self.call("POST", tiers.AGENT_READY_PATH, {"run": run, "checkpoint_id": ckpt, "rank": rank,
                                                                 "files": list(files), "replicas": replicas})
        return code, got

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


@pytest.fixture
def shm(request):
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else None
    with tempfile.TemporaryDirectory(prefix="lastgood-agent-test-", dir=base) as d:
        yield Path(d)


@pytest.fixture
def two_nodes(shm):
    pa, pb = _free_port(), _free_port()
    a = AgentProc("node-a", pa, shm / "a", {"node-b": pb})
    b = AgentProc("node-b", pb, shm / "b", {"node-a": pa})
    yield a, b
    a.stop()
    b.stop()


def _wait(pred, timeout=15.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if (got := pred()):
            return got
        time.sleep(0.05)
    raise AssertionError("timed out")


def test_a_segment_is_hashed_replicated_to_the_partner_host_and_read_back_by_range(two_nodes):
    a, b = two_nodes
    data = os.urandom(3 << 20) + b"tail"
    code, got = a.save("run-1", 7, 0, {"model.lgs": data, "meta.json": b"{}"})
    assert code == 200, got
    assert got["partners"] == [b.address]
    assert {f["name"]: f["xxh3_128"] for f in got["files"]} == {"model.lgs": hash_bytes(data), "meta.json": hash_bytes(b"{}")}
    held = _wait(lambda: [s for s in b.status()["segments"] if s["checkpoint_id"] == 7 and len(s["files"]) == 2])
    assert {f["name"]: (f["size"], f["xxh3_128"]) for f in held[0]["files"]} == \
        {"model.lgs": (len(data), hash_bytes(data)), "meta.json": (2, hash_bytes(b"{}"))}
    assert (b.root / "run-1" / "7" / "0" / "model.lgs").read_bytes() == data   # the partner's own segment
    for agent in (a, b):
        code, body, headers = agent.call("GET", f"{tiers.AGENT_SEGMENTS_PATH}/run-1/7/0/model.lgs",
                                         headers={"Range": "bytes=1000-1048575"})
        assert code == 206 and body == data[1000:1 << 20]
        assert headers[tiers.AGENT_DIGEST_HEADER] == hash_bytes(data)
    assert not a.status()["events"] and not b.status()["events"]


def test_the_budget_frees_the_oldest_that_may_go_keeps_the_newest_complete_else_refuses(shm):
    a = AgentProc("node-a", _free_port(), shm / "a", {}, "--memory-budget", "3M")
    try:
        one = b"x" * (1 << 20)
        assert a.save("r", 1, 0, {"f": one}, replicas=0)[0] == 200
        assert a.save("r", 2, 0, {"f": one}, replicas=0)[0] == 200
        assert a.save("r", 3, 0, {"f": one + one[:1 << 19]}, replicas=0)[0] == 200   # 3.5M > 3M: frees 1
        st = a.status()
        assert st["freed"] == [["r", 1]] and not (a.root / "r" / "1").exists()
        assert sorted(s["checkpoint_id"] for s in st["segments"]) == [2, 3] and st["held_bytes"] <= 3 << 20
        # 3M more: freeing 2 is allowed (3 is now the newest complete), 3 stays: does not fit
        code, got = a.save("r", 4, 0, {"f": one * 3}, replicas=0)
        assert code == 507 and got["error"] == "budget"
        st = a.status()
        assert [e["kind"] for e in st["events"]] == ["memory_refused"]
        assert sorted(s["checkpoint_id"] for s in st["segments"]) == [2, 3] and st["freed"] == [["r", 1]]
        assert (a.root / "r" / "3" / "0" / "f").stat().st_size == 3 << 19
    finally:
        a.stop()


def test_bad_requests_are_bounded_4xx_and_change_nothing(two_nodes):
    a, _ = two_nodes
    assert a.save("r", 1, 0, {"f": b"abc"})[0] == 200
    before = a.status()["segments"]
    seg = tiers.AGENT_SEGMENTS_PATH
    assert a.call("GET", f"{seg}/r/1/0/f", headers={"Range": "bytes=2-9"})[0] == 400
    assert a.call("GET", f"{seg}/r/1/0/nope")[0] == 404
    assert a.call("GET", f"{seg}/%2E%2E/1/0/f")[0] == 400
    assert a.call("POST", tiers.AGENT_RESERVE_PATH, {"run": "../x", "checkpoint_id": 2, "rank": 0, "bytes": 1})[0] == 400
    assert a.call("POST", tiers.AGENT_READY_PATH, {"run": "r", "checkpoint_id": 2, "rank": 0, "files": ["gone"]})[0] == 404
    code, got, _ = a.call("POST", tiers.AGENT_READY_PATH, {"run": "r", "checkpoint_id": 2, "rank": 0, "files": ["f"], "replicas": 2})
    assert code == 409 and "partner" in got["detail"]      # two partners on other hosts needed, one known
    assert a.status()["segments"] == before
    assert [e["kind"] for e in a.status()["events"]] == ["memory_given_up"]


def test_an_unreachable_partner_is_an_event_and_the_rank_does_not_wait(shm):
    a = AgentProc("node-a", _free_port(), shm / "a", {"node-b": _free_port()})
    try:
        t0 = time.monotonic()
        code, got = a.save("r", 1, 0, {"f": b"y" * 1000})
        assert code == 200 and time.monotonic() - t0 < 5
        ev = _wait(lambda: a.status()["events"])
        assert ev[0]["kind"] == "partner_unreachable" and ev[0]["checkpoint_id"] == 1
    finally:
        a.stop()


def test_replication_is_throttled_to_its_rate(shm):
    pa, pb = _free_port(), _free_port()
    b = AgentProc("node-b", pb, shm / "b", {"node-a": pa})
    a = AgentProc("node-a", pa, shm / "a", {"node-b": pb}, "--replication-rate", "4M")
    try:
        data = os.urandom(4 << 20)
        t0 = time.monotonic()
        assert a.save("r", 1, 0, {"f": data})[0] == 200
        _wait(lambda: [s for s in b.status()["segments"] if s["files"]])
        took = time.monotonic() - t0
        assert took >= (4 - 1) / 4 * 0.95      # 1 MiB burst, then 4 MiB/s (unthrottled: milliseconds)
    finally:
        a.stop()
        b.stop()


def test_the_token_bucket_allows_its_rate_and_one_burst():
    now = [0.0]
    slept = []
    bucket = TokenBucket(100.0, burst=50, clock=lambda: now[0], sleep=lambda s: (slept.append(s), now.__setitem__(0, now[0] + s)))
    bucket.take(50)
    assert slept == []
    bucket.take(100)
    assert slept == [pytest.approx(1.0)]
    with pytest.raises(ValueError):
        TokenBucket(0)


def test_a_byte_flipped_in_a_replica_is_detected_and_the_other_copy_read(two_nodes):
    from lastgood.datapath.agents import AgentClient, AgentRefused, read_verified
    from lastgood.errors import CorruptCheckpoint

    a, b = two_nodes
    data = os.urandom(1 << 20)
    own = AgentClient(a.address)
    d = Path(own.reserve("r", 5, 1, len(data)))
    (d / "w.lgs").write_bytes(data)
    [held] = own.ready("r", 5, 1, ["w.lgs"])
    assert held["xxh3_128"] == hash_bytes(data)
    _wait(lambda: [s for s in b.status()["segments"] if s["files"]])
    # a byte flipped in the partner's shared memory, after it hashed its copy
    replica = b.root / "r" / "5" / "1" / "w.lgs"
    with open(replica, "r+b") as f:
        f.seek(12345)
        c = f.read(1)
        f.seek(12345)
        f.write(bytes([c[0] ^ 0x01]))
    got, source = read_verified([b.address, a.address], "r", 5, 1, "w.lgs", len(data), hash_bytes(data))
    assert got == data and source == a.address                  # the damaged copy was skipped
    # control: with only the damaged copy, nothing wrong is returned
    with pytest.raises(CorruptCheckpoint, match="not the manifest"):
        read_verified([b.address], "r", 5, 1, "w.lgs", len(data), hash_bytes(data))
    (a.root / "r" / "5" / "1" / "w.lgs").unlink()                # the own copy lost as well
    with pytest.raises(CorruptCheckpoint, match="no good copy"):
        read_verified([a.address, b.address], "r", 5, 1, "w.lgs", len(data), hash_bytes(data))
    with pytest.raises(AgentRefused) as e:
        own.reserve("../r", 6, 1, 10)
    assert e.value.status == 400


def test_supervise_with_a_memory_budget_runs_the_agent_and_hands_its_address_to_the_job(shm, tmp_path):
    """The service is unreachable here: the agent registers later (an event), the job runs,
    finds LASTGOOD_AGENT, and a save into the agent's segment is held and readable."""
    out = tmp_path / "job.json"
    job = ("import json, os, sys; sys.path[:0] = [%r]; "
           "from lastgood.datapath.agents import AgentClient, read_range; "
           "a = os.environ['LASTGOOD_AGENT']; c = AgentClient(a); d = c.reserve('r', 1, 0, 5); "
           "open(d + '/f', 'wb').write(b'hello'); "
           "held = c.ready('r', 1, 0, ['f'], replicas=0); "
           "json.dump({'held': held, 'read': read_range(a, 'r', 1, 0, 'f', 1, 3).decode()}, open(%r, 'w'))"
           % (str(Path(__file__).resolve().parents[2] / "client"), str(out)))
    proc = subprocess.run([sys.executable, "-m", "lastgood.cli", "--url", f"http://127.0.0.1:{_free_port()}",
                           "supervise", "--run", "r", "--max-restarts", "0", "--memory-budget", "1M",
                           "--agent-host", "node-a", "--agent-shm-root", str(shm / "a"), "--", sys.executable, "-c", job],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(out.read_text())
    assert got["held"] == [{"name": "f", "size": 5, "xxh3_128": hash_bytes(b"hello")}] and got["read"] == "ell"
    assert (shm / "a" / "r" / "1" / "0" / "f").read_bytes() == b"hello"   # it outlives the job's process


def test_a_copy_whose_node_drops_the_connection_is_passed_over_within_the_connect_timeout(two_nodes):
    """A node that is gone may drop the SYN (here: a listener whose accept queue is full, so
    the kernel drops every new SYN). A restore's read moves to the next copy once
    tiers.AGENT_CONNECT_TIMEOUT has passed, not after its whole read timeout (which it did:
    the connection's one timeout covered the connect too: 8 s here)."""
    import socket

    from lastgood.datapath.agents import AgentClient, read_verified
    from lastgood.errors import CorruptCheckpoint

    a, _ = two_nodes
    connect = getattr(tiers, "AGENT_CONNECT_TIMEOUT", 2.0)  # (getattr: the control runs on code without it)
    data = os.urandom(1 << 16)
    own = AgentClient(a.address)
    (Path(own.reserve("r", 7, 0, len(data))) / "w.lgs").write_bytes(data)
    own.ready("r", 7, 0, ["w.lgs"])
    hole = socket.socket()
    hole.bind(("127.0.0.1", 0))
    hole.listen(0)
    filler = socket.create_connection(hole.getsockname(), timeout=5)  # the accept queue is full now
    try:
        dead = "%s:%d" % hole.getsockname()
        read_timeout = 3 * connect + 2
        t0 = time.monotonic()
        got, source = read_verified([dead, a.address], "r", 7, 0, "w.lgs", len(data), hash_bytes(data),
                                    timeout=read_timeout)
        took = time.monotonic() - t0
        assert got == data and source == a.address
        assert connect * 0.9 <= took < read_timeout - 2, took
        with pytest.raises(CorruptCheckpoint, match=f"within {connect} s"):
            read_verified([dead], "r", 7, 0, "w.lgs", len(data), hash_bytes(data), timeout=read_timeout)
    finally:
        filler.close()
        hole.close()
