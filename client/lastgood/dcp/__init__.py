"""`torch.distributed.checkpoint` through lastgood's two-phase commit.

    import torch.distributed.checkpoint as dcp
    from lastgood import dcp as lgdcp

    dcp.save(state_dict, storage_writer=lgdcp.StorageWriter(url, run="gpt"), checkpoint_id="1000",
             planner=lgdcp.SavePlanner())
    dcp.load(state_dict, storage_reader=lgdcp.StorageReader(url, run="gpt"), planner=lgdcp.LoadPlanner())

(`checkpoint_id` of a save is its step; of a load, a lastgood checkpoint id, or nothing for
the run's last-good; `dcp.async_save` works the same.)

How DCP's protocol maps onto the commit (the Checkpointer's save session, lastgood.commit): the
coordinator picks the checkpoint's attempt and parent in `prepare_global_plan` and hands
them to every rank inside the plans; in `write_data` each rank writes its items as one
safetensors file (into the service's spool on its host, else streamed), then begins the
checkpoint (idempotent on run, step and attempt, so every rank gets the same one) and,
unless it is the coordinator, votes; the coordinator's `finish()` uploads DCP's metadata,
votes last and returns only when the checkpoint is COMMITTED. The file is written before
begin, as the Checkpointer does, so a long write never runs into the checkpoint's lease.
A failure aborts the checkpoint, so nothing partial becomes visible, unless the failure
was a lost reply of a checkpoint that did commit; a rank that dies leaves it to expire.

No pickle: DCP's metadata is stored as JSON, and DCP's default planners pickle
non-tensor values (`torch.save` on write, an unrestricted torch load on read), so lastgood ships
a save planner that stores them as typed JSON instead, and the writer refuses pickled
bytes. The reader decodes the JSON itself and places each value as DCP's default
`load_bytes` would (`_load_value`), so any planner that keeps that method works: DCP's
default, and the ones torch's helpers build (`dcp_to_torch_save`'s, `load_sharded_optimizer_state_dict`'s);
`LoadPlanner` is DCP's default planner with that spelled out.

The writer is picklable and opens its connection lazily (DCP's process-based async mode
pickles it).

`lastgood.dcp.stock` reads a stock DCP directory without running its pickled `.metadata`
and imports it into a run (`lastgood import-dcp`); `lastgood export --format dcp` writes
one from any checkpoint (lastgood.export). docs/dcp.md has both.
"""

from __future__ import annotations

import dataclasses
import io
import json
import logging
import secrets
import torch
import torch.distributed.checkpoint as dcp
from torch.futures import Future
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, SavePlan, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from lastgood.wire import names
from lastgood.state.codec import Encoder, UnsupportedValue
from lastgood.remote.config import ENV_URL, ClientConfig
from lastgood.errors import CorruptCheckpoint, FormatError, LastgoodError
from lastgood.wire.format import META_STATE, header_length, parse_header, shard_file_name
from lastgood.state.staging import StagingPool, snapshot
from lastgood.state.buffers import tensor_from_buffer
from lastgood.state.dcp_metadata import (MAGIC, METADATA_FILE, metadata_from_json, metadata_to_json,
                                        value_from_json)

log = logging.getLogger("lastgood")
# a coordinator's shard up to this size is sent in finish(), beside DCP's metadata; a larger one
# at once in write_data(), so that its upload overlaps the other ranks' writes
SEND_WITH_METADATA = 1 << 20


# ---------------------------------------------------------------------- planners
def _json_bytes(obj, fqn: str) -> io.BytesIO:
    enc = Encoder()
    doc = enc.encode(obj, [fqn])
    if enc.tensors:
        raise UnsupportedValue(f"{fqn}: a non-tensor value that holds tensors; give DCP the tensors as entries")
    return io.BytesIO(MAGIC + json.dumps(doc, allow_nan=False).encode())


