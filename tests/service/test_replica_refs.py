"""The service's verify checks the replicated-tensor references of a deduplicated DDP
checkpoint (client/lastgood/restore/replicas.py, docs/replicated.md): each `__replica__` must name
a rank of the checkpoint whose files hold that tensor. A dangling one marks the checkpoint
CORRUPT, so last-good moves back, as for any damage."""

from __future__ import annotations

import json

import numpy as np
import pytest

from lastgood.wire.format import META_STATE, TensorSpec, plan_layout

from .helpers import Client, http, last_good_id, shard_name


def rank_file(tensors: list[str], refs: dict[str, dict]) -> bytes:
    """A rank's file holding `tensors` (4 floats each) and a state naming them and `refs`."""
    state = {"version": 2, "components": {"model": {"kind": "module", "state": {
        **{n.rsplit(".", 1)[-1]: {"__tensor__": n} for n in tensors}, **refs}}}}  # key: the name's last part
    lay = plan_layout([TensorSpec(n, "F32", (4,)) for n in tensors], {META_STATE: json.dumps(state)})
    buf = bytearray(lay.size)
    buf[:lay.data_start] = lay.header
    for n in tensors:
        a, b = lay.offsets[n]
        buf[a:b] = np.ones(4, np.float32).tobytes()
    return bytes(buf)


def commit(svc, run: str, step: int, parent: int, files: list[bytes]) -> int:
    with Client(svc.grpc_target) as c:
        cid = c.begin(run, step, len(files), parent_id=parent).checkpoint_id
        for r, data in enumerate(files):
            c.put(cid, r, shard_name(r), data)
        for r in range(len(files)):
            res = c.vote(cid, r, [shard_name(r)], wait=0.0 if r < len(files) - 1 else 2.0)
        assert res.status == "COMMITTED", res
    return cid


@pytest.mark.parametrize("ref", [{"__replica__": "gone", "rank": 1},   # the owner does not hold it
                                 {"__replica__": "w", "rank": 2},      # no such rank
                                 {"__replica__": "w", "rank": [1]}])   # not a rank at all
def test_a_dangling_replica_reference_marks_the_checkpoint_corrupt(service, run_name, ref):
    good = commit(service, run_name, 1, 0, [rank_file(["b"], {"w": {"__replica__": "w", "rank": 1}}),
                                            rank_file(["w"], {})])
    assert http(service).post(f"/api/v1/checkpoints/{good}/verify").json()["ok"]  # control: a reference that resolves
    bad = commit(service, run_name, 2, good, [rank_file(["b"], {"w": ref}), rank_file(["w"], {})])
    assert last_good_id(service, run_name) == bad
    res = http(service).post(f"/api/v1/checkpoints/{bad}/verify").json()
    assert not res["ok"] and res["status"] == "CORRUPT", res
    assert "replica" in json.dumps(res["bad"])
    assert last_good_id(service, run_name) == good
