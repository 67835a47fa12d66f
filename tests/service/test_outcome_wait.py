"""How a rank that has voted learns the outcome: GET /api/v1/checkpoints/{id}/outcome?wait=S,
a long-poll that holds no thread per waiting rank (docs/control-plane.md)."""

from __future__ import annotations

import socket
import threading

import httpx

from lastgood.datapath.transport import Transport
from tests.service.helpers import Client, http, json_error, make_shard, shard_name


def _two_rank_checkpoint(service, run: str) -> tuple[Client, int]:
    c = Client(service.grpc_target)
    cid = c.begin(run, world_size=2).checkpoint_id
    for r in range(2):
        c.put(cid, r, shard_name(r), make_shard(r))
    assert c.vote(cid, 0, [shard_name(0)]).status == "PENDING"
    return c, cid


def test_a_pending_outcome_names_the_ranks_that_have_not_voted(service, run_name):
    c, cid = _two_rank_checkpoint(service, run_name)
    h = http(service)
    with c:
        got = h.get(f"/api/v1/checkpoints/{cid}/outcome", params={"wait": 0.3}).json()
        assert got == {"checkpoint_id": cid, "status": "PENDING", "missing_ranks": [1]}
        json_error(h.get("/api/v1/checkpoints/999999/outcome", params={"wait": 0.3}), 404)
        json_error(h.get(f"/api/v1/checkpoints/{cid}/outcome", params={"wait": 1e9}), 422)
        json_error(h.get(f"/api/v1/checkpoints/{cid}/outcome", params={"wait": "nan"}), 422)


def test_a_waiter_is_woken_by_the_commit(service, run_name):
    """A waiter with a long wait gets COMMITTED, not PENDING at its timeout: the commit woke it."""
    c, cid = _two_rank_checkpoint(service, run_name)
    got: list[dict] = []
    with c, httpx.Client(base_url=service.url) as h:
        waiter = threading.Thread(target=lambda: got.append(
            h.get(f"/api/v1/checkpoints/{cid}/outcome", params={"wait": 120}, timeout=180).json()))
        waiter.start()
        assert c.vote(cid, 1, [shard_name(1)]).status == "COMMITTED"
        waiter.join(180)
    assert got == [{"checkpoint_id": cid, "status": "COMMITTED", "missing_ranks": []}]


def test_a_rank_whose_connection_drops_while_waiting_learns_the_outcome_by_asking_again(service, run_name):
    c, cid = _two_rank_checkpoint(service, run_name)
    host, port = service.url.removeprefix("http://").split(":")
    with c:
        # rank 0 waits on a raw connection, which then drops before any answer
        s = socket.create_connection((host, int(port)), timeout=30)
        s.sendall(f"GET /api/v1/checkpoints/{cid}/outcome?wait=60 HTTP/1.1\r\nHost: x\r\n\r\n".encode())
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")  # RST on close
        s.close()
        assert c.vote(cid, 1, [shard_name(1)]).status == "COMMITTED"
        # asked again (the client's own call): the decided outcome, at once
        t = Transport(service.url)
        try:
            assert t.outcome(cid, wait=30) == {"checkpoint_id": cid, "status": "COMMITTED", "missing_ranks": []}
        finally:
            t.close()
    assert http(service).get("/healthz").status_code == 200  # the dropped waiter harmed nothing
