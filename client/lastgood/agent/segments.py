"""The agent's segments: files under <root>/<run>/<checkpoint id>/<rank>/<file> (tiers.SHM_ROOT
on a node; a tmpfs, so the bytes are memory that outlives the rank processes), their digests,
and the node's memory budget.

The budget rule: a new segment is admitted when the bytes held plus its own fit the budget;
else the oldest checkpoints (lowest id first, across runs) are freed, except the newest
checkpoint of each run that the agent holds complete (the restore point while the new one is
not committed); if that is still not enough the new segment is refused (BudgetExceeded) and
nothing held is touched beyond what was freed.

Recycling: the files of a checkpoint freed by the live list are not deleted but kept in a pool
(<root>/.free, a name no run can have), and a new segment takes them: a reservation that names
its files gets a pooled file renamed to each name (the best fit by size), and the writer
overwrites it in place and truncates it to its size. A tmpfs page that is written again costs a
copy; a new one costs an allocation and a zero-fill first (on this project's VM, memory freed a
while ago is handed back to the host and comes back slowly: docs/performance.md). The pool counts
against the budget and is the first thing given up for room, and it keeps at most the bytes of
the checkpoint freed last (what the next one takes: so held and pooled together stay within
the node's formula, docs/memory-tier.md). An agent starts with an empty pool.

Adoption: an agent that replaces one on the node (it crashed, or was stopped) takes up what
that one left under the root (`adopt`): every complete file is hashed and held again, as a
rank's sealed files are; what is left of a copy being received (`.part`) and of a reservation
nothing was written to is removed. `drop_all` instead removes it all (`lastgood agent --fresh`).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import threading
from dataclasses import dataclass, field
from pathlib import Path

from lastgood.common.durable import open_for_overwrite, write_all
from lastgood.wire import names
from lastgood.wire.hashing import StreamHasher

CHUNK = 1 << 20


class BudgetExceeded(Exception):
    """The node's memory budget cannot hold a new segment even after freeing what may go."""


class SegmentMissing(LookupError):
    pass


@dataclass
class Held:
    """One checkpoint's files on this agent: {(rank, file): (size, xxh3_128)}."""
    run: str
    checkpoint_id: int
    files: dict[tuple[int, str], tuple[int, str]] = field(default_factory=dict)
    reserved: int = 0
    complete: bool = False

    @property
    def nbytes(self) -> int:
        return max(self.reserved, sum(size for size, _ in self.files.values()))


def check_key(run: str, checkpoint_id: int, rank: int, name: str | None = None) -> None:
    names.check_run_name(run)
    if not isinstance(checkpoint_id, int) or isinstance(checkpoint_id, bool) or checkpoint_id < 1:
        raise ValueError(f"checkpoint_id must be a positive integer, got {checkpoint_id!r}")
    if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < 1 << 20:
        raise ValueError(f"rank must be 0..{(1 << 20) - 1}, got {rank!r}")
    if name is not None:
        names.check_file_name(name)


def _a_file_name(name: str) -> bool:
    try:
        names.check_file_name(name)
        return True
    except names.InvalidName:
        return False


POOL = ".free"  # the recycled files' folder under the root: a run name starts with a letter or digit


