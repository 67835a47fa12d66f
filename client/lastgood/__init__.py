"""lastgood: complete, verified, resumable checkpoints for PyTorch training.

    import lastgood
    ckpt = lastgood.Checkpointer("http://127.0.0.1:8000", run="gpt-small")
    state = lastgood.TrainState(model=model, optimizer=optimizer, scheduler=scheduler, loader=loader)
    start = ckpt.restore(state)
    ...
    ckpt.save(step, state)
    ckpt.wait(); ckpt.close()

Every name below is imported on first use, so importing a sub-package (the service imports
lastgood.wire and lastgood.common alone) loads nothing else. docs/architecture.md maps the
sub-packages.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_ERRORS = ("LastgoodError", "SaveFailed", "CorruptCheckpoint", "NoUsableCheckpoint", "ServiceError", "Fenced",
           "Unavailable", "ServiceUnreachable", "Refused", "NotFound", "InvalidArgument", "Conflict",
           "FailedPrecondition", "PermissionDenied", "Unauthenticated", "DataLoss", "CatalogBehind", "StoreFull")
_LAZY = {
    "Checkpointer": "lastgood.trainer.checkpointer",
    "TrainState": "lastgood.state.trainstate",
    "ResumableDistributedSampler": "lastgood.state.sampler",
    "SpikeGuard": "lastgood.trainer.spike",
    "ClientConfig": "lastgood.remote.config",
    "Interval": "lastgood.common.interval",
    **dict.fromkeys(_ERRORS, "lastgood.errors"),
}

_SUBMODULES = ("errors", "dcp", "export", "wire", "common", "remote", "datapath", "commit", "state", "restore",
               "trainer", "supervise", "cli")

__all__ = [*_LAZY]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    if name in _SUBMODULES:  # `import lastgood; lastgood.errors.Fenced`
        return importlib.import_module(f"lastgood.{name}")
    raise AttributeError(f"module 'lastgood' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])
