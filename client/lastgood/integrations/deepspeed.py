"""DeepSpeed: a `DeepSpeedEngine` saves and resumes through lastgood (ZeRO stages 1-3).

    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    ds_ckpt = attach(engine, "http://127.0.0.1:8000", run="my-run")
    engine.load_checkpoint("ckpt", tag="last-good")     # (None, None) on a new run
    ...
    engine.save_checkpoint("ckpt")                      # every rank, as with DeepSpeed's own files
    ds_ckpt.close()

How it fits DeepSpeed (docs/integrations/deepspeed.md):

- `attach` puts a `LastgoodCheckpointEngine` in the engine's `checkpoint_engine` (DeepSpeed
  picks its own engines from the config; it has no entry for another one). Every rank calls
  it: it makes the ranks' Checkpointer, which is collective.
- One `save_checkpoint(save_dir, tag)` is one lastgood checkpoint at the engine's
  `global_steps`: `create` starts collecting, each `save(state_dict, path)` keeps the
  rank's file under its file name, `commit` saves the rank's files as its shard, waits for
  the commit (DeepSpeed's own engine returns once its files are written) and tags the
  checkpoint with DeepSpeed's tag (rank 0). With ZeRO stages 1 and 2 every rank keeps the
  model states file too (DeepSpeed writes it on data-parallel rank 0 only), so each rank
  restores from its own shard. `save_dir` holds only DeepSpeed's `latest` file and its
  zero_to_fp32.py scripts.
- `engine.load_checkpoint(load_dir, tag)`: `tag` is a lastgood reference of the run:
  "last-good", a DeepSpeed tag (a tag of the checkpoint) or a checkpoint id; `None` reads
  DeepSpeed's `latest` file in `load_dir` when there is one, else means "last-good". Every
  rank restores its shard (verified, as any restore), then DeepSpeed's own loading runs
  on it. The torch RNG states are restored too.
- Non-tensor values of DeepSpeed's state_dicts (config, versions, shapes) are stored as
  the codec stores them (state/codec.py); DeepSpeed's loss scalers and fragment addresses
  get a tagged form and are rebuilt from an allow-list of their classes. Anything else is
  refused with its key named. Nothing is pickled, nothing is unpickled.

Importing this module imports DeepSpeed; the rest of the client never does.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import tempfile
from typing import Any

from lastgood.errors import LastgoodError, ServiceError
from lastgood.integrations.common import Held, resolve
from lastgood.state.codec import UnsupportedValue
from lastgood.state.trainstate import TrainState
from lastgood.trainer.checkpointer import Checkpointer
from lastgood.wire.names import LAST_GOOD_TAG

try:
    from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointEngine
    from deepspeed.runtime.fp16 import loss_scaler as _loss_scaler
    from deepspeed.utils.tensor_fragment import fragment_address
except ModuleNotFoundError as e:
    raise ModuleNotFoundError("lastgood.integrations.deepspeed needs DeepSpeed: pip install deepspeed",
                              name="deepspeed") from e

log = logging.getLogger("lastgood")

COMPONENT = "deepspeed"  # the TrainState component that holds a rank's DeepSpeed files
_OBJECT = "__deepspeed__"
# the DeepSpeed classes whose objects DeepSpeed keeps in its state_dicts, rebuilt by name on load
_CLASSES = {cls.__name__: cls for cls in (_loss_scaler.LossScaler, _loss_scaler.DynamicLossScaler,
                                          fragment_address)}


# ---------------------------------------------------------------------- values the codec lacks
def storable(value: Any) -> Any:
    """DeepSpeed's state_dict with its loss scalers and fragment addresses in a tagged form
    (the codec stores the rest or refuses it, naming the key)."""
    cls = type(value)
    if _CLASSES.get(cls.__name__) is cls:
        return {_OBJECT: cls.__name__, "state": storable(dict(vars(value)))}
    if isinstance(value, dict):
        return {k: storable(v) for k, v in value.items()}
    if isinstance(value, list):
        return [storable(v) for v in value]
    if isinstance(value, tuple) and type(value) in (tuple,):
        return tuple(storable(v) for v in value)
    return value


def revived(value: Any) -> Any:
    """The inverse of `storable`: objects of the allow-listed classes only."""
    if isinstance(value, list):
        return [revived(v) for v in value]
    if isinstance(value, tuple):
        return tuple(revived(v) for v in value)
    if not isinstance(value, dict):
        return value
    if set(value) == {_OBJECT, "state"}:
        cls = _CLASSES.get(value[_OBJECT])
        state = revived(value["state"])
        if cls is None or not isinstance(state, dict):
            raise LastgoodError(f"checkpoint holds an unknown DeepSpeed object {value[_OBJECT]!r}")
        if dataclasses.is_dataclass(cls):
            return cls(**state)
        obj = cls.__new__(cls)
        obj.__dict__.update(state)
        return obj
    return {k: revived(v) for k, v in value.items()}


# ---------------------------------------------------------------------- the engine
class LastgoodCheckpointEngine(CheckpointEngine):
    """DeepSpeed's CheckpointEngine through lastgood: create / save / commit map onto one
    Checkpointer.save of the rank's files (begin, put, vote, commit), load onto the files
    of the checkpoint restored by `engine.load_checkpoint`. Made by `attach`."""

    def __init__(self, ds_engine, checkpointer: Checkpointer) -> None:
        super().__init__(None)
        self.name = "LastgoodCheckpointEngine"
        self.ds_engine = ds_engine
        self.checkpointer = checkpointer
        self._saving: dict[str, Any] | None = None
        self._loaded: dict[str, Any] = {}

    def create(self, info) -> None:
        self._saving = {}

    def makedirs(self, path, exist_ok=False) -> None:
        os.makedirs(path, exist_ok=True)  # save_dir keeps DeepSpeed's `latest` file and scripts

    def save(self, state_dict, path: str) -> None:
        if self._saving is None:
            raise LastgoodError("LastgoodCheckpointEngine.save outside engine.save_checkpoint")
        self._saving[os.path.basename(path)] = state_dict

    def preserves_storage_sharing(self) -> bool:
        return False  # the Checkpointer copies every tensor it saves: no clone needed first

    def commit(self, info) -> bool:
        files, self._saving = self._saving or {}, None
        ckpt = self.checkpointer
        try:
            ckpt.save(int(self.ds_engine.global_steps),
                      TrainState(**{COMPONENT: Held({"tag": info.tag, "files": storable(files)})}))
        except UnsupportedValue as e:
            raise LastgoodError(f"cannot save DeepSpeed's checkpoint {info.tag!r}: {e}") from None
        ckpt.wait()
        if ckpt.rank == 0:
            try:
                ckpt.tag(info.tag, alias=True)
            except (ServiceError, LastgoodError) as e:
                log.warning("lastgood: could not tag checkpoint %s as %r: %s", ckpt.last_saved, info.tag, e)
        return True

    def load(self, path: str, map_location=None):
        """One of the rank's files of the restored checkpoint (on the device it was saved from)."""
        name = os.path.basename(path)
        if name not in self._loaded:
            raise LastgoodError(f"this rank's checkpoint has no {name} (it holds {sorted(self._loaded)}); "
                                "a ZeRO elastic checkpoint, which reads every rank's files, is not supported")
        return revived(self._loaded[name])

    def restore(self, ref: str | int) -> int | None:
        """Restore the checkpoint `ref` names into this engine's files; its step, or None when
        the run has none. Collective."""
        held = Held()
        step = self.checkpointer.restore(TrainState(**{COMPONENT: held}), checkpoint_id=resolve(ref, self.checkpointer))
        self._loaded = dict(held.checkpoint["files"]) if step is not None else {}
        return step

    def close(self) -> None:
        self.checkpointer.close()