class Segments:
    def __init__(self, root: Path | str, budget: int | None = None) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.budget = budget
        self._held: dict[tuple[str, int], Held] = {}
        self._lock = threading.Lock()
        self.freed: list[tuple[str, int]] = []   # what the budget or the live list freed, in order
        self._pool_dir = self.root / POOL
        shutil.rmtree(self._pool_dir, ignore_errors=True)  # an earlier agent's: not this one's bytes
        self._pool_dir.mkdir()
        self._pool: list[tuple[int, Path]] = []  # (size, path) of each recycled file
        self._pool_seq = 0
        self.recycled = 0  # files a new segment took from the pool
        self._readers: dict[tuple[str, int, int, str], int] = {}  # open reads of each held file

    # ---------------------------------------------------------------- layout
    def directory(self, run: str, checkpoint_id: int, rank: int) -> Path:
        check_key(run, checkpoint_id, rank)
        return self.root / run / str(checkpoint_id) / str(rank)

    def path(self, run: str, checkpoint_id: int, rank: int, name: str) -> Path:
        check_key(run, checkpoint_id, rank, name)
        return self.directory(run, checkpoint_id, rank) / name

    # ---------------------------------------------------------------- budget
    def held_bytes(self) -> int:
        with self._lock:
            return sum(h.nbytes for h in self._held.values())

    def pooled_bytes(self) -> int:
        with self._lock:
            return sum(n for n, _ in self._pool)

    def reserve(self, run: str, checkpoint_id: int, rank: int, nbytes: int,
                files: list[tuple[str, int]] | None = None) -> Path:
        """Make room for `nbytes` more of (run, checkpoint_id) and create its rank directory;
        each of `files` ((name, size), what will be written there) that the pool can serve
        is placed there as a recycled file, cut to its size, to be overwritten in place."""
        if not isinstance(nbytes, int) or nbytes < 0:
            raise ValueError(f"bytes must be a non-negative integer, got {nbytes!r}")
        d = self.directory(run, checkpoint_id, rank)
        wanted = [(self.path(run, checkpoint_id, rank, n).name, size) for n, size in files or []]
        with self._lock:
            held = self._held.get((run, checkpoint_id))
            have = held.nbytes if held else 0
            taken = [(name, size, got) for name, size in wanted if (got := self._take(size)) is not None]
            try:
                self._admit(run, checkpoint_id, nbytes)
            except BudgetExceeded:
                self._pool.extend(got for _, _, got in taken)
                raise
            if held is None:
                held = self._held[(run, checkpoint_id)] = Held(run, checkpoint_id)
            held.reserved = have + nbytes
        d.mkdir(parents=True, exist_ok=True)
        self._place([(d / name, size, got[1]) for name, size, got in taken])
        return d

    def _place(self, moves: list[tuple[Path, int, Path]]) -> None:
        """Pooled files to their new paths, each cut to its new size at once (so a writer that
        dies before its own truncate leaves no bytes beyond the reservation); a move that fails
        unlinks the pooled file rather than leaving it uncounted in the pool's folder."""
        for dest, size, path in moves:
            try:
                os.replace(path, dest)
                os.truncate(dest, size)
            except OSError:
                path.unlink(missing_ok=True)
                continue
            self.recycled += 1

    def take_for(self, path: Path, size: int) -> None:
        """A pooled file, if any, placed at `path` (a partner's copy being received there)."""
        with self._lock:
            got = self._take(size)
        if got is not None:
            self._place([(path, size, got[1])])

    def _take(self, size: int) -> tuple[int, Path] | None:
        """The pooled file that best fits `size` bytes: the smallest as large, else the largest."""
        if not self._pool or size <= 0:
            return None
        fits = [f for f in self._pool if f[0] >= size]
        best = min(fits) if fits else max(self._pool)
        self._pool.remove(best)
        return best

    def _recycle(self, held: Held) -> None:
        """A freed checkpoint's files into the pool, then the pool trimmed to its limit. A
        file still open for reading (a partner's copy or a ranged read in flight) is not
        pooled: a new checkpoint overwriting it in place would change the bytes under that
        reader; it is unlinked with its folder, and the reader keeps its bytes."""
        d = self.root / held.run / str(held.checkpoint_id)
        for (rank, name), (size, _) in held.files.items():
            if self._readers.get((held.run, held.checkpoint_id, rank, name)):
                continue
            self._pool_seq += 1
            dest = self._pool_dir / str(self._pool_seq)
            try:
                os.replace(d / str(rank) / name, dest)
            except OSError:
                continue
            self._pool.append((size, dest))
        limit = held.nbytes  # what the next checkpoint takes; within the budget with what else is held
        if self.budget is not None:
            limit = min(limit, self.budget - sum(h.nbytes for h in self._held.values() if h is not held))
        self._trim(limit)

    def _trim(self, limit: int) -> None:
        """Unlink pooled files, oldest first, until the pool holds at most `limit` bytes."""
        while self._pool and sum(n for n, _ in self._pool) > max(limit, 0):
            _, path = self._pool.pop(0)
            path.unlink(missing_ok=True)

    def _admit(self, run: str, checkpoint_id: int, nbytes: int) -> None:
        if self.budget is None:
            return
        total = sum(h.nbytes for h in self._held.values())
        self._trim(self.budget - total - nbytes)  # the pool is the first thing given up for room
        if total + nbytes <= self.budget:
            return
        newest_complete = {}
        for h in self._held.values():
            if h.complete and h.checkpoint_id > newest_complete.get(h.run, 0):
                newest_complete[h.run] = h.checkpoint_id
        may_go = sorted((h for h in self._held.values()
                         if (h.run, h.checkpoint_id) != (run, checkpoint_id)
                         and newest_complete.get(h.run) != h.checkpoint_id),
                        key=lambda h: h.checkpoint_id)
        if total - sum(h.nbytes for h in may_go) + nbytes > self.budget:
            raise BudgetExceeded(
                f"{nbytes} bytes for {run}/{checkpoint_id} do not fit the node's memory budget of "
                f"{self.budget} bytes ({total} held, of which the newest complete checkpoint of each run stays)")
        for h in may_go:
            if total + nbytes <= self.budget:
                break
            total -= h.nbytes
            self._drop(h.run, h.checkpoint_id)

    # ---------------------------------------------------------------- contents
    def seal(self, run: str, checkpoint_id: int, rank: int, files: list[str]) -> list[dict]:
        """Hash the rank's files as they lie in its directory; they become held. A file
        missing or over the reservation raises (and nothing is recorded)."""
        out, entries = [], {}
        for name in files:
            p = self.path(run, checkpoint_id, rank, name)
            if not p.is_file():
                raise SegmentMissing(f"{run}/{checkpoint_id}/{rank}/{name} is not in the agent's segment")
            h = StreamHasher()
            buf = memoryview(bytearray(CHUNK))
            with open(p, "rb", buffering=0) as f:
                while n := f.readinto(buf):
                    h.update(buf[:n])
            entries[(rank, name)] = (h.size, h.hexdigest())
            out.append({"name": name, "size": h.size, "xxh3_128": h.hexdigest()})
        with self._lock:
            held = self._held.setdefault((run, checkpoint_id), Held(run, checkpoint_id))
            held.files.update(entries)
            held.complete = True
        return out

    def receive(self, run: str, checkpoint_id: int, rank: int, name: str, size: int, readinto) -> dict:
        """A partner's copy: `size` bytes from readinto(buffer), written and hashed as they
        arrive, through one reused buffer."""
        p = self.path(run, checkpoint_id, rank, name)
        tmp = p.with_name(p.name + ".part")
        self.reserve(run, checkpoint_id, rank, size)
        self.take_for(tmp, size)
        h = StreamHasher()
        buf = memoryview(bytearray(min(CHUNK, size) or 1))
        try:
            with open_for_overwrite(tmp) as f:
                left = size
                while left:
                    n = readinto(buf[:min(len(buf), left)])
                    if not n:
                        raise ConnectionError(f"the copy of {name} ended after {size - left} of {size} bytes")
                    h.update(buf[:n])
                    write_all(f.fileno(), buf[:n])
                    left -= n
                f.truncate(size)
            os.replace(tmp, p)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        with self._lock:
            held = self._held[(run, checkpoint_id)]
            held.files[(rank, name)] = (h.size, h.hexdigest())
            held.complete = True
        return {"name": name, "size": h.size, "xxh3_128": h.hexdigest()}

    def digest(self, run: str, checkpoint_id: int, rank: int, name: str) -> tuple[int, str]:
        with self._lock:
            held = self._held.get((run, checkpoint_id))
            if held is None or (rank, name) not in held.files:
                raise SegmentMissing(f"{run}/{checkpoint_id}/{rank}/{name} is not held here")
            return held.files[(rank, name)]

    @contextlib.contextmanager
    def open(self, run: str, checkpoint_id: int, rank: int, name: str):
        """A held file open for reading; while it is, freeing its checkpoint unlinks the file
        instead of pooling it (_recycle)."""
        key = (run, checkpoint_id, rank, name)
        with self._lock:
            self._readers[key] = self._readers.get(key, 0) + 1
        try:
            self.digest(run, checkpoint_id, rank, name)
            try:
                f = open(self.path(run, checkpoint_id, rank, name), "rb")
            except FileNotFoundError:
                raise SegmentMissing(f"{run}/{checkpoint_id}/{rank}/{name} is gone from the segment") from None
            with f:
                yield f
        finally:
            with self._lock:
                self._readers[key] -= 1
                if not self._readers[key]:
                    del self._readers[key]

    def adopt(self) -> list[tuple[str, int, int, list[dict]]]:
        """Hold again what an earlier agent left under the root: (run, checkpoint id, rank,
        [{name, size, xxh3_128}]) of each rank's files, hashed now (seal), in key order, for the
        agent to report (the service lists a new agent's copies only once it has). A path that
        is no segment's (a name no run, id or rank can have) is left alone; a `.part` file (a
        copy whose receiving was cut off) and an empty folder are removed."""
        found = []
        for run_dir in sorted(p for p in self.root.iterdir() if p.is_dir() and p.name != POOL):
            for cid_dir in sorted(p for p in run_dir.iterdir() if p.is_dir()):
                for rank_dir in sorted(p for p in cid_dir.iterdir() if p.is_dir()):
                    try:
                        run, cid, rank = run_dir.name, int(cid_dir.name), int(rank_dir.name)
                        check_key(run, cid, rank)
                    except ValueError:
                        continue
                    files = []
                    for f in sorted(rank_dir.iterdir()):
                        if f.name.endswith(".part"):
                            f.unlink(missing_ok=True)
                        elif f.is_file() and not f.is_symlink() and _a_file_name(f.name):
                            files.append(f.name)
                    if files:
                        found.append((run, cid, rank, self.seal(run, cid, rank, files)))
                    else:
                        with contextlib.suppress(OSError):
                            rank_dir.rmdir()
                with contextlib.suppress(OSError):
                    cid_dir.rmdir()  # only if empty
        return found

    def drop_all(self) -> list:
        """Remove what an earlier agent left under the root (every run's folder; the pool is
        this agent's already); nothing is adopted."""
        for run_dir in self.root.iterdir():
            if run_dir.is_dir() and not run_dir.is_symlink() and run_dir.name != POOL:
                shutil.rmtree(run_dir, ignore_errors=True)
        return []

    def listing(self) -> list[dict]:
        with self._lock:
            return [{"run": h.run, "checkpoint_id": h.checkpoint_id,
                     "files": [{"rank": r, "name": n, "size": s, "xxh3_128": d}
                               for (r, n), (s, d) in sorted(h.files.items())]}
                    for h in sorted(self._held.values(), key=lambda h: (h.run, h.checkpoint_id))]

    def keys(self) -> set[tuple[str, int]]:
        with self._lock:
            return set(self._held)

    def free(self, run: str, checkpoint_id: int) -> None:
        """No longer live (the service's list): its files go to the pool for the next segments."""
        with self._lock:
            held = self._held.get((run, checkpoint_id))
            if held is not None:
                self._recycle(held)
            self._drop(run, checkpoint_id)

    def _drop(self, run: str, checkpoint_id: int) -> None:
        self._held.pop((run, checkpoint_id), None)
        shutil.rmtree(self.root / run / str(checkpoint_id), ignore_errors=True)
        self.freed.append((run, checkpoint_id))
