"""Lightning: a `lightning.pytorch.Trainer` saves and resumes through lastgood.

    from lastgood.integrations.lightning import LastgoodCheckpointIO
    io = LastgoodCheckpointIO("http://127.0.0.1:8000", run="my-run")
    trainer = Trainer(plugins=[io], callbacks=[ModelCheckpoint(save_last=True, every_n_train_steps=50)])
    trainer.fit(model, datamodule, ckpt_path=io.resume())   # "last-good", or None on a new run

How it fits Lightning (docs/integrations.md):

- Lightning saves on global rank 0 only (single device and DDP, whose state is the same on
  every rank), so the plugin's Checkpointer is solo (trainer/checkpointer.py): rank 0 saves
  the whole checkpoint as a world of one, every rank restores it, nothing is collective.
- `save_checkpoint(checkpoint, path)` commits the checkpoint (it returns once committed, as
  Lightning's own file writer returns once written), pins it, and writes at `path` a small
  JSON pointer naming it. ModelCheckpoint keeps working on the pointers as on its files:
  top-k, `save_last`, `ckpt_path="last"` / `"best"`; `remove_checkpoint(path)` unpins the
  checkpoint (the run's retention may then delete it) and deletes the pointer. Pins take
  an admin token where the service requires tokens; with a writer's token the plugin says
  so once and pins nothing (the run's retention alone then decides what is kept).
- `load_checkpoint(path)`: a pointer file, or a lastgood reference of the run: "last-good",
  a tag, a checkpoint id. RNG states are restored too (rank 0's, on every rank).
- Values Lightning keeps that JSON has no form for are stored tagged and revived on load:
  `pathlib` paths, `argparse.Namespace` and enum members (an enum is revived as its member
  when its class is already imported, else as its value: nothing is imported to read a
  checkpoint). Anything else is refused with its key named. Nothing is pickled.
- `load_from_checkpoint(cls, ref)` stands in for `LightningModule.load_from_checkpoint`,
  which reads files with torch.load and bypasses every CheckpointIO.

Importing this module imports Lightning; the rest of the client never does.
"""

from __future__ import annotations

import argparse
import enum
import json
import logging
import os
import pathlib
import sys
from typing import Any

from lastgood.errors import LastgoodError, PermissionDenied, ServiceError
from lastgood.integrations.common import Held, resolve, resume_reference
from lastgood.remote.config import ClientConfig
from lastgood.state import distributed
from lastgood.state.codec import UnsupportedValue
from lastgood.state.trainstate import TrainState
from lastgood.trainer.checkpointer import Checkpointer
from lastgood.wire.names import LAST_GOOD_TAG

try:
    from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
except ModuleNotFoundError as e:  # the standalone package (pytorch_lightning) ships it as lightning_fabric
    try:
        from lightning_fabric.plugins.io.checkpoint_io import CheckpointIO
    except ModuleNotFoundError:
        raise ModuleNotFoundError("lastgood.integrations.lightning needs Lightning: pip install lightning",
                                  name="lightning") from e

log = logging.getLogger("lastgood")

POINTER_FORMAT = "lastgood-lightning-pointer"
MAX_POINTER_BYTES = 64 << 10
COMPONENT = "lightning"  # the TrainState component that holds Lightning's checkpoint dict
_PATH, _NAMESPACE, _ENUM = "__path__", "__namespace__", "__enum__"


