"""Checkpointer: the trainer-facing API (save / restore / wait / close).

save(step, state) snapshots the state into a pooled CPU buffer and returns; a background
thread hashes it, begins the checkpoint, streams the shard, votes and waits for the
commit. Saves are processed in order, one at a time, so a checkpoint's parent is always
the previous commit (or the checkpoint restored from). A failed save aborts its
checkpoint, leaves last-good where it was, and is raised by wait() or close().
"""

from __future__ import annotations

import json
import logging
import os
import queue
import threading
import time
from dataclasses import dataclass

from . import distributed, names
from .errors import CorruptCheckpoint, LastgoodError, NoUsableCheckpoint, SaveFailed, ServiceError
from .format import META_STATE, parse_header
from .hashing import hash_bytes
from .manifest import Manifest
from .staging import Snapshot, StagingPool, snapshot
from .state import TrainState, array_from_buffer, tensor_from_buffer
from .transport import Transport

log = logging.getLogger("lastgood")


def shard_file_name(rank: int) -> str:
    return f"rank{rank:05d}.safetensors"


@dataclass
class SaveResult:
    step: int
    checkpoint_id: int


class Checkpointer:
    def __init__(self, url: str | None = None, run: str | None = None, *, attempt: str | None = None,
                 staging_buffers: int = 2, commit_timeout: float | None = None) -> None:
        url = url or os.environ.get("LASTGOOD_URL")
        if not url:
            raise LastgoodError("no service URL: pass Checkpointer(url, run=...) or set LASTGOOD_URL")
        run = run or os.environ.get("LASTGOOD_RUN")
        if not run:
            raise LastgoodError("name the run: Checkpointer(url, run='my-run') or set LASTGOOD_RUN")
        self.run = names.check_run_name(run)
        self.rank, self.world_size = distributed.rank_world()
        self.transport = Transport(url)
        self.commit_timeout = commit_timeout or 2 * float(self.transport.info.get("lease_seconds", 60)) + 60
        self.attempt = names.check_attempt(attempt or distributed.launch_attempt(self.world_size))
        self.file_name = shard_file_name(self.rank)
        self.parent_id: int | None = None
        self.last_saved: SaveResult | None = None
        self._pool = StagingPool(slots=staging_buffers)
        self._jobs: queue.Queue[Snapshot | None] = queue.Queue()
        self._failures: list[tuple[int, BaseException]] = []
        self._lock = threading.Lock()
        self._closed = False
        self._worker = threading.Thread(target=self._run, name="lastgood-upload", daemon=True)
        self._worker.start()

    # ------------------------------------------------------------------ save
    def save(self, step: int, state: TrainState) -> None:
        """Snapshot `state` into CPU memory and return; the upload continues in the background."""
        if self._closed:
            raise LastgoodError("Checkpointer is closed")
        if not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be a non-negative int, got {step!r}")
        cap = state.capture(step, self.rank, self.world_size)
        snap = snapshot(step, cap.json_state, cap.tensors, self._pool)
        self._jobs.put(snap)

    def _run(self) -> None:
        while True:
            snap = self._jobs.get()
            try:
                if snap is None:
                    return
                self._upload(snap)
            except BaseException as e:  # noqa: BLE001 - every failure is reported by wait()
                log.error("lastgood: save of step %s failed: %s", snap.step, e)
                with self._lock:
                    self._failures.append((snap.step, e))
            finally:
                if snap is not None:
                    self._pool.release(snap.buffer)
                self._jobs.task_done()

    def _upload(self, snap: Snapshot) -> None:
        data = snap.view()
        digest = hash_bytes(data)
        ck = self.transport.begin(self.run, snap.step, self.world_size, self.parent_id, self.attempt, self.rank)
        cid = ck.checkpoint_id
        try:
            self.transport.put_shard(cid, self.rank, self.file_name, data, digest)
            deadline = time.monotonic() + self.commit_timeout
            while True:
                res = self.transport.commit_rank(cid, self.rank, [self.file_name], wait=2.0)
                if res.status == "COMMITTED":
                    break
                if time.monotonic() > deadline:
                    raise SaveFailed(f"checkpoint {cid} (step {snap.step}) not committed after "
                                     f"{self.commit_timeout:.0f}s; ranks not voted: {list(res.missing_ranks)}")
        except BaseException as e:
            try:
                self.transport.abort(cid, f"rank {self.rank}: {e}"[:1000], self.rank)
            except Exception:  # the checkpoint may be committed or expired already
                pass
            raise
        self.parent_id = cid
        self.last_saved = SaveResult(snap.step, cid)

    def wait(self) -> None:
        """Block until every save so far is committed; raise SaveFailed if any failed."""
        self._jobs.join()
        with self._lock:
            failures, self._failures = self._failures, []
        if failures:
            steps = ", ".join(str(s) for s, _ in failures)
            raise SaveFailed(f"saves of step(s) {steps} failed; last-good did not move: {failures[-1][1]}") \
                from failures[-1][1]

    def close(self) -> None:
        if self._closed:
            return
        try:
            self.wait()
        finally:
            self._closed = True
            self._jobs.put(None)
            self._worker.join(timeout=10)
            self.transport.close()

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ restore
    def restore(self, state: TrainState, checkpoint_id: int | None = None) -> int | None:
        """Load the run's last-good (or the given checkpoint) into `state` in place.

        Returns its step, or None if the run has no checkpoint. Every byte read is
        re-hashed; on a mismatch the checkpoint is reported (the service re-verifies it
        and marks it CORRUPT) and the next older committed checkpoint is tried. All ranks
        agree on each candidate and on the outcome, so they never resume from different
        checkpoints.
        """
        self.wait()
        for cid in self._candidates(checkpoint_id):
            ok, manifest, payload, err = 1, None, None, None
            try:
                manifest, payload = self._fetch(cid)
            except CorruptCheckpoint as e:
                ok, err = 0, e
            if distributed.all_min(ok) == 0:
                if err is not None:
                    log.error("lastgood: %s", err)
                    try:
                        self.transport.verify(cid)
                    except ServiceError as ve:
                        log.error("lastgood: verify of checkpoint %s failed: %s", cid, ve)
                if checkpoint_id is not None:
                    raise err or CorruptCheckpoint(f"checkpoint {cid} failed verification on another rank")
                continue
            self._apply(state, payload)
            self.parent_id = cid
            log.info("lastgood: restored %s step %s (checkpoint %s)", self.run, manifest.step, cid)
            return manifest.step
        if checkpoint_id is None and self._had_candidates:
            raise NoUsableCheckpoint(f"every committed checkpoint of run {self.run!r} failed verification")
        return None

    def _candidates(self, explicit: int | None):
        """Candidate checkpoint ids, newest first, as rank 0 sees them (broadcast to all)."""
        self._had_candidates = False
        if explicit is not None:
            self._had_candidates = True
            yield distributed.broadcast_int(explicit)
            return
        tried: set[int] = set()
        while True:
            cid = 0
            if self.rank == 0:
                lg = self.transport.last_good(self.run)
                if lg is not None and lg["id"] not in tried:
                    cid = lg["id"]
                else:
                    older = [c["id"] for c in self.transport.committed(self.run) if c["id"] not in tried]
                    cid = older[0] if older else 0
            cid = distributed.broadcast_int(cid)
            if cid == 0:
                return
            self._had_candidates = True
            tried.add(cid)
            yield cid

    def _fetch(self, cid: int) -> tuple[Manifest, bytearray]:
        manifest = self.transport.manifest(cid)
        if manifest.world_size != self.world_size:
            raise LastgoodError(f"checkpoint {cid} was written by {manifest.world_size} ranks; this job has "
                                f"{self.world_size}. Restoring at another world size is not supported yet")
        entry = next((f for f in manifest.files(self.rank) if f.name == self.file_name), None)
        if entry is None:
            raise LastgoodError(f"checkpoint {cid} has no file {self.file_name} for rank {self.rank}")
        buf, got = self.transport.read_file(cid, self.rank, entry.name, entry.size)
        if got != entry.xxh3_128:
            raise CorruptCheckpoint(f"checkpoint {cid} (step {manifest.step}) rank {self.rank} file {entry.name}: "
                                    f"xxh3-128 {got} does not match the committed {entry.xxh3_128}")
        return manifest, buf

    @staticmethod
    def _apply(state: TrainState, buf: bytearray) -> None:
        tensors, meta = parse_header(buf, file_size=len(buf))
        start = 8 + int.from_bytes(buf[:8], "little")
        json_state = json.loads(meta[META_STATE])
        consumers = {n: c["kind"] for n, c in json_state["components"].items()}

        def tensor(name: str, device: str | None):
            # module weights are copied into the parameters by load_state_dict; everything
            # else is cloned so the optimizer does not keep the whole download alive
            copy = consumers.get(name.split(".", 1)[0]) != "module"
            return tensor_from_buffer(buf, tensors[name], start, device, copy)

        state.apply(json_state, tensor, lambda name: array_from_buffer(buf, tensors[name], start))
