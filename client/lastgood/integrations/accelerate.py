"""Accelerate: `Accelerator.save_state` / `load_state` through lastgood, writing no pickle
file and reading none.

    from lastgood.integrations.accelerate import LastgoodAccelerator
    accelerator = LastgoodAccelerator(lastgood_run="my-run", dataloader_config=DataLoaderConfiguration(
        use_stateful_dataloader=True, use_seedable_sampler=True))
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    accelerator.register_for_checkpointing(progress)
    if (ref := accelerator.resume()) is not None:   # "last-good", or None on a new run
        accelerator.load_state(ref)
    ...
    accelerator.save_state(step=step)               # on every process, as Accelerate's own
    accelerator.end_training()                      # returns once the last save committed

How it fits Accelerate (docs/integrations/accelerate.md):

- `save_state(step=N)` saves what Accelerate's own `save_state` writes to a folder, as one
  checkpoint of the run through a Checkpointer: every prepared model (unwrapped), optimizer
  and LR scheduler, the grad scaler, each prepared data loader's position (its epoch, and a
  StatefulDataLoader's state as Accelerate snapshots it, one batch fetched ahead accounted
  for), the objects given to `register_for_checkpointing`, Accelerate's step and save
  counters, and every process's RNG states (Python, NumPy, torch CPU and CUDA). Nothing is
  written to disk. The save returns once the state is snapshotted; the upload goes on in
  the background.
- `load_state(ref)`: `ref` is "last-good" (or None), a tag of the run or a checkpoint id;
  a folder is refused. Every byte is verified before anything is applied; the data loaders'
  first iterators after it draw nothing from the global RNGs (the uninterrupted run drew
  their seeds before the save), so a resumed run is bit-identical to an uninterrupted one.
- The Checkpointer is collective, as `save_state` is called on every process: every rank
  saves its own RNG states (replicated tensors are kept once, docs/replicated.md).
"""

from __future__ import annotations

import os

from lastgood.errors import LastgoodError
from lastgood.integrations.common import resolve, resume_reference
from lastgood.remote.config import ENV_URL, ClientConfig
from lastgood.state import distributed, loaders
from lastgood.state.codec import UnsupportedValue
from lastgood.state.trainstate import TrainState
from lastgood.trainer.checkpointer import Checkpointer
from lastgood.wire.names import LAST_GOOD_TAG

try:
    from accelerate import Accelerator
    from accelerate.utils import DistributedType
except ModuleNotFoundError as e:
    raise ModuleNotFoundError("lastgood.integrations.accelerate needs accelerate: pip install accelerate",
                              name="accelerate") from e

# these save through their engines' own files (FSDP's, DeepSpeed's, Megatron's, XLA's)
UNSUPPORTED = {DistributedType.FSDP, DistributedType.DEEPSPEED, DistributedType.MEGATRON_LM, DistributedType.XLA}


class _Loader:
    """A prepared data loader's position: Accelerate's epoch counter (it sets a
    SeedableRandomSampler's epoch from it) and, for a StatefulDataLoader, the state
    Accelerate snapshots after each batch it hands to the loop."""

    def __init__(self, shard) -> None:
        self.shard = shard
        self.stateful = getattr(shard, "use_stateful_dataloader", False)

    def state_dict(self) -> dict:
        out = {"iteration": int(getattr(self.shard, "iteration", 0))}
        if self.stateful:
            out["loader"] = self.shard.state_dict()
        return out

    def load_state_dict(self, state: dict) -> None:
        if hasattr(self.shard, "iteration"):
            self.shard.iteration = state["iteration"]
        if self.stateful and "loader" in state:
            # the StatefulDataLoader Accelerate iterates: its state, and a first iterator
            # that leaves the global RNGs as it found them (lastgood.state.loaders)
            loaders.StatefulLoaderAdapter(self.shard.base_dataloader).load_state_dict(state["loader"])


class _Counters:
    """Accelerate's own counters: `step` (gradient accumulation) and the save iteration."""

    def __init__(self, accelerator: "LastgoodAccelerator") -> None:
        self.accelerator = accelerator

    def state_dict(self) -> dict:
        return {"step": self.accelerator.step, "iteration": self.accelerator.project_configuration.iteration}

    def load_state_dict(self, state: dict) -> None:
        self.accelerator.step = state["step"]
        self.accelerator.project_configuration.iteration = state["iteration"]


