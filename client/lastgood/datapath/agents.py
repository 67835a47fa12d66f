"""A rank's side of the node agent's protocol (lastgood.agent; docs/memory-tier.md): room in
its own agent's segment, the files it wrote there made ready, and a held file read back from
the copies in order, every byte hashed against the manifest's digest.

`read_verified` is the per-file fallback of a memory restore: each copy in turn (the own
agent first, then partner agents); a copy that is missing, cut short or whose bytes do not
hash to the manifest's digest is skipped; no good copy left raises CorruptCheckpoint, and
the restorer falls back to the newest good ancestor on every rank alike.

From the rank's own agent (`local=`) a file is read from where it lies on this host
(`read_local`: the agent says where, GET tiers.AGENT_LOCAL_PATH; the rank reads it straight
into its buffer, hashing each piece as it lands), not through the agent's socket: 0.34 s of a
256 MiB restore's 0.59 s was that socket here. Where the path is not this host's (an agent
elsewhere, a container without its tmpfs) the file is read over HTTP as from a partner.
"""

from __future__ import annotations

import http.client
import json
import logging
import os
from dataclasses import dataclass
from urllib.parse import quote

from lastgood.errors import CorruptCheckpoint
from lastgood.wire import tiers
from lastgood.wire.hashing import StreamHasher

log = logging.getLogger("lastgood.agent")
CHUNK = 1 << 20


def _route(prefix: str, run: str, checkpoint_id: int, rank: int, name: str | None = None) -> str:
    """An agent route's path: `prefix`/<run>/<checkpoint id>/<rank>[/<file>], quoted (the agent's
    server parses them back in one place, agent/server.py `_key`)."""
    tail = "" if name is None else "/" + quote(name, safe="")
    return f"{prefix}/{quote(run, safe='')}/{checkpoint_id}/{rank}{tail}"


class AgentRefused(Exception):
    """The agent cannot take this memory save (budget, too few partners, bad input): the
    memory save is given up; training goes on."""

    def __init__(self, status: int, detail: str) -> None:
        super().__init__(f"the node agent refused the memory save ({status}): {detail}")
        self.status = status


def connect(address: str, timeout: float) -> http.client.HTTPConnection:
    """An open connection to the agent at `address`: it must open within
    tiers.AGENT_CONNECT_TIMEOUT (a node that is gone may drop the SYN), then each read and
    write may take up to `timeout`."""
    host, port = _split(address)
    conn = http.client.HTTPConnection(host, port, timeout=min(timeout, tiers.AGENT_CONNECT_TIMEOUT))
    try:
        conn.connect()
    except TimeoutError:
        conn.close()
        raise TimeoutError(f"no connection to the agent at {address} within "
                           f"{min(timeout, tiers.AGENT_CONNECT_TIMEOUT)} s") from None
    except BaseException:
        conn.close()
        raise
    conn.sock.settimeout(timeout)
    return conn


def _split(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"an agent address is HOST:PORT, got {address!r}")
    return host, int(port)


@dataclass(frozen=True)
class AgentClient:
    address: str
    timeout: float = 30.0

    def _post(self, path: str, body: dict) -> dict:
        try:
            conn = connect(self.address, self.timeout)
        except OSError as e:
            raise AgentRefused(0, f"no answer from the agent at {self.address}: {e}") from None
        try:
            data = json.dumps(body).encode()
            conn.request("POST", path, data, {"Content-Type": "application/json"})
            resp = conn.getresponse()
            raw = resp.read()
        except OSError as e:
            raise AgentRefused(0, f"no answer from the agent at {self.address}: {e}") from None
        finally:
            conn.close()
        try:
            got = json.loads(raw)
        except ValueError:
            got = {"detail": raw[:200].decode(errors="replace")}
        if resp.status != 200:
            raise AgentRefused(resp.status, str(got.get("detail", got))[:500])
        return got

    def replication(self, run: str, checkpoint_id: int, rank: int, timeout: float | None = None) -> dict | None:
        """How the agent's replication of this rank's files stands ({"state": queued | sent |
        failed, "partner", "detail"}), or None when the agent does not say (it knows no such
        job, predates the route, or does not answer within `timeout`)."""
        try:
            conn = connect(self.address, self.timeout if timeout is None else timeout)
        except OSError:
            return None
        try:
            conn.request("GET", _route(tiers.AGENT_REPLICATION_PATH, run, checkpoint_id, rank))
            resp = conn.getresponse()
            raw = resp.read()
            return json.loads(raw) if resp.status == 200 else None
        except (OSError, ValueError, http.client.HTTPException):
            return None
        finally:
            conn.close()

    def reserve(self, run: str, checkpoint_id: int, rank: int, nbytes: int,
                files: list[tuple[str, int]] | None = None) -> str:
        """The directory the rank writes its files into, with room for `nbytes` made; each of
        `files` ((name, size)) may already be there, a recycled segment file to overwrite in
        place and truncate (agent/segments.py)."""
        return self._post(tiers.AGENT_RESERVE_PATH, {"run": run, "checkpoint_id": checkpoint_id, "rank": rank,
                                                     "bytes": nbytes,
                                                     "files": [{"name": n, "size": s} for n, s in files or []]})["directory"]

    def ready(self, run: str, checkpoint_id: int, rank: int, files: list[str],
              replicas: int = tiers.DEFAULT_REPLICAS) -> list[dict]:
        """The agent hashes the files, reports its copy and replicates in the background;
        its digests of what it holds come back (the rank votes its own)."""
        return self._post(tiers.AGENT_READY_PATH, {"run": run, "checkpoint_id": checkpoint_id, "rank": rank,
                                                   "files": files, "replicas": replicas})["files"]


