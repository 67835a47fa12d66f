"""The stored shards that fill a live DTensor's local shard must cover it exactly once
(sharding.ShardIndex.read_items, used by fill and by the read plan). HSDP stores each
shard once per replica: identical chunks in several files are one chunk, not a double
count (which made every HSDP restore at another world size CorruptCheckpoint); and two
chunks that overlap must not stand in for a region none holds."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from lastgood.state.codec import ShardRef
from lastgood.errors import CorruptCheckpoint
from lastgood.state.sharding import ShardIndex


class Stored(SimpleNamespace):
    """A stored file as ShardIndex sees it: its state and tensors, and its pieces (all `value`)."""

    def __init__(self, value: float, rows: tuple[int, int]) -> None:
        a, b = rows
        super().__init__(value=value, tensors={"w": {"shape": [b - a, 4]}},
                         state={"components": {"m": {"w": {"__dtensor__": "w", "shape": [32, 4], "offset": [a, 0]}}}})

    def piece(self, name, offsets, lengths):
        return torch.full(tuple(int(n) for n in lengths), self.value)


@pytest.fixture(scope="module")
def live():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield lambda: distribute_tensor(torch.zeros(32, 4), init_device_mesh("cpu", (1,)), [Shard(0)])
    finally:
        dist.destroy_process_group()


REF = ShardRef("w", (32, 4), (0, 0))


def test_hsdp_replicas_of_a_shard_count_once(live):
    target = live()
    index = ShardIndex([Stored(1.0, (0, 16)), Stored(2.0, (16, 32)), Stored(3.0, (0, 16))])  # 3: a replica of 1
    assert len(index.read_items(REF, target)) == 2
    index.fill(REF, target)
    local = target.to_local()
    assert torch.equal(local[:16], torch.full((16, 4), 1.0)) and torch.equal(local[16:], torch.full((16, 4), 2.0))


def test_overlapping_chunks_do_not_mask_a_missing_region(live):
    """Rows 0-16 and 8-24 hold 128 elements, as many as the local shard, but none holds 24-32."""
    with pytest.raises(CorruptCheckpoint, match="cover"):
        ShardIndex([Stored(1.0, (0, 16)), Stored(2.0, (8, 24))]).fill(REF, live())
    with pytest.raises(CorruptCheckpoint, match="cover"):  # the control: a plain gap
        ShardIndex([Stored(1.0, (0, 16))]).fill(REF, live())
