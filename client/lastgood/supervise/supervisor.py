"""`lastgood supervise -- torchrun ... train.py ...`: run a job, watch it, relaunch it.

torchrun restarts a group only when a process *exits*; a rank stuck in its step or in a
collective holds the whole job until someone looks. The supervisor looks: it runs the
command in a session of its own, asks the service for the run's health every `poll`
seconds, and when a rank of this launch is `hung` (or the command exits with an error) it
ends every process of the launch (proctree.terminate), posts a `supervisor_restart` event
saying why, and starts the command again. The job resumes from last-good on its own.

Each launch gets the run name (LASTGOOD_RUN) and a fresh launch identity
(LASTGOOD_ATTEMPT; on several nodes rank 0 draws it), so the relaunch registers a new
generation and anything left of the old one is fenced (docs/fencing.md). A local rank
whose failures keep coming back (it died first, or it alone stopped beating, `drain_after`
times), or one named by `--drain`, is left out: the next launch runs with fewer processes
per node (torchrun's --nproc-per-node rewritten, CUDA_VISIBLE_DEVICES without the drained
rank's device) and the job restores resharded. That is a one-machine rule: with --nnodes
above 1 the supervisor restarts but does not drain. docs/supervise.md tells the whole story.

The checkpoint service never costs the job: while the service is unreachable the
supervisor says so once and keeps the job running; it only acts on what it can see.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum

from lastgood.wire import names
from lastgood.supervise import proctree
from lastgood.remote.config import ENV_ATTEMPT as ATTEMPT_ENV
from lastgood.remote.config import ENV_RUN as RUN_ENV
from lastgood.remote.config import ENV_SUPERVISOR_LAUNCH as LAUNCH_ENV  # the marker proctree finds a launch by
from lastgood.errors import NotFound, ServiceError, ServiceUnreachable
NPROC = ("--nproc-per-node", "--nproc_per_node")
NNODES = ("--nnodes",)
RDZV_ID = ("--rdzv-id", "--rdzv_id")
# health states that end a launch (docs/supervise.md)
ACT_ON = frozenset({"hung", "lost"})


class Outcome(Enum):
    FINISHED = "finished"   # the command exited 0
    GAVE_UP = "gave_up"     # restarts exhausted, or nothing left to run on
    STOPPED = "stopped"     # SIGINT / SIGTERM / SIGHUP to the supervisor: the job was stopped


class UsageError(ValueError):
    """The command or the options cannot be supervised as asked."""


# ---------------------------------------------------------------- the torchrun command line
def _where(r: dict) -> str:
    """Where a rank was: the last step it reported (`ckpt.step`, or its last save or restore)
    is the last it finished, so a rank stuck in a step is stuck after that one."""
    step, phase = r.get("step"), r.get("phase")
    where = "before its first step" if step is None else f"after step {step}"
    return where if phase in (None, "train") else f"{where}, {phase}"


def option(cmd: list[str], spellings: tuple[str, ...]) -> tuple[int, str, bool] | None:
    """The first `--opt=value` or `--opt value` among cmd: (index, value, inline)."""
    for i, arg in enumerate(cmd):
        for name in spellings:
            if arg.startswith(name + "="):
                return i, arg[len(name) + 1:], True
            if arg == name and i + 1 < len(cmd):
                return i, cmd[i + 1], False
    return None


def nproc(cmd: list[str]) -> int | None:
    """torchrun's processes per node, if the command says a number (torchrun's default is 1)."""
    found = option(cmd, NPROC)
    if found is None:
        return 1 if any(os.path.basename(a) in ("torchrun", "torch.distributed.run") for a in cmd) else None
    return int(found[1]) if found[1].isdigit() else None


def with_nproc(cmd: list[str], n: int) -> list[str]:
    found = option(cmd, NPROC)
    if found is None:
        raise UsageError(f"the command has no {NPROC[0]} to rewrite")
    i, _, inline = found
    out = list(cmd)
    if inline:
        out[i] = f"{out[i].split('=', 1)[0]}={n}"
    else:
        out[i + 1] = str(n)
    return out


def one_node(cmd: list[str]) -> bool:
    found = option(cmd, NNODES)
    return found is None or found[1] in ("1", "1:1")


def run_of(cmd: list[str]) -> str | None:
    """torchrun's --rdzv-id, which the client also takes for the run name."""
    found = option(cmd, RDZV_ID)
    return found[1] if found else None


# ---------------------------------------------------------------- the supervisor
@dataclass
class Policy:
    max_restarts: int = 3
    hang_timeout: float | None = None   # None: the service's own, computed from the run's step times
    poll: float = 5.0
    grace: float = 10.0                 # SIGTERM, then SIGKILL after this long
    drain_after: int = 2                # failures of one local rank before it is drained


@dataclass
class Launch:
    number: int
    attempt: str
    slots: list[int]                    # the original local rank behind each local rank of this launch
    proc: subprocess.Popen
    started: float
    watch: proctree.RankWatch
    rc: int | None = None

    @property
    def world(self) -> int:
        return len(self.slots)


