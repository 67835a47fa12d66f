"""A committed shard that hashes right but whose state cannot be read is a damaged
checkpoint like any other: restore falls back to its parent, and the service marks it
CORRUPT (its verify reads the shard's state as the client does).

Such a shard is uploaded as it is (its hash is the hash of those bytes): a buggy or
hostile writer, or a client of another version. The cases are the ones that used to
escape restore as RecursionError, JSONDecodeError and KeyError. Control: the same
rewrite that keeps the state as it was restores that checkpoint.
"""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import lastgood
from lastgood.wire.format import META_STATE, TensorSpec, header_length, parse_header, plan_layout
from tests.service.helpers import Client, shard_name


def _rewrite(shard: bytes, change) -> bytes:
    """The same tensors under a new lastgood.state: change(state text) -> new text."""
    tensors, meta = parse_header(shard, file_size=len(shard))
    start = header_length(shard)
    specs = [TensorSpec(n, e["dtype"], tuple(e["shape"])) for n, e in tensors.items()]
    layout = plan_layout(specs, {**meta, META_STATE: change(meta[META_STATE])})
    out = bytearray(layout.size)
    out[:layout.data_start] = layout.header
    for name, e in tensors.items():
        a, b = e["data_offsets"]
        lo, hi = layout.offsets[name]
        out[lo:hi] = shard[start + a:start + b]
    return bytes(out)


def _missing_tensor(text: str) -> str:
    state = json.loads(text)
    state["components"]["model"]["state"]["weight"]["__tensor__"] = "model.no_such_tensor"
    return json.dumps(state)


def _nested_in_extra(depth: int):
    def change(text: str) -> str:
        state = json.loads(text)
        state["extra"] = {"deep": "@"}
        return json.dumps(state).replace('"@"', "[" * depth + "]" * depth)
    return change


CASES = {
    "unchanged": lambda text: text,                     # control: a faithful rewrite
    "not-json": lambda text: text[: len(text) // 2],
    "nested-beyond-the-parser": lambda text: "[" * 100_000 + "]" * 100_000,
    "nested-beyond-restore": _nested_in_extra(600),      # parses, but too deep to decode
    "missing-tensor": _missing_tensor,
}


@pytest.mark.parametrize("case", list(CASES))
def test_malformed_state_falls_back_to_the_parent(service, run_name, case):
    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    with lastgood.Checkpointer(service.url, run=run_name) as ckpt:
        ckpt.save(1, lastgood.TrainState(model=model))
        ckpt.wait()
        good = ckpt.last_saved.checkpoint_id
    step1 = {k: v.clone() for k, v in model.state_dict().items()}
    shard = service.get(f"/api/v1/checkpoints/{good}/ranks/0/files/{shard_name(0)}").content

    with Client(service.grpc_target) as client:  # step 2: the rewritten shard, committed as it is
        # as the launch that saved step 1: a run with registered launches fences generation 0
        gen = service.get(f"/api/v1/runs/{run_name}/launches/current").json()["generation"]
        cid = client.begin(run_name, step=2, parent_id=good, generation=gen).checkpoint_id
        client.put(cid, 0, shard_name(0), _rewrite(shard, CASES[case]), chunk=1 << 20)
        assert client.vote(cid, 0, [shard_name(0)], wait=5).status == "COMMITTED"
    assert service.get(f"/api/v1/runs/{run_name}/last-good").json()["id"] == cid

    with torch.no_grad():
        model.weight.fill_(7.0)
    with lastgood.Checkpointer(service.url, run=run_name) as ckpt:
        step = ckpt.restore(lastgood.TrainState(model=model))
    if case == "unchanged":
        assert step == 2 and service.get(f"/api/v1/checkpoints/{cid}").json()["status"] == "COMMITTED"
        return
    assert step == 1
    assert all(torch.equal(v, step1[k]) for k, v in model.state_dict().items())
    assert service.get(f"/api/v1/checkpoints/{cid}").json()["status"] == "CORRUPT"
    assert service.get(f"/api/v1/runs/{run_name}/last-good").json()["id"] == good
    events = service.get(f"/api/v1/runs/{run_name}/events", params={"kind": "corrupt"}).json()["items"]
    assert [e["checkpoint_id"] for e in events] == [cid]
    assert "lastgood.state" in json.dumps(events[0]["data"])  # says what is wrong with the shard
