"""The lineage page shows the run's health and its checkpoint interval: every rank ok, then
a rank that stops beating turns `hung` on the page and in its events, and the interval
line carries the run's own C, M, τ and work lost per failure."""

from __future__ import annotations

import threading
from urllib.parse import urlencode

import httpx

from .test_web_ui import wait_text


def test_the_page_shows_health_and_the_interval(open_page, make_service, run_name):
    svc = make_service(LASTGOOD_HEALTH_INTERVAL="0.3", LASTGOOD_HANG_FLOOR_SECONDS="3")  # 3 s: a loaded CI box
    u = svc.url
    gen = httpx.post(f"{u}/api/v1/runs/{run_name}/launches", json={"attempt": "a", "world_size": 2}).json()["generation"]
    stop = threading.Event()
    beating = {0: True, 1: True}

    def beat_loop():
        step = 0
        with httpx.Client(timeout=30) as http:
            while not stop.wait(0.2):
                step += 1
                for rank in (0, 1):
                    if beating[rank]:
                        http.post(f"{u}/api/v1/runs/{run_name}/heartbeats", json={
                            "rank": rank, "world_size": 2, "step": step, "step_seconds": 0.2, "phase": "train",
                            "attempt": "a", "generation": gen, "period_s": 0.2, "save_stall_s": 3.0})

    t = threading.Thread(target=beat_loop, daemon=True)
    t.start()
    try:
        page, _ = open_page(f"{u}/#{urlencode({'run': run_name})}")
        wait_text(page, "#run-health", "2 ranks ok")
        line = page.locator("#run-health .interval-line")
        wait_text(page, "#run-health .interval-line", "auto interval τ")
        text = line.inner_text()
        assert "checkpoint cost C 3.0 s" in text and "(the prior: no failure yet)" in text
        assert "time between failures M 24 h" in text and "work lost per failure" in text
        beating[1] = False  # rank 1 stops: hung past its timeout
        wait_text(page, "#run-health", "hung: rank 1")
        assert page.locator('#run-health tr[data-rank="1"] .badge').inner_text() in ("hung", "lost")
        wait_text(page, "#events", "rank 1")
        assert page.locator("#events li.ev-hung .badge").first.inner_text() == "hung"
    finally:
        stop.set()
        t.join(5)
