"""A rank's files read back at the saving world size: every file of the rank into one
buffer, concurrently, each hashed as it arrives and checked against the commit; a rank
split into several files (lastgood.state.split) is read as one StoredFile."""

from __future__ import annotations

from collections.abc import Callable

from lastgood.common.parallel import run_all
from lastgood.errors import CorruptCheckpoint, FormatError
from lastgood.state.sharding import StoredFile
from lastgood.state.split import offsets
from lastgood.state.buffers import array_from_buffer, tensor_from_buffer
from lastgood.wire.format import header_length, is_sibling, parse_header, sibling_name, sibling_tensors


def fetch_rank(transport, manifest, rank: int, main: str, alloc: Callable[[int], object]):
    """Read every file of `rank` (its first file `main`, and its siblings) concurrently into
    one buffer from `alloc(nbytes)` (a uint8 tensor), each hashed as it arrives and checked
    against the commit; returns (StoredFile, buffer). CorruptCheckpoint when a file is
    missing or its bytes are not the commit's; FormatError when the files do not agree."""
    cid = manifest.checkpoint_id
    entries = manifest.files(rank)
    first = next((f for f in entries if f.name == main), None)
    if first is None:
        raise CorruptCheckpoint(f"checkpoint {cid} has no file {main} for rank {rank}")
    siblings = sorted((f for f in entries if is_sibling(main, f.name)), key=lambda f: f.name)
    files = [first, *siblings]
    at = offsets([f.size for f in files])
    buf = alloc(at[-1])
    view = memoryview(buf.numpy()).cast("B")

    def read(i: int) -> memoryview:
        e = files[i]
        data, got = transport.read_file(cid, rank, e.name, e.size, into=view[at[i]:at[i] + e.size])
        if got != e.xxh3_128:
            raise CorruptCheckpoint(f"checkpoint {cid} (step {manifest.step}) rank {rank} file {e.name}: "
                                    f"xxh3-128 {got} does not match the committed {e.xxh3_128}")
        return data

    datas = run_all([lambda i=i: read(i) for i in range(len(files))])
    if len(files) == 1:
        _, meta = parse_header(datas[0], file_size=len(datas[0]))
        if sibling_tensors(meta):  # its tensors would be missing at restore: a KeyError, no fallback
            raise CorruptCheckpoint(f"checkpoint {cid} rank {rank}: {main} names {len(sibling_tensors(meta))} "
                                    f"further files, the checkpoint holds none")
        return StoredFile(rank, datas[0]), buf
    return SplitFile(rank, datas[0], datas[1:], main), buf


class SplitFile(StoredFile):
    """One rank's files as one StoredFile: the first file's state, every file's tensors."""

    def __init__(self, rank: int, buf, others: list, main: str) -> None:
        super().__init__(rank, buf)
        _, meta = parse_header(buf, file_size=len(buf))
        declared = sibling_tensors(meta)
        if len(declared) != len(others):
            raise CorruptCheckpoint(f"rank {rank}: {main} names {len(declared)} further files, "
                                    f"the checkpoint holds {len(others)}")
        self._where: dict[str, tuple] = {}
        for i, (names, data) in enumerate(zip(declared, others), start=1):
            tensors, _ = parse_header(data, file_size=len(data))
            if sorted(tensors) != sorted(names) or any(n in self.tensors for n in names):
                raise FormatError(f"rank {rank}: {sibling_name(main, i)} does not hold the tensors "
                                  f"{main} names for it")
            start = header_length(data)
            for n, spec in tensors.items():
                self.tensors[n] = spec
                self._where[n] = (data, start)

    def _at(self, name: str):
        return self._where.get(name, (self.buf, self.start))

    def tensor(self, name: str):
        buf, start = self._at(name)
        return tensor_from_buffer(buf, self.tensors[name], start, None, copy=False)

    def resolve(self, name: str, device, copy: bool):
        buf, start = self._at(name)
        return tensor_from_buffer(buf, self.tensors[name], start, device, copy=copy)

    def array(self, name: str):
        buf, start = self._at(name)
        return array_from_buffer(buf, self.tensors[name], start)
