"""DCP's metadata as lastgood stores it: JSON, never a pickle (the service keeps it as the
file `dcp.metadata.json` of the coordinator's rank), and the prefix that marks a non-tensor
value as lastgood's typed JSON. lastgood.dcp writes and reads it; the DCP export
(export/dcp.py) reads it."""

from __future__ import annotations

import json

import torch
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata,
                                                   MetadataIndex, StorageMeta, TensorProperties,
                                                   TensorStorageMetadata)

from lastgood.errors import FormatError
from lastgood.state.codec import Encoder, UnsupportedValue, decode

MAGIC = b"lastgood-json:1\n"  # opens every non-tensor value lastgood.dcp stores
METADATA_FILE = "dcp.metadata.json"


def _index_key(index: MetadataIndex) -> list:
    return [index.fqn, list(index.offset) if index.offset is not None else None]


def metadata_to_json(md: Metadata) -> bytes:
    sdm = {}
    for fqn, m in md.state_dict_metadata.items():
        if isinstance(m, BytesStorageMetadata):
            sdm[fqn] = {"type": "bytes"}
        else:
            sdm[fqn] = {"type": "tensor", "dtype": str(m.properties.dtype).removeprefix("torch."),
                        "requires_grad": bool(m.properties.requires_grad), "size": list(m.size),
                        "chunks": [{"offsets": list(c.offsets), "sizes": list(c.sizes)} for c in m.chunks]}
    enc = Encoder()
    planner_data = enc.encode(md.planner_data, ["planner_data"])
    if enc.tensors:
        raise UnsupportedValue("DCP planner data holds tensors")
    sm = md.storage_meta
    doc = {
        "format": "lastgood.dcp/1", "version": md.version, "state_dict_metadata": sdm, "planner_data": planner_data,
        "storage_data": [[*_index_key(k), v] for k, v in (md.storage_data or {}).items()],
        "storage_meta": None if sm is None else {"checkpoint_id": str(sm.checkpoint_id) if sm.checkpoint_id else None,
                                                 "save_id": sm.save_id, "load_id": sm.load_id,
                                                 "modules": list(sm.modules)},
    }
    return json.dumps(doc, sort_keys=True, allow_nan=False).encode()


def metadata_from_json(raw: bytes) -> Metadata:
    doc = json.loads(raw)
    if doc.get("format") != "lastgood.dcp/1":
        raise FormatError(f"unknown DCP metadata format {doc.get('format')!r}")
    sdm = {}
    for fqn, m in doc["state_dict_metadata"].items():
        if m["type"] == "bytes":
            sdm[fqn] = BytesStorageMetadata()
        else:
            dtype = getattr(torch, m["dtype"], None)
            if not isinstance(dtype, torch.dtype):
                raise FormatError(f"{fqn}: unknown dtype {m['dtype']!r}")
            sdm[fqn] = TensorStorageMetadata(
                properties=TensorProperties(dtype=dtype, requires_grad=m["requires_grad"]),
                size=torch.Size(m["size"]),
                chunks=[ChunkStorageMetadata(offsets=torch.Size(c["offsets"]), sizes=torch.Size(c["sizes"]))
                        for c in m["chunks"]])
    storage = {MetadataIndex(fqn, offset): where for fqn, offset, where in doc["storage_data"]}
    sm = doc["storage_meta"]
    return Metadata(state_dict_metadata=sdm, planner_data=decode(doc["planner_data"], lambda *_: None,
                                                                 lambda *_: None),
                    storage_data=storage, version=doc["version"],
                    storage_meta=None if sm is None else StorageMeta(**sm))




def value_from_json(text: str):
    """A non-tensor value lastgood.dcp stored (its typed JSON, after MAGIC), decoded."""
    return decode(json.loads(text), lambda *_: None, lambda *_: None)
