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

_ERRORS = ("LastgoodError", "SaveFailed", "CorruptCheckpoint", "DDPInternalsChanged", "NoUsableCheckpoint",
           "ServiceError", "Fenced", "Unavailable", "ServiceUnreachable", "Refused", "NotFound", "InvalidArgument", "Conflict",
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
               "trainer", "supervise", "integrations", "cli")
_TORCH_HINT = ("lastgood.{name} needs PyTorch, which this environment lacks: install the client with its torch "
               "extra (pip install 'lastgood[torch]'), or torch itself at the version your training uses")

__all__ = [*_LAZY]


def __getattr__(name: str):
    try:
        if name in _LAZY:
            return getattr(importlib.import_module(_LAZY[name]), name)
        if name in _SUBMODULES:  # `import lastgood; lastgood.errors.Fenced`
            return importlib.import_module(f"lastgood.{name}")
    except ModuleNotFoundError as e:
        if e.name in ("torch", "numpy"):  # the torch-free install: say which extra is missing
            raise ModuleNotFoundError(_TORCH_HINT.format(name=name), name=e.name) from e
        raise
    raise AttributeError(f"module 'lastgood' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])
