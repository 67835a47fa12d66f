"""A Checkpointer's launch within its process: which attempt each save goes under, and
which Checkpointers of a run are open in this process.

Attempts: (run, step, attempt) names a checkpoint, and a begin of an existing name joins
that checkpoint. A second save of a step this attempt has saved already (Lightning's
ModelCheckpoint saves each step with a top-k and a `save_last` save twice) therefore goes
under a new attempt of the same launch, `<attempt>_<n>`: it commits as a newer
checkpoint, child of the first, and last-good is the newest state saved. Every rank makes
the same save() calls, so every rank names the same attempt, with no message between them.

Registration: rank 0 registers the launch for its generation and broadcasts it (`register`).

Open Checkpointers: a second Checkpointer of the same run in one process would register a
new launch and fence the first, whose saves then fail. It is refused at construction
(unless it names an attempt of its own, a new launch on purpose), with what to do.
"""

from __future__ import annotations

import logging
import threading

from lastgood.errors import LastgoodError, PermissionDenied, ServiceError
from lastgood.state import distributed

log = logging.getLogger("lastgood")


class Attempts:
    def __init__(self, launch: str) -> None:
        self.launch = launch
        self.restores = 0  # every rank restores the same number of times, so they agree on the attempt
        self.repeats = 0
        self._steps: set[int] = set()  # steps saved under the current attempt

    @property
    def current(self) -> str:
        base = self.launch if self.restores == 0 else f"{self.launch}.{self.restores}"
        return base if self.repeats == 0 else f"{base}_{self.repeats}"

    def for_save(self, step: int) -> str:
        """The attempt a save of `step` goes under (called once per save(), in order)."""
        if step in self._steps:
            self.repeats += 1
            self._steps = set()
        self._steps.add(step)
        return self.current

    def restored(self) -> None:
        """A restore starts a new attempt: the job may save steps it saved before."""
        self.restores += 1
        self.repeats = 0
        self._steps = set()


_open: dict[tuple[str, str], object] = {}
_lock = threading.Lock()


def claim(url: str, run: str, attempt_given: bool, owner: object) -> None:
    """Record `owner` as the open Checkpointer of `run` at `url` in this process; refuse a
    second one unless it names an attempt of its own."""
    with _lock:
        first = _open.get((url, run))
        if first is not None and not attempt_given and not getattr(first, "_fenced", None):
            raise LastgoodError(
                f"a Checkpointer of run {run!r} is already open in this process (attempt "
                f"{getattr(first, 'launch', '?')}): a second one would register a new launch and fence it. "
                "Use the open one (pass it to where it is needed), or close() it first; "
                "to start a new launch on purpose, pass attempt=...")
        _open[(url, run)] = owner


def release(url: str, run: str, owner: object) -> None:
    with _lock:
        if _open.get((url, run)) is owner:
            del _open[(url, run)]


def register(transport, run: str, launch: str, world_size: int, rank: int, retention: str | None) -> int | None:
    """Fencing (docs/fencing.md): this launch's generation, registered before anything is
    read, so that a commit of an older launch either shows up in this launch's restore or
    is refused. Rank 0 registers and broadcasts (one registration per launch, however many
    ranks); without a process group every rank registers, which the service answers with
    the same generation. A token that may not write (a reader restoring) neither registers
    nor fences the job that writes; its saves are refused anyway. The run's `retention`,
    if given, is set in the same step, so a policy the service refuses stops every rank."""
    generation, err = 0, None
    if rank == 0 or not distributed.initialized():
        try:
            generation = transport.register_launch(run, launch, world_size)
            if retention is not None:
                transport.set_retention(run, retention)
        except ServiceError as e:
            if isinstance(e, PermissionDenied):
                log.info("lastgood: not registered as a launch of %s (read-only token): %s", run, e)
            else:
                generation, err = -1, e
        except Exception as e:  # noqa: BLE001 - re-raised after the broadcast
            generation, err = -1, e
    generation = distributed.broadcast_int(generation)
    if generation < 0:
        raise err or LastgoodError("rank 0 could not register this launch (or set the run's retention) "
                                   "with the service; see its log")
    return generation or None
