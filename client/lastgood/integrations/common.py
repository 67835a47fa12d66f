"""What the framework integrations share, framework-free: a framework's checkpoint dict
held as one TrainState component, and the lastgood references a framework's resume
argument may name ("last-good", a tag of the run, a checkpoint id)."""

from __future__ import annotations

from lastgood.remote import reading
from lastgood.remote.config import ClientConfig
from lastgood.remote.rest import RestClient
from lastgood.trainer.checkpointer import Checkpointer
from lastgood.wire.names import LAST_GOOD_TAG


class Held:
    """A framework's checkpoint (a dict of JSON values and tensors) as one TrainState
    component."""

    def __init__(self, checkpoint: dict | None = None) -> None:
        self.checkpoint = checkpoint

    def state_dict(self) -> dict | None:
        return self.checkpoint

    def load_state_dict(self, state: dict) -> None:
        self.checkpoint = state


def resolve(ref: str | int, ckpt: Checkpointer) -> int | None:
    """The checkpoint id a reference of the Checkpointer's run names: None for
    "last-good" (the restore's own choice), an id as such, else a tag of the run."""
    text = str(ref)
    if text == LAST_GOOD_TAG:
        return None
    if text.isdigit():
        return int(text)
    return reading.resolve(ckpt.transport, reading.CkptRef(run=ckpt.run, tag=text))


def resume_reference(config: ClientConfig, run: str) -> str | None:
    """"last-good" when the run has a committed checkpoint, else None: for a script that
    starts a run and resumes it alike. Asks the service only (callable before the process
    group is up)."""
    rest = RestClient(config.url, token=config.token, retry=config.retry)
    return LAST_GOOD_TAG if rest.last_good(run) is not None else None
