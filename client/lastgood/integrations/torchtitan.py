"""torchtitan: its CheckpointManager saves and resumes through lastgood.

    from lastgood.integrations.torchtitan import LastgoodCheckpointManager
    config = Trainer.Config(..., checkpoint=LastgoodCheckpointManager.Config(
        enable=True, interval=500, url="http://127.0.0.1:8000", run="llama3-8b",
        async_mode="async", last_save_model_only=False))

How it fits torchtitan (docs/integrations/torchtitan.md):

- torchtitan picks its checkpoint manager by the class of `Trainer.Config.checkpoint`: the
  trainer builds whatever `config.checkpoint.build(...)` makes, and every manager's Config
  names its owner. `LastgoodCheckpointManager` is torchtitan's own DCP `CheckpointManager`
  with lastgood's DCP StorageWriter and StorageReader (lastgood.dcp) in place of the
  checkpoint folder, so every policy of the `checkpoint` section keeps its meaning:
  `interval`, `async_mode` ("disabled", "async": DCP's thread, "async_with_pinned_mem": DCP's
  process with torchtitan's stager), `last_save_model_only` / `export_dtype`,
  `exclude_from_loading`, `load_step`, `load_only`, `initial_load_path`.
- A save of step N commits checkpoint N of the run (the model parts, optimizers, LR
  schedulers, dataloader and train state, each rank its shard); `load()` on start resumes
  from the run's last-good (or, with `load_step`, the newest committed checkpoint of that
  step); a run with none starts as torchtitan does without a checkpoint folder
  (`initial_load_path`, the HF assets, or from scratch). A checkpoint that holds only the
  model (step 0, or the last step's `last_save_model_only` save) loads the model only.
- Not pickled: torchtitan's `ParallelAwareDataloader` pickles its own state; here the
  loader's state is stored as typed JSON (lastgood.state.codec) and read back without
  unpickling.
- The run's retention decides which checkpoints are kept (`retention=`, lastgood's
  syntax, sent by rank 0 at start); `keep_latest_k` is not applied. The HF export
  (`last_save_in_hf`) still writes safetensors under `checkpoint.folder`, as torchtitan does.
- The token comes from LASTGOOD_TOKEN, never from the config (torchtitan logs its config).

Importing this module imports torchtitan; the rest of the client never does.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import logging
import re
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
from torch.distributed.checkpoint.stateful import Stateful

from lastgood import dcp as lgdcp
from lastgood.errors import LastgoodError, NotFound
from lastgood.remote.config import ENV_URL, ClientConfig
from lastgood.remote.rest import RestClient
from lastgood.state import distributed
from lastgood.state.codec import Encoder, decode
from lastgood.wire.vocab import Status

try:
    from torchdata.stateful_dataloader import StatefulDataLoader
    from torchtitan.components.checkpointer import DATALOADER, MODEL, CheckpointManager
    from torchtitan.components.checkpointer.dcp import AsyncMode
    from torchtitan.components.dataloader import ParallelAwareDataloader
    from torchtitan.tools.utils import GarbageCollection
except ModuleNotFoundError as e:
    raise ModuleNotFoundError("lastgood.integrations.torchtitan needs torchtitan: pip install torchtitan",
                              name="torchtitan") from e

log = logging.getLogger("lastgood")

_STEP = re.compile(r"step-(\d+)$")
LOADER_FORMAT = "lastgood-loader-state"


# ---------------------------------------------------------------------- the dataloader's state
def _loader_text(state: Any, key: str) -> str:
    """A dataloader's state as one JSON text: typed JSON (lastgood.state.codec), its few
    tensors and arrays (a sampler's RNG state) inline as raw bytes."""
    enc = Encoder()
    doc = enc.encode(state, [key])
    arrays = {}
    for name, t in enc.tensors.items():
        a = t.detach().cpu().contiguous().numpy() if isinstance(t, torch.Tensor) else np.ascontiguousarray(t)
        arrays[name] = {"torch": isinstance(t, torch.Tensor), "dtype": a.dtype.str, "shape": list(a.shape),
                        "data": base64.b64encode(a.tobytes()).decode()}
    return json.dumps({"format": LOADER_FORMAT, "state": doc, "arrays": arrays}, allow_nan=False)


def _loader_state(text: str, key: str) -> Any:
    try:
        doc = json.loads(text)
        assert isinstance(doc, dict) and doc.get("format") == LOADER_FORMAT
        arrays = doc["arrays"]
    except (ValueError, TypeError, KeyError, AssertionError):
        raise LastgoodError(f"{key}: not a dataloader state written by LastgoodCheckpointManager") from None

    def array(name: str) -> np.ndarray:
        a = arrays[name]
        dtype = np.dtype(a["dtype"])
        if dtype.hasobject:
            raise LastgoodError(f"{key}: an object array in the dataloader's state; refusing it")
        return np.frombuffer(base64.b64decode(a["data"]), dtype=dtype).reshape(a["shape"]).copy()

    return decode(doc["state"], lambda name, _device: torch.from_numpy(array(name)), array)


class LoaderState(Stateful):
    """torchtitan's ParallelAwareDataloader, checkpointed as it checkpoints itself (each
    data-parallel rank its own key, and the world size) but with the loader's state as
    typed JSON text, not a pickle. One text per rank, a single DCP value: the loader's state
    changes shape as it runs, and a load asks only for the keys the live state has."""

    def __init__(self, loader: ParallelAwareDataloader) -> None:
        self.loader = loader
        self.key = loader._rank_id

    def state_dict(self) -> dict[str, Any]:
        return {self.key: _loader_text(StatefulDataLoader.state_dict(self.loader), f"{DATALOADER}.{self.key}"),
                "world_size": self.loader.dp_world_size}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not state_dict or self.key not in state_dict:  # as ParallelAwareDataloader: no state, nothing to do
            return
        if state_dict["world_size"] != self.loader.dp_world_size:
            raise LastgoodError(f"the dataloader was saved with {state_dict['world_size']} data-parallel ranks "
                                f"and runs with {self.loader.dp_world_size}; torchtitan does not reshard it")
        StatefulDataLoader.load_state_dict(self.loader, _loader_state(state_dict[self.key], DATALOADER))


# ---------------------------------------------------------------------- the manager
class LastgoodCheckpointManager(CheckpointManager):
    """torchtitan's DCP CheckpointManager with lastgood as its storage; select it with
    `Trainer.Config(checkpoint=LastgoodCheckpointManager.Config(...))`."""

    @dataclass(kw_only=True, slots=True)
    class Config(CheckpointManager.Config):
        url: str | None = None
        """The lastgood service; None: LASTGOOD_URL."""

        run: str | None = None
        """The lastgood run; None: LASTGOOD_RUN, else torchrun's --rdzv-id."""

        retention: str | None = None
        """The run's retention policy (lastgood's syntax, e.g. "latest:5,every:1000,tagged,last-good,
        branch-heads"), set by rank 0 at start; None leaves the run's policy as it is."""

    def __init__(self, config: Config, **components) -> None:
        # keep_latest_k purges step folders; the run's retention keeps lastgood's checkpoints
        super().__init__(dataclasses.replace(config, keep_latest_k=0), **components)
        if not self.enable:
            return
        cfg = ClientConfig.resolve(url=config.url, run=config.run)
        if not cfg.url:
            raise LastgoodError(f"no lastgood service: set checkpoint.url or {ENV_URL}")
        self.lastgood, self.run = cfg, distributed.run_name(cfg.run, cfg.new_run)
        if isinstance(self.states.get(DATALOADER), ParallelAwareDataloader):
            self.states[DATALOADER] = LoaderState(self.states[DATALOADER])
        self._writer: lgdcp.StorageWriter | None = None
        if config.retention is not None and distributed.rank_world()[0] == 0:
            self._rest().set_retention(self.run, config.retention)

    def _rest(self) -> RestClient:
        cfg = self.lastgood
        return RestClient(cfg.url, token=cfg.token, retry=cfg.retry)

    @property
    def writer(self) -> lgdcp.StorageWriter:
        """One writer for the manager's saves (a save starts after the one before has
        finished: torchtitan waits for it)."""
        if self._writer is None:
            self._writer = lgdcp.StorageWriter(self.lastgood.url, run=self.run, token=self.lastgood.token)
        return self._writer

    # ------------------------------------------------------------------ save
    @torch.no_grad()
    def dcp_save(self, state_dict: dict[str, Any], checkpoint_id: str, async_mode: AsyncMode,
                 enable_garbage_collection: bool = False, to_hf: bool = False):
        if to_hf:  # torchtitan's HF export: safetensors files under checkpoint.folder
            return super().dcp_save(state_dict, checkpoint_id, async_mode, enable_garbage_collection, to_hf)
        found = _STEP.search(checkpoint_id)
        if found is None:
            raise LastgoodError(f"cannot tell the step of torchtitan's checkpoint {checkpoint_id!r}")
        how = {"storage_writer": self.writer, "planner": lgdcp.SavePlanner(), "checkpoint_id": found.group(1)}
        if async_mode == AsyncMode.ASYNC:
            ret = dcp.async_save(state_dict, process_group=self.pg, **how)
        elif async_mode == AsyncMode.ASYNC_WITH_PINNED_MEM:
            ret = dcp.async_save(state_dict, process_group=self.pg, async_checkpointer_type=AsyncCheckpointerType.PROCESS,
                                 async_stager=self.stager, **how)
        else:
            ret = dcp.save(state_dict, **how)
        if enable_garbage_collection:
            GarbageCollection.collect("GC collection invoked by checkpointer.")
        return ret

    def _purge_stale_checkpoints(self) -> None:
        """Nothing to purge: the run's retention decides (see the module doc)."""

    # ------------------------------------------------------------------ load
    def _find_load_step(self, folder: str = "") -> int:
        return -1  # resuming is lastgood's (_load); the folder holds no checkpoint to resume from

    def _committed(self, step: int) -> tuple[int, int]:
        """(checkpoint id, step) to resume from: the run's last-good for step -1, else the
        newest committed checkpoint of that step; (0, -1) for none. Rank 0 asks, every rank
        gets its answer (they load the same checkpoint)."""
        cid, at = 0, -1
        if distributed.rank_world()[0] == 0:
            rest = self._rest()
            if step == -1:
                lg = rest.last_good(self.run)
                cid, at = (lg["id"], lg["step"]) if lg else (0, -1)
            else:
                cid, at = next(((c["id"], c["step"]) for c in _committed_pages(rest, self.run)
                                if c["step"] == step), (0, -1))
        return distributed.broadcast_int(cid), distributed.broadcast_int(at)

    @torch.no_grad()
    def _load(self, step: int = -1) -> bool:
        cid, at = self._committed(step)
        if not cid:
            if step != -1:
                raise LastgoodError(f"checkpoint.load_step={step}: run {self.run!r} has no committed checkpoint "
                                    f"of step {step}")
            return super()._load(-1)  # torchtitan's start without a checkpoint: initial_load_path, HF, scratch
        reader = lgdcp.StorageReader(self.lastgood.url, run=self.run, checkpoint_id=cid, token=self.lastgood.token)
        saved = {key.split(".", 1)[0] for key in reader.read_metadata().state_dict_metadata}
        model_only = at == 0 or not saved & (set(self.states) - {MODEL})
        log.info("lastgood: loading checkpoint %s (step %s) of run %s%s", cid, at, self.run,
                 ", the model only" if model_only else "")
        states = self._states_to_load(model_only)
        dcp.load(states, storage_reader=reader, planner=lgdcp.LoadPlanner())
        self.states[MODEL].load_state_dict(states)
        GarbageCollection.collect("GC collection for checkpoint loading.")
        return True


def _committed_pages(rest: RestClient, run: str, page: int = 100):
    """The run's committed checkpoints, newest step first."""
    offset = 0
    while True:
        try:
            items = rest.checkpoints(run, Status.COMMITTED, limit=page, offset=offset)["items"]
        except NotFound:  # a run the service does not know has none
            return
        yield from items
        if len(items) < page:
            return
        offset += page
