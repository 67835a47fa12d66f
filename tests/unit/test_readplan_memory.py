"""A resharding restore keeps exactly the bytes of what it planned (lastgood/restore/readplan.py):
ranges read as one request are copied out of the request's buffer, which is then freed,
so a rank never holds a whole old file when its pieces are smaller than a block."""

from __future__ import annotations

import json

import torch
from safetensors.torch import save

from lastgood.wire.format import META_STATE, header_length, parse_header, tensor_index
from lastgood.wire.hashing import hash_bytes
from lastgood.wire.manifest import FileEntry
from lastgood.wire.ranges import RangeHasher
from lastgood.restore.readplan import RangedFile, RangeReader

BLOCK = 4096


class Bytes:
    """read_range over a file held in memory (the bytes the service would send)."""

    def __init__(self, data: bytes) -> None:
        self.data, self.requested = data, []

    def read_range(self, checkpoint_id, rank, file_name, offset, into) -> None:
        view = memoryview(into).cast("B")
        view[:] = self.data[offset:offset + view.nbytes]
        self.requested.append(view.nbytes)


def stored_file(rows: int) -> tuple[bytes, FileEntry]:
    tensors = {f"t{i}": torch.full((rows, 16), float(i)) for i in range(64)}  # 64 x rows x 64 B
    data = save(tensors, metadata={META_STATE: json.dumps({"components": {}})})
    start = header_length(data)
    index = tensor_index(parse_header(data[:start])[0])
    h = RangeHasher(start, index, BLOCK)
    h.update(data)
    return data, FileEntry("f", len(data), hash_bytes(data), data_start=start, tensors=index, digests=h.digests())


def held(tensors) -> int:
    """Bytes of the distinct buffers these tensors keep alive."""
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())


def test_pieces_smaller_than_a_block_are_kept_without_the_rest_of_the_file():
    data, entry = stored_file(rows=32)  # 2 KiB tensors: 2 per block, every file range touches the next
    transport = Bytes(data)
    f = RangedFile(0, entry, RangeReader(transport, 1, window=64 * 1024))
    planned = sum(f.want_piece(f"t{i}", [0, 0], [1, 16]) for i in range(64))  # one row of each tensor
    f.read_planned()
    pieces = [f.piece(f"t{i}", (0, 0), (1, 16)) for i in range(64)]
    assert all(torch.equal(p, torch.full((1, 16), float(i))) for i, p in enumerate(pieces))
    assert held(pieces) == planned == 64 * 64  # not the ~128 KiB of the file's data
    assert max(transport.requested) <= 64 * 1024  # no request beyond one window


def test_adjacent_whole_tensors_are_kept_as_read_without_a_copy():
    """A request every byte of which is kept (whole stored shards side by side, as at
    8 -> 4) is kept as it was read: one buffer per request, of exactly the planned bytes."""
    data, entry = stored_file(rows=32)
    transport = Bytes(data)
    f = RangedFile(0, entry, RangeReader(transport, 1, window=64 * 1024))
    planned = f.want_whole([f"t{i}" for i in range(64)])
    f.read_planned()
    kept = [f.resolve(f"t{i}", None, copy=False) for i in range(64)]
    assert all(torch.equal(t, torch.full((32, 16), float(i))) for i, t in enumerate(kept))
    assert held(kept) == planned == 64 * 2048 and len(transport.requested) == 1 + 2  # the header, two windows


