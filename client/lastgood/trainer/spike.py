"""SpikeGuard: roll back automatically when the loss (or gradient norm) spikes.

    guard = lastgood.SpikeGuard(ckpt, state, lr_factor=0.5)
    for ids, x, y in loader:            # ids: the dataset indices of this step's samples
        loss = loss_fn(model(x), y); loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
        if guard.observe(step, loss.item(), grad_norm=norm.item(), batch=ids):
            step = guard.next_step      # the state is back at the checkpoint before the spike
            break                       # re-enter the data loop: it continues after the spike
        optimizer.step(); ...; ckpt.save(step, state)

(docs/training.md has a complete program, which a test runs.)

Call `observe` after backward and before `optimizer.step()`, on every rank. NaN or Inf
trips it at once; otherwise a value more than `threshold` robust deviations above the
median of the last `window` healthy values (median absolute deviation, scaled to a
standard deviation) is a spike. Ranks agree: if any rank sees a spike, all roll back.

On a spike the guard: waits for in-flight saves; picks the newest committed, non-suspect
checkpoint on the current lineage saved at least `margin` steps before the spike; asks the
service to mark everything saved after it `suspect` (never last-good again), tag it
`rollback-target` and record `spike` and `rollback` events with the numbers; restores it
in place; puts back the spike-time state of the data loaders and `extra` (the data cursor
moves past the batches that preceded the spike; they are recorded, and a
ResumableDistributedSampler never yields them again); and scales the learning rate by
`lr_factor`. The next save starts a new branch. The events carry a non-finite loss or
gradient norm as the string "nan", "inf" or "-inf" (lastgood.wire.jsonvalues: JSON has no NaN).
"""

from __future__ import annotations

import logging
import math
import statistics
from collections import deque

from lastgood.common.joblog import incident
from lastgood.wire.vocab import Status
from lastgood.state import distributed
from lastgood.wire import jsonvalues
from lastgood.errors import LastgoodError
from lastgood.state.sampler import ResumableDistributedSampler

log = logging.getLogger("lastgood")


class _Window:
    def __init__(self, size: int) -> None:
        self.values: deque[float] = deque(maxlen=size)

    def score(self, x: float) -> tuple[float, float, float]:
        """(robust z-score of x, median, MAD) against the window."""
        med = statistics.median(self.values)
        mad = statistics.median(abs(v - med) for v in self.values)
        scale = 1.4826 * mad + 1e-3 * abs(med) + 1e-12  # floor: a flat loss is not a zero scale
        return (x - med) / scale, med, mad


