"""A Checkpointer's launch within its process: which attempt each save goes under, and
which Checkpointers of a run are open in this process.

Attempts: (run, step, attempt) names a checkpoint, and a begin of an existing name joins
that checkpoint. A second save of a step this attempt has saved already (Lightning's
ModelCheckpoint saves each step with a top-k and a `save_last` save twice) therefore goes
under a new attempt of the same launch, `<attempt>_<n>`: it commits as a newer
checkpoint, child of the first, and last-good is the newest state saved. Every rank makes
the same save() calls, so every rank names the same attempt, with no message between them.

Open Checkpointers: a second Checkpointer of the same run in one process would register a
new launch and fence the first, whose saves then fail. It is refused at construction
(unless it names an attempt of its own, a new launch on purpose), with what to do.
"""

from __future__ import annotations

import threading

from lastgood.errors import LastgoodError


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
