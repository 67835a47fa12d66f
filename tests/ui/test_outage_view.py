"""An outage on the page: a real Checkpointer saves through a service outage (the service
SIGKILLed and restarted on its data and ports), gives up the saves it could not upload and
records them when the service is back. The page shows them, in Chromium: the events list
says which steps' saves were given up (a sentence, not JSON), the graph marks them and draws
the gap in the lineage, the runs list and the health panel count them as a failure, and
the run is finished once the Checkpointer closed. The legend has a glyph for every marker."""

from __future__ import annotations

import re
import time
from urllib.parse import urlencode

import pytest
import torch
from torch import nn

import lastgood
from lastgood.remote.retry import RetryPolicy

from ..conftest import ROOT
from .conftest import ARTIFACTS, wait_graph
from .test_web_ui import wait_text

STATIC = ROOT / "service/lastgood_service/static"


def outage_run(svc, run: str) -> None:
    """Saves of steps 0..2 commit; 3..7 are saved while the service is down; 8..9 after it
    is back."""
    torch.manual_seed(0)
    state = lastgood.TrainState(model=nn.Linear(16, 16), extra={})
    ckpt = lastgood.Checkpointer(svc.url, run=run, heartbeat_seconds=0.2, retry=RetryPolicy(deadline=60, max_delay=0.5))
    for step in range(3):
        ckpt.step(step)
        ckpt.save(step, state)
        ckpt.wait()
    svc.kill()
    for step in range(3, 8):  # the first upload retries; each newer save gives up the one waiting
        ckpt.step(step)
        ckpt.save(step, state)
        time.sleep(0.3)
    svc.restart()
    for step in (8, 9):
        ckpt.step(step)
        ckpt.save(step, state)
        ckpt.wait()
    ckpt.close()


@pytest.mark.slow  # a real outage: the service killed and restarted (~28 s on two busy cores)
def test_the_outage_run_shows_its_given_up_saves(open_page, make_service, run_name):
    svc = make_service(LASTGOOD_LEASE_SECONDS="30")
    outage_run(svc, run_name)
    events = svc.get(f"/api/v1/runs/{run_name}/events", params={"kind": "save_given_up"}).json()["items"]
    assert len(events) == 1, events  # the control: the client did give saves up, and said so once back
    lost = sorted(events[0]["data"]["steps"])
    assert lost and all(3 <= s <= 7 for s in lost), lost
    # a second rank of the same job gave up the same saves: one entry on the page, two ranks
    r = svc.post(f"/api/v1/runs/{run_name}/events", json={"kind": "save_given_up", "data": {
        **events[0]["data"], "rank": 1}})
    assert r.status_code == 200, r.text
    committed = sorted(c["step"] for c in svc.get(f"/api/v1/runs/{run_name}/checkpoints").json()["items"]
                       if c["status"] == "COMMITTED")

    page, _ = open_page(f"{svc.url}/#{urlencode({'run': run_name})}")
    snap = wait_graph(page, run_name)
    wait_text(page, "#events", "gave up")
    text = page.locator("#events li.ev-save_given_up .event-data").inner_text()
    steps = f"step {lost[0]}" if len(lost) == 1 else f"{lost[-1]}"
    assert page.locator("#events li.ev-save_given_up").count() == 1
    assert text.startswith("2 ranks (0, 1) gave up the saves of") and steps in text, text
    assert "{" not in text, text  # a sentence, not the event's JSON
    assert page.locator("#events li.ev-save_given_up .badge").inner_text() == "saves given up"

    # the graph: a marker at the first given-up step, and the edge across the gap says so
    assert ("save_given_up", lost[0]) in {(m["kind"], m["step"]) for m in snap["markers"]}, snap["markers"]
    gaps = [e for e in snap["edges"] if e.get("gap")]
    assert len(gaps) == 1 and gaps[0]["gap"] == lost, snap["edges"]
    before = max(s for s in committed if s < lost[0])
    nodes = {n["key"]: n for n in snap["nodes"]}
    assert nodes[gaps[0]["from"]]["step"] == before and nodes[gaps[0]["to"]]["step"] > lost[-1]

    # counted as a failure on the runs list and in the health panel, alike; the run finished
    row = page.locator(f'tr[data-run="{run_name}"] td.health')
    wait_text(page, f'tr[data-run="{run_name}"] td.health', "2 failures (24 h)")  # one event per rank
    assert "2 failures (24 h)" in row.inner_text()
    wait_text(page, "#run-health", "finished")
    health = page.locator("#run-health .health-line").inner_text()
    assert "2 failures (24 h): save given up 2" in health and "hang timeout" not in health, health
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "lineage-outage.png"))


def test_the_legend_has_the_graphs_glyph_for_every_marker():
    """Every marker kind the graph draws has its legend entry, styled for that kind."""
    graph = (STATIC / "graph.js").read_text()
    kinds = set(re.findall(r"'(\w+)'", re.search(r"MARKER_KINDS = new Set\(\[(.*?)\]\)", graph).group(1)))
    legend = set(re.findall(r'data-marker="(\w+)"', (STATIC / "index.html").read_text()))
    css = (STATIC / "app.css").read_text()
    style = (STATIC / "graph-style.js").read_text()  # the graph's cytoscape style
    assert kinds == legend, (kinds, legend)
    for k in kinds:
        assert f"node.m-{k}'" in style and f".swatch.m-{k} " in css, k