class SpikeGuard:
    def __init__(self, checkpointer, state, *, window: int = 100, threshold: float = 6.0, min_history: int = 10,
                 lr_factor: float = 0.5, margin: int = 0, keep: tuple[str, ...] | None = None) -> None:
        if not 0 < lr_factor <= 1:
            raise ValueError("lr_factor must be in (0, 1]")
        self.ckpt, self.state = checkpointer, state
        self.threshold, self.min_history = threshold, min_history
        self.lr_factor, self.margin = lr_factor, margin
        self.loss, self.grad = _Window(window), _Window(window)
        # components whose spike-time state survives the rollback: the data position
        self.keep = keep if keep is not None else tuple(state._adapters) + ("extra",)
        self.batches: deque[tuple[int, list[int]]] = deque(maxlen=100_000)
        self.next_step: int | None = None
        self.rollbacks = 0

    # ------------------------------------------------------------------ detection
    def _check(self, name: str, win: _Window, x: float | None) -> dict | None:
        if x is None:
            return None
        if not math.isfinite(x):
            return {"metric": name, "value": jsonvalues.carry(x), "reason": "not finite"}
        if len(win.values) >= self.min_history:
            z, med, mad = win.score(x)
            if z > self.threshold:
                return {"metric": name, "value": x, "median": med, "mad": mad, "z": z,
                        "threshold": self.threshold, "reason": "robust z-score above threshold"}
        return None

    def observe(self, step: int, loss: float, grad_norm: float | None = None, batch=None) -> bool:
        """Report one step. True means: rolled back; continue at `next_step`, re-enter the loop."""
        loss = float(loss)
        grad_norm = None if grad_norm is None else float(grad_norm)
        if batch is not None:
            self.batches.append((step, [int(i) for i in batch]))
        found = self._check("loss", self.loss, loss) or self._check("grad_norm", self.grad, grad_norm)
        # the lowest rank that saw a spike, or world_size if none did: that rank reports it,
        # with its own numbers (another rank's loss may be unremarkable)
        world = self.ckpt.world_size
        reporter = distributed.all_min(self.ckpt.rank if found else world)
        if reporter == world:
            self.loss.values.append(loss)
            if grad_norm is not None:
                self.grad.values.append(grad_norm)
            return False
        self._rollback(step, found or {"reason": "another rank saw a spike"}, loss, grad_norm, reporter)
        return True

    # ------------------------------------------------------------------ rollback
    def _target(self, spike_step: int) -> dict:
        t = self.ckpt.transport
        chain = []
        if self.ckpt.parent_id is not None:
            chain = [t.checkpoint(self.ckpt.parent_id)] + t.ancestors(self.ckpt.parent_id)["items"]
        for c in chain:
            if (c["status"] == Status.COMMITTED and c["step"] < spike_step - self.margin
                    and not any(tag["name"] == "suspect" for tag in c["tags"])):
                return c
        raise LastgoodError(f"no committed checkpoint before step {spike_step - self.margin} to roll back to")

    def _rollback(self, step: int, found: dict, loss: float, grad_norm: float | None, reporter: int = 0) -> None:
        self.ckpt.wait()  # in-flight saves commit first, so that they are marked suspect too
        target_id = 0
        if self.ckpt.rank == 0:
            target_id = self._target(step)["id"]
        target_id = distributed.broadcast_int(target_id)
        target = self.ckpt.transport.checkpoint(target_id)
        skipped_ids = sorted({i for s, ids in self.batches if target["step"] < s <= step for i in ids})
        all_skipped = sorted(set(distributed.all_gather_ints(skipped_ids)))
        if self.ckpt.rank == reporter:  # the rank that saw the spike records it, with its numbers
            # strict JSON: a NaN or infinite loss or gradient norm goes as "nan", "inf", "-inf"
            data = jsonvalues.carried({**found, "loss": loss, "grad_norm": grad_norm,
                                       "rank": reporter, "lr_factor": self.lr_factor, "rollback": self.rollbacks + 1,
                                       "skipped": {"steps": [target["step"] + 1, step], "samples": all_skipped}})
            self.ckpt.transport.rollback(self.ckpt.run, target_id, step, data)
        kept = {name: self.state._adapters[name].state_dict() if name in self.state._adapters else dict(self.state.extra)
                for name in self.keep}
        self.ckpt.restore(self.state, checkpoint_id=target_id)
        for name, sd in kept.items():
            if name == "extra":
                self.state.extra.clear()
                self.state.extra.update(sd)
            else:
                self.state._adapters[name].load_state_dict(sd)
        self._exclude(all_skipped)
        self._scale_lr()
        self.loss.values.clear()
        self.grad.values.clear()
        self.batches.clear()
        self.rollbacks += 1
        self.next_step = target["step"] + 1
        incident(log, logging.WARNING, "lastgood: spike at step %s (%s); rolled back to step %s (checkpoint %s), lr x%s",
                 step, found.get("reason"), target["step"], target_id, self.lr_factor)

    def _exclude(self, ids: list[int]) -> None:
        for adapter in self.state._adapters.values():
            sampler = getattr(adapter.loader, "sampler", None)
            if isinstance(sampler, ResumableDistributedSampler):
                sampler.exclude(ids)
            elif ids:
                log.warning("lastgood: the skipped samples are recorded in the rollback event, but this "
                            "loader's sampler cannot exclude them from later epochs")

    def _scale_lr(self) -> None:
        import torch

        for obj in self.state.components.values():
            if isinstance(obj, torch.optim.Optimizer):
                for g in obj.param_groups:
                    g["lr"] = g["lr"] * self.lr_factor
                    if "initial_lr" in g:
                        g["initial_lr"] = g["initial_lr"] * self.lr_factor
            base = getattr(obj, "base_lrs", None)
            if isinstance(base, list):  # an LR scheduler: it recomputes lr from base_lrs
                obj.base_lrs = [b * self.lr_factor for b in base]
