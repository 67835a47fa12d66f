"""A launched job's processes, found and ended through /proc (Linux; torch-free).

Killing a torchrun job by its process group is not enough: torchrun starts every worker
in a session of its own (`start_new_session=True`), so `killpg(torchrun)` leaves the ranks
running, and a rank's data-loader workers sit in the rank's group. Nor is the child's tree
enough once its parent is gone: an orphan is re-parented to init and drops out of it.

So the supervisor makes itself a *child subreaper* (prctl PR_SET_CHILD_SUBREAPER): every
orphan of the job is re-parented to the supervisor instead of init and stays in its tree.
A launch's members are then the supervisor's descendants, plus (belt and braces, for a
process that escaped to another subreaper) every process whose environment carries the
launch's marker (`LASTGOOD_SUPERVISOR_LAUNCH=<launch id>`, unique per launch).
`terminate` signals each member and each member's process group, SIGTERM first and
SIGKILL after a grace, reaps what it inherited, and returns only when /proc shows none of
them left. `RankWatch` tells which rank process of a launch died first.
"""

from __future__ import annotations

import ctypes
import os
import signal
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

PROC = "/proc"
PR_SET_CHILD_SUBREAPER = 36


@dataclass(frozen=True)
class Proc:
    pid: int
    ppid: int
    pgid: int
    sid: int
    state: str        # R, S, D, Z (zombie: dead, not reaped yet), T, ...
    start: int        # start time in clock ticks since boot: (pid, start) names one process
    exit_code: int    # a zombie's wait status (0 for a live process)

    @property
    def dead(self) -> bool:
        return self.state in ("Z", "X")


def set_subreaper() -> bool:
    """Make orphans of this process's descendants its own children (Linux 3.4+)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def read(pid: int) -> Proc | None:
    """One process from /proc/PID/stat; None once it is gone (or on another OS)."""
    try:
        with open(f"{PROC}/{pid}/stat", "rb") as f:
            raw = f.read().decode(errors="replace")
    except OSError:
        return None
    # the command name (field 2) is in parentheses and may hold spaces and parentheses itself
    rest = raw[raw.rfind(")") + 2:].split()
    exit_code = int(rest[49]) if len(rest) > 49 else 0
    return Proc(pid, int(rest[1]), int(rest[2]), int(rest[3]), rest[0], int(rest[19]), exit_code)


def table() -> dict[int, Proc]:
    procs = {}
    for name in os.listdir(PROC):
        if name.isdigit() and (p := read(int(name))) is not None:
            procs[p.pid] = p
    return procs


def environ(pid: int) -> dict[str, str]:
    """The environment a process was started with ({} if it is gone or not ours to read)."""
    try:
        with open(f"{PROC}/{pid}/environ", "rb") as f:
            raw = f.read()
    except OSError:
        return {}
    out = {}
    for item in raw.split(b"\0"):
        key, sep, value = item.partition(b"=")
        if sep:
            out[key.decode(errors="replace")] = value.decode(errors="replace")
    return out


def descendants(root: int, procs: dict[int, Proc]) -> list[Proc]:
    children: dict[int, list[Proc]] = {}
    for p in procs.values():
        children.setdefault(p.ppid, []).append(p)
    out, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), ()):
            out.append(child)
            todo.append(child.pid)
    return out


def marked(marker: tuple[str, str], procs: Iterable[Proc]) -> list[Proc]:
    key, value = marker
    return [p for p in procs if environ(p.pid).get(key) == value]


def members(marker: tuple[str, str] | None, root: int | None) -> list[Proc]:
    """The processes of a launch: the descendants of `root` (the supervisor itself; None:
    none), and every process whose environment holds marker = (KEY, VALUE). The calling
    process is never one."""
    procs = table()
    found = {p.pid: p for p in descendants(root, procs)} if root is not None else {}
    if marker is not None:
        found.update({p.pid: p for p in marked(marker, procs.values()) if p.pid not in found})
    found.pop(os.getpid(), None)
    return sorted(found.values(), key=lambda p: p.pid)


def reap() -> dict[int, int]:
    """Collect every child that has exited (this process is a subreaper: orphans of the job
    become its children and would otherwise stay zombies). pid -> exit code as subprocess
    reports it (negative: killed by that signal)."""
    done = {}
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return done
        if pid == 0:
            return done
        done[pid] = os.waitstatus_to_exitcode(status)


def _signal(procs: list[Proc], sig: int) -> None:
    own = os.getpgrp()
    for pgid in {p.pgid for p in procs if p.pgid not in (own, 0)}:
        try:
            os.killpg(pgid, sig)  # the whole group at once: no fork slips between two kills
        except (ProcessLookupError, PermissionError):
            pass
    for p in procs:
        try:
            os.kill(p.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def terminate(marker: tuple[str, str] | None, grace: float, *, root: int | None,
              on_reaped: Callable[[dict[int, int]], None] | None = None, kill_wait: float = 10.0) -> list[Proc]:
    """End every member of a launch (see members()): SIGTERM, then SIGKILL to whatever is
    left after `grace` seconds (and again to anything forked meanwhile), until /proc shows
    none alive. Returns
    the processes still alive after `kill_wait` more seconds (a process stuck in the
    kernel, state D, outlives SIGKILL for a while); normally []. When `root` is this process
    (a subreaper), it reaps its children as they die; `on_reaped` hears their exit codes.
    Another caller's children are left to it (waitpid(-1) would steal their statuses)."""
    start = time.monotonic()
    termed: set[tuple[int, int]] = set()
    while True:
        done = reap() if root == os.getpid() else {}
        if done and on_reaped is not None:
            on_reaped(done)
        alive = [p for p in members(marker, root) if not p.dead]
        now = time.monotonic() - start
        if not alive:
            return []
        if now > grace + kill_wait:
            return alive
        if now < grace:
            fresh = [p for p in alive if (p.pid, p.start) not in termed]
            _signal(fresh, signal.SIGTERM)
            termed.update((p.pid, p.start) for p in fresh)
        else:
            _signal(alive, signal.SIGKILL)
        time.sleep(0.05)


