"""Restore at any world size: the candidate the ranks agree on, read and verified, then
applied in place; a damaged candidate is reported and its newest usable ancestor tried.

At the saving world size a rank reads its own files (files.py) into a staging buffer; at
another world size it reads just the verified byte ranges its new shards and the
replicated state need (readplan.py), and replicated tensors written once come from the
ranks that wrote them (replicas.py). docs/recovery.md tells the whole story.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable

import numpy
import torch

from lastgood.common.joblog import incident
from lastgood.errors import (Conflict, CorruptCheckpoint, DataLoss, FailedPrecondition, FormatError, LastgoodError,
                             NotFound, NoUsableCheckpoint, ServiceError)
from lastgood.remote.reading import RESTORE_LEASE_SECONDS, ReadLease
from lastgood.restore import readplan, replicas
from lastgood.datapath.memory import MemoryReader
from lastgood.restore.files import fetch_rank
from lastgood.state import distributed
from lastgood.state.sharding import ShardIndex
from lastgood.state.staging import StagingPool, aligned_empty
from lastgood.state.trainstate import TrainState, fits
from lastgood.wire import tiers
from lastgood.wire.format import shard_file_name
from lastgood.wire.manifest import Manifest

log = logging.getLogger("lastgood")
# service answers that say a checkpoint cannot be read as committed: missing, damaged, or
# no longer COMMITTED
DAMAGED = (NotFound, DataLoss, FailedPrecondition, Conflict)


class Restorer:
    """One rank's restores, with the transport it reads through and the staging pool whose
    buffers a restore at the saving world size reads into."""

    OK, UNUSABLE, FAILED = 0, 1, 2

    def __init__(self, transport, run: str, rank: int, world_size: int, pool: Callable[[], StagingPool],
                 ddp_buckets: bool = True, agent: str | None = None) -> None:
        """`pool`: the staging pool of the writer this restore shares buffers with, asked
        for at each restore (the Checkpointer's, which a caller may share among several).
        `ddp_buckets`: DDP resumes in its saved gradient-bucket layout (state/ddp_buckets.py).
        `agent`: this node's agent (HOST:PORT), read first for a memory checkpoint."""
        self.transport, self.run, self.rank, self.world_size, self._pool_of = transport, run, rank, world_size, pool
        self.ddp_buckets = ddp_buckets
        self.agent = agent
        self._memory: set[int] = set()  # memory checkpoints met: the service cannot re-hash their bytes
        self.reads: dict | None = None  # what the last restore by ranges read (readplan.py)

    @property
    def pool(self) -> StagingPool:
        return self._pool_of()

    def restore(self, state: TrainState, checkpoint_id: int | None) -> tuple[int, int] | None:
        """(step, checkpoint id) of the checkpoint restored into `state`, or None when the
        run has none (Checkpointer.restore says how the ranks agree on every candidate)."""
        tried: list[int] = []
        cid = self._agree(lambda: checkpoint_id if checkpoint_id is not None else self._last_good_id())
        while cid > 0:
            code, result, err = self._try_fetch(cid, state)
            agreed = distributed.all_max(code)
            if code == self.OK and agreed != self.OK:
                self._give_back(state, result[3])  # fetched here, unusable elsewhere: nothing applied
            if agreed == self.OK:
                manifest, files, source, held = result
                try:
                    self._apply(state, manifest, files, source)
                finally:
                    self._give_back(state, held)
                if tried:
                    incident(log, logging.WARNING, "lastgood: restored %s step %s (checkpoint %s), the newest good "
                             "ancestor of damaged checkpoint(s) %s", self.run, manifest.step, cid, tried)
                else:
                    incident(log, logging.INFO, "lastgood: restored %s step %s (checkpoint %s)", self.run,
                             manifest.step, cid)
                return manifest.step, cid
            if agreed == self.FAILED:
                raise err or LastgoodError(f"restoring checkpoint {cid} failed on another rank; see its log")
            if err is not None:
                log.error("lastgood: checkpoint %s is unusable: %s", cid, err)
            if self.rank == 0 and cid not in self._memory:
                self._report_unusable(cid)
            if checkpoint_id is not None:
                raise err or CorruptCheckpoint(f"checkpoint {cid} is unusable on another rank")
            tried.append(cid)
            cid = self._agree(lambda: self._fallback(cid))
        if tried:
            raise NoUsableCheckpoint(f"run {self.run!r} has no usable checkpoint: {tried} and every ancestor of "
                                     f"theirs are damaged (CORRUPT); restore a checkpoint by id or start a new run")
        incident(log, logging.WARNING, "lastgood: run %r has no checkpoint at %s: starting from the beginning",
                 self.run, self.transport.base_url)
        return None

    def _agree(self, pick) -> int:
        """Rank 0 picks (0: none), everyone gets its answer; a negative value tells the
        others it failed (-2: the run has no usable checkpoint, raised alike everywhere)."""
        value, err = 0, None
        if self.rank == 0:
            try:
                value = pick() or 0
            except Exception as e:  # noqa: BLE001 - re-raised after the broadcast
                value, err = (-2 if isinstance(e, NoUsableCheckpoint) else -1), e
        value = distributed.broadcast_int(value)
        if value == -2:
            raise err or NoUsableCheckpoint(f"run {self.run!r} has no usable checkpoint; see rank 0's log")
        if value < 0:
            raise err or LastgoodError("rank 0 could not choose a checkpoint to restore; see its log")
        return value

    def _last_good_id(self) -> int:
        lg = self.transport.last_good(self.run)
        return lg["id"] if lg else 0

    def _report_unusable(self, cid: int) -> None:
        """Have the service re-verify the checkpoint: it re-hashes every file and reads every
        shard's state, marks the checkpoint CORRUPT when anything is wrong and moves
        last-good back. The client only reports; the service decides."""
        try:
            res = self.transport.verify(cid)
        except ServiceError as e:
            log.error("lastgood: verify of checkpoint %s failed: %s", cid, e)
            return
        if res.get("ok"):
            log.error("lastgood: the service found checkpoint %s intact, but this job cannot use it; "
                      "trying its ancestors", cid)

    def _fallback(self, failed: int) -> int:
        """The service's newest usable ancestor of the failed checkpoint (0: none left): the
        same rule that moves last-good back when a checkpoint turns out CORRUPT."""
        return self.transport.ancestors(failed).get("fallback_id") or 0

    def _try_fetch(self, cid: int, state: TrainState):
        try:
            return self.OK, self._fetch(cid, state), None
        except (CorruptCheckpoint, FormatError) as e:  # bytes or state that are not the commit's
            return self.UNUSABLE, None, e
        except ServiceError as e:
            # a blob or manifest gone or damaged, or no longer committed, in the service's own
            # words; a proxy's bare 404/409 says nothing about the checkpoint (no fallback on it)
            if isinstance(e, DAMAGED) and e.coded:
                return self.UNUSABLE, None, e
            return self.FAILED, None, e
        except Exception as e:  # noqa: BLE001 - agreed on with the other ranks, then raised
            return self.FAILED, None, e

    def _fetch(self, cid: int, state: TrainState) -> tuple[Manifest, list, int, list]:
        # a read lease keeps GC away from this checkpoint while its bytes are read; a restore
        # does not renew it, so it is taken for as long as a restore may take
        with ReadLease(self.transport, cid, f"{self.run}/rank{self.rank}", seconds=RESTORE_LEASE_SECONDS):
            return self._fetch_leased(cid, state)

    def _fetch_leased(self, cid: int, state: TrainState):
        """(manifest, files, source rank, staging buffers held). At the saving world size a
        rank reads its own file, into a staging buffer: restore runs between saves, when the
        pool is idle, and a buffer already touched is written at memory speed (a new one
        costs a page fault per 4 KiB). At another world size it reads just the verified
        byte ranges its new shards and the replicated state need (readplan.py); a
        checkpoint written before range digests is read whole, every rank's file: DTensor
        shards may overlap its new shards, and replicated state comes from old rank
        min(rank, old world - 1)."""
        manifest = self.transport.manifest(cid)
        old_world = manifest.world_size
        if self.transport.checkpoint(cid).get("tier") == tiers.Tier.MEMORY:
            self._memory.add(cid)
            return self._fetch_memory(manifest)
        if old_world != self.world_size:
            before = self.transport.shard_bytes, self.transport.range_requests
            planned = readplan.fetch(self.transport, state, manifest, self.rank, shard_file_name)
            if planned is not None:
                files, source, counts = planned
                # replicated tensors written once, by other ranks: found in their files (replicas.py)
                files = replicas.complete(self.transport, manifest, files, source)
                self.reads = {**counts, "bytes": self.transport.shard_bytes - before[0],
                                      "requests": self.transport.range_requests - before[1]}
                log.info("lastgood: rank %s read checkpoint %s by ranges: %s", self.rank, cid, self.reads)
                return manifest, files, source, []
        return self._fetch_whole(self.transport, manifest)

    def _fetch_whole(self, source, manifest: Manifest):
        """Whole files through `source` (the transport, or a memory checkpoint's agents):
        at the saving world size this rank's own, else every old rank's."""
        old_world = manifest.world_size
        ranks = [self.rank] if old_world == self.world_size else list(range(old_world))
        files, held = [], []
        try:
            for r in ranks:
                # every file of the rank (its first, and any it was split into: state/split.py), read
                # concurrently; at the saving world size into a staging buffer, else an uninitialised one
                alloc = (lambda n: _held(held, self.pool.acquire(n))) if len(ranks) == 1 else (
                    lambda n: aligned_empty(n))
                files.append(fetch_rank(source, manifest, r, shard_file_name(r), alloc)[0])
            # replicated tensors written once, by other ranks: found in their files (replicas.py)
            files = replicas.complete(source, manifest, files, min(self.rank, old_world - 1))
        except BaseException:
            for buf in held:
                self.pool.release(buf)
            raise
        return manifest, files, min(self.rank, old_world - 1), held

    def _fetch_memory(self, manifest: Manifest):
        """A memory checkpoint's files, each from the first agent whose copy hashes to the
        manifest's digest, own agent first (datapath/memory.py); no good copy left is
        CorruptCheckpoint, and every rank falls back to the newest good ancestor. At another
        world size every old rank's file is read whole from the agents: a memory file has
        no range digests (the service never reads its bytes), so no range plan is made."""
        reader = MemoryReader(self.transport, self.run, manifest, self.agent)
        got = self._fetch_whole(reader, manifest)
        self.reads = {"memory_copies": sorted(set(reader.sources.values()))}
        if manifest.world_size != self.world_size:
            self.reads["saved_world_size"] = manifest.world_size
        return got

    def _give_back(self, state: TrainState, held: list) -> None:
        """Return restore buffers to the staging pool, where the next save overwrites them.
        Everything restored was copied out of them, unless a component kept the tensor it
        was given (a module whose custom load keeps its input, say): then that buffer
        belongs to the component from now on and leaves the pool."""
        for buf in held:
            try:
                reuse = not state.aliases(buf)
            except Exception as e:  # noqa: BLE001 - cannot tell: do not reuse it, but free the slot
                log.warning("lastgood: could not check restored state against the download buffer: %s", e)
                reuse = False
            if not reuse:
                log.warning("lastgood: restored state may still refer to the download buffer; "
                            "it is left to the state and not reused for snapshots")
            self.pool.release(buf if reuse else None)

    def _apply(self, state: TrainState, manifest: Manifest, files: list, source: int) -> None:
        src = next(f for f in files if f.rank == source)
        changed = manifest.world_size != self.world_size
        if changed:
            incident(log, logging.WARNING, "lastgood: checkpoint %s was saved by %s ranks; restoring on %s",
                     manifest.checkpoint_id, manifest.world_size, self.world_size)

        # the optimizers' current moments and the plain modules' parameters and buffers on
        # the CPU: copied in place (copy_into), the module's own given back to its
        # load_state_dict, whose copy of a tensor onto itself is a no-op; a module tensor
        # elsewhere: copied in by load_state_dict
        targets = state.optimizer_tensors(src.state["components"])
        modules = state.module_tensors()

        def tensor(name: str, device: str | None):
            dst = targets.get(name)
            if dst is None:
                dst = modules.get(name)
            if dst is not None and fits(dst, src.tensors[name], device):
                copy_into(dst, src.resolve(name, None, copy=False))
                return dst
            # everything else is cloned: the buffer goes back to the staging pool
            return src.resolve(name, device, copy=name not in modules)

        state.apply(src.state, tensor, src.array,
                    shards=ShardIndex(files),
                    reseed=None if self.rank < manifest.world_size else _derived_seed(manifest.checkpoint_id, self.rank),
                    world_changed=changed, ddp_buckets=self.ddp_buckets)


def copy_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst[...] = src, for a verified stored tensor `src` already of dst's dtype and shape.
    Both contiguous on the CPU: one memcpy on this thread, the GIL released (numpy's
    copy), so its speed does not hang on torch's intra-op threads, which wait for each
    other on a loaded host; the process's thread setting is left as the trainer set it.
    Otherwise torch's copy_."""
    if (dst.device.type == "cpu" and src.device.type == "cpu" and dst.is_contiguous() and src.is_contiguous()
            and dst.dtype == src.dtype and dst.numel() == src.numel() and dst.numel() > 0
            and not dst.is_conj() and not dst.is_neg() and not src.is_conj() and not src.is_neg()):
        with torch.no_grad():
            out = dst.detach().reshape(-1).view(torch.uint8).numpy()
            numpy.copyto(out, src.detach().reshape(-1).view(torch.uint8).numpy())
        return
    with torch.no_grad():
        dst.copy_(src)


def _held(held: list, buf):
    held.append(buf)
    return buf


def _derived_seed(checkpoint_id: int, rank: int) -> int:
    """The RNG seed of a rank that did not exist when the checkpoint was saved: fixed by
    the checkpoint and the rank, different for every rank, the same on every restore."""
    return int.from_bytes(hashlib.sha256(f"lastgood:{checkpoint_id}:{rank}".encode()).digest()[:8], "little") >> 1
