"""ResumableDistributedSampler: DistributedSampler with a position that survives restarts.

Same order as torch's DistributedSampler for the same seed and epoch (a permutation of the
dataset from `seed + epoch`, padded to a multiple of the world size, dealt round-robin).
It also keeps how many samples of the epoch this rank's loop has consumed (counted by
lastgood as batches reach the loop, never as workers prefetch them), so a restored run
resumes mid-epoch at the exact next sample. `set_epoch` works as usual: calling it with
the restored epoch keeps the restored position; any other epoch starts at its beginning.
"""

from __future__ import annotations

import math

import torch
from torch.utils.data import Sampler

from lastgood.state.distributed import rank_world
from lastgood.errors import LastgoodError


class ResumableDistributedSampler(Sampler[int]):
    def __init__(self, dataset, num_replicas: int | None = None, rank: int | None = None,
                 shuffle: bool = True, seed: int = 0, drop_last: bool = False) -> None:
        rk, ws = rank_world()
        self.num_replicas = ws if num_replicas is None else num_replicas
        self.rank = rk if rank is None else rank
        if not 0 <= self.rank < self.num_replicas:
            raise ValueError(f"rank {self.rank} outside [0, {self.num_replicas})")
        self.dataset_len = len(dataset)
        self.shuffle, self.seed, self.drop_last = shuffle, seed, drop_last
        self.num_samples = self._num_samples(self.dataset_len)
        self.total_size = self.num_samples * self.num_replicas
        self.epoch = 0
        self._start = 0        # where the next iteration of this epoch begins
        self._consumed = 0     # samples of this epoch the loop has taken
        self._base = 0         # global position at which this epoch's order was dealt out (resharding)
        self._excluded: set[int] = set()  # never fed again, from epoch `_excluded_from` on
        self._excluded_from = 0

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self.epoch = epoch
            self._start = self._consumed = self._base = 0

    def exclude(self, indices) -> None:
        """Never yield these dataset indices again, from the next epoch on (the current
        epoch's order must not shift under the cursor; the loss-spike guard excludes the
        batches it skipped, which lie behind the cursor anyway)."""
        self._excluded |= {int(i) for i in indices}
        self._excluded_from = self.epoch + 1

    def _num_samples(self, n: int) -> int:
        if self.drop_last and n % self.num_replicas:
            return math.ceil((n - self.num_replicas) / self.num_replicas)
        return math.ceil(n / self.num_replicas)

    def _indices(self) -> list[int]:
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.dataset_len, generator=g).tolist()
        else:
            order = list(range(self.dataset_len))
        if self._excluded and self.epoch >= self._excluded_from:
            order = [i for i in order if i not in self._excluded]
        order = order[self._base:]  # after a restore at another world size: what is left, dealt anew
        self.num_samples = self._num_samples(len(order))
        self.total_size = self.num_samples * self.num_replicas
        if self.drop_last:
            order = order[: self.total_size]
        elif len(order) < self.total_size:
            pad = self.total_size - len(order)
            order += (order * math.ceil(pad / len(order)))[:pad]
        return order[self.rank: self.total_size: self.num_replicas]

    def __iter__(self):
        # A new pass over the epoch starts here (DataLoader calls this lazily, at the
        # first batch, or up front when workers prefetch): the restored position applies
        # to this pass only.
        start, self._start = self._start, 0
        self._consumed = start
        return iter(self._indices()[start:])

    def __len__(self) -> int:
        return self.num_samples

    # called by lastgood's loader adapter as each batch reaches the loop -------------
    def _advance(self, n: int) -> None:
        self._consumed = min(self._consumed + n, self.num_samples)

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "consumed": self._consumed, "num_replicas": self.num_replicas,
                "rank": self.rank, "seed": self.seed, "shuffle": self.shuffle, "drop_last": self.drop_last,
                "dataset_len": self.dataset_len,
                # position in the epoch's global order, independent of the world size
                "global_position": self._base + self._consumed * self.num_replicas, "base": self._base,
                "excluded": sorted(self._excluded), "excluded_from": self._excluded_from}

    def load_state_dict(self, sd: dict) -> None:
        for key in ("seed", "shuffle", "drop_last", "dataset_len"):
            if sd[key] != getattr(self, key):
                raise LastgoodError(f"sampler {key} was {sd[key]!r} at save time and is {getattr(self, key)!r} now")
        self.epoch = sd["epoch"]
        if sd["num_replicas"] == self.num_replicas:
            self._base = sd.get("base", 0)
            self._start = self._consumed = sd["consumed"]
        else:
            # Another world size: the epoch goes on from its global position; the samples
            # not yet taken are dealt round-robin to the new ranks, none repeated or skipped.
            self._base = sd["global_position"]
            self._start = self._consumed = 0
        self._excluded = set(sd.get("excluded", ()))
        self._excluded_from = sd.get("excluded_from", 0)
