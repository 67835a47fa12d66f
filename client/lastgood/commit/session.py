"""One rank's side of the two-phase commit, for every writer (the Checkpointer, DCP's
StorageWriter). torch-free.

    session = SaveSession(transport, run, rank, commit_timeout=...)   # one per writer
    up = session.checkpoint(step)        # one rank's part in one checkpoint
    up.add("rank00000.safetensors", data)  # prepared by the data path (paths.py), before begin
    up.add_all([(name, data), ...])       # several files of the rank, prepared concurrently (common/parallel.py)
    up.begin(world_size, attempt)        # or up.join(cid): a checkpoint another rank began
    up.commit()                          # send, vote, wait for the outcome (or commit(wait=False): vote only)

Why one object: the rules of a save that must not differ between writers live here once.
Every call retries transient failures (the transport's RetryPolicy), so a service that
restarts mid-save costs a delay, not the save. The outcome is waited for on the REST
long-poll, where a waiting rank holds no service thread. When anything fails after begin,
the reply may be what was lost: the service is asked (retrying) what became of the
checkpoint before the save is declared failed; committed with exactly this rank's bytes
is success, PENDING is aborted (nothing partial stays visible), and no answer at all is
"outcome unknown", remembered and settled before the next begin. Across saves the session
keeps the parent (the previous commit, or the checkpoint restored from) and the
checkpoints whose outcome it missed (`settle`), and makes ranks that gave up different
saves during an outage meet on one step (`converge`). docs/availability.md tells the story.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from lastgood.wire.vocab import Status
from lastgood.datapath import peer
from lastgood.errors import GaveUp, SaveFailed, ServiceError
from lastgood.wire.hashing import hash_bytes
from lastgood.common import parallel
from lastgood.common.joblog import incident
from lastgood.datapath.choose import default_path
from lastgood.datapath.paths import DataPath, Prepared, StreamPath, carried

log = logging.getLogger("lastgood")
_SENT = memoryview(b"")  # what a sent file's handle holds instead of its bytes


@dataclass(frozen=True)
class Unsure:
    """A checkpoint whose outcome a rank missed, and the files it tried to save in it."""

    checkpoint_id: int
    step: int
    rank: int
    files: tuple[tuple[str, str], ...]  # (name, xxh3-128)


class SaveSession:
    def __init__(self, transport, run: str, rank: int, *, commit_timeout: float,
                 path: DataPath | None = None) -> None:
        """`commit_timeout`: how long a rank that voted waits for the others. `path`: how
        files travel (paths.py); by default chosen per checkpoint (`default_path`)."""
        self.transport, self.run, self.rank = transport, run, rank
        self.commit_timeout = commit_timeout
        self.path = path
        self.parent_id: int | None = None
        self.unsure: list[Unsure] = []

    def checkpoint(self, step: int, rank: int | None = None) -> "Upload":
        """This rank's part in saving `step` (`rank`: DCP numbers ranks by its plans)."""
        return Upload(self, step, self.rank if rank is None else rank, self.path or default_path(self.transport))

    # ------------------------------------------------------------------ what the service says
    def status(self, cid: int, quiet: bool = True) -> str | None:
        """The checkpoint's status, asked with the retry policy's patience; None (or the
        error, with quiet=False) when the service does not answer within it."""
        try:
            return self.transport.checkpoint(cid)["status"]
        except ServiceError:
            if not quiet:
                raise
            return None

    def committed_with(self, cid: int, files, rank: int | None = None) -> bool:
        """Does the committed checkpoint hold exactly the files (name, xxh3-128) this rank
        tried to save? An error that may pass (the service or the path to it away) is
        raised: "unknown" is not "other bytes"."""
        try:
            stored = self.transport.manifest(cid).files(self.rank if rank is None else rank)
        except ServiceError as e:
            if e.retryable:
                raise
            return False
        return sorted((f.name, f.xxh3_128) for f in stored) == sorted(files)

    # ------------------------------------------------------------------ across saves
    def settle(self, on_committed: Callable[[int, int], None] | None = None) -> None:
        """Before anything new begins, learn from the service what became of checkpoints whose
        outcome this rank missed (a reply lost in a restart, an upload given up after it
        began). Every rank asks the same service, so all continue from the same parent: a
        pending one is aborted first, which makes its outcome final for everyone.
        `on_committed(step, checkpoint_id)` hears of each that did commit with this rank's bytes."""
        while self.unsure:
            u = self.unsure[0]
            status = self.status(u.checkpoint_id, quiet=False)
            if status == Status.PENDING:
                try:
                    self.transport.abort(u.checkpoint_id, f"rank {u.rank} gave up step {u.step}", u.rank)
                except GaveUp:
                    raise
                except ServiceError:  # committed or expired meanwhile: asked again below
                    pass
                status = self.status(u.checkpoint_id, quiet=False)
            if status == Status.COMMITTED:
                self.parent_id = u.checkpoint_id
                if self.committed_with(u.checkpoint_id, u.files, u.rank):
                    if on_committed is not None:
                        on_committed(u.step, u.checkpoint_id)
                    incident(log, logging.WARNING, "lastgood: step %s (checkpoint %s) did commit after all", u.step,
                             u.checkpoint_id)
            self.unsure.pop(0)

    def converge(self, step: int, attempt: str, cid: int | None = None) -> None:
        """After an outage the ranks may have given up different saves: one rank begins step
        8 while another dropped 8 and began 20, and each would wait for the other until the
        lease runs out. Saves are processed in order, so a PENDING checkpoint of this launch
        at an older step is one this rank has given up: abort it, and a peer waiting on it
        learns at once. One at a newer step means a peer has moved on: give this step up.
        Every rank applies the same rule to the same catalog, so all converge on the newest
        step. Asked only while saves are being given up or failing (one listing per save)."""
        items = self.transport.pending(self.run)  # none while the run has no checkpoint yet
        mine = [c for c in items if c["attempt"] == attempt and c["id"] != cid]
        for c in mine:
            if c["step"] < step:
                try:
                    self.transport.abort(c["id"], f"rank {self.rank} gave up step {c['step']}", self.rank)
                except GaveUp:
                    raise
                except ServiceError:  # committed or expired meanwhile
                    pass
        newer = sorted(c["step"] for c in mine if c["step"] > step)
        if newer:
            if cid is not None:
                self.transport.abort(cid, f"rank {self.rank}: another rank moved on to step {newer[0]}", self.rank)
            raise SaveFailed(f"another rank gave step {step} up and moved on to step {newer[0]}")