def read_range(address: str, run: str, checkpoint_id: int, rank: int, name: str, start: int, length: int,
               timeout: float = 30.0, into=None):
    """`length` bytes of a held file from `start`, from the agent at `address` (no check):
    received straight into `into` (a writable buffer of at least `length` bytes: the
    restore's staging buffer, so no second copy) and a view of them returned, else into a
    new bytearray."""
    conn = connect(address, timeout)
    try:
        conn.request("GET", _route(tiers.AGENT_SEGMENTS_PATH, run, checkpoint_id, rank, name),
                     headers={"Range": f"bytes={start}-{start + length - 1}"})
        resp = conn.getresponse()
        if resp.status != 206:
            raise LookupError(f"{address}: {resp.status} {resp.read(200)!r}")
        body = bytearray(length) if into is None else into
        view, got = memoryview(body).cast("B")[:length], 0
        if view.nbytes < length:
            raise ValueError(f"a buffer of {view.nbytes} bytes cannot take {length}")
        while got < length:
            n = resp.readinto(view[got:])
            if not n:
                raise ConnectionError(f"{address}: {got} of {length} bytes")
            got += n
        return body if into is None else view
    finally:
        conn.close()


PIECE = 8 << 20  # a local read lands and is hashed piece by piece, while it is in the CPU's cache


def read_local(address: str, run: str, checkpoint_id: int, rank: int, name: str, size: int,
               timeout: float = 30.0, into=None) -> tuple[object, str] | None:
    """The file as the agent at `address` holds it on this host, read from its path: (the
    bytes, their xxh3-128); None when the path is not there from here (the caller reads over
    HTTP). Unverified: the caller compares the digest with the manifest's."""
    conn = connect(address, timeout)
    try:
        conn.request("GET", _route(tiers.AGENT_LOCAL_PATH, run, checkpoint_id, rank, name))
        resp = conn.getresponse()
        raw = resp.read(64 * 1024)
    finally:
        conn.close()
    if resp.status != 200:  # not held, or an agent without the route: the HTTP read says which
        return None
    try:
        path = json.loads(raw)["path"]
        f = open(path, "rb", buffering=0)
    except (ValueError, KeyError, TypeError, OSError):
        return None  # not this host's file system (or not readable from here): over HTTP
    body = bytearray(size) if into is None else into
    view, h = memoryview(body).cast("B")[:size], StreamHasher()
    with f:
        if os.fstat(f.fileno()).st_size != size:
            raise LookupError(f"{address}: {path} is not {size} bytes")
        got = 0
        while got < size:
            n = f.readinto(view[got:min(got + PIECE, size)])
            if not n:
                raise LookupError(f"{address}: {path} ended after {got} of {size} bytes")
            h.update(view[got:got + n])
            got += n
    return (body if into is None else view), h.hexdigest()


def read_verified(copies: list[str], run: str, checkpoint_id: int, rank: int, name: str, size: int,
                  digest: str, timeout: float = 30.0, into=None, local: str | None = None) -> tuple[object, str]:
    """The file's bytes from the first copy whose bytes hash to `digest`, and that copy's
    address. A copy is read whole (a file of a memory checkpoint is one range of one rank),
    into `into` when given (each copy tried overwrites it; the view returned is of it).
    `local`: the address of this host's own agent, whose copy is read from its path
    (read_local) where this host sees it."""
    if into is not None and memoryview(into).nbytes < size:  # the caller's mistake, not a bad copy
        raise ValueError(f"a buffer of {memoryview(into).nbytes} bytes cannot take {name}'s {size}")
    tried = []
    for address in copies:
        try:
            got = read_local(address, run, checkpoint_id, rank, name, size, timeout, into) \
                if address == local and size else None
            if got is None:
                data = read_range(address, run, checkpoint_id, rank, name, 0, size, timeout, into) if size \
                    else bytearray()
                h = StreamHasher()
                h.update(data)
                got = data, h.hexdigest()
        except (OSError, LookupError, ValueError, http.client.HTTPException) as e:
            tried.append(f"{address}: {e}")
            continue
        data, found = got
        if found == digest:
            return data, address
        log.warning("the copy of %s/%s/%s/%s at %s does not match the manifest's digest: next copy",
                    run, checkpoint_id, rank, name, address)
        tried.append(f"{address}: xxh3-128 {found} is not the manifest's {digest}")
    raise CorruptCheckpoint(f"no good copy of {run}/{checkpoint_id}/{rank}/{name}: " + "; ".join(tried))