# ---------------------------------------------------------------------- values JSON lacks
def storable(value: Any, key: str = "") -> Any:
    """Lightning's checkpoint with paths, namespaces and enum members in tagged forms
    (the codec stores the rest or refuses it, naming the key)."""
    if isinstance(value, enum.Enum):
        cls = type(value)
        return {_ENUM: f"{cls.__module__}:{cls.__qualname__}", "name": value.name,
                "value": storable(value.value, key)}
    if isinstance(value, pathlib.PurePath):
        return {_PATH: str(value)}
    if isinstance(value, argparse.Namespace):
        return {_NAMESPACE: storable(vars(value), key)}
    if isinstance(value, dict):
        clash = [k for k in value if k in (_PATH, _NAMESPACE, _ENUM)]
        if clash:
            raise LastgoodError(f"cannot save Lightning's checkpoint: key {clash[0]!r} at '{key}' is reserved")
        return {k: storable(v, f"{key}.{k}" if key else str(k)) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        items = [storable(v, f"{key}.{i}") for i, v in enumerate(value)]
        return items if isinstance(value, list) else tuple(items)
    return value


def revived(value: Any) -> Any:
    """The inverse of `storable`."""
    if isinstance(value, list):
        return [revived(v) for v in value]
    if isinstance(value, tuple):
        return tuple(revived(v) for v in value)
    if not isinstance(value, dict):
        return value
    if set(value) == {_PATH}:
        return pathlib.Path(value[_PATH])
    if set(value) == {_NAMESPACE}:
        return argparse.Namespace(**revived(value[_NAMESPACE]))
    if set(value) == {_ENUM, "name", "value"}:
        return _member(value[_ENUM], value["name"], revived(value["value"]))
    return {k: revived(v) for k, v in value.items()}


def _member(where: str, name: str, fallback: Any) -> Any:
    """The enum member, when its class is already imported; else its value."""
    module, _, qualname = where.partition(":")
    obj = sys.modules.get(module)
    for part in qualname.split("."):
        obj = getattr(obj, part, None) if obj is not None else None
    if isinstance(obj, type) and issubclass(obj, enum.Enum) and name in obj.__members__:
        return obj[name]
    return fallback


# ---------------------------------------------------------------------- pointers
def _write_pointer(path, doc: dict) -> None:
    path = os.fspath(path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.lastgood-tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_pointer(path) -> dict:
    """The pointer at `path`: {"format", "url", "run", "checkpoint_id", "step"}; LastgoodError
    for any other file (a torch.save checkpoint is not read: it would be unpickled)."""
    path = os.fspath(path)
    with open(path, "rb") as f:
        data = f.read(MAX_POINTER_BYTES + 1)
    try:
        doc = json.loads(data) if len(data) <= MAX_POINTER_BYTES else None
    except (ValueError, UnicodeDecodeError):
        doc = None
    if not (isinstance(doc, dict) and doc.get("format") == POINTER_FORMAT and isinstance(doc.get("run"), str)
            and isinstance(doc.get("checkpoint_id"), int) and not isinstance(doc["checkpoint_id"], bool)):
        raise LastgoodError(f"{path} is not a lastgood checkpoint pointer (a file written by "
                            "LastgoodCheckpointIO); lastgood reads no torch.save file, which is a pickle")
    return doc


# ---------------------------------------------------------------------- the plugin
class LastgoodCheckpointIO(CheckpointIO):
    """Lightning's CheckpointIO through lastgood: `Trainer(plugins=[LastgoodCheckpointIO(url,
    run=...)])`. Other keyword arguments go to the Checkpointer (e.g. `retention=`,
    `heartbeat_seconds=`, `token=`); url and run may come from LASTGOOD_URL / LASTGOOD_RUN."""

    def __init__(self, url: str | None = None, run: str | None = None, **options) -> None:
        super().__init__()
        for reserved in ("solo", "read_only"):
            if reserved in options:
                raise TypeError(f"LastgoodCheckpointIO sets {reserved}= itself")
        self.config = ClientConfig.resolve(url=url, run=run, token=options.get("token"))
        self.url, self.run = self.config.url, distributed.run_name(self.config.run, self.config.new_run)
        self.options = options
        self._ckpt: Checkpointer | None = None
        self._may_pin = True

    @property
    def checkpointer(self) -> Checkpointer:
        """Made at first use (the process group is up by then): solo, see the module doc."""
        if self._ckpt is None:
            self._ckpt = Checkpointer(self.url, run=self.run, solo=True, **self.options)
        return self._ckpt

    def resume(self) -> str | None:
        """"last-good" when the run has a committed checkpoint, else None: for
        `trainer.fit(model, ckpt_path=io.resume())` in a script that starts and resumes alike.
        Asks the service only (callable before the process group is up); every rank gets the
        same answer unless a commit lands between their asks (call it before fit, as here)."""
        return resume_reference(self.config, self.run)

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError("LastgoodCheckpointIO.save_checkpoint takes no storage_options")
        ckpt = self.checkpointer
        try:
            state = TrainState(**{COMPONENT: Held(storable(checkpoint))})
            ckpt.save(int(checkpoint.get("global_step", 0)), state)
        except UnsupportedValue as e:
            raise LastgoodError(f"cannot save Lightning's checkpoint: {e}. Keep such values as JSON, tensors, "
                                "paths, enums or argparse.Namespace") from None
        ckpt.wait()
        saved = ckpt.last_saved
        self._pin(saved.checkpoint_id, True)  # kept whatever the retention says, until ModelCheckpoint removes it
        replaced = read_pointer(path)["checkpoint_id"] if os.path.isfile(os.fspath(path)) else None
        _write_pointer(path, {"format": POINTER_FORMAT, "url": self.url, "run": self.run,
                              "checkpoint_id": saved.checkpoint_id, "step": saved.step})
        if replaced is not None and replaced != saved.checkpoint_id:  # last.ckpt again: the one it named goes
            self._pin(replaced, False)

    def load_checkpoint(self, path, map_location: Any | None = None, weights_only: bool | None = None) -> dict:
        """`path`: a pointer file, or "last-good", a tag or a checkpoint id of the run.
        Tensors come back on the device they were saved from (`map_location` is not
        applied; Lightning moves the state onto the model). Nothing is unpickled, so
        `weights_only` changes nothing."""
        ckpt = self.checkpointer
        held = Held()
        cid = self._resolve(path, ckpt)
        if ckpt.restore(TrainState(**{COMPONENT: held}), checkpoint_id=cid) is None:
            raise LastgoodError(f"run {self.run!r} has no checkpoint to resume from (pass ckpt_path=io.resume(), "
                                "which is None on a new run)")
        return revived(held.checkpoint)

    def _resolve(self, path, ckpt: Checkpointer) -> int | None:
        text = os.fspath(path)
        if os.path.isfile(text):
            doc = read_pointer(text)
            if doc["run"] != self.run:
                raise LastgoodError(f"{text} points to a checkpoint of run {doc['run']!r}; this plugin's run "
                                    f"is {self.run!r}")
            return doc["checkpoint_id"]
        return resolve(text, ckpt)

    def remove_checkpoint(self, path) -> None:
        """ModelCheckpoint drops a checkpoint: unpin it, delete the pointer."""
        text = os.fspath(path)
        if not os.path.isfile(text):
            return
        self._pin(read_pointer(text)["checkpoint_id"], False)
        os.remove(text)

    def _pin(self, cid: int, pinned: bool) -> None:
        if not self._may_pin:
            return
        try:
            self.checkpointer.pin(cid, pinned)
        except PermissionDenied as e:
            self._may_pin = False
            log.warning("lastgood: this token may not pin checkpoints (%s): the run's retention alone decides "
                        "which of ModelCheckpoint's checkpoints are kept", e)
        except ServiceError as e:  # gone already, or the service is away: the pointer goes on
            log.warning("lastgood: could not %s checkpoint %s: %s", "pin" if pinned else "unpin", cid, e)

    def teardown(self) -> None:
        if self._ckpt is not None:
            ckpt, self._ckpt = self._ckpt, None
            ckpt.close()


def read_checkpoint(ref: str = LAST_GOOD_TAG, *, url: str | None = None, run: str | None = None,
                    token: str | None = None) -> dict:
    """Lightning's checkpoint dict from a pointer file or a reference of the run, read by a
    read-only Checkpointer (it registers no launch: a job that trains on is not fenced)."""
    io = LastgoodCheckpointIO(url, run=run, token=token, heartbeat_seconds=0)
    io._ckpt = Checkpointer(io.url, run=io.run, solo=True, read_only=True, token=token, heartbeat_seconds=0)
    try:
        return io.load_checkpoint(ref)
    finally:
        io.teardown()


def load_from_checkpoint(cls, ref: str = LAST_GOOD_TAG, *, url: str | None = None, run: str | None = None,
                         token: str | None = None, strict: bool | None = None, **kwargs):
    """`cls.load_from_checkpoint` for a lastgood checkpoint: the LightningModule (or
    LightningDataModule) built from its saved hyperparameters (`kwargs` override them),
    its weights loaded, on the device they were saved from."""
    from lightning.pytorch.core.saving import _load_state

    return _load_state(cls, read_checkpoint(ref, url=url, run=run, token=token), strict=strict, **kwargs)