class Upload:
    """One rank's part in one checkpoint: its files, begin (or join), send, vote, outcome."""

    def __init__(self, session: SaveSession, step: int, rank: int, path: DataPath) -> None:
        self.session, self.transport = session, session.transport
        self.step, self.rank, self.path = step, rank, path
        self.files: list[Prepared] = []
        self._sent = 0  # files[:_sent] are the service's, or (_carried) travel with the vote
        self._carried: list[Prepared] = []
        self.checkpoint_id: int | None = None
        self.attempt: str | None = None

    @property
    def digests(self) -> tuple[tuple[str, str], ...]:
        # a file written as it is sent (paths.FOLLOW) has its hash once sent; before, from its bytes
        return tuple((h.name, h.digest if h.digest is not None else hash_bytes(h.data)) for h in self.files)

    def add(self, name: str, data) -> Prepared:
        """Prepare one more file of this rank (any number, before or after begin)."""
        if any(h.name == name for h in self.files):
            raise ValueError(f"file {name!r} added twice to the save of step {self.step}")
        handle = self.path.prepare(name, data)
        self.files.append(handle)
        return handle

    def add_all(self, files: list[tuple[str, object]]) -> list[Prepared]:
        """Prepare several files of this rank concurrently (a rank's state split into files,
        common/parallel.py): each hashed and written at once with the others; in the order given."""
        names = [n for n, _ in files]
        if len(set(names)) != len(names) or any(h.name in names for h in self.files):
            raise ValueError(f"a file added twice to the save of step {self.step}: {names}")
        handles = parallel.run_all([lambda n=n, d=d: self.path.prepare(n, d) for n, d in files],
                                transport=self.transport, undo=self.path.discard)
        self.files.extend(handles)
        return handles

    def begin(self, world_size: int, attempt: str, *, parent_id: int | None = None) -> int:
        """BeginCheckpoint (idempotent on run, step, attempt), telling the service what the
        files added so far will cost its store. `parent_id`: by default the session's (0: none)."""
        parent = self.session.parent_id if parent_id is None else parent_id
        try:
            ck = self.transport.begin(self.session.run, self.step, world_size, parent, attempt, self.rank,
                                      expected_bytes=sum(h.expected_bytes for h in self.files))
        except BaseException:
            self.discard()
            raise
        self.checkpoint_id, self.attempt = ck.checkpoint_id, attempt
        return self.checkpoint_id

    def join(self, checkpoint_id: int) -> "Upload":
        """Take part in a checkpoint another rank began (DCP's coordinator)."""
        self.checkpoint_id = checkpoint_id
        return self

    def discard(self) -> None:
        """Drop what the data path prepared and did not send (a spool file)."""
        for handle in self.files[self._sent:]:
            self.path.discard(handle)

    def abort(self, why: BaseException | str) -> None:
        """Abort the checkpoint for a failure outside the session (the caller raises it):
        nothing partial becomes visible. An abort that fails (committed or expired
        meanwhile) is left to the service's lease."""
        self.discard()
        if self.checkpoint_id is None:
            return
        try:
            self.transport.abort(self.checkpoint_id, f"rank {self.rank}: {why}"[:1000], self.rank)
        except Exception:  # noqa: BLE001 - expired or committed meanwhile: the lease settles it
            pass

    def send(self) -> None:
        """Hand every file added and not yet sent to the service (commit() does it too); a
        failure is handled as commit() handles one."""
        try:
            self._send()
        except BaseException as e:
            self._failed(e, remember=False)

    def _send(self) -> None:
        # every file not yet sent, handed over concurrently (common/parallel.py); a path's send is
        # final and safe to retry, and a file it handed over holds no token to discard
        def send(handle: Prepared) -> None:
            self.path.send(self.checkpoint_id, self.rank, handle)
            handle.data = _SENT  # the service has it: the writer's buffer is not held past the save

        todo = self.files[self._sent:]
        # small files go with the vote (paths.INLINE): a tiny state's save is begin and vote alone
        self._carried += carried(todo, self.transport.info.inline_bytes - sum(h.data.nbytes for h in self._carried))
        todo = [h for h in todo if all(h is not c for c in self._carried)]
        streamed = isinstance(self.path, StreamPath) and any(h.token is None for h in todo)  # not a hand-over by name
        parallel.run_all([lambda h=h: send(h) for h in todo], workers=parallel.STREAM_WORKERS if streamed else parallel.WORKERS,
                      transport=self.transport)
        self._sent = len(self.files)

    def commit(self, *, wait: bool = True, converging: Callable[[], bool] | None = None) -> None:
        """Send what is left, vote with every file of this rank, and (`wait`) return once the
        checkpoint is COMMITTED. `wait=False` votes and returns: another rank waits for the
        outcome (DCP's coordinator). `converging()`: should the ranks meet on one step
        (SaveSession.converge) while this one waits? Any failure is checked against what the
        service says (the reply may be what was lost) and raised as SaveFailed naming the
        true outcome, unless the checkpoint did commit with this rank's bytes."""
        try:
            self._send()
            self._vote(wait, converging or (lambda: False))
        except BaseException as e:
            self._failed(e, remember=wait)  # returns only when it committed with this rank's files
        if wait:
            self.session.parent_id = self.checkpoint_id

    def _vote(self, wait: bool, converging: Callable[[], bool]) -> None:
        cid, names = self.checkpoint_id, [h.name for h in self.files]
        deadline = time.monotonic() + self.session.commit_timeout
        # vote without waiting, then wait for the outcome where a waiting rank costs the
        # service no thread (a long-poll on its event loop: docs/control-plane.md)
        res = self.transport.commit_rank(cid, self.rank, names, wait=0.0,
                                         inline=[(h.name, h.digest, h.data) for h in self._carried])
        for h in self._carried:
            h.data = _SENT  # the service has it (recorded before the vote)
        self._carried = []
        status, missing = res.status, list(res.missing_ranks)
        if res.status == Status.PENDING and peer.wanted(self.transport):  # peer.py: read back another rank's files
            from lastgood.datapath import directfs

            checked = peer.check(self.transport, directfs.of(self.transport), cid, self.rank, deadline,
                                 wait_for_peer=wait)
            if checked == Status.COMMITTED:  # heard already (often its own report committed): no outcome call
                status = checked
        if not wait:
            return
        while status != Status.COMMITTED:
            if status != Status.PENDING:  # decided otherwise: the vote, asked again, raises why (fenced, ...)
                status = self.transport.commit_rank(cid, self.rank, names, wait=0.0).status
                if status != Status.COMMITTED:
                    raise SaveFailed(f"checkpoint {cid} (step {self.step}) is {status}")
                break
            if converging():  # a peer may have given this step up and moved on (or began it late)
                self.session.converge(self.step, self.attempt, cid)
            if time.monotonic() > deadline:
                raise SaveFailed(f"checkpoint {cid} (step {self.step}) not committed after "
                                 f"{self.session.commit_timeout:.0f}s; ranks not voted: {missing}")
            # long waits (the service holds no thread for them); short ones while a peer may give up
            out = self.transport.outcome(cid, wait=min(2.0 if converging() else 10.0,
                                                       max(deadline - time.monotonic(), 0.0) + 0.01))
            status, missing = out["status"], out["missing_ranks"]

    def _failed(self, e: BaseException, remember: bool) -> None:
        """The lost-reply check: returns if the checkpoint committed with this rank's bytes,
        else aborts it (if still PENDING) and raises SaveFailed with what became of it.
        `remember`: an unknown outcome is settled before the next begin (a rank that does
        not wait for the outcome leaves that to the rank that does)."""
        session, cid, step = self.session, self.checkpoint_id, self.step
        self.discard()
        unsure = Unsure(cid, step, self.rank, self.digests)
        if isinstance(e, GaveUp):  # a newer save wants this buffer: settled before that one begins
            session.unsure.append(unsure)
            raise
        try:
            status = session.status(cid, quiet=False)
            ours = status == Status.COMMITTED and session.committed_with(cid, unsure.files, self.rank)
        except ServiceError:
            if remember:
                session.unsure.append(unsure)  # the next save asks again first
            raise SaveFailed(f"save of step {step} (checkpoint {cid}): outcome unknown, the service "
                             f"did not answer: {e}") from e
        if ours:
            log.warning("lastgood: step %s: %s, but checkpoint %s is committed", step, e, cid)
            return
        if status == Status.PENDING:
            self.abort(e)
        outcome = ("last-good did not move" if status in (Status.PENDING, Status.ABANDONED)
                   else "it committed with other bytes for this rank" if status == Status.COMMITTED
                   else f"it is {status}")
        raise SaveFailed(f"save of step {step} (checkpoint {cid}) failed, {outcome}: {e}") from e
