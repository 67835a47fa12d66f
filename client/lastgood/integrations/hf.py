"""Hugging Face: a `transformers.Trainer` that saves and resumes through lastgood and
writes no pickle file.

    from lastgood.integrations.hf import LastgoodTrainer
    trainer = LastgoodTrainer(model=model, args=TrainingArguments("out", save_steps=50), train_dataset=data,
                              lastgood_run="my-run")
    trainer.train(resume_from_checkpoint=trainer.resume())   # "last-good", or None on a new run

How it fits the Trainer (docs/integrations/hf.md):

- The Trainer decides when to save (`save_strategy`, `save_steps`) and calls
  `_save_checkpoint`; here that saves the model's, optimizer's, LR scheduler's (and grad
  scaler's) state dicts and the TrainerState (JSON) as one checkpoint of the run, with the
  RNG states TrainState captures (Python, NumPy, torch CPU and CUDA). Nothing is written
  to `output_dir`: no checkpoint-N folder, no optimizer.pt, rng_state.pth or
  training_args.bin; `save_model()` writes safetensors and JSON only. The save returns
  once the state is snapshotted; the upload goes on in the background, and `train()`
  returns once the last save committed.
- `train(resume_from_checkpoint=ref)`: `ref` is "last-good" (or True), a tag of the run or
  a checkpoint id. The checkpoint is read once, before training; the Trainer's own resume
  path then applies it piece by piece, where it would read its files: the weights before
  the model is prepared, the TrainerState (and stateful callbacks) in
  `_init_training_state`, the optimizer and scheduler once created, the RNG states where
  the uninterrupted run drew from them: mid-epoch, the batch Accelerate's loader had
  fetched ahead is collated from the states recorded before it (`_Collate`), then the
  saved ones are restored (the Trainer's own resume collates it from a fresh process's).
- The Checkpointer is solo (trainer/checkpointer.py): the Trainer's state is the same on
  every rank under DDP, so global rank 0 saves it as a world of one and every rank restores
  it; no call is collective.

`LastgoodTrainerMixin` puts this in front of any Trainer subclass (`class MyTrainer(
LastgoodTrainerMixin, SFTTrainer)`); `LastgoodTrainer` is it on the stock Trainer.
Importing this module imports transformers; the rest of the client never does.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import random

import numpy as np
import torch
from lastgood.errors import LastgoodError
from lastgood.integrations.common import Held, resolve, resume_reference
from lastgood.remote.config import ENV_URL, ClientConfig
from lastgood.state import distributed, rng
from lastgood.state.codec import UnsupportedValue
from lastgood.state.trainstate import TrainState
from lastgood.trainer.checkpointer import Checkpointer
from lastgood.wire.names import LAST_GOOD_TAG

from safetensors.torch import save_file

try:
    from transformers import PreTrainedModel, Trainer
    from transformers.trainer_callback import ExportableState, TrainerState
    from transformers.trainer_utils import compare_trainer_and_checkpoint_args
    from transformers.utils import SAFE_WEIGHTS_NAME
except ModuleNotFoundError as e:
    raise ModuleNotFoundError("lastgood.integrations.hf needs transformers: pip install transformers",
                              name="transformers") from e

log = logging.getLogger("lastgood")

COMPONENT = "hf_trainer"  # the TrainState component that holds the Trainer's checkpoint dict
TRAINING_ARGS_JSON = "training_args.json"  # save_model()'s training arguments (the Trainer's own: a pickle)


class LastgoodTrainerMixin:
    """Put before a `transformers.Trainer` class. Keyword arguments: `lastgood_url`,
    `lastgood_run` (else LASTGOOD_URL / LASTGOOD_RUN) and `lastgood_options`, a dict for the
    Checkpointer (e.g. `{"retention": "latest:3,last-good,branch-heads"}`, `{"token": ...}`)."""

    def __init__(self, *args, lastgood_url: str | None = None, lastgood_run: str | None = None,
                 lastgood_options: dict | None = None, **kwargs) -> None:
        options = dict(lastgood_options or {})
        for reserved in ("solo", "read_only", "url", "run"):
            if reserved in options:
                raise TypeError(f"lastgood_options may not set {reserved}= (the Trainer sets it)")
        self.lastgood_config = ClientConfig.resolve(url=lastgood_url, run=lastgood_run, token=options.get("token"))
        if not self.lastgood_config.url:
            raise LastgoodError(f"no lastgood service URL: pass lastgood_url= or set {ENV_URL}")
        self.lastgood_run = distributed.run_name(self.lastgood_config.run, self.lastgood_config.new_run)
        self._lg_options = options
        self._lg_ckpt: Checkpointer | None = None
        self._lg_ref: str | None = None   # the reference train() resumes from
        self._lg_held: dict | None = None  # the checkpoint read for it, applied piece by piece
        self._lg_rng: dict | None = None
        self._lg_collated: dict | None = None  # the CPU RNGs before the latest collation (_Collate)
        self._lg_before_collate: dict | None = None  # the resume's: for the first collation
        super().__init__(*args, **kwargs)
        if self.args.load_best_model_at_end:
            raise LastgoodError("load_best_model_at_end reads the best checkpoint's folder, which a lastgood "
                                "Trainer never writes: tag the checkpoint to keep and restore it by tag")

    # ------------------------------------------------------------------ the store
    @property
    def checkpointer(self) -> Checkpointer:
        """Made at first use (the process group is up by then): solo, see the module doc."""
        if self._lg_ckpt is None:
            self._lg_ckpt = Checkpointer(self.lastgood_config.url, run=self.lastgood_run, solo=True,
                                         **self._lg_options)
        return self._lg_ckpt

    def resume(self) -> str | None:
        """"last-good" when the run has a committed checkpoint, else None:
        `trainer.train(resume_from_checkpoint=trainer.resume())` starts or resumes alike."""
        return resume_reference(self.lastgood_config, self.lastgood_run)

    def close_checkpointer(self) -> None:
        """Wait for the last save to commit and close the Checkpointer (train() does it)."""
        if self._lg_ckpt is not None:
            ckpt, self._lg_ckpt = self._lg_ckpt, None
            ckpt.close()

    # ------------------------------------------------------------------ save
    def _save_checkpoint(self, model, trial) -> None:
        if self.hp_search_backend is None and trial is None:
            self.store_flos()
        for cb in [cb for cb in self.callback_handler.callbacks + [self.control] if isinstance(cb, ExportableState)]:
            name, cb_state = cb.__class__.__name__, cb.state()  # as the Trainer's own save records them
            if isinstance(self.state.stateful_callbacks[name], list):
                self.state.stateful_callbacks[name].append(cb_state)
            else:
                self.state.stateful_callbacks[name] = cb_state
        if distributed.rank_world()[0] != 0:  # rank 0 saves the state every rank holds alike
            return
        held = {"model": self.accelerator.unwrap_model(self.model).state_dict(),
                "trainer_state": dataclasses.asdict(self.state)}
        if self._lg_collated is not None:
            held["rng_before_collate"] = self._lg_collated
        if not self.args.save_only_model:
            held["optimizer"] = self.optimizer.state_dict()
            held["lr_scheduler"] = self.lr_scheduler.state_dict()
            if getattr(self.accelerator, "scaler", None) is not None:
                held["scaler"] = self.accelerator.scaler.state_dict()
        try:
            self.checkpointer.save(self.state.global_step, TrainState(**{COMPONENT: Held(held)}))
        except UnsupportedValue as e:
            raise LastgoodError(f"cannot save the Trainer's checkpoint: {e}") from None

    # ------------------------------------------------------------------ resume
    def train(self, resume_from_checkpoint: str | int | bool | None = None, trial=None,
              ignore_keys_for_eval: list[str] | None = None, **kwargs):
        """`resume_from_checkpoint`: "last-good" (or True), a tag of the run, a checkpoint
        id, or None. A folder of the Trainer's own is refused: its files are pickles."""
        ref = LAST_GOOD_TAG if resume_from_checkpoint is True else resume_from_checkpoint
        if ref is False:
            ref = None
        if ref is not None and os.path.isdir(os.fspath(ref) if not isinstance(ref, int) else ""):
            raise LastgoodError(f"{ref} is a folder: a lastgood Trainer resumes from a reference of run "
                                f"{self.lastgood_run!r} (\"last-good\", a tag, a checkpoint id), and reads no "
                                "Trainer checkpoint folder (its optimizer.pt and rng_state.pth are pickles)")
        self._lg_ref = None if ref is None else str(ref)
        try:
            if self._lg_ref is not None:
                self._lg_read(self._lg_ref)
            # the Trainer's own resume reads files: it is given None, and the overrides below
            # apply the checkpoint read here (see _inner_training_loop)
            out = super().train(resume_from_checkpoint=None, trial=trial, ignore_keys_for_eval=ignore_keys_for_eval,
                                **kwargs)
        except BaseException:
            try:  # training failed: the saves so far still commit, and the run is free for another Checkpointer
                self.close_checkpointer()
            except Exception as e:  # noqa: BLE001 - the training's own error is the one raised
                log.error("lastgood: closing the Trainer's Checkpointer after a failed train(): %s", e)
            raise
        finally:
            self._lg_ref = self._lg_held = self._lg_rng = self._lg_before_collate = None
        self.close_checkpointer()  # returns once the last save committed (SaveFailed if it did not)
        return out

    def _lg_read(self, ref: str) -> None:
        ckpt = self.checkpointer
        held = Held()
        if ckpt.restore(TrainState(**{COMPONENT: held}), checkpoint_id=resolve(ref, ckpt)) is None:
            raise LastgoodError(f"run {self.lastgood_run!r} has no checkpoint to resume from (pass "
                                "resume_from_checkpoint=trainer.resume(), which is None on a new run)")
        self._lg_held = held.checkpoint
        self._lg_rng = rng.capture()  # restore() set the saved RNG states: kept for _load_rng_state
        self._lg_before_collate = self._lg_held.get("rng_before_collate")
        saved = self._lg_held["trainer_state"]
        if self.args.auto_find_batch_size and saved.get("train_batch_size") is not None:
            self._train_batch_size = saved["train_batch_size"]

    def _inner_training_loop(self, batch_size=None, args=None, resume_from_checkpoint=None, trial=None,
                             ignore_keys_for_eval=None):
        if self._lg_held is not None:  # the weights before the model is prepared, as the Trainer loads its own
            self.accelerator.unwrap_model(self.model).load_state_dict(self._lg_held["model"])
            resume_from_checkpoint = self._lg_ref  # not None: the Trainer skips the trained batches
        return super()._inner_training_loop(batch_size=batch_size, args=args,
                                            resume_from_checkpoint=resume_from_checkpoint, trial=trial,
                                            ignore_keys_for_eval=ignore_keys_for_eval)

    def _init_training_state(self, max_steps, num_update_steps_per_epoch, num_train_epochs, resume_from_checkpoint,
                             trial):
        epochs_trained, steps_in_epoch = super()._init_training_state(
            max_steps, num_update_steps_per_epoch, num_train_epochs, None, trial)
        if self._lg_held is None:
            return epochs_trained, steps_in_epoch
        # the Trainer's resume branch, with the TrainerState from the checkpoint instead of trainer_state.json
        self.state = TrainerState(**self._lg_held["trainer_state"])
        self.state.best_model_checkpoint = None  # a folder of another launch, never written here
        compare_trainer_and_checkpoint_args(self.args, self.state)
        self._load_callback_state()
        epochs_trained = int(self.state.global_step // num_update_steps_per_epoch)
        steps_in_epoch = 0
        if not self.args.ignore_data_skip:
            steps_in_epoch = self.state.global_step % num_update_steps_per_epoch
            steps_in_epoch *= self.args.gradient_accumulation_steps
        self.state.init_training_references(self, max_steps, num_train_epochs, trial)
        return epochs_trained, steps_in_epoch

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None) -> None:
        if self._lg_held is None:
            raise LastgoodError("a lastgood Trainer loads weights only from its run's checkpoints")
        # FSDP and SageMaker load after prepare; the weights were loaded before it already

    def _load_optimizer_and_scheduler(self, checkpoint) -> None:
        if self._lg_held is None or "optimizer" not in self._lg_held:
            return
        self.optimizer.load_state_dict(self._lg_held["optimizer"])
        self.lr_scheduler.load_state_dict(self._lg_held["lr_scheduler"])

    def _load_scaler(self, checkpoint) -> None:
        if self._lg_held is not None and "scaler" in self._lg_held and getattr(self.accelerator, "scaler", None):
            self.accelerator.scaler.load_state_dict(self._lg_held["scaler"])

    def _load_rng_state(self, checkpoint) -> None:
        """At an epoch's start the Trainer restores the RNGs before the loader's iterator
        is made, as the uninterrupted run drew from them. Mid-epoch it restores them after
        fetching the next batches; `_Collate` restored them already, at the right draw."""
        self._lg_before_collate = None
        self._lg_restore_rng()

    def _lg_restore_rng(self) -> None:
        if self._lg_rng is not None:
            state, self._lg_rng = self._lg_rng, None
            rng.restore(state)

    def get_train_dataloader(self):
        loader = super().get_train_dataloader()
        # the collator runs here, drawing from this process's RNGs, and a resume skips batches
        # without collating them (an IterableDataset's are collated: the Trainer's own order then)
        iterable = isinstance(self.train_dataset, torch.utils.data.IterableDataset)
        if self.args.dataloader_num_workers == 0 and not iterable:
            base = getattr(loader, "base_dataloader", loader)  # accelerate's DataLoaderShard holds the DataLoader
            base.collate_fn = _Collate(base.collate_fn, self)
        return loader

    # ------------------------------------------------------------------ save_model
    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        """`save_model()`: the model through `save_pretrained` (safetensors and its config),
        the processing class, and the training arguments as training_args.json (the
        Trainer's own pickles them into training_args.bin)."""
        if getattr(self, "is_distributed_loading_by_transformers", False):
            raise LastgoodError("save_model() of a model sharded at load time is not supported by the lastgood "
                                "Trainer")
        if not self.args.should_save:
            return
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        os.makedirs(output_dir, exist_ok=True)
        model = self.accelerator.unwrap_model(self.model, keep_torch_compile=False)
        if isinstance(model, PreTrainedModel):
            model.save_pretrained(output_dir, state_dict=state_dict, is_main_process=True)
        else:
            save_file(state_dict if state_dict is not None else model.state_dict(),
                      os.path.join(output_dir, SAFE_WEIGHTS_NAME), metadata={"format": "pt"})
        if self.processing_class is not None:
            self.processing_class.save_pretrained(output_dir)
        with open(os.path.join(output_dir, TRAINING_ARGS_JSON), "w", encoding="utf-8") as f:
            f.write(self.args.to_json_string())


