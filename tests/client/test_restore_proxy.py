"""An error that is not the service's own answer (a proxy's or load balancer's bare 404 or
409, with no lastgood error code) says nothing about the checkpoint: restore must not take
it for damage and fall back to an older checkpoint (the job would silently lose the newer
progress and fork the run). It fails clearly instead; the next launch restores the newest.
Control: the same restore without the proxy's error restores the newest checkpoint."""

from __future__ import annotations

import http.server
import socketserver
import threading

import httpx
import pytest
from torch import nn

import lastgood
from lastgood.errors import ServiceError


class _Proxy(http.server.BaseHTTPRequestHandler):
    target = ""
    fail_path = ""        # answered with a bare error, not forwarded
    fail_status = 404

    def _forward(self):
        if self.fail_path and self.path.startswith(self.fail_path):
            self.send_error(self.fail_status, "upstream says no")  # HTML body, no lastgood error code
            return
        n = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(n) if n else None
        headers = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "content-length")}
        r = httpx.request(self.command, self.target + self.path, content=body, headers=headers, timeout=60)
        self.send_response(r.status_code)
        for k, v in r.headers.items():
            if k.lower() not in ("content-length", "transfer-encoding", "connection", "content-encoding"):
                self.send_header(k, v)
        self.send_header("Content-Length", str(len(r.content)))
        self.end_headers()
        self.wfile.write(r.content)

    do_GET = do_POST = do_PUT = do_DELETE = _forward

    def log_message(self, *args):
        pass


@pytest.mark.parametrize("status", [404, 409])
def test_a_proxys_bare_error_is_not_damage(service, run_name, status):
    state = lastgood.TrainState(model=nn.Linear(8, 8), extra={})
    with _ckpt(service.url, run_name) as ckpt:
        ckpt.save(1, state)
        ckpt.wait()
        ckpt.save(2, state)
        ckpt.wait()
        newest = ckpt.last_saved.checkpoint_id

    class Handler(_Proxy):
        target = service.url
        fail_path = f"/api/v1/checkpoints/{newest}/manifest"
        fail_status = status

    with socketserver.ThreadingTCPServer(("127.0.0.1", 0), Handler) as proxy:
        threading.Thread(target=proxy.serve_forever, daemon=True).start()
        url = f"http://127.0.0.1:{proxy.server_address[1]}"
        with _ckpt(url, run_name) as ckpt, pytest.raises(ServiceError) as failed:
            ckpt.restore(lastgood.TrainState(model=nn.Linear(8, 8), extra={}))
        assert not failed.value.coded
        Handler.fail_path = ""  # control: the same proxy, answering
        with _ckpt(url, run_name) as ckpt:
            assert ckpt.restore(lastgood.TrainState(model=nn.Linear(8, 8), extra={})) == 2
        proxy.shutdown()
    assert service.get(f"/api/v1/checkpoints/{newest}").json()["status"] == "COMMITTED"


class _ckpt:
    def __init__(self, url: str, run: str) -> None:
        self.c = lastgood.Checkpointer(url, run=run, heartbeat_seconds=0)

    def __enter__(self):
        return self.c

    def __exit__(self, *exc):
        self.c.close()