def _from_json_bytes(raw: bytes, fqn: str):
    if not raw.startswith(MAGIC):
        raise FormatError(f"{fqn}: not lastgood JSON; refusing to unpickle it")
    return value_from_json(raw[len(MAGIC):].decode())


class SavePlanner(DefaultSavePlanner):
    """DCP's default planner, with non-tensor values stored as typed JSON, not pickles."""

    def transform_object(self, write_item, object):
        if write_item.type == WriteItemType.BYTE_IO:
            return _json_bytes(object, write_item.index.fqn)
        return object


def _place(planner: DefaultLoadPlanner, read_item, obj) -> None:
    """A value into the planner's state dict, where DefaultLoadPlanner.load_bytes puts it."""
    if planner.flatten_state_dict:
        set_element(planner.original_state_dict, planner.mappings[read_item.dest_index.fqn], obj)
    else:
        planner.state_dict[read_item.dest_index.fqn] = obj


class LoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, reading non-tensor values from typed JSON."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        _place(self, read_item, _from_json_bytes(value.read(), read_item.dest_index.fqn))


def _load_value(planner, read_item, text: str) -> None:
    """A stored value (typed JSON) handed to the load's planner. Planners that keep
    DefaultLoadPlanner's load_bytes (DCP's default, and those torch's helpers build:
    `_EmptyStateDictLoadPlanner` in dcp_to_torch_save, `_ReaderWithOffset` in
    load_sharded_optimizer_state_dict) get it placed as that method would place it, never
    through its torch.load; lastgood's LoadPlanner reads it itself; any other load_bytes,
    which would expect a pickle, is refused."""
    if isinstance(planner, LoadPlanner):
        planner.load_bytes(read_item, io.BytesIO(MAGIC + text.encode()))
    elif isinstance(planner, DefaultLoadPlanner) and type(planner).load_bytes is DefaultLoadPlanner.load_bytes:
        _place(planner, read_item, value_from_json(text))
    else:
        raise LastgoodError(f"{read_item.dest_index.fqn}: non-tensor values are stored as JSON, and "
                            f"{type(planner).__name__}.load_bytes expects a pickle; load with DCP's default "
                            f"planner or planner=lastgood.dcp.LoadPlanner()")


# ---------------------------------------------------------------------- writer
def _digits(value, what: str) -> int:
    text = str(value)
    if not text.isdigit():
        raise LastgoodError(f"{what} (digits), not {text!r}")
    return int(text)


class _Connected:
    """Lazy connection, dropped when pickled (DCP's process-based async_save)."""

    def __init__(self, url: str | None, run: str | None, token: str | None) -> None:
        self.config = cfg = ClientConfig.resolve(url=url, run=run, token=token)
        if not cfg.url:
            raise LastgoodError(f"no service URL: pass url= or set {ENV_URL}")
        self.url, self.token = cfg.url, cfg.token
        self.run = names.check_run_name(cfg.run or "")
        self._transport = None

    @property
    def transport(self):
        if self._transport is None:
            from lastgood.datapath.transport import Transport

            cfg = self.config
            self._transport = Transport(cfg.url, token=cfg.token, config=cfg)
        return self._transport

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_transport"] = None
        return state