@dataclass
class Ending:
    reason: str                         # finished, exited, hung, stopped
    detail: str
    ranks: list[int] = field(default_factory=list)   # local ranks of this launch to blame


class Supervisor:
    def __init__(self, command: list[str], run: str, rest, policy: Policy | None = None,
                 drain: set[int] | None = None, say: Callable[[str], None] | None = None) -> None:
        """`rest`: a lastgood.remote.rest.RestClient for the service (health and events)."""
        if not command:
            raise UsageError("no command to run: lastgood supervise [OPTIONS] -- torchrun ... train.py ...")
        self.command, self.run, self.rest = list(command), names.check_run_name(run), rest
        self.policy = policy or Policy()
        self.say = say or (lambda msg: print(f"lastgood supervise: {msg}", file=sys.stderr, flush=True))
        self.size = nproc(self.command)
        self.single_node = one_node(self.command)
        self.resizable = self.size is not None and option(self.command, NPROC) is not None and self.single_node
        self.drained: set[int] = set(drain or ())
        if self.drained:
            if not self.resizable:
                raise UsageError(f"--drain needs a torchrun command on one node with a numeric {NPROC[0]}")
            bad = sorted(r for r in self.drained if not 0 <= r < self.size)
            if bad:
                raise UsageError(f"--drain {bad}: the command runs local ranks 0..{self.size - 1}")
            if len(self.drained) >= self.size:
                raise UsageError("--drain would leave no rank to run")
        self.failures: Counter[int] = Counter()
        self.restarts = 0
        self.prefix = f"sv-{secrets.token_hex(4)}"
        self._stop: int | None = None
        self._unreachable = False
        self._said_not_lastgood = False

    # ---- what each launch runs
    def _slots(self) -> list[int]:
        return [s for s in range(self.size or 1) if s not in self.drained]

    def _env(self, attempt: str, slots: list[int]) -> dict[str, str]:
        env = {**os.environ, RUN_ENV: self.run, LAUNCH_ENV: attempt}
        # The launch identity. On several nodes each node has its own supervisor, and the
        # ranks of one launch must share it: there rank 0 draws it and broadcasts it.
        if self.single_node:
            env[ATTEMPT_ENV] = attempt
        else:
            env.pop(ATTEMPT_ENV, None)
        if self.drained:
            visible = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d]
            devices = visible if len(visible) >= (self.size or 0) else [str(i) for i in range(self.size or 0)]
            env["CUDA_VISIBLE_DEVICES"] = ",".join(devices[s] for s in slots)
        return env

    def _start(self, number: int) -> Launch:
        slots = self._slots()
        cmd = with_nproc(self.command, len(slots)) if self.drained else self.command
        attempt = names.check_attempt(f"{self.prefix}-{number}")
        ranks = f", {len(slots)} local rank(s)" if self.size is not None else ""
        self.say(f"launch {number} of run {self.run} ({attempt}{ranks}): {' '.join(cmd)}")
        watch = proctree.RankWatch()
        try:
            proc = subprocess.Popen(cmd, env=self._env(attempt, slots), start_new_session=True)
        except OSError as e:
            raise UsageError(f"cannot run {cmd[0]!r}: {e}") from None
        watch.start()
        return Launch(number, attempt, slots, proc, time.monotonic(), watch)

    # ---- watching one launch
    def _health(self, launch: Launch) -> Ending | None:
        try:
            doc = self.rest.health(self.run, self.policy.hang_timeout)
        except ServiceUnreachable as e:
            if not self._unreachable:
                self.say(f"the service is unreachable; the job keeps running unwatched until it answers ({e})")
            self._unreachable = True
            return None
        except NotFound as e:
            if not e.coded and not self._said_not_lastgood:  # not the service's answer: a wrong --url, a proxy
                self._said_not_lastgood = True
                self.say(f"health of {self.run}: {e} (is {self.rest.base_url} a lastgood service?); "
                         f"the job runs unwatched until it answers")
            return None  # the service's own 404: no launch of the run has registered yet
        except Exception as e:  # noqa: BLE001 - whatever a health read does, the supervisor goes on
            self.say(f"health of {self.run}: {e}")
            return None
        if self._unreachable:
            self.say("the service answers again")
            self._unreachable = False
        elapsed = time.monotonic() - launch.started
        # a rank counts once it has beaten during this launch; older beats are the previous launch's
        ours = [r for r in doc.get("ranks", [])
                if r.get("age_s", elapsed) < elapsed and r.get("rank", -1) < launch.world]
        bad = [r for r in ours if r.get("state") in ACT_ON]
        if not bad:
            return None
        detail = "; ".join(f"rank {r['rank']} {r['state']} {_where(r)} (no progress for "
                           f"{r.get('progress_age_s', 0):.1f}s, timeout {r.get('timeout_s')}s, "
                           f"last beat {r.get('age_s', 0):.1f}s ago)" for r in bad)
        # A hang is blamed on no rank: the rank stuck in its step and the ranks waiting for it
        # in a collective look alike (none makes progress; which is flagged first depends on
        # each rank's allowance). A rank that stopped beating while the others beat is one
        # process frozen or gone: that one is singled out.
        lost = sorted(r["rank"] for r in bad if r.get("state") == "lost")
        return Ending("hung", detail, lost if len(lost) < len(ours) else [])

    def _watch(self, launch: Launch) -> Ending:
        next_health = launch.started + self.policy.poll
        while True:
            status = proctree.reap()
            if launch.proc.pid in status:
                launch.rc = launch.proc.returncode = status[launch.proc.pid]
            if launch.rc is not None:
                if launch.rc == 0:
                    return Ending("finished", "the command exited 0")
                time.sleep(3 * launch.watch.interval)  # let the watch see the last deaths
                first = launch.watch.first_failure()
                detail = f"the command exited with {launch.rc}"
                if first is None:
                    return Ending("exited", f"{detail}; no one rank failed first (deaths: {launch.watch.summary()})")
                how = proctree.describe_status(first[1])
                return Ending("exited", f"{detail}; local rank {first[0]} failed first ({how})", [first[0]])
            if self._stop is not None:
                return Ending("stopped", f"stopped by {signal.Signals(self._stop).name}")
            if time.monotonic() >= next_health:
                ending = self._health(launch)
                if ending is not None:
                    return ending
                next_health = time.monotonic() + self.policy.poll
            time.sleep(0.1)

    def _end(self, launch: Launch) -> None:
        """Every process of the launch gone, verified in /proc."""
        def reaped(done: dict[int, int]) -> None:
            if launch.proc.pid in done and launch.rc is None:
                launch.rc = launch.proc.returncode = done[launch.proc.pid]

        survivors = proctree.terminate((LAUNCH_ENV, launch.attempt), self.policy.grace, root=os.getpid(),
                                       on_reaped=reaped)
        launch.watch.stop()
        if launch.proc.returncode is None:  # reaped here (proctree.reap), so Popen must never wait for it
            launch.proc.returncode = launch.rc if launch.rc is not None else -signal.SIGKILL
        if survivors:
            self.say(f"{len(survivors)} process(es) of launch {launch.number} survived SIGKILL: "
                     + ", ".join(f"{p.pid} (state {p.state})" for p in survivors))

    def _event(self, kind: str, data: dict) -> None:
        try:
            self.rest.record_event(self.run, kind, data)
        except (ServiceError, ValueError) as e:  # the run may not exist yet; the service may be away
            self.say(f"could not record {kind} ({e})")

    def _drain(self, launch: Launch, ending: Ending) -> list[int]:
        """Count the failure against the ranks it blames; the slots to leave out from now on."""
        for local in ending.ranks:
            self.failures[launch.slots[local]] += 1
        due = sorted(s for s in launch.slots if self.failures[s] >= self.policy.drain_after)
        if due and not self.resizable:
            self.say(f"local rank(s) {due} keep failing, but this command cannot be resized "
                     f"(one node and a numeric {NPROC[0]} are needed); relaunching at the same size")
            return []
        if len(due) >= len(launch.slots):
            return due  # nothing left: the caller gives up
        self.drained.update(due)
        return due

    # ---- the loop
    def _on_signal(self, signum, _frame) -> None:
        self._stop = signum

    def supervise(self) -> Outcome:
        if not proctree.set_subreaper():
            self.say("cannot become a subreaper (not Linux?): orphans of the job may escape the kill")
        handlers = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
        try:
            return self._loop()
        finally:
            for s, h in handlers.items():
                signal.signal(s, h)

    def _loop(self) -> Outcome:
        number = 0
        while True:
            launch = self._start(number)
            ending = self._watch(launch)
            if ending.reason != "finished":
                self.say(f"launch {number}: {ending.reason}: {ending.detail}; ending every process of it")
            self._end(launch)
            base = {"reason": ending.reason, "detail": ending.detail, "launch": number,
                    "attempt": launch.attempt if self.single_node else None,
                    "world_size": launch.world, "exit_code": launch.rc}
            if ending.reason == "finished":
                self.say(f"launch {number} finished")
                return Outcome.FINISHED
            if ending.reason == "stopped" or self._stop is not None:  # a signal during the kill wins
                base.update(reason="stopped", detail=f"stopped by {signal.Signals(self._stop).name}")
                self._event("supervisor_stopped", base)
                return Outcome.STOPPED
            newly = self._drain(launch, ending)
            left = self._slots()
            if self.restarts >= self.policy.max_restarts or not left or len(newly) >= launch.world:
                why = "no rank left to run" if (not left or len(newly) >= launch.world) else \
                    f"{self.restarts} restart(s) used of {self.policy.max_restarts}"
                self.say(f"giving up: {why}")
                self._event("supervisor_gave_up", {**base, "why": why, "restarts": self.restarts})
                return Outcome.GAVE_UP
            self.restarts += 1
            if newly:
                self.say(f"draining local rank(s) {newly}: relaunching on {len(left)} rank(s)")
            self._event("supervisor_restart", {**base, "ranks": [launch.slots[r] for r in ending.ranks],
                                               "drained": sorted(self.drained), "next_world_size": len(left),
                                               "restart": self.restarts, "max_restarts": self.policy.max_restarts})
            number += 1
