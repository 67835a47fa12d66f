"""The control plane under a storm of ranks: thousands beginning at once, hundreds voting at
once (simulated in one process with asyncio; bench/control_plane.py carries the timing)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import grpc
import pytest

from lastgood.wire.v1 import lastgood_pb2 as pb
from lastgood.wire.v1 import lastgood_pb2_grpc as pb_grpc
from tests.conftest import ROOT
from tests.service.helpers import http

STORM_RANKS = 300
VOTE_BATCH_RANKS = 128
BEGIN_STORM = 3200  # above gRPC's default hard limit of 3,000 queued calls


@pytest.mark.slow
def test_hundreds_of_ranks_voting_at_once_all_hear_committed(service, run_name):
    """A separate process simulates the ranks (bench/control_plane.py `storm`): all begin,
    put, then vote at once and wait on GET .../outcome. Every one must hear COMMITTED."""
    proc = subprocess.run([sys.executable, "-m", "bench.control_plane", "storm", service.url, "--run", run_name,
                           "--ranks", str(STORM_RANKS), "--mode", "outcome"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert res["begin"]["errors"] == 0 and res["begin"]["checkpoint_ids"] == 1
    assert res["statuses"] == {"COMMITTED": STORM_RANKS}
    assert res["heard"] == STORM_RANKS
    view = http(service).get(f"/api/v1/checkpoints/{res['checkpoint_id']}").json()
    assert view["status"] == "COMMITTED" and view["world_size"] == STORM_RANKS


def catalog_transactions(svc, label: str) -> int:
    """This service process's catalog transactions so far run by `label` (/metrics)."""
    for line in http(svc).get("/metrics").text.splitlines():
        if line.startswith(f'lastgood_catalog_transactions_total{{label="{label}"}}'):
            return int(float(line.split()[-1]))
    return 0


@pytest.mark.slow
def test_ranks_voting_at_once_are_written_in_a_few_catalog_transactions(service, run_name):
    """Group commit of votes (domain/commit/votebatch.py): votes that arrive together are
    written in one transaction, and no vote re-reads the others. One transaction per vote
    (and one more to read every vote back) made the catalog work of a checkpoint
    O(ranks) transactions and O(ranks^2) rows read."""
    ranks = VOTE_BATCH_RANKS
    before = catalog_transactions(service, "vote")
    proc = subprocess.run([sys.executable, "-m", "bench.control_plane", "storm", service.url, "--run", run_name,
                           "--ranks", str(ranks), "--mode", "outcome"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert res["statuses"] == {"COMMITTED": ranks}
    spent = catalog_transactions(service, "vote") - before
    # every vote and the commit, all of them: batches plus the commit's few transactions
    assert 0 < spent <= ranks // 4, f"{ranks} votes took {spent} catalog transactions"


@pytest.mark.slow
def test_thousands_of_ranks_beginning_at_once_are_all_served(service, run_name):
    """Calls beyond gRPC's queue of calls waiting for a worker were CANCELLED (229 of 2,048
    and 947 of 4,096 ranks beginning at once); the service raises that queue."""

    async def storm() -> tuple[list[str], set[int]]:
        chans = [grpc.aio.insecure_channel(service.grpc_target, options=[("grpc.use_local_subchannel_pool", 1)])
                 for _ in range(BEGIN_STORM // 256)]
        errors, ids = [], set()

        async def begin(r: int) -> None:
            try:
                res = await pb_grpc.CheckpointsStub(chans[r % len(chans)]).BeginCheckpoint(pb.BeginCheckpointRequest(
                    run=run_name, step=1, world_size=BEGIN_STORM, attempt="storm", rank=r), timeout=300)
                ids.add(res.checkpoint_id)
            except grpc.aio.AioRpcError as e:
                errors.append(e.code().name)

        try:
            await asyncio.gather(*(begin(r) for r in range(BEGIN_STORM)))
        finally:
            for c in chans:
                await c.close()
        return errors, ids

    errors, ids = asyncio.run(storm())
    assert errors == [] and len(ids) == 1, (len(errors), sorted(set(errors)), ids)
