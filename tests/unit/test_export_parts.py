"""The export's parts that no round trip reaches on its own: dtype conversion in NumPy bit
for bit against torch, the sizes --max-shard-size takes, Hugging Face's file split, and
the coverage check and assembly of tensors sharded in ways FSDP2 does not (2-D blocks,
gaps, overlaps)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from lastgood.errors import CorruptCheckpoint
from lastgood.export.convert import convert
from lastgood.export.hf import Item, blocks, check_coverage, shard_size, split
from lastgood.export.source import Collector, Piece, Tensor

torch = pytest.importorskip("torch")

ST = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def awkward() -> torch.Tensor:
    """Ties, subnormals, overflow, infinities, NaNs, signed zeros and plain values."""
    special = [0.0, -0.0, 1.0, -1.0, math.inf, -math.inf, math.nan, 65504.0, 65520.0, 1e-8, 6e-8, 1e-40, 3e38,
               3.4e38, 1 + 2**-8, 1 + 3 * 2**-9, 1 + 2**-9, -(1 + 2**-9), 2**-126, 2**-133, 1e300, -1e-300]
    g = torch.Generator().manual_seed(0)
    return torch.cat([torch.tensor(special, dtype=torch.float64), torch.randn(4000, generator=g, dtype=torch.float64)
                      * torch.logspace(-30, 30, 4000, dtype=torch.float64)])


@pytest.mark.parametrize("src", list(ST))
@pytest.mark.parametrize("dst", list(ST))
def test_conversion_matches_torch_bit_for_bit(src, dst):
    x = awkward().to(ST[src])
    raw = x.contiguous().view(torch.uint8).numpy().tobytes()
    got = np.frombuffer(bytes(memoryview(convert(raw, src, dst)).cast("B")), dtype=np.uint8)
    want = x.to(ST[dst]).view(torch.uint8).numpy()
    nan = x.to(ST[dst]).isnan().numpy()
    size = want.size // x.numel()
    g, w = got.reshape(-1, size), want.reshape(-1, size)
    assert np.array_equal(g[~nan], w[~nan])
    back = torch.from_numpy(g.copy().reshape(-1)).view(ST[dst])
    assert bool(back[torch.from_numpy(nan)].isnan().all())


def test_sizes():
    assert shard_size("5GB") == 5 * 10**9 and shard_size("500MiB") == 500 * 2**20
    assert shard_size("1000") == 1000 and shard_size(" 1.5 kb ") == 1500 and shard_size(7) == 7
    for bad in ("", "GB", "5 parsecs", "-1GB", "0", 0, "1e9"):
        with pytest.raises(ValueError):
            shard_size(bad)


def _item(name: str, nbytes: int) -> Item:
    return Item(name, Tensor(name, "U8", (nbytes,), False), "U8")


def test_split_fills_files_in_order_and_gives_a_large_tensor_its_own():
    files = split([_item("a", 40), _item("b", 50), _item("c", 200), _item("d", 10), _item("e", 95)], 100)
    assert [[it.name for it in f] for f in files] == [["a", "b"], ["c"], ["d"], ["e"]]
    assert [[it.name for it in f] for f in split([_item("a", 40), _item("b", 60)], 100)] == [["a", "b"]]


def _sharded(shape, boxes) -> Tensor:
    t = Tensor("w", "F32", shape, True)
    for offset, local in boxes:
        t.pieces.append(Piece(offset, local, 0))
        t.covered += math.prod(local)
    return t


def test_coverage_refuses_gaps_and_overlaps():
    check_coverage(_sharded((5, 3), [((3, 0), (2, 3)), ((0, 0), (3, 3))]))  # dim-0 blocks, any order
    check_coverage(_sharded((4, 6), [((0, 0), (2, 3)), ((0, 3), (2, 3)), ((2, 0), (2, 3)), ((2, 3), (2, 3))]))
    with pytest.raises(CorruptCheckpoint, match=r"leave rows 2..2 of \[5, 3\] uncovered"):
        check_coverage(_sharded((5, 3), [((0, 0), (2, 3)), ((3, 0), (2, 3))]))
    with pytest.raises(CorruptCheckpoint, match=r"cover rows 0..2 of \[5, 3\]"):
        check_coverage(_sharded((5, 3), [((0, 0), (3, 3))]))
    with pytest.raises(CorruptCheckpoint, match="overlap at row 2"):
        check_coverage(_sharded((5, 3), [((0, 0), (3, 3)), ((2, 0), (3, 3))]))
    with pytest.raises(CorruptCheckpoint, match="overlap"):
        check_coverage(_sharded((4, 6), [((0, 0), (4, 4)), ((0, 3), (4, 3))]))
    with pytest.raises(CorruptCheckpoint, match="cover 18 of 24 elements"):
        check_coverage(_sharded((4, 6), [((0, 0), (4, 3)), ((0, 3), (2, 3))]))


@pytest.mark.parametrize("dst", ["F32", "BF16"])
def test_assembly_of_dim0_blocks_and_of_2d_blocks(tmp_path, dst):
    full = torch.randn(6, 10, generator=torch.Generator().manual_seed(1))
    src = Collector("model.", str(tmp_path / "scratch"))
    try:
        for name, boxes in (("rows", [((4, 0), (2, 10)), ((0, 0), (4, 10))]),
                            ("grid", [((0, 0), (3, 4)), ((0, 4), (3, 6)), ((3, 0), (3, 4)), ((3, 4), (3, 6))])):
            t = Tensor(name, "F32", (6, 10), True)
            for offset, local in boxes:
                block = full[offset[0]:offset[0] + local[0], offset[1]:offset[1] + local[1]].contiguous()
                data = block.view(torch.uint8).numpy().tobytes()
                t.pieces.append(Piece(offset, local, src._end))
                src._end += len(data)
                src._pwrite(memoryview(data), t.pieces[-1].pos)
                t.covered += block.numel()
            check_coverage(t)
            out = b"".join(bytes(memoryview(b).cast("B")) for b in blocks(Item(name, t, dst), src))
            want = full.to(ST[dst]).view(torch.uint8).numpy().tobytes()
            assert out == want, name
    finally:
        src.close()
