from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class BeginCheckpointRequest(_message.Message):
    __slots__ = ("run", "step", "world_size", "parent_id", "attempt", "rank", "generation", "expected_bytes", "tier", "replicas")
    RUN_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    PARENT_ID_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_BYTES_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    run: str
    step: int
    world_size: int
    parent_id: int
    attempt: str
    rank: int
    generation: int
    expected_bytes: int
    tier: str
    replicas: int
    def __init__(self, run: _Optional[str] = ..., step: _Optional[int] = ..., world_size: _Optional[int] = ..., parent_id: _Optional[int] = ..., attempt: _Optional[str] = ..., rank: _Optional[int] = ..., generation: _Optional[int] = ..., expected_bytes: _Optional[int] = ..., tier: _Optional[str] = ..., replicas: _Optional[int] = ...) -> None: ...

class BeginCheckpointResponse(_message.Message):
    __slots__ = ("checkpoint_id", "status", "lease_seconds")
    CHECKPOINT_ID_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    LEASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    checkpoint_id: int
    status: str
    lease_seconds: float
    def __init__(self, checkpoint_id: _Optional[int] = ..., status: _Optional[str] = ..., lease_seconds: _Optional[float] = ...) -> None: ...

class ShardHeader(_message.Message):
    __slots__ = ("checkpoint_id", "rank", "file_name", "size", "xxh3_128", "spool_file", "spool_id", "range_digests", "follow")
    CHECKPOINT_ID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    FILE_NAME_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    XXH3_128_FIELD_NUMBER: _ClassVar[int]
    SPOOL_FILE_FIELD_NUMBER: _ClassVar[int]
    SPOOL_ID_FIELD_NUMBER: _ClassVar[int]
    RANGE_DIGESTS_FIELD_NUMBER: _ClassVar[int]
    FOLLOW_FIELD_NUMBER: _ClassVar[int]
    checkpoint_id: int
    rank: int
    file_name: str
    size: int
    xxh3_128: str
    spool_file: str
    spool_id: str
    range_digests: str
    follow: bool
    def __init__(self, checkpoint_id: _Optional[int] = ..., rank: _Optional[int] = ..., file_name: _Optional[str] = ..., size: _Optional[int] = ..., xxh3_128: _Optional[str] = ..., spool_file: _Optional[str] = ..., spool_id: _Optional[str] = ..., range_digests: _Optional[str] = ..., follow: _Optional[bool] = ...) -> None: ...

class SpoolProgress(_message.Message):
    __slots__ = ("written", "xxh3_128")
    WRITTEN_FIELD_NUMBER: _ClassVar[int]
    XXH3_128_FIELD_NUMBER: _ClassVar[int]
    written: int
    xxh3_128: str
    def __init__(self, written: _Optional[int] = ..., xxh3_128: _Optional[str] = ...) -> None: ...

class PutShardRequest(_message.Message):
    __slots__ = ("header", "chunk", "progress")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    header: ShardHeader
    chunk: bytes
    progress: SpoolProgress
    def __init__(self, header: _Optional[_Union[ShardHeader, _Mapping]] = ..., chunk: _Optional[bytes] = ..., progress: _Optional[_Union[SpoolProgress, _Mapping]] = ...) -> None: ...

class PutShardResponse(_message.Message):
    __slots__ = ("already_present", "size", "xxh3_128")
    ALREADY_PRESENT_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    XXH3_128_FIELD_NUMBER: _ClassVar[int]
    already_present: bool
    size: int
    xxh3_128: str
    def __init__(self, already_present: _Optional[bool] = ..., size: _Optional[int] = ..., xxh3_128: _Optional[str] = ...) -> None: ...