def _cpu_rng() -> dict:
    """The RNGs a collator draws from (Python, NumPy, torch CPU), in the codec's types."""
    version, internal, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    return {"python": [version, list(internal), gauss], "torch": torch.get_rng_state(),
            "numpy": [name, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached)]}


def _set_cpu_rng(state: dict) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])


class _Collate:
    """The train loader's collator, recording the RNGs before each collation. Accelerate's
    loader fetches one batch ahead, so at a save mid-epoch the next batch is collated
    already, from RNG states older than the saved ones. A resumed run collates that batch
    from the states recorded before it, then continues from the saved ones: a collator
    that masks or augments draws as in the uninterrupted run (the Trainer's own resume
    collates it from a fresh process's states)."""

    def __init__(self, inner, trainer: "LastgoodTrainerMixin") -> None:
        self.inner, self.trainer = inner, trainer

    def __call__(self, rows):
        t = self.trainer
        pending, t._lg_before_collate = t._lg_before_collate, None
        if pending is not None:
            _set_cpu_rng(pending)
        t._lg_collated = _cpu_rng()
        batch = self.inner(rows)
        if pending is not None:
            t._lg_restore_rng()  # the saved states: drawn from after this collation, as in the uninterrupted run
        return batch


class LastgoodTrainer(LastgoodTrainerMixin, Trainer):
    """`transformers.Trainer` saving to and resuming from a lastgood run (module doc)."""
