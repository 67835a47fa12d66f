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

import os
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

import click
from rich.text import Text

from lastgood.wire import names
from lastgood.errors import CorruptCheckpoint
from lastgood.wire.hashing import StreamHasher
from lastgood.wire.manifest import FileEntry
from lastgood.cli import render
from lastgood.cli.app import CKPT, CkptRef, CliError, Exit, State, cli, json_option, pass_state
from lastgood.remote.reading import CHUNK, ReadLease, read_manifest, read_verified

if TYPE_CHECKING:
    from lastgood.remote.rest import RestClient



def _hash_file(path: Path) -> tuple[int, str]:
    h = StreamHasher()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    return h.size, h.hexdigest()


def _fetch(rest: RestClient, cid: int, rank: int, entry: FileEntry, path: Path, progress, task, lease: ReadLease) -> None:
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
    lease = ReadLease(rest, cid)
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
                raise CorruptCheckpoint(f"checkpoint {cid}: the manifest names an unsafe file: {exc}") from None

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
        if not lease.release():
            st.err.print(Text(f"lastgood: warning: could not release read lease {lease.lease_id}; "
                              f"it expires by itself", style="yellow"))

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
