"""What the supervisor reads of a run's health, against a real service: `--hang-timeout`
reaches the service, only ranks that beat during the current launch can end it, a hang is
blamed on no one, and a service that does not answer ends nothing."""

from __future__ import annotations

import time

import httpx
import pytest

from lastgood.supervise.supervisor import Launch, Policy, Supervisor
from lastgood.remote.rest import RestClient
from tests.conftest import free_port


def beat(url: str, run: str, gen: int, step: int) -> None:
    for rank in (0, 1):
        httpx.post(f"{url}/api/v1/runs/{run}/heartbeats", timeout=30, json={
            "rank": rank, "world_size": 2, "step": step, "step_seconds": 0.1, "phase": "train", "attempt": "a",
            "generation": gen, "period_s": 0.1}).raise_for_status()


def launch(started_ago: float) -> Launch:
    return Launch(0, "a", [0, 1], proc=None, started=time.monotonic() - started_ago, watch=None)


def supervisor(url: str, run: str, hang_timeout: float | None, said: list[str]) -> Supervisor:
    return Supervisor(["torchrun", "--nproc-per-node=2", "t.py"], run, RestClient(url, 5.0),
                      Policy(hang_timeout=hang_timeout), say=said.append)


@pytest.mark.slow
def test_a_hang_of_this_launch_ends_it_and_older_beats_do_not(service, run_name):
    u = service.url
    gen = httpx.post(f"{u}/api/v1/runs/{run_name}/launches", json={"attempt": "a", "world_size": 2}).json()["generation"]
    for step in range(3):
        beat(u, run_name, gen, step)
    time.sleep(1.5)
    beat(u, run_name, gen, 2)  # beating, but no progress for 1.5 s
    said: list[str] = []
    ending = supervisor(u, run_name, 1.0, said)._health(launch(started_ago=60))
    assert ending is not None and ending.reason == "hung", said
    assert ending.ranks == []  # both stuck alike: blamed on no one
    assert "rank 0 hung after step 2" in ending.detail and "timeout 1.0s" in ending.detail
    # the same beats, sent before this launch started: the previous launch's, not this one's
    time.sleep(1.0)
    assert supervisor(u, run_name, 1.0, said)._health(launch(started_ago=0.5)) is None
    # without --hang-timeout the service's own timeout applies (a 60 s floor by default)
    assert supervisor(u, run_name, None, said)._health(launch(started_ago=60)) is None


def test_a_service_that_does_not_answer_ends_nothing(run_name):
    said: list[str] = []
    sup = supervisor(f"http://127.0.0.1:{free_port()}", run_name, 1.0, said)
    assert sup._health(launch(started_ago=60)) is None and sup._health(launch(started_ago=60)) is None
    assert len([s for s in said if "unreachable" in s]) == 1  # said once, not every poll


def test_a_url_that_is_not_lastgood_is_said_and_a_broken_answer_does_not_end_the_supervisor(run_name):
    """A wrong --url (any web server's 404) must not pass for "no launch registered yet" in
    silence, and an answer cut short must not raise out of the supervisor's loop."""
    import http.server
    import socketserver
    import threading

    class NotLastgood(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            if self.path.startswith("/broken"):
                self.send_response(200)
                self.send_header("Content-Length", "100")
                self.end_headers()
                self.wfile.write(b'{"ra')  # and hang up
                return
            self.send_error(404, "no such page")

        def log_message(self, *args):
            pass

    with socketserver.ThreadingTCPServer(("127.0.0.1", 0), NotLastgood) as httpd:
        threading.Thread(target=httpd.serve_forever, daemon=True).start()
        url = f"http://127.0.0.1:{httpd.server_address[1]}"
        said: list[str] = []
        sup = supervisor(url, run_name, 1.0, said)
        assert sup._health(launch(started_ago=60)) is None and sup._health(launch(started_ago=60)) is None
        assert len([s for s in said if "a lastgood service?" in s]) == 1, said  # said once
        broken = supervisor(url + "/broken", run_name, 1.0, said)
        assert broken._health(launch(started_ago=60)) is None  # no exception: the job stays watched
        httpd.shutdown()
