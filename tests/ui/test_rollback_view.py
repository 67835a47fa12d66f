"""A SpikeGuard rollback as the page shows it: the new branch is a rollback, not a restart
(the job never relaunched; its Checkpointer saves under `<launch>.1` after the in-process
restore), the spike and rollback events read as sentences rather than raw JSON (a rollback
carries hundreds of excluded sample ids), and the runs list counts spikes instead of
calling the run "ok". A real relaunch (a new launch id) is still a restart."""

from __future__ import annotations

import httpx

from . import seed
from .conftest import wait_graph
from .test_web_ui import by_key, page_url


def test_a_rollback_reads_as_a_rollback(open_page, ui_service, grpc_client):
    run = seed.unique("rolled")
    launch = "5f0c1a2b3c4d5e6f"
    c1 = seed.save(grpc_client, run, 100, 0, launch)
    c2 = seed.save(grpc_client, run, 200, c1, launch)
    c3 = seed.save(grpc_client, run, 300, c2, launch)
    samples = list(range(1000, 1300))  # the 300 sample ids the guard excluded
    seed.ok(ui_service.post(f"/api/v1/runs/{run}/rollback", json={
        "target_id": c2, "spike_step": 350,
        "data": {"metric": "loss", "value": 49319.25, "loss": 49319.25, "median": 4.9, "mad": 0.2, "z": 16000.25,
                 "threshold": 6.0, "reason": "robust z-score above threshold", "rank": 1, "grad_norm": None,
                 "lr_factor": 0.5, "rollback": 1, "skipped": {"steps": [201, 350], "samples": samples}}}))
    c4 = seed.save(grpc_client, run, 300, c2, f"{launch}.1")    # after the rollback, same job
    c5 = seed.save(grpc_client, run, 400, c4, f"{launch}.1")
    c6 = seed.save(grpc_client, run, 500, c5, "9e8d7c6b5a493827")  # the job relaunched

    page, _ = open_page(page_url(ui_service, run=run))
    snap = wait_graph(page, run)
    nodes = by_key(snap)
    assert nodes[f"c{c4}"]["branch"] != nodes[f"c{c3}"]["branch"]
    assert "rollback" in nodes[f"c{c4}"]["label"] and "restart" not in nodes[f"c{c4}"]["label"]
    assert "restart" in nodes[f"c{c6}"]["label"]
    restarts = [m["target"] for m in snap["markers"] if m["kind"] == "restart"]
    assert restarts == [f"c{c6}"]

    page.wait_for_selector("#events li.ev-rollback")
    spike = page.locator("#events li.ev-spike .event-data").inner_text()
    rollback = page.locator("#events li.ev-rollback .event-data").inner_text()
    assert spike == "at step 350 · loss 49,319 · median 4.9 · z 16,000 > 6 · rank 1", spike
    assert rollback == "to step 200 · spike at step 350 · lr × 0.5 · steps 201–350 skipped · 300 samples excluded" \
        " · 1 checkpoint suspect", rollback
    # the full data is still there, on hover
    assert "1299" in page.locator("#events li.ev-rollback .event-data").get_attribute("title")

    overview = {r["name"]: r for r in httpx.get(f"{ui_service.url}/api/v1/overview", params={"limit": 1000},
                                                timeout=30).json()["items"]}
    assert (overview[run]["spikes"], overview[run]["rollbacks"]) == (1, 1)
    page.wait_for_selector(f'tr[data-run="{run}"] td.health')
    health = page.locator(f'tr[data-run="{run}"] td.health').inner_text()
    assert health == "1 spike, 1 rollback", health