class StorageWriter(_Connected, dcp.StorageWriter):
    def __init__(self, url: str | None = None, run: str | None = None, step: int | None = None, *,
                 parent_id: int | None = None, token: str | None = None) -> None:
        _Connected.__init__(self, url, run, token)
        self.step, self.parent_id = step, parent_id
        self.is_coordinator, self.rank = False, 0
        self.checkpoint_id: int | None = None
        self._session = None  # commit/session.py: made with the connection
        self._upload = None   # this rank's part in the checkpoint being saved

    @property
    def session(self):
        """The commit protocol's client side, the Checkpointer's own (commit/session.py)."""
        if self._session is None:
            from lastgood.commit.session import SaveSession

            t = self.transport
            self._session = SaveSession(t, self.run, self.rank,
                                        commit_timeout=t.info.commit_timeout)
        return self._session

    def __getstate__(self):
        state = super().__getstate__()
        state["_session"] = state["_upload"] = None  # they hold the connection
        return state

    def reset(self, checkpoint_id=None) -> None:
        if checkpoint_id is not None:
            self.step = _digits(checkpoint_id, "a lastgood DCP save's checkpoint_id is its step")
        self.checkpoint_id = None
        self._upload = None

    def set_up_storage_writer(self, is_coordinator: bool, *args, **kwargs) -> None:
        self.is_coordinator = is_coordinator
        self.rank = kwargs.get("rank", torch.distributed.get_rank() if torch.distributed.is_initialized() else 0)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        if self.step is None:
            raise LastgoodError("name the step: StorageWriter(step=...) or dcp.save(..., checkpoint_id=step)")
        self.session.settle()  # a checkpoint whose outcome a failed save missed: aborted, or found committed
        # the parent: the one named, else this writer's previous commit (as a Checkpointer's
        # save continues from its last one), else the run's last-good (one call, the first save only)
        parent = self.parent_id if self.parent_id is not None else self.session.parent_id
        if parent is None:
            lg = self.transport.last_good(self.run)
            parent = lg["id"] if lg else None
        # every rank begins it itself after writing its file (begin is idempotent on the attempt)
        begin = {"attempt": f"dcp-{secrets.token_hex(8)}", "parent": parent or 0, "world": len(plans)}  # 0: none
        return [dataclasses.replace(p, storage_data={**begin, "rank": i}) for i, p in enumerate(plans)]

    def write_data(self, plan: SavePlan, planner) -> Future:
        how = plan.storage_data
        self.rank = rank = how["rank"]
        self._upload = up = self.session.checkpoint(self.step or 0, rank=rank)
        begin = lambda: up.begin(how["world"], how["attempt"], parent_id=how["parent"])  # noqa: E731
        try:
            results, tensors, values = [], {}, {}
            for item in plan.items:
                data = planner.resolve_data(item)
                name = item.index.fqn if item.index.offset is None or not any(item.index.offset) else \
                    f"{item.index.fqn}@{','.join(map(str, item.index.offset))}"
                if item.type == WriteItemType.BYTE_IO:
                    raw = data.getvalue()
                    if not raw.startswith(MAGIC):
                        raise FormatError(f"{item.index.fqn}: DCP's default planner pickled this value; "
                                          f"use planner=lastgood.dcp.SavePlanner()")
                    values[name] = raw[len(MAGIC):].decode()
                    where = {"rank": rank, "file": shard_file_name(rank), "json": name}
                    size = len(raw)
                else:
                    tensors[name] = data.detach()
                    where = {"rank": rank, "file": shard_file_name(rank), "tensor": name}
                    size = data.numel() * data.element_size()
                results.append(WriteResult(index=item.index, size_in_bytes=size, storage_data=where))
            snap = snapshot(self.step or 0, {"dcp_values": values}, tensors, StagingPool(slots=1, pin=False))
            up.add(shard_file_name(rank), snap.view())  # the spool on the service's host, else the stream
            self.checkpoint_id = begin()  # after the write: a long write never meets the lease
        except BaseException as e:
            if up.checkpoint_id is None:  # begun only to abort it, so the peers learn at once
                try:
                    begin()
                except Exception:  # noqa: BLE001 - the service is away: the lease settles it
                    pass
            up.abort(e)
            raise
        if self.is_coordinator:
            # the coordinator votes in finish(), with DCP's metadata; a small shard waits for it
            # there and both are sent at once (one hand-over's latency, not two, on a tiny save)
            if snap.view().nbytes > SEND_WITH_METADATA:
                up.send()
        else:
            up.commit(wait=False)  # vote; the coordinator waits for the outcome
        fut: Future = Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        up = self._upload
        try:
            metadata.storage_data = {wr.index: wr.storage_data for rs in results for wr in rs}
            metadata.storage_meta = self.storage_meta()
            up.add(METADATA_FILE, metadata_to_json(metadata))
        except BaseException as e:
            up.abort(e)
            raise
        up.commit()  # vote last, wait for COMMITTED; a lost reply is checked, a failure aborts

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=str(self.step), save_id=str(self.checkpoint_id))

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        return False  # never chosen implicitly: pass storage_writer= explicitly