class CommitRankRequest(_message.Message):
    __slots__ = ("checkpoint_id", "rank", "files", "wait_seconds", "peer_key", "memory_files", "inline_files")
    CHECKPOINT_ID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    FILES_FIELD_NUMBER: _ClassVar[int]
    WAIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PEER_KEY_FIELD_NUMBER: _ClassVar[int]
    MEMORY_FILES_FIELD_NUMBER: _ClassVar[int]
    INLINE_FILES_FIELD_NUMBER: _ClassVar[int]
    checkpoint_id: int
    rank: int
    files: _containers.RepeatedScalarFieldContainer[str]
    wait_seconds: float
    peer_key: str
    memory_files: _containers.RepeatedCompositeFieldContainer[MemoryFile]
    inline_files: _containers.RepeatedCompositeFieldContainer[InlineFile]
    def __init__(self, checkpoint_id: _Optional[int] = ..., rank: _Optional[int] = ..., files: _Optional[_Iterable[str]] = ..., wait_seconds: _Optional[float] = ..., peer_key: _Optional[str] = ..., memory_files: _Optional[_Iterable[_Union[MemoryFile, _Mapping]]] = ..., inline_files: _Optional[_Iterable[_Union[InlineFile, _Mapping]]] = ...) -> None: ...

class InlineFile(_message.Message):
    __slots__ = ("name", "xxh3_128", "data")
    NAME_FIELD_NUMBER: _ClassVar[int]
    XXH3_128_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    name: str
    xxh3_128: str
    data: bytes
    def __init__(self, name: _Optional[str] = ..., xxh3_128: _Optional[str] = ..., data: _Optional[bytes] = ...) -> None: ...

class MemoryFile(_message.Message):
    __slots__ = ("name", "size", "xxh3_128")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    XXH3_128_FIELD_NUMBER: _ClassVar[int]
    name: str
    size: int
    xxh3_128: str
    def __init__(self, name: _Optional[str] = ..., size: _Optional[int] = ..., xxh3_128: _Optional[str] = ...) -> None: ...

class CommitRankResponse(_message.Message):
    __slots__ = ("checkpoint_id", "status", "missing_ranks")
    CHECKPOINT_ID_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    MISSING_RANKS_FIELD_NUMBER: _ClassVar[int]
    checkpoint_id: int
    status: str
    missing_ranks: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, checkpoint_id: _Optional[int] = ..., status: _Optional[str] = ..., missing_ranks: _Optional[_Iterable[int]] = ...) -> None: ...

class AbortCheckpointRequest(_message.Message):
    __slots__ = ("checkpoint_id", "reason", "rank")
    CHECKPOINT_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    checkpoint_id: int
    reason: str
    rank: int
    def __init__(self, checkpoint_id: _Optional[int] = ..., reason: _Optional[str] = ..., rank: _Optional[int] = ...) -> None: ...

class AbortCheckpointResponse(_message.Message):
    __slots__ = ("status",)
    STATUS_FIELD_NUMBER: _ClassVar[int]
    status: str
    def __init__(self, status: _Optional[str] = ...) -> None: ...

class GetManifestRequest(_message.Message):
    __slots__ = ("checkpoint_id", "run")
    CHECKPOINT_ID_FIELD_NUMBER: _ClassVar[int]
    RUN_FIELD_NUMBER: _ClassVar[int]
    checkpoint_id: int
    run: str
    def __init__(self, checkpoint_id: _Optional[int] = ..., run: _Optional[str] = ...) -> None: ...

class GetManifestResponse(_message.Message):
    __slots__ = ("checkpoint_id", "step", "manifest")
    CHECKPOINT_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    checkpoint_id: int
    step: int
    manifest: bytes
    def __init__(self, checkpoint_id: _Optional[int] = ..., step: _Optional[int] = ..., manifest: _Optional[bytes] = ...) -> None: ...

class GetShardRequest(_message.Message):
    __slots__ = ("checkpoint_id", "rank", "file_name", "offset", "length", "spool_id")
    CHECKPOINT_ID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    FILE_NAME_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    SPOOL_ID_FIELD_NUMBER: _ClassVar[int]
    checkpoint_id: int
    rank: int
    file_name: str
    offset: int
    length: int
    spool_id: str
    def __init__(self, checkpoint_id: _Optional[int] = ..., rank: _Optional[int] = ..., file_name: _Optional[str] = ..., offset: _Optional[int] = ..., length: _Optional[int] = ..., spool_id: _Optional[str] = ...) -> None: ...

class GetShardResponse(_message.Message):
    __slots__ = ("chunk", "spool_file")
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    SPOOL_FILE_FIELD_NUMBER: _ClassVar[int]
    chunk: bytes
    spool_file: str
    def __init__(self, chunk: _Optional[bytes] = ..., spool_file: _Optional[str] = ...) -> None: ...
