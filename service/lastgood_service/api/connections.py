"""REST connection limits that hold without a token (docs/security.md, "Connection limits").

uvicorn bounds neither how many connections it holds nor how long a client may take to
send a request: its keep-alive timer starts only once an answer is sent, so a connection
that sends half a header line and stops is held until the client goes, and enough of
them take every file descriptor of the process (accepts then fail, and with them every
call, /healthz included). `LimitedHttp` is uvicorn's own HTTP/1.1 protocol (httptools)
with the three bounds it lacks, one `Limits` per server:

- a read deadline: a request's headers and body arrive in full within `read_timeout`
  of the connection's start or of the request's first byte, or the connection is closed
  (408 when no answer has started);
- a cap on connections, in all and per client address. A connection over a cap closes
  the oldest *waiting* connection of the same address (or, over the total cap, of any
  address): one that is sending a request or idle between requests, never one whose
  request is being answered. A request that arrives whole in one read is therefore never
  shut out by connections that send nothing; only when every connection under the cap
  is being answered is the new one refused (503, closed);
- idle keep-alive connections close after `keep_alive` seconds (uvicorn's own timer).

The total cap comes from the open-file limit (`budget`), so that the process keeps file
descriptors for its catalog, its files and gRPC whatever REST is sent."""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass, field

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

log = logging.getLogger("lastgood.rest")

FD_RESERVE = 256  # file descriptors kept out of the REST budget: catalog, files, gRPC's listener, logs
MAX_DERIVED = 16384  # the derived cap's ceiling (each connection holds a few KiB of the event loop's)

_408 = b"HTTP/1.1 408 Request Timeout\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
_503 = b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 0\r\nretry-after: 1\r\nconnection: close\r\n\r\n"


def budget(nofile: int, configured: int) -> int:
    """REST connections at most: `configured`, or (0) half of the open-file limit left after
    FD_RESERVE, at least 64 and at most MAX_DERIVED (gRPC's connections, one per rank, take
    file descriptors too)."""
    if configured:
        return configured
    return max(64, min(MAX_DERIVED, (nofile - FD_RESERVE) // 2))


@dataclass
class Limits:
    """The bounds and the state they need, shared by every connection of one server."""

    max_connections: int
    max_per_client: int
    read_timeout: float  # 0: no read deadline
    total: int = 0
    by_client: dict[str, int] = field(default_factory=dict)
    waiting: OrderedDict = field(default_factory=OrderedDict)  # connection -> None, oldest first
    waiting_by_client: dict[str, OrderedDict] = field(default_factory=dict)
    evicted: int = 0
    refused: int = 0
    timed_out: int = 0

    def admit(self, conn: "LimitedHttp") -> bool:
        """Count a new connection in, closing the oldest waiting one a cap asks for; False
        (and nothing counted) when only connections being answered hold the cap."""
        addr = conn.address
        if self.by_client.get(addr, 0) >= self.max_per_client:
            victim = next(iter(self.waiting_by_client.get(addr) or ()), None)
        elif self.total >= self.max_connections:
            victim = next(iter(self.waiting), None)
        else:
            victim = conn  # room: nothing to close
        if victim is None:
            self.refused += 1
            return False
        if victim is not conn:
            self.evicted += 1
            victim.close_waiting()
        self.total += 1
        self.by_client[addr] = self.by_client.get(addr, 0) + 1
        return True

    def wait(self, conn: "LimitedHttp") -> None:
        """`conn` waits for (or reads) a request: the newest candidate to close."""
        self.waiting[conn] = None
        self.waiting.move_to_end(conn)
        mine = self.waiting_by_client.setdefault(conn.address, OrderedDict())
        mine[conn] = None
        mine.move_to_end(conn)

    def busy(self, conn: "LimitedHttp") -> None:
        """`conn`'s request is being answered: never closed for room."""
        self.waiting.pop(conn, None)
        mine = self.waiting_by_client.get(conn.address)
        if mine is not None:
            mine.pop(conn, None)
            if not mine:
                del self.waiting_by_client[conn.address]

    def leave(self, conn: "LimitedHttp") -> None:
        self.busy(conn)
        self.total -= 1
        n = self.by_client[conn.address] - 1
        if n:
            self.by_client[conn.address] = n
        else:
            del self.by_client[conn.address]


class LimitedHttp(HttpToolsProtocol):
    """uvicorn's httptools protocol under `Limits` (uvicorn.Config(http=...) makes one per
    connection: `protocol(limits)` gives the factory)."""

    def __init__(self, *args, limits: Limits, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.limits = limits
        self.address = ""
        self.counted = False
        self.deadline = None  # the read deadline's timer while a request is being read

    @classmethod
    def protocol(cls, limits: Limits):
        def make(*args, **kwargs):
            return cls(*args, limits=limits, **kwargs)

        return make

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self.address = self.client[0] if self.client else ""
        if not self.limits.admit(self):
            self.transport.write(_503)
            self.transport.close()
            return
        self.counted = True
        self.limits.wait(self)
        self._arm()

    def connection_lost(self, exc) -> None:
        self._disarm()
        if self.counted:
            self.counted = False
            self.limits.leave(self)
        super().connection_lost(exc)

    def close_waiting(self) -> None:
        """Closed for room: counted out now, so that one new connection closes one old one."""
        self._disarm()
        if self.counted:
            self.counted = False
            self.limits.leave(self)
        self.transport.close()

    def _arm(self) -> None:
        if self.limits.read_timeout and self.deadline is None:
            self.deadline = self.loop.call_later(self.limits.read_timeout, self._read_timed_out)

    def _disarm(self) -> None:
        if self.deadline is not None:
            self.deadline.cancel()
            self.deadline = None

    def _read_timed_out(self) -> None:
        self.deadline = None
        if self.transport.is_closing():
            return
        self.limits.timed_out += 1
        if self.cycle is None or self.cycle.response_complete:  # no answer started: say why
            self.transport.write(_408)
        self.transport.close()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._arm()  # the request's first byte: its headers and body within the read timeout

    def on_headers_complete(self) -> None:
        super().on_headers_complete()
        if self.counted:
            self.limits.busy(self)

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._disarm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.counted and not self.transport.is_closing() and (self.cycle is None or self.cycle.response_complete):
            self.limits.wait(self)  # idle between requests (uvicorn's keep-alive timer runs)
