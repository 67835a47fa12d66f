"""The lineage page lists what `lastgood supervise` recorded: why a launch ended, the rank
blamed, the drain and the restart count (the events' data as the supervisor posts it)."""

from __future__ import annotations

from urllib.parse import urlencode

import httpx

from .test_web_ui import wait_text


def test_the_page_shows_the_supervisors_restarts(open_page, service, run_name):
    u = service.url
    httpx.post(f"{u}/api/v1/runs/{run_name}/launches", json={"attempt": "sv-1-0", "world_size": 4}).raise_for_status()
    common = {"launch": 1, "attempt": "sv-1-1", "world_size": 4, "exit_code": 1, "max_restarts": 3}
    for kind, data in (
            ("supervisor_restart", {**common, "reason": "exited", "restart": 2, "ranks": [3], "drained": [3],
                                    "next_world_size": 3, "detail": "local rank 3 failed first (killed by SIGKILL)"}),
            ("supervisor_gave_up", {**common, "launch": 2, "reason": "hung", "why": "3 restart(s) used of 3",
                                    "detail": "rank 0 hung at step 9"})):
        r = httpx.post(f"{u}/api/v1/runs/{run_name}/events", json={"kind": kind, "data": data})
        assert r.status_code == 200, r.text
    page, _ = open_page(f"{u}/#{urlencode({'run': run_name})}")
    wait_text(page, "#events", "launch 2 hung")
    text = page.locator("#events").inner_text()
    assert "launch 1 exited · local rank 3 to blame · relaunched on 3 ranks (drained 3) · restart 2 of 3" in text
    assert "3 restart(s) used of 3 · rank 0 hung at step 9" in text
    assert page.locator("#events li.ev-supervisor_restart .badge").first.inner_text() == "supervisor_restart"
