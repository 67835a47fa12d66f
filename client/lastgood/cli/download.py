"""`lastgood download CKPT DIR`: every file of a checkpoint, hashed while it streams.

Order of work, and why:
1. take a read lease, so GC cannot delete the checkpoint while it is read (I4); renew it
   by taking a fresh one every half period, so a killed download holds GC off briefly;
2. read the manifest: the list of files, each with its size and xxh3-128;
3. stream each file over REST into DIR/rank{R}/.NAME.*.part, hashing as bytes arrive;
   only a file whose size and hash match the manifest is renamed to DIR/rank{R}/NAME.
   A mismatch deletes the partial file and exits 5. A file already in place with the
   right size and hash is kept (a rerun resumes);
4. write DIR/manifest.json last (the exact bytes the service committed), so a directory
   with a manifest.json holds a complete, verified checkpoint.
"""

from __future__ import annotations

import http.client
import os
import socket
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import click
from rich.text import Text

from .. import names
from ..errors import ServiceError
from ..hashing import StreamHasher
from ..manifest import FileEntry, Manifest
from . import render
from .app import CKPT, CkptRef, CliError, Exit, State, VerificationFailed, cli, json_option, pass_state

if TYPE_CHECKING:
    from ..rest import RestClient

CHUNK = 1024 * 1024
LEASE_SECONDS = 600.0


class Lease:
    """A read lease on one checkpoint, renewed by replacement while the download runs."""

    def __init__(self, rest: RestClient, checkpoint_id: int, seconds: float = LEASE_SECONDS,
                 what: str = "download") -> None:
        self.rest, self.checkpoint_id, self.seconds = rest, checkpoint_id, seconds
        self.holder = f"lastgood-cli {what} on {socket.gethostname()} pid {os.getpid()}"[:128]
        self.lease_id = rest.acquire_lease(checkpoint_id, self.holder, seconds)
        self.taken = time.monotonic()

    def keep_alive(self) -> None:
        if time.monotonic() - self.taken < self.seconds / 2:
            return
        old, self.lease_id = self.lease_id, self.rest.acquire_lease(self.checkpoint_id, self.holder, self.seconds)
        self.taken = time.monotonic()
        self._release(old)

    def release(self, err_console) -> None:
        if not self._release(self.lease_id):
            err_console.print(Text(f"lastgood: warning: could not release read lease {self.lease_id}; "
                                   f"it expires by itself", style="yellow"))

    def _release(self, lease_id: int) -> bool:
        try:
            self.rest.release_lease(lease_id)
            return True
        except ServiceError:
            return False


def _hash_file(path: Path) -> tuple[int, str]:
    h = StreamHasher()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    return h.size, h.hexdigest()


def read_manifest(rest: RestClient, cid: int) -> tuple[bytes, Manifest]:
    """The checkpoint's manifest: the exact bytes the service committed, and parsed."""
    raw = rest.manifest_bytes(cid)
    try:
        manifest = Manifest.from_bytes(raw)
    except (ValueError, KeyError, TypeError) as e:
        raise VerificationFailed(f"checkpoint {cid}: the manifest does not parse: {e}") from None
    if manifest.checkpoint_id != cid:
        raise VerificationFailed(f"checkpoint {cid}: the service sent the manifest of checkpoint "
                                 f"{manifest.checkpoint_id}")
    return raw, manifest


def read_verified(rest: RestClient, cid: int, rank: int, entry: FileEntry, lease: Lease,
                  tail: str = "") -> Iterator[bytes]:
    """Yield one file's bytes as they arrive, hashing them; once the last byte is in, raise
    VerificationFailed unless size and xxh3-128 match the manifest's. Nothing yielded is
    verified until the generator is exhausted without an error. `tail` ends each error
    message (what the caller did with the bytes)."""
    where = f"checkpoint {cid} rank {rank} file {entry.name}"
    hasher = StreamHasher()
    resp = rest.open_file(cid, rank, entry.name)
    with resp:
        while True:
            try:
                chunk = resp.read(CHUNK)
            except http.client.IncompleteRead as e:
                got = hasher.size + len(e.partial)
                raise VerificationFailed(f"{where}: the service sent {got} of {entry.size} bytes (a truncated "
                                         f"blob, or the connection dropped){tail}") from None
            except OSError as e:
                raise CliError(f"{where}: the download broke off after {hasher.size} bytes: {e}",
                               Exit.UNREACHABLE) from None
            if not chunk:
                break
            if hasher.size + len(chunk) > entry.size:
                raise VerificationFailed(f"{where}: the service sent more than the manifest's {entry.size} "
                                         f"bytes{tail}")
            hasher.update(chunk)
            yield chunk
            lease.keep_alive()
    if hasher.size != entry.size:
        raise VerificationFailed(f"{where}: received {hasher.size} of {entry.size} bytes{tail}")
    got = hasher.hexdigest()
    if got != entry.xxh3_128:
        raise VerificationFailed(f"{where}: the bytes received hash to xxh3-128 {got} but the manifest says "
                                 f"{entry.xxh3_128}{tail}. `lastgood verify {cid}` re-hashes the checkpoint "
                                 f"on the service (and marks it CORRUPT if it is)")


