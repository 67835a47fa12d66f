"""Checkpointer: the trainer-facing API (save / restore / wait / close).

save(step, state) snapshots the state into a pooled CPU buffer and returns; a background
thread (trainer/worker.py) hashes it, begins the checkpoint, streams the shard, votes and
waits for the commit. Saves are processed in order, one at a time, so a checkpoint's
parent is always the previous commit (or the checkpoint restored from). A failed save
aborts its checkpoint and leaves last-good where it was.

The service may be away for a while (a restart, a network blip): every call retries
transient failures (retry.py), and training never waits for the service. While it is
away, save() gives up older snapshots instead of waiting for their uploads (uploads.py);
each given-up save is logged, counted (`stats`) and posted as a `save_given_up` event once
the service answers again. wait() and close() fail only when the newest save did not
commit (`require_final=False` makes that a loud log line instead): an outage that later
saves recovered from costs nothing. When a rank cannot tell whether a checkpoint
committed, its next save first asks the service (retrying), so every rank continues from
the same parent. docs/availability.md tells the whole story.
Each launch registers with the service for a generation; once a newer launch of the run
has registered, this one is fenced and save(), wait() and close() raise Fenced.
A Checkpointer is collective: every rank creates it, and a rank that waits in vain for the
others raises within seconds (distributed.arrive). `solo=True` is the exception, for state
every rank holds alike: global rank 0 saves it alone, any rank restores it, and no call
is collective (docs/replicated.md). One open Checkpointer per run and process (launch.py).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from contextlib import nullcontext

from lastgood.commit.session import SaveSession
from lastgood.common import joblog
from lastgood.common.interval import Decider, Interval
from lastgood.trainer import memory as memtier
from lastgood.datapath.transport import Transport
from lastgood.errors import Fenced, LastgoodError, SaveFailed, ServiceError
from lastgood.remote import config
from lastgood.remote import heartbeat as _health
from lastgood.remote.config import ClientConfig
from lastgood.remote.retry import RetryPolicy
from lastgood.restore import replicas
from lastgood.restore.restorer import Restorer
from lastgood.state import distributed, split
from lastgood.state.staging import StagingPool, snapshot
from lastgood.state.trainstate import TrainState
from lastgood.trainer import launch as _launch
from lastgood.trainer.uploads import SaveRecord, UploadQueue
from lastgood.trainer.worker import SaveResult, UploadWorker
from lastgood.wire import names, tiers
from lastgood.wire.format import shard_file_name

log = logging.getLogger("lastgood")

class Checkpointer(UploadWorker):
    def __init__(self, url: str | None = None, run: str | None = None, *, attempt: str | None = None,
                 token: str | None = None, staging_buffers: int = 2, commit_timeout: float | None = None,
                 retry: RetryPolicy | None = None, require_final: bool = True, new_run: bool | None = None,
                 interval: Interval | str | None = None, heartbeat_seconds: float | None = None,
                 retention: str | None = None, dedup: bool | None = None, solo: bool = False,
                 read_only: bool = False, memory: Interval | str | None = None, agent: str | None = None,
                 memory_replicas: int = tiers.DEFAULT_REPLICAS) -> None:
        """`retry`: how transient failures are retried (default: the LASTGOOD_RETRY_* settings);
        it also bounds how long a service that is starting is waited for, here and in
        restore(). `require_final`: wait()/close() raise SaveFailed when the newest save did
        not commit (else they log it as an error). `new_run`: accept a run name drawn at
        random by `torchrun --standalone` (also LASTGOOD_NEW_RUN=1). `interval`: when
        `due(step)` says to save (an Interval or its text: "auto", "500", "30m", "epoch").
        `heartbeat_seconds`: the beat period (default LASTGOOD_HEARTBEAT_SECONDS, 10 s; 0: no
        beats; docs/health.md). `retention`: the run's own retention policy, e.g.
        "latest:5,every:1000,tagged,last-good,branch-heads" (docs/training.md), sent once by
        rank 0; None leaves the run's policy as it is. `dedup`: write replicated (DDP)
        state once per checkpoint, spread over the ranks (default on; LASTGOOD_DEDUP=0 turns
        it off; docs/replicated.md). `solo`: this process saves and restores alone, as a world
        of one, with no collective call, for state every rank holds alike (DDP) when one rank
        saves it (Lightning saves on global rank 0 only): only global rank 0 registers the
        launch and may save; every rank may restore. `read_only`: restore only, never
        register a launch (so a job that trains is not fenced by a reader). Otherwise every rank creates the
        Checkpointer, within LASTGOOD_JOIN_SECONDS of each other (default 30; else a
        LastgoodError on the ranks that did). `memory`: the memory tier's interval
        (docs/memory-tier.md): `due()` also answers True at its steps and `save()` then writes
        a memory checkpoint into the node agent at `agent` (HOST:PORT; default
        LASTGOOD_AGENT) with `memory_replicas` partner copies. What is not passed comes from the
        environment, resolved once (config.ClientConfig, kept as `self.config`)."""
        self.config = cfg = ClientConfig.resolve(url=url, token=token, run=run, attempt=attempt, new_run=new_run,
                                                 retry=retry, dedup=dedup)
        if not cfg.url:
            raise LastgoodError(f"no service URL: pass Checkpointer(url, run=...) or set {config.ENV_URL}")
        self.run = names.check_run_name(distributed.run_name(cfg.run, cfg.new_run))
        self.solo = solo
        # solo: a world of one; only the group's rank 0 writes (the others restore)
        self.writer = not read_only and (not solo or distributed.rank_world()[0] == 0)
        self._closed = True  # until constructed: close() has nothing to do
        if self.writer:
            _launch.claim(cfg.url, self.run, bool(cfg.attempt), self)
        try:
            with self._collectives():
                self._construct(cfg, commit_timeout, require_final, retention, interval, heartbeat_seconds,
                                staging_buffers)
                self._start_memory(memory, agent, memory_replicas)
        except BaseException:
            _launch.release(cfg.url, self.run, self)
            raise

    def _collectives(self):
        """Where this Checkpointer's calls run: without collectives when solo."""
        return distributed.alone() if self.solo else nullcontext()

    def _construct(self, cfg, commit_timeout, require_final, retention, interval, heartbeat_seconds,
                   staging_buffers) -> None:
        self.rank, self.world_size = (0, 1) if self.solo else distributed.rank_world()
        distributed.arrive("lastgood.Checkpointer()", cfg.join_seconds)  # before the first collective
        joblog.set_job(self.rank, self.world_size)  # incidents: one line for the job (common/joblog.py)
        self.retry = cfg.retry
        self.require_final = require_final
        self.transport = Transport(cfg.url, token=cfg.token, config=cfg)
        self._record_restart()
        commit_timeout = commit_timeout or self.transport.info.commit_timeout
        self.launch = names.check_attempt(distributed.launch_attempt(self.world_size, cfg.attempt))[:56]
        self._attempts = _launch.Attempts(self.launch)
        self.generation = self._register(retention) if self.writer else None  # a bad retention raises on every rank
        self._fenced: Fenced | None = None
        self.file_name = shard_file_name(self.rank)
        # the commit protocol's client side, shared with DCP's writer: it keeps the parent
        # and the checkpoints whose outcome this rank missed (commit/session.py)
        self._session = SaveSession(self.transport, self.run, self.rank, commit_timeout=commit_timeout)
        self.last_saved: SaveResult | None = None
        self._pool = StagingPool(slots=staging_buffers)
        self._restorer = Restorer(self.transport, self.run, self.rank, self.world_size, lambda: self._pool,
                                  ddp_buckets=cfg.ddp_buckets, agent=os.environ.get(config.ENV_AGENT) or None)
        self._jobs = UploadQueue()
        self._record = SaveRecord()
        self._gave_up_since_commit = False  # then the ranks converge on a step before each begin (converge)
        self._last_error: BaseException | None = None
        self._closed = False
        self._worker = threading.Thread(target=self._run, name="lastgood-upload", daemon=True)
        self._worker.start()
        self._start_health(interval, heartbeat_seconds if self.writer else 0)

    # ------------------------------------------------------------------ health (docs/health.md)
    def _start_health(self, interval, period: float | None) -> None:
        """Heartbeats from a daemon thread; the save decisions of `due()`."""
        self.interval = Interval.parse(interval) if isinstance(interval, str) else interval
        auto = bool(self.interval and self.interval.auto)
        self.heartbeat = _health.Heartbeat(self.config.url, self.run, self.rank, self.world_size,
                                           token=self.config.token,
                                           attempt=self.launch, generation=self.generation,
                                           period=self.config.heartbeat_seconds if period is None else period,
                                           want_interval=auto).start()
        if auto and self.heartbeat.period == 0:
            log.warning(f"lastgood: interval 'auto' needs heartbeats ({config.ENV_HEARTBEAT}=0): "
                        "it saves once, then only on its other triggers")
        self._decider = Decider(self.interval, lambda: self.heartbeat.interval_s, distributed.broadcast_int) \
            if self.interval else None

    def _start_memory(self, memory, agent: str | None, replicas: int) -> None:
        """The memory tier's saves (trainer/memory.py), when `memory` sets its interval."""
        self._next_tier = None
        self.memory, self._memory_decider = memtier.start(self.transport, self.run, self.rank, memory, agent, replicas)
        if self.memory is not None:
            self._restorer.agent = self.memory.agent
        elif agent:  # a restore-only Checkpointer names the agent it reads first, memory interval or not
            self._restorer.agent = agent

    def step(self, step: int) -> None:
        """Record that training reached `step` (a timestamp, no I/O): the heartbeat thread
        reports it, and the service judges hangs and stragglers from it. Once per step."""
        self.heartbeat.step(step)

    def due(self, step: int, epoch_end: bool = False) -> bool:
        """Should this step be saved, under the Checkpointer's `interval`? Call it once per
        step on every rank (it records the step, as `step()` does); every rank gets the same
        answer. `epoch_end=True` at the last step of an epoch."""
        if self._decider is None and self._memory_decider is None:
            raise LastgoodError("due() needs Checkpointer(..., interval=...): e.g. Interval(every_steps=500), "
                                "'30m' or 'auto'")
        self.heartbeat.step(step)
        with self._collectives():
            durable = self._decider is not None and self._decider.due(step, epoch_end)
            memory = self._memory_decider is not None and self._memory_decider.due(step, epoch_end)
        self._next_tier = (step, tiers.Tier.DURABLE if durable else tiers.Tier.MEMORY) if durable or memory else None
        return durable or memory

    def _record_restart(self) -> None:
        """Under torchrun's elastic agent, every restart of the group is an event of the run."""
        restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
        if restarts <= 0 or self.rank != 0 or not self.writer:
            return
        try:
            self.transport.record_event(self.run, "restart", {
                "restart_count": restarts, "world_size": self.world_size,
                "max_restarts": int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0)})
        except ServiceError as e:  # a run that has no checkpoint yet has nowhere to record it
            log.warning("lastgood: could not record restart %s: %s", restarts, e)

    def _register(self, retention: str | None = None) -> int | None:
        """Fencing (docs/fencing.md): this launch's generation (launch.register)."""
        generation = _launch.register(self.transport, self.run, self.launch, self.world_size, self.rank, retention)
        self.transport.generation = generation
        return generation

    @property
    def attempt(self) -> str:
        """(run, step, attempt) names a checkpoint. After a restore the job may save steps it
        saved before (on another branch), so every restore starts a new attempt."""
        return self._attempts.current

    @property
    def commit_timeout(self) -> float:
        """How long a save waits for its commit after its upload (the session's; settable)."""
        return self._session.commit_timeout

    @commit_timeout.setter
    def commit_timeout(self, value: float) -> None:
        self._session.commit_timeout = value

    @property
    def parent_id(self) -> int | None:
        """The parent of the next save: the last commit, or the checkpoint restored from."""
        return self._session.parent_id

    @parent_id.setter
    def parent_id(self, value: int | None) -> None:
        self._session.parent_id = value

    @property
    def _unsure(self) -> list:
        """Checkpoints whose outcome this rank missed, settled before the next begin."""
        return self._session.unsure

    # ------------------------------------------------------------------ save
    def save(self, step: int, state: TrainState, tier: str | None = None) -> None:
        """Snapshot `state` into CPU memory and return; the upload continues in the background.
        `tier`: "memory" or "durable"; by default what `due(step)` decided, else durable."""
        if self._closed:
            raise LastgoodError("Checkpointer is closed")
        if not self.writer:
            raise LastgoodError("a read-only Checkpointer does not save" if not self.solo else
                                f"a solo Checkpointer saves on global rank 0 only (this is rank "
                                f"{distributed.rank_world()[0]}): the state is the same on every rank")
        if self._fenced is not None and not self.config.dedup:  # with dedup: raised in the collective (_snapshot)
            raise self._fenced
        if not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be a non-negative int, got {step!r}")
        began = time.monotonic()
        self.heartbeat.reached(step)  # progress and pace, also for a script that never calls step()
        self.heartbeat.phase(_health.SAVING)
        try:
            with self._collectives():
                self._snapshot(step, state, self._tier_of(step, tier))
        finally:  # the stall the trainer paid: C of the auto interval
            self.heartbeat.saved(time.monotonic() - began)
            self.heartbeat.phase(_health.TRAIN)
            if self._decider is not None and self._tier_of(step, tier) != tiers.Tier.MEMORY:
                self._decider.saved()

    def _tier_of(self, step: int, tier: str | None) -> str:
        return memtier.tier_of(step, tier, self._next_tier, self.memory is not None)

    def _snapshot(self, step: int, state: TrainState, tier: str = tiers.Tier.DURABLE) -> None:
        cap = state.capture(step, self.rank, self.world_size, ddp_buckets=self.config.ddp_buckets)
        if self.config.dedup:  # replicated state: only this rank's share of it (collective; replicas.py)
            try:  # a fenced rank enters the collective too: every rank raises Fenced at this save
                cap = replicas.split(cap, state, self.rank, self.world_size, fenced=self._fenced is not None)
            except Fenced as e:
                self._fenced = self._fenced or e
            if self._fenced is not None:
                raise self._fenced
        if self._pool.full():
            # every buffer is taken: while the service is away, give up the oldest waiting
            # snapshot instead of waiting for an upload that cannot finish (uploads.py)
            dropped = self._jobs.drop_oldest_if_troubled()
            if dropped is not None:
                self._pool.release(dropped.buffer)
                self._given_up(dropped.step, f"superseded by step {step} while the service was unreachable")
        # no buffer free: an upload stuck retrying gives up its buffer (see _run)
        self._jobs.wanted = self._pool.full()
        try:
            # a large state's files: at most one per core by default, up to 4 when set (state/split.py)
            most = split.files_per_rank() if self.config.files_by_cores else split.MAX_FILES
            snap = snapshot(step, cap.json_state, cap.tensors, self._pool, self.config.file_bytes, most)
        finally:
            self._jobs.wanted = False
        snap.attempt = self._attempts.for_save(step)  # a step saved again: a newer checkpoint (launch.py)
        snap.tier = tier  # a memory save is not one wait() answers for (trainer/memory.py)
        snap.seq = self._record.request(step) if tier == tiers.Tier.DURABLE else 0
        self._jobs.put(snap)

    @property
    def stats(self) -> dict:
        """Counters of this rank's saves: saves_committed, saves_given_up."""
        return dict(self._record.counts)

    def wait(self) -> None:
        """Block until every save so far has committed or been given up (uploads retry up to
        the retry policy's deadline). Saves given up along the way are forgiven when a later
        one committed; if the newest did not, raise SaveFailed with a summary of what
        committed and what did not (or log it, with require_final=False). While it waits the
        rank's heartbeats say `saving`: a final upload may take longer than any step, and a
        rank judged hung for it would be killed by a supervisor (docs/health.md)."""
        self.heartbeat.phase(_health.SAVING)
        try:
            self._jobs.join()
        finally:
            self.heartbeat.phase(_health.TRAIN)
        if self._fenced is not None:
            raise self._fenced
        if self._record.final_committed():
            if self._record.counts["saves_given_up"] > self._record.told:
                self._record.told = self._record.counts["saves_given_up"]
                joblog.incident(log, logging.WARNING, "lastgood: run %s: the newest save committed; %s", self.run,
                                self._record.summary())
            return
        msg = f"run {self.run} rank {self.rank}: the newest state was NOT committed. {self._record.summary()}"
        self._record.request(None)  # said once: close() after a failed wait() does not say it again
        if self.require_final:
            raise SaveFailed(msg) from self._last_error
        log.error("lastgood: %s", msg)

    def close(self) -> None:
        if self._closed:
            return
        try:
            self.wait()
        finally:
            self._closed = True
            _launch.release(self.config.url, self.run, self)
            self.heartbeat.stop(_health.IDLE)  # done: idle, never hung
            self._jobs.put(None)
            self._worker.join(timeout=10)
            self.transport.close()
            self._pool.clear()  # free the (possibly pinned) staging buffers
            joblog.set_job(0, 1)  # no job's rank any more: the process logs as one

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ restore
    def restore(self, state: TrainState, checkpoint_id: int | None = None) -> int | None:
        """Load the run's last-good (or the given checkpoint) into `state` in place.

        Returns its step, or None if the run has no checkpoint (the service says so; an
        error never reads as "none"). Every byte read is re-hashed and every shard's state
        checked before anything is applied. Ranks agree on each candidate (rank 0 picks,
        then broadcasts) and on each outcome (all_max of ok / unusable / failed), so they
        never resume from different checkpoints and never wait on a rank that gave up. An
        unusable candidate (bytes that differ from the commit, a file missing, too short or
        too long, a manifest damaged, a state that cannot be read) is re-verified by the
        service, which marks it CORRUPT, and the service's choice of its newest usable
        ancestor is tried next. A run whose every candidate is damaged raises
        NoUsableCheckpoint on every rank. docs/recovery.md has the whole story
        (lastgood.restore.restorer).
        """
        self.heartbeat.phase(_health.RESTORING)
        try:
            self._jobs.join()  # in-flight saves finish first; their failures stay for wait()
            with self._collectives():
                restored = self._restorer.restore(state, checkpoint_id)
            if restored is None:
                return None
            step, cid = restored
            self.heartbeat.reached(step, restored=True)
            self.parent_id = cid
            self._unsure.clear()  # the restored checkpoint is the parent now, on every rank
            self._attempts.restored()
            return step
        finally:
            self.heartbeat.phase(_health.TRAIN)
            if self._decider is not None:
                self._decider.restart()

    @property
    def restore_reads(self) -> dict | None:
        """What the last restore by ranges read (readplan.py)."""
        return self._restorer.reads

    # ------------------------------------------------------------------ tags
    def _target(self, checkpoint_id: int | None) -> int:
        if checkpoint_id is not None:
            return checkpoint_id
        self.wait()
        if self.last_saved is None:
            raise LastgoodError("nothing saved yet by this Checkpointer: name a checkpoint_id")
        return self.last_saved.checkpoint_id

    def tag(self, name: str, checkpoint_id: int | None = None, *, alias: bool = False) -> dict:
        """Tag a checkpoint (default: the last one this Checkpointer saved). An alias names
        one checkpoint per run and moves when set again; a plain tag may name many."""
        return self.transport.tag(self._target(checkpoint_id), name, alias)

    def untag(self, name: str, checkpoint_id: int | None = None) -> dict:
        return self.transport.untag(self._target(checkpoint_id), name)

    def pin(self, checkpoint_id: int | None = None, pinned: bool = True) -> dict:
        """Pin a checkpoint so that GC keeps it whatever the retention policy says."""
        return self.transport.pin(self._target(checkpoint_id), pinned)
