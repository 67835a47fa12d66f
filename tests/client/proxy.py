"""A reverse proxy in front of a real service that can answer one path with a bare error
(no lastgood error code), as a load balancer or a misconfigured proxy would. Not a mock of
the service: every other request is forwarded to it."""

from __future__ import annotations

import contextlib
import http.server
import socketserver
import threading

import httpx


class Proxy(http.server.BaseHTTPRequestHandler):
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


@contextlib.contextmanager
def proxy(target: str, fail_path: str = "", fail_status: int = 404):
    """(url, handler class): set `handler.fail_path = ""` to let everything through."""

    class Handler(Proxy):
        pass

    Handler.target, Handler.fail_path, Handler.fail_status = target, fail_path, fail_status
    with socketserver.ThreadingTCPServer(("127.0.0.1", 0), Handler) as srv:
        srv.daemon_threads = True
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        try:
            yield f"http://127.0.0.1:{srv.server_address[1]}", Handler
        finally:
            srv.shutdown()
