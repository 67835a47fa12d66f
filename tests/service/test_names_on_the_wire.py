"""Names ending in a newline are refused on every path that takes one (issue 10, item 5):
`re.match(...$)` accepted `x\\n`, and a committed file `nl.bin\\n` could never be downloaded
(h11 refuses the Content-Disposition header and drops the connection)."""

from __future__ import annotations

import grpc

from .helpers import assert_unchanged, http, json_error, make_shard, rpc_error, snapshot

SC = grpc.StatusCode


def test_a_trailing_newline_is_refused_in_runs_attempts_and_file_names(svc, cl):
    before = snapshot(svc, "nl-run")
    rpc_error(SC.INVALID_ARGUMENT, cl.begin, "nl-run\n")
    rpc_error(SC.INVALID_ARGUMENT, cl.begin, "nl-run", attempt="a\n")
    assert_unchanged(before, snapshot(svc, "nl-run"))
    assert "nl-run\n" not in [r["name"] for r in http(svc).get("/api/v1/runs").json()["items"]]
    cid = cl.begin("nl-run").checkpoint_id  # control: the same names without the newline
    rpc_error(SC.INVALID_ARGUMENT, cl.put, cid, 0, "nl.bin\n", make_shard(0))
    cl.put(cid, 0, "nl.bin", make_shard(0))  # control
    assert cl.vote(cid, 0, ["nl.bin"], wait=2).status == "COMMITTED"
    h = http(svc)
    assert json_error(h.get("/api/v1/runs/nl-run%0A"), 400)["code"] == "invalid_argument"
    assert json_error(h.get(f"/api/v1/checkpoints/{cid}/ranks/0/files/nl.bin%0A"), 400)["code"] == "invalid_argument"
    assert h.get(f"/api/v1/checkpoints/{cid}/ranks/0/files/nl.bin").content == make_shard(0)