# ---------------------------------------------------------------------- reader
class StorageReader(_Connected, dcp.StorageReader):
    def __init__(self, url: str | None = None, run: str | None = None, checkpoint_id: int | None = None, *,
                 token: str | None = None) -> None:
        _Connected.__init__(self, url, run, token)
        self.checkpoint_id = checkpoint_id
        self.storage_data: dict = {}
        self._manifest = None

    def reset(self, checkpoint_id=None) -> None:
        if checkpoint_id is not None:
            self.checkpoint_id = _digits(checkpoint_id, "a lastgood DCP load's checkpoint_id is a checkpoint id")

    def _file(self, rank: int, name: str) -> bytearray:
        """One whole file of the checkpoint, re-hashed against the manifest."""
        entry = next((f for f in self._manifest.files(rank) if f.name == name), None)
        if entry is None:
            raise CorruptCheckpoint(f"checkpoint {self.checkpoint_id} has no file {name} for rank {rank}")
        buf, got = self.transport.read_file(self.checkpoint_id, rank, name, entry.size)
        if got != entry.xxh3_128:
            raise CorruptCheckpoint(f"checkpoint {self.checkpoint_id} rank {rank} {name}: xxh3-128 {got} does not "
                                    f"match the committed {entry.xxh3_128}")
        return buf

    def read_metadata(self, *args, **kwargs) -> Metadata:
        if self.checkpoint_id is None:
            lg = self.transport.last_good(self.run)
            if lg is None:
                raise LastgoodError(f"run {self.run!r} has no committed checkpoint")
            self.checkpoint_id = lg["id"]
        self._manifest = self.transport.manifest(self.checkpoint_id)
        owner = next((r for r, fs in self._manifest.ranks.items() if any(f.name == METADATA_FILE for f in fs)), None)
        if owner is None:
            raise LastgoodError(f"checkpoint {self.checkpoint_id} was not written by DCP (no {METADATA_FILE})")
        raw = self._file(owner, METADATA_FILE)
        return metadata_from_json(bytes(raw))

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args, **kwargs) -> None:
        self.storage_data = metadata.storage_data
        if self._manifest is None:  # a rank that did not read the metadata itself
            self._manifest = self.transport.manifest(self.checkpoint_id)

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner) -> Future:
        files: dict[tuple[int, str], tuple[bytearray, dict, int, dict]] = {}
        for item in plan.items:
            where = self.storage_data[item.storage_index]
            key = (where["rank"], where["file"])
            if key not in files:
                buf = self._file(*key)
                tensors, meta = parse_header(buf, file_size=len(buf))
                values = json.loads(meta[META_STATE])["dcp_values"]
                files[key] = (buf, tensors, header_length(buf), values)
            buf, tensors, start, values = files[key]
            if item.type == LoadItemType.BYTE_IO:
                _load_value(planner, item, values[where["json"]])
            else:
                src = tensor_from_buffer(buf, tensors[where["tensor"]], start, None, copy=False)
                src = narrow_tensor_by_index(src, item.storage_offsets, item.lengths)
                target = planner.resolve_tensor(item).detach()
                if target.size() != src.size():
                    raise CorruptCheckpoint(f"{item.storage_index.fqn}: stored {tuple(src.size())}, "
                                            f"wanted {tuple(target.size())}")
                target.copy_(src)
                planner.commit_tensor(item, target)
        fut: Future = Future()
        fut.set_result(None)
        return fut

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        return False