def _fetch(rest: RestClient, cid: int, rank: int, entry: FileEntry, path: Path, progress, task, lease: Lease) -> None:
    """Stream one file into a temp file beside path; rename it into place only if verified."""
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.part")
    ok = False
    try:
        with open(tmp, "wb") as f:
            for chunk in read_verified(rest, cid, rank, entry, lease, "; the partial file was deleted"):
                f.write(chunk)
                progress.advance(task, len(chunk))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        ok = True
    finally:
        if not ok:
            tmp.unlink(missing_ok=True)


def _write_atomically(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.part")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


@cli.command()
@click.argument("ckpt", type=CKPT)
@click.argument("dest", metavar="DIR", type=click.Path(file_okay=False, path_type=Path))
@click.option("--rank", "ranks", type=click.IntRange(0), multiple=True, metavar="R",
              help="Only the files of rank R (repeatable). Default: every rank.")
@click.option("--progress/--no-progress", default=None,
              help="Show a progress bar on stderr. Default: when stderr is a terminal and not --json.")
@json_option
@pass_state
def download(st: State, ckpt: CkptRef, dest: Path, ranks: tuple[int, ...], progress: bool | None) -> None:
    """Fetch a checkpoint's files into DIR, verifying every hash.

    Each file streams to a temporary name and becomes DIR/rank{R}/NAME only once its size
    and xxh3-128 match the manifest; DIR/manifest.json is written last. A file already in
    place with the right hash is kept. A read lease keeps GC away meanwhile. Exit 5 if a
    file does not verify (its partial file is deleted).
    """
    from rich.progress import (BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn,
                               TransferSpeedColumn)

    rest = st.rest
    cid = st.resolve(ckpt)
    lease = Lease(rest, cid)
    try:
        raw, manifest = read_manifest(rest, cid)
        for r in ranks:
            if not 0 <= r < manifest.world_size:
                raise CliError(f"rank {r} is outside world size {manifest.world_size} of checkpoint {cid}",
                               Exit.REFUSED)
        wanted = sorted(set(ranks)) if ranks else sorted(manifest.ranks)
        files = [(r, e) for r in wanted for e in sorted(manifest.files(r), key=lambda e: e.name)]
        for _, e in files:  # the names become paths: hold the manifest to the same rule as uploads
            try:
                names.check_file_name(e.name)
            except names.InvalidName as exc:
                raise VerificationFailed(f"checkpoint {cid}: the manifest names an unsafe file: {exc}") from None

        dest.mkdir(parents=True, exist_ok=True)
        show = progress if progress is not None else (st.err.is_terminal and not st.json)
        bar = Progress(TextColumn("{task.description}", markup=False), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                       TimeRemainingColumn(), console=st.err, disable=not show, transient=False)
        results = []
        with bar:
            task = bar.add_task(f"checkpoint {cid}", total=sum(e.size for _, e in files))
            for r, e in files:
                path = dest / f"rank{r}" / e.name
                path.parent.mkdir(exist_ok=True)
                bar.update(task, description=f"#{cid} rank {r} {e.name}")
                reused = path.is_file() and path.stat().st_size == e.size and _hash_file(path) == (e.size, e.xxh3_128)
                if reused:
                    bar.advance(task, e.size)
                else:
                    _fetch(rest, cid, r, e, path, bar, task, lease)
                results.append({"rank": r, "name": e.name, "size": e.size, "xxh3_128": e.xxh3_128,
                                "path": str(path), "reused": reused})
            bar.update(task, description=f"checkpoint {cid}")
        _write_atomically(dest / "manifest.json", raw)
    finally:
        lease.release(st.err)

    total = sum(f["size"] for f in results)
    doc = {"checkpoint_id": cid, "run": manifest.run, "step": manifest.step, "dir": str(dest),
           "manifest": str(dest / "manifest.json"), "files": results, "bytes": total, "verified": True}

    def human(out):
        table = render.make_table("RANK", "FILE", "SIZE", "XXH3-128", "")
        table.columns[0].justify = table.columns[2].justify = "right"
        for f in results:
            table.add_row(Text(str(f["rank"])), Text(f["path"]), Text(render.fmt_bytes(f["size"])),
                          Text(f["xxh3_128"]), Text("kept" if f["reused"] else "verified", style="green"))
        out.print(table)
        render.line(out, Text("downloaded ", style="bold"), render.ckpt_id(cid), " (run ",
                    Text(manifest.run), f", step {manifest.step}): {len(results)} file(s), "
                    f"{render.fmt_bytes(total)}, every xxh3-128 verified; manifest at ",
                    Text(str(dest / "manifest.json")))
    st.emit(doc, human)