# ---------------------------------------------------------------- which rank died first
EXEC_SETTLE_S = 2.0  # RankWatch: a process read without LOCAL_RANK this long after the first such read has exec'd


class RankWatch(threading.Thread):
    """Notes, every `interval` seconds, when each rank process of the supervisor's launch
    dies, so that a rank that keeps failing can be drained. torchrun's own "first observed
    failure" has a resolution of one second: ranks failing within the same second (a
    crashed rank's peers fail on their closed connections) all tie, and it names the lowest.
    A rank process is a descendant with LOCAL_RANK in its environment whose parent has none
    (its data-loader workers inherit LOCAL_RANK from it)."""

    def __init__(self, interval: float = 0.02) -> None:
        super().__init__(name="lastgood-rank-watch", daemon=True)
        self.interval = interval
        self.deaths: list[tuple[int, int, int | None]] = []  # (tick, local rank, wait status or None)
        self._ranks: dict[tuple[int, int], int] = {}          # (pid, start) -> local rank
        self._envs: dict[tuple[int, int], str | None] = {}       # (pid, start) -> LOCAL_RANK, once final
        self._absent: dict[tuple[int, int], float] = {}          # (pid, start) -> when first read without one
        self._sessions: set[int] = set()                         # the sessions of the ranks found
        self._halt = threading.Event()

    def stop(self) -> None:
        self._halt.set()
        self.join(5)

    def _local_rank(self, p: Proc) -> str | None:
        """LOCAL_RANK from the process's environment. A process seen between its fork and its
        exec still shows its launcher's environment (torchrun forks each rank, then execs it
        with LOCAL_RANK set): an absent one is read again at later looks, or that rank would
        never be watched and a peer dying after it be blamed; only once it has been absent
        for EXEC_SETTLE_S (an exec follows its fork within milliseconds) is that final, so a
        job with no rank is not read at every tick forever."""
        key = (p.pid, p.start)
        if key in self._envs:
            return self._envs[key]
        local = environ(p.pid).get("LOCAL_RANK")
        now = time.monotonic()
        if local is not None or now - self._absent.setdefault(key, now) >= EXEC_SETTLE_S:
            self._envs[key] = local
            self._absent.pop(key, None)
        return local

    def _scan(self) -> None:
        procs = table()
        for p in descendants(os.getpid(), procs):
            key = (p.pid, p.start)
            if key in self._ranks or p.dead:
                continue
            parent = procs.get(p.ppid)
            parent_rank = None if parent is None else self._local_rank(parent)
            local = self._local_rank(p)
            if p.sid in self._sessions and p.sid != p.pid:
                # a rank's data-loader worker (torchrun starts each rank in a session of its
                # own), re-parented to the supervisor when its rank died: no rank itself
                continue
            if local is not None and local.isdigit() and parent_rank is None:
                self._ranks[key] = int(local)
                if p.sid == p.pid:  # the leader of its own session: its workers are in it
                    self._sessions.add(p.sid)

    def run(self) -> None:
        tick, last_scan = 0, 0.0
        while not self._halt.is_set():
            if time.monotonic() - last_scan > 1.0 or not self._ranks:
                self._scan()
                last_scan = time.monotonic()
            for key, local in list(self._ranks.items()):
                p = read(key[0])
                if p is None or p.start != key[1] or p.dead:
                    self.deaths.append((tick, local, p.exit_code if p is not None and p.start == key[1] else None))
                    del self._ranks[key]
            tick += 1
            self._halt.wait(self.interval)

    def first_failure(self) -> tuple[int, int | None] | None:
        """(local rank, wait status) of the one rank that failed before any other, or None.
        Deaths first seen in the same look (the watch may be starved on a loaded machine)
        are told apart by how they died: once one rank has failed torchrun ends the others
        with SIGTERM, so a death by SIGTERM is not the first; a death seen as a zombie with
        its status beats one reaped before a look; and a death by a signal (SIGKILL,
        SIGSEGV, SIGABRT) beats an error exit (a crashed rank's peers fail on their closed
        connections)."""
        failed = [d for d in self.deaths if d[2] != 0]
        if not failed:
            return None
        first = [d for d in failed if d[0] == failed[0][0]]
        if len(first) > 1:
            first = [d for d in first if d[2] is None or (d[2] & 0x7F) != signal.SIGTERM]
        if len(first) > 1:
            first = [d for d in first if d[2] is not None] or first
        if len(first) > 1:
            first = [d for d in first if d[2] is not None and d[2] & 0x7F] or first
        return (first[0][1], first[0][2]) if len(first) == 1 else None

    def summary(self) -> str:
        return ", ".join(f"rank {r} {describe_status(s)} (tick {t})" for t, r, s in self.deaths) or "none seen"


def describe_status(status: int | None) -> str:
    if status is None:
        return "exited"
    if status & 0x7F:
        sig = status & 0x7F
        try:
            return f"killed by {signal.Signals(sig).name}"
        except ValueError:
            return f"killed by signal {sig}"
    return f"exited with {status >> 8}"
