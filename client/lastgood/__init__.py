"""lastgood: complete, verified, resumable checkpoints for PyTorch training.

    import lastgood
    ckpt = lastgood.Checkpointer("http://127.0.0.1:8000", run="gpt-small")
    state = lastgood.TrainState(model=model, optimizer=optimizer, scheduler=scheduler, loader=loader)
    start = ckpt.restore(state)
    ...
    ckpt.save(step, state)
    ckpt.wait(); ckpt.close()

The torch-free modules (format, manifest, hashing, names, transport, v1) are what the
service shares; the torch-dependent API below is imported lazily. The errors (errors.py)
and the settings (config.py, ClientConfig) are exported here.
"""

from __future__ import annotations

__version__ = "0.1.0"

_LAZY = {
    "Checkpointer": ("lastgood.checkpointer", "Checkpointer"),
    "TrainState": ("lastgood.state", "TrainState"),
    "ResumableDistributedSampler": ("lastgood.sampler", "ResumableDistributedSampler"),
    "SpikeGuard": ("lastgood.spike", "SpikeGuard"),
}

__all__ = [*_LAZY, "ClientConfig", "Interval", "LastgoodError", "SaveFailed", "CorruptCheckpoint", "NoUsableCheckpoint",
           "ServiceError", "Fenced", "Unavailable", "ServiceUnreachable", "Refused", "NotFound", "InvalidArgument",
           "Conflict", "FailedPrecondition", "PermissionDenied", "Unauthenticated", "DataLoss", "CatalogBehind",
           "StoreFull"]

from .config import ClientConfig  # noqa: E402
from .errors import (CatalogBehind, Conflict, CorruptCheckpoint, DataLoss, FailedPrecondition,  # noqa: E402
                     Fenced, InvalidArgument, LastgoodError, NoUsableCheckpoint, NotFound, PermissionDenied,
                     Refused, SaveFailed, ServiceError, ServiceUnreachable, StoreFull, Unauthenticated,
                     Unavailable)
from .interval import Interval  # noqa: E402 - torch-free


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        mod, attr = _LAZY[name]
        return getattr(importlib.import_module(mod), attr)
    raise AttributeError(f"module 'lastgood' has no attribute {name!r}")
