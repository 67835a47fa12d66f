"""The memory tier's data path (docs/memory-tier.md): a rank's files written into its own
node agent's segment, and a memory checkpoint's files read back from the agents that hold
verified copies. torch-free.

Writing (`MemoryPath.write`): room is reserved in the agent's segment for all the rank's
files, each file is written there from the staging buffer, hashed (xxh3-128) in the same
pass, and the agent is told it is ready; the agent hashes and replicates in the
background, so the rank never waits on a partner. What comes back is the vote's
declaration: (name, size, xxh3-128) of every file, the rank's own digests.

Reading (`MemoryReader`): stands in for the transport in a restore's `fetch_rank`
(restore/files.py): each file from the copies the service lists, the own agent first,
then partners, through `agents.read_verified`; no good copy left is CorruptCheckpoint, and
the restorer falls back to the newest good ancestor on every rank alike.
"""

from __future__ import annotations

import os

from lastgood.common.durable import open_for_overwrite, write_all
from lastgood.datapath import agents
from lastgood.datapath.agents import AgentClient, AgentRefused, read_verified
from lastgood.errors import CorruptCheckpoint
from lastgood.wire import tiers
from lastgood.wire.hashing import StreamHasher

PIECE = 8 << 20  # written and hashed piece by piece, while it is in the CPU's cache


class MemoryPath:
    """One rank's writes into its node agent's shared memory."""

    name = "memory"
    tier = tiers.Tier.MEMORY

    def __init__(self, agent: str, replicas: int = tiers.DEFAULT_REPLICAS, timeout: float = 30.0) -> None:
        self.agent = AgentClient(agent, timeout)
        self.replicas = replicas

    def write(self, run: str, checkpoint_id: int, rank: int, files: list[tuple[str, object]]) -> list[tuple[str, int, str]]:
        """Write `files` ((name, bytes-like)) into the agent's segment and make them ready:
        the vote's (name, size, xxh3-128) of each. AgentRefused when the agent is away or
        refuses (budget: 507; too few partners: 409)."""
        views = [(n, memoryview(d).cast("B")) for n, d in files]
        directory = self.agent.reserve(run, checkpoint_id, rank, sum(v.nbytes for _, v in views),
                                       [(n, v.nbytes) for n, v in views])
        declared = []
        for name, view in views:
            hasher = StreamHasher()
            try:
                # a file the agent recycled is overwritten in place: its pages are kept
                with open_for_overwrite(os.path.join(directory, name)) as f:
                    for at in range(0, view.nbytes, PIECE):
                        piece = view[at:at + PIECE]
                        hasher.update(piece)
                        write_all(f.fileno(), piece)  # in the page cache's fast pieces (common/durable.py)
                    f.truncate(view.nbytes)
            except OSError as e:  # the segment is not writable from here: the memory save is given up
                raise AgentRefused(0, f"writing {name} into {directory}: {e}") from None
            declared.append((name, view.nbytes, hasher.hexdigest()))
        self.agent.ready(run, checkpoint_id, rank, [n for n, _ in views], self.replicas)
        return declared

    def replication_failed(self, run: str, checkpoint_id: int, rank: int, timeout: float) -> str | None:
        """Why the agent's replication of these files failed (a partner unreachable), or None
        while it is queued, done, or the agent does not say within `timeout`."""
        got = self.agent.replication(run, checkpoint_id, rank, timeout)
        if got and got.get("state") == "failed":
            return f"the copy to partner {got.get('partner')} failed: {got.get('detail')}"
        return None


def copy_order(copies: dict, own: str | None) -> dict[tuple[int, str], list[str]]:
    """(rank, file) -> the addresses of its verified copies (GET .../copies), own agent first."""
    out = {}
    for entry in copies.get("copies", []):
        addresses = [a["address"] for a in entry.get("agents", [])]
        addresses.sort(key=lambda a: a != own)  # stable: the service's order after the own agent
        out[(int(entry["rank"]), entry["file"])] = addresses
    return out


class MemoryReader:
    """A memory checkpoint's files for restore/files.fetch_rank, from the agents' copies."""

    def __init__(self, transport, run: str, manifest, own_agent: str | None) -> None:
        self.run, self.manifest, self.own = run, manifest, own_agent
        self.order = copy_order(transport.copies(manifest.checkpoint_id), own_agent)
        self.sources: dict[tuple[int, str], str] = {}  # (rank, file) -> the copy read

    def read_file(self, checkpoint_id: int, rank: int, file_name: str, size: int, into=None):
        entry = next((f for f in self.manifest.files(rank) if f.name == file_name), None)
        if entry is None:
            raise CorruptCheckpoint(f"checkpoint {checkpoint_id} has no file {file_name} for rank {rank}")
        data, source = read_verified(self.order.get((rank, file_name), []), self.run, checkpoint_id, rank,
                                     file_name, size, entry.xxh3_128, into=into, local=self.own)
        self.sources[(rank, file_name)] = source
        return memoryview(data), entry.xxh3_128

    def read_range(self, checkpoint_id: int, rank: int, file_name: str, offset: int, into) -> None:
        """Bytes the caller verifies by their range digests (restore/replicas.py), from the
        first copy that answers."""
        view = memoryview(into).cast("B")
        tried = []
        for address in self.order.get((rank, file_name), []):
            try:
                agents.read_range(address, self.run, checkpoint_id, rank, file_name, offset, view.nbytes, into=view)
                return
            except (OSError, LookupError, ValueError) as e:
                tried.append(f"{address}: {e}")
        raise CorruptCheckpoint(f"no copy of {self.run}/{checkpoint_id}/{rank}/{file_name} answered: {tried}")