def attach(engine, url: str | None = None, run: str | None = None, **options) -> LastgoodCheckpointEngine:
    """Save and load `engine`'s checkpoints through lastgood (every rank calls it, after
    `deepspeed.initialize`). Other keyword arguments go to the Checkpointer; url and run may
    come from LASTGOOD_URL / LASTGOOD_RUN. Returns the checkpoint engine (close it at the end)."""
    ce = LastgoodCheckpointEngine(engine, Checkpointer(url, run=run, **options))
    engine.checkpoint_engine = ce
    if not engine.zero_optimization_partition_weights():
        engine.save_non_zero_checkpoint = True  # each rank's shard holds the model states file
    load = engine.load_checkpoint

    def load_checkpoint(load_dir, tag=None, load_module_strict=True, load_optimizer_states=True, **kwargs):
        if tag is None:
            latest = os.path.join(os.fspath(load_dir), "latest")
            tag = LAST_GOOD_TAG
            if os.path.isfile(latest):
                with open(latest) as f:
                    tag = f.read().strip()
        if engine.zero_optimization_partition_weights() and not load_optimizer_states:
            raise LastgoodError("ZeRO stage 3 without load_optimizer_states reads DeepSpeed's files from disk "
                                "(zero_to_fp32); load with load_optimizer_states=True")
        if ce.restore(tag) is None:
            return None, None
        stubs = tempfile.mkdtemp(prefix="lastgood-deepspeed-")
        try:  # DeepSpeed finds the files by name on disk (glob): empty stand-ins, read through load()
            os.makedirs(os.path.join(stubs, "ckpt"))
            for name in ce._loaded:
                open(os.path.join(stubs, "ckpt", name), "w").close()
            path, client_state = load(stubs, "ckpt", load_module_strict=load_module_strict,
                                      load_optimizer_states=load_optimizer_states, **kwargs)
        finally:
            shutil.rmtree(stubs, ignore_errors=True)
            ce._loaded = {}
        ref = ce.checkpointer.parent_id
        return (None if path is None else f"{ce.checkpointer.run}@{ref}"), client_state

    engine.load_checkpoint = load_checkpoint
    return ce
