"""Data loaders in TrainState: the cursor of what the loop consumed, and the RNG draw trap.

1. The cursor must count the batches the training loop took, not the ones workers
   prefetched. torchdata's StatefulDataLoader does this itself. For a plain DataLoader,
   lastgood counts the batches its iterator hands to the loop and keeps the position in
   a `ResumableDistributedSampler`.

2. Every DataLoader iterator draws its worker base seed from the *global* torch RNG when
   it is created (`_BaseDataLoaderIter.__init__`), even when StatefulDataLoader then
   replaces that seed with the saved one. In an uninterrupted run that draw happened at
   the start of the epoch, before the checkpoint; in a resumed run the first iterator is
   created after the restore, so the draw would happen twice and every later dropout mask
   would differ. lastgood restores loaders first and RNGs last, and makes the first
   iterator created after a restore leave the global generators as it found them.
"""

from __future__ import annotations

import warnings

from torch.utils.data import DataLoader

from lastgood.state import rng
from lastgood.errors import LastgoodError
from lastgood.state.sampler import ResumableDistributedSampler

try:  # optional: torchdata
    from torchdata.stateful_dataloader import StatefulDataLoader
except ImportError:  # pragma: no cover - exercised only without torchdata
    StatefulDataLoader = None  # type: ignore[assignment,misc]


def is_loader(obj) -> bool:
    return isinstance(obj, DataLoader)


def _rng_neutral_first_iterator(loader: DataLoader) -> None:
    """Make the loader's next `_get_iterator()` call leave every global RNG untouched,
    then put back whatever `_get_iterator` was before (an adapter's wrapper, or none)."""
    if getattr(type(loader), "_get_iterator", None) is None:
        warnings.warn("this DataLoader has no _get_iterator; a resumed run may draw one extra "
                      "random number and lose bit-exactness", stacklevel=3)
        return
    previous = loader.__dict__.get("_get_iterator")
    current = loader._get_iterator

    def once():
        if previous is None:
            del loader._get_iterator
        else:
            loader._get_iterator = previous
        saved = rng.capture()
        try:
            return current()
        finally:
            rng.restore(saved)

    loader._get_iterator = once


class StatefulLoaderAdapter:
    """torchdata StatefulDataLoader: its own state_dict, plus the RNG-neutral first iterator."""

    def __init__(self, loader) -> None:
        self.loader = loader

    def state_dict(self):
        return self.loader.state_dict()

    def load_state_dict(self, sd) -> None:
        self.loader.load_state_dict(sd)
        _rng_neutral_first_iterator(self.loader)


class PlainLoaderAdapter:
    """A plain DataLoader over a ResumableDistributedSampler.

    lastgood wraps each iterator the loader creates so that it counts the batches handed to
    the loop (instance attributes only; the DataLoader class is untouched). The sampler
    keeps epoch and position; the count turns into the sampler's `consumed` at save time.
    """

    def __init__(self, loader: DataLoader) -> None:
        sampler = loader.sampler
        if not isinstance(sampler, ResumableDistributedSampler):
            raise LastgoodError(
                "a plain DataLoader in TrainState needs sampler=lastgood.ResumableDistributedSampler(...) "
                "so its position can be restored; or use torchdata's StatefulDataLoader")
        if loader.batch_size is None:
            raise LastgoodError("a plain DataLoader in TrainState needs a batch_size (no custom batch_sampler)")
        self.loader = loader
        self.sampler = sampler
        self.in_pass = False  # between `iter(loader)` and its StopIteration
        self._install()

    def _install(self) -> None:
        loader, cls_get = self.loader, type(self.loader)._get_iterator

        def get_iterator():
            it = cls_get(loader)
            self._wrap(it)
            return it

        loader._get_iterator = get_iterator

    def _wrap(self, it) -> None:
        sampler, batch_size, cls_next = self.sampler, self.loader.batch_size, type(it)._next_data
        self.in_pass = True

        def next_data():
            try:
                batch = cls_next(it)
            except StopIteration:  # the end of the epoch: the loop leaves its for
                self.in_pass = False
                raise
            sampler._advance(batch_size)
            return batch

        it._next_data = next_data

    def state_dict(self):
        return {"sampler": self.sampler.state_dict(), "in_pass": self.in_pass}

    def load_state_dict(self, sd) -> None:
        self.sampler.load_state_dict(sd["sampler"])
        self.in_pass = sd.get("in_pass", True)
        # Saved inside a pass, the uninterrupted run drew the iterator's seed before the
        # save: the resumed run's first iterator must not draw again. Saved between passes
        # (or before the first), the next pass draws in both runs.
        if self.in_pass:
            _rng_neutral_first_iterator(self.loader)


def adapt(loader: DataLoader):
    if StatefulDataLoader is not None and isinstance(loader, StatefulDataLoader):
        return StatefulLoaderAdapter(loader)
    return PlainLoaderAdapter(loader)