class LastgoodAccelerator(Accelerator):
    """`accelerate.Accelerator` whose `save_state` / `load_state` go through a lastgood
    run. Keyword arguments besides Accelerator's: `lastgood_url`, `lastgood_run` (else
    LASTGOOD_URL / LASTGOOD_RUN) and `lastgood_options`, a dict for the Checkpointer
    (e.g. `{"retention": "latest:3,last-good,branch-heads"}`, `{"token": ...}`)."""

    def __init__(self, *args, lastgood_url: str | None = None, lastgood_run: str | None = None,
                 lastgood_options: dict | None = None, **kwargs) -> None:
        options = dict(lastgood_options or {})
        for reserved in ("solo", "read_only", "url", "run"):
            if reserved in options:
                raise TypeError(f"lastgood_options may not set {reserved}= (the Accelerator sets it)")
        self.lastgood_config = ClientConfig.resolve(url=lastgood_url, run=lastgood_run, token=options.get("token"))
        if not self.lastgood_config.url:
            raise LastgoodError(f"no lastgood service URL: pass lastgood_url= or set {ENV_URL}")
        super().__init__(*args, **kwargs)  # the process group is up after this
        if self.project_configuration.automatic_checkpoint_naming:
            raise LastgoodError("automatic_checkpoint_naming names folders, which a lastgood Accelerator never "
                                "writes: its checkpoints are the run's, kept by its retention policy")
        self.lastgood_run = distributed.run_name(self.lastgood_config.run, self.lastgood_config.new_run)
        self._lg_options = options
        self._lg_ckpt: Checkpointer | None = None

    # ------------------------------------------------------------------ the store
    @property
    def checkpointer(self) -> Checkpointer:
        """Made at first use, on every process alike (its construction is collective)."""
        if self._lg_ckpt is None:
            self._lg_ckpt = Checkpointer(self.lastgood_config.url, run=self.lastgood_run, **self._lg_options)
        return self._lg_ckpt

    def resume(self) -> str | None:
        """"last-good" when the run has a committed checkpoint, else None:
        `if (ref := accelerator.resume()) is not None: accelerator.load_state(ref)`."""
        return resume_reference(self.lastgood_config, self.lastgood_run)

    def close_checkpointer(self) -> None:
        """Wait for the last save to commit and close the Checkpointer (end_training() does it)."""
        if self._lg_ckpt is not None:
            ckpt, self._lg_ckpt = self._lg_ckpt, None
            ckpt.close()

    def end_training(self) -> None:
        self.close_checkpointer()  # returns once the last save committed (SaveFailed if it did not)
        super().end_training()

    def _lg_state(self, what: str) -> TrainState:
        if self.distributed_type in UNSUPPORTED:
            raise LastgoodError(f"{what} through lastgood supports DDP and a single process, not "
                                f"{self.distributed_type.value}")
        hooks = self._save_model_state_pre_hook if what == "save_state" else self._load_model_state_pre_hook
        if hooks:
            raise LastgoodError(f"{what} pre-hooks read or write a folder, which a lastgood Accelerator has not: "
                                "register the object with register_for_checkpointing instead")
        parts: dict = {"accelerate": _Counters(self)}
        for kind, objects in (("model", self._models), ("optimizer", self._optimizers),
                              ("scheduler", self._schedulers), ("custom", self._custom_objects)):
            for i, obj in enumerate(objects):
                parts[f"{kind}_{i}"] = obj  # TrainState keeps a model's plain names (DDP's "module." dropped)
        for i, loader in enumerate(self._dataloaders):
            parts[f"dataloader_{i}"] = _Loader(loader)
        if self.scaler is not None:
            parts["scaler"] = self.scaler
        return TrainState(**parts)

    # ------------------------------------------------------------------ save / load
    def save_state(self, output_dir: str | None = None, safe_serialization: bool = True, *, step: int | None = None,
                   **save_model_func_kwargs) -> int:
        """Save the training state as one checkpoint of the run at `step` (by default
        Accelerate's count of saves). Call it on every process. Returns the step."""
        if output_dir is not None:
            raise LastgoodError(f"save_state({output_dir!r}): a lastgood Accelerator saves to run "
                                f"{self.lastgood_run!r}, not to a folder: call save_state(step=...)")
        if save_model_func_kwargs:
            raise TypeError(f"save_state() got unexpected keyword arguments {sorted(save_model_func_kwargs)}")
        state = self._lg_state("save_state")
        step = self.project_configuration.iteration if step is None else step
        self.project_configuration.iteration += 1  # as Accelerate's own counts its saves (saved before it)
        try:
            self.checkpointer.save(step, state)
        except UnsupportedValue as e:
            self.project_configuration.iteration -= 1
            raise LastgoodError(f"cannot save the Accelerator's state: {e} (a registered object's state_dict() "
                                "holds JSON values and tensors only)") from None
        return step

    def load_state(self, input_dir: str | int | None = None, load_kwargs: dict | None = None,
                   **load_model_func_kwargs) -> int:
        """Load a checkpoint of the run into the prepared objects, the registered ones and
        the RNGs: `input_dir` is "last-good" (or None), a tag of the run or a checkpoint
        id. Call it on every process, after prepare() and register_for_checkpointing().
        Returns the checkpoint's step."""
        if load_kwargs or load_model_func_kwargs:
            raise TypeError("load_state() through lastgood takes a reference only")
        ref = LAST_GOOD_TAG if input_dir is None else input_dir
        if not isinstance(ref, int) and os.path.isdir(os.fspath(ref)):
            raise LastgoodError(f"{ref} is a folder: a lastgood Accelerator loads a reference of run "
                                f"{self.lastgood_run!r} (\"last-good\", a tag, a checkpoint id), and reads no "
                                "folder of Accelerate's (its optimizer.bin and random_states_0.pkl are pickles)")
        state = self._lg_state("load_state")
        ckpt = self.checkpointer
        step = ckpt.restore(state, checkpoint_id=resolve(ref, ckpt))
        if step is None:
            raise LastgoodError(f"run {self.lastgood_run!r} has no checkpoint to load (use accelerator.resume(), "
                                "which is None on a new run)")
        return step