def test_a_files_header_must_hold_no_chunk_the_root_does_not_name():
    """The root's `chunks` choose which old files a rank opens (a superset is safe: one more
    file opened; one it does not name may be skipped). So a kept file's header must hold no
    chunk its root entry leaves out; the root may name more (another walk rule, a replica)."""
    import pytest

    from lastgood.errors import CorruptCheckpoint
    from lastgood.wire.manifest import index_bytes, index_ref
    from lastgood.restore.readplan import _open

    state = {"components": {"m": {"w": {"__dtensor__": "w", "shape": [32, 4], "offset": [8, 0]}}}}
    data = save({"w": torch.ones(8, 4)}, metadata={META_STATE: json.dumps(state)})
    start = header_length(data)
    index = tensor_index(parse_header(data[:start])[0])
    h = RangeHasher(start, index, BLOCK)
    h.update(data)
    body = index_bytes(0, "f", start, index, h.digests())

    class Store(Bytes):
        def index_bytes(self, checkpoint_id, rank, name) -> bytes:
            return body

    def opened(chunks):
        entry = FileEntry("f", len(data), hash_bytes(data), index=index_ref(body, 1, chunks))
        return _open(Store(data), 0, entry, RangeReader(Store(data), 1))

    assert opened({"32,4": [[[8, 0], [8, 4]]]}).state == state  # as the service writes it
    assert opened({"32,4": [[[0, 0], [8, 4]], [[8, 0], [8, 4]]], "7": [[[0], [7]]]}).state == state  # more
    for short in ({"32,4": [[[0, 0], [8, 4]]]}, {}, {"32,4": []}):
        with pytest.raises(CorruptCheckpoint, match="not where the root says"):
            opened(short)


def test_a_rank_split_into_files_is_opened_as_one_and_its_declared_shapes_are_checked():
    """A split rank (state/split.py) at another world size: its first file and its further
    file opened together (readplan.RangedRank), each range read from the file holding the
    tensor. The root's summary comes from the shapes the first file declares for the
    further files (layout.of_header); a shape that lied leaves a shard outside the summary,
    which the check on the whole rank refuses. A further file holding other tensors than
    the first names is refused too."""
    import pytest

    from lastgood.errors import CorruptCheckpoint, FormatError
    from lastgood.wire.format import META_FILE_SHAPES, META_FILES
    from lastgood.wire.layout import of_header
    from lastgood.wire.manifest import index_bytes, index_ref
    from lastgood.restore.readplan import RangedRank, _open

    state = {"components": {"m": {"w": {"__dtensor__": "w", "shape": [32, 4], "offset": [8, 0]},
                                  "v": {"__dtensor__": "v", "shape": [16], "offset": [8]}}}}

    def rank(declared: list, further: dict):
        meta = {META_STATE: json.dumps(state), META_FILES: json.dumps([["v"]]), META_FILE_SHAPES: json.dumps(declared)}
        datas = {"rank00000.safetensors": save({"w": torch.ones(8, 4)}, metadata=meta),
                 "rank00000-001.safetensors": save(further)}
        bodies, entries = {}, []
        for name, data in datas.items():
            start = header_length(data)
            tensors, m = parse_header(data[:start])
            h = RangeHasher(start, tensor_index(tensors), BLOCK)
            h.update(data)
            bodies[name] = index_bytes(0, name, start, tensor_index(tensors), h.digests())
            chunks = of_header(m, tensors) if name == "rank00000.safetensors" else {}
            entries.append(FileEntry(name, len(data), hash_bytes(data), index=index_ref(bodies[name], 1, chunks)))

        class Store:
            def read_range(self, checkpoint_id, r, file_name, offset, into) -> None:
                view = memoryview(into).cast("B")
                view[:] = datas[file_name][offset:offset + view.nbytes]

            def index_bytes(self, checkpoint_id, r, name) -> bytes:
                return bodies[name]

        class Listed:
            def files(self, r):
                return entries

        return _open(Store(), 0, entries[0], RangeReader(Store(), 1), Listed())

    f = rank([[[8]]], {"v": torch.arange(8.0)})
    assert isinstance(f, RangedRank) and sorted(f.tensors) == ["v", "w"] and f.state == state
    f.want_piece("v", [0], [8])
    f.want_whole(["w"])
    f.read_planned()
    assert torch.equal(f.piece("v", (0,), (8,)), torch.arange(8.0))
    assert torch.equal(f.resolve("w", None, copy=True), torch.ones(8, 4))
    with pytest.raises(CorruptCheckpoint, match="not where the root says"):
        rank([[[4]]], {"v": torch.arange(8.0)})  # declared 4 rows, holds 8
    with pytest.raises(FormatError, match="does not hold the tensors"):
        rank([[[8]]], {"u": torch.arange(8.0)})
