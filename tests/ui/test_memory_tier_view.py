"""A memory checkpoint on the lineage page (docs/memory-tier.md): the lineage answer names
its tier, the graph draws it as a hexagon labelled "memory", and the legend shows that
glyph. The memory checkpoint commits as an agent makes it commit: two agents on two hosts
register and report their copies over plain HTTP."""

from __future__ import annotations

from lastgood.wire import tiers
from lastgood.wire.v1 import lastgood_pb2 as pb

from ..service.helpers import ATTEMPT, RPC_TIMEOUT
from . import seed
from .conftest import wait_graph
from .test_web_ui import by_key, page_url

DIGEST = "1" * 32


def _memory_checkpoint(svc, client, run: str, step: int, parent: int) -> int:
    agents = [seed.ok(svc.post("/api/v1/agents", json={"host": f"{run}-{h}", "address": f"127.0.0.1:{7200 + i}"}))
              for i, h in enumerate("ab")]
    cid = client.stub.BeginCheckpoint(pb.BeginCheckpointRequest(
        run=run, step=step, world_size=1, attempt=ATTEMPT, tier=tiers.Tier.MEMORY, replicas=1, parent_id=parent),
        timeout=RPC_TIMEOUT).checkpoint_id
    client.stub.CommitRank(pb.CommitRankRequest(checkpoint_id=cid, rank=0, memory_files=[
        pb.MemoryFile(name="model.bin", size=10, xxh3_128=DIGEST)]), timeout=RPC_TIMEOUT)
    for agent in agents:
        answer = seed.ok(svc.post(f"/api/v1/checkpoints/{cid}/copies", headers={tiers.AGENT_KEY_HEADER: agent["key"]},
                                  json={"agent_id": agent["agent_id"], "rank": 0,
                                        "files": [{"name": "model.bin", "size": 10, "xxh3_128": DIGEST}]}))
    assert answer["status"] == "COMMITTED"
    return cid


def test_a_memory_checkpoint_has_its_own_glyph_label_and_legend_entry(open_page, ui_service, grpc_client):
    run = seed.unique("memtier")
    durable = seed.save(grpc_client, run, 100)
    memory = _memory_checkpoint(ui_service, grpc_client, run, 200, durable)

    page, _ = open_page(page_url(ui_service, run=run))
    snap = wait_graph(page, run)
    nodes = by_key(snap)
    mem, dur = nodes[f"c{memory}"], nodes[f"c{durable}"]
    assert mem["tier"] == "memory" and "memory" in mem["label"].split("\n") and mem["lastGood"]
    assert dur["tier"] == "durable" and "memory" not in dur["label"]  # control: a durable one is drawn as before
    assert page.evaluate("(k) => window.lastgoodGraph.shape(k)", f"c{memory}") == "hexagon"
    assert page.evaluate("(k) => window.lastgoodGraph.shape(k)", f"c{durable}") == "ellipse"
    # the legend's glyph is the graph's: a hexagon
    swatch = page.locator(".legend .swatch.tier-memory")
    assert swatch.is_visible()
    assert "memory" in swatch.locator("xpath=..").inner_text()
    clip = swatch.evaluate("(el) => getComputedStyle(el).clipPath")
    assert clip.startswith("polygon(") and clip.count(",") == 5, clip  # six corners
