from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Iterable as _Iterable, Mapping as _Mapping, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RetireReplicaRequest(_message.Message):
    __slots__ = ("job", "step", "rank", "meta_xxh3_128")
    JOB_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    META_XXH3_128_FIELD_NUMBER: _ClassVar[int]
    job: str
    step: int
    rank: int
    meta_xxh3_128: str
    def __init__(self, job: _Optional[str] = ..., step: _Optional[int] = ..., rank: _Optional[int] = ..., meta_xxh3_128: _Optional[str] = ...) -> None: ...

class RetireReplicaReply(_message.Message):
    __slots__ = ("removed",)
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    removed: bool
    def __init__(self, removed: bool = ...) -> None: ...

class ShardPiece(_message.Message):
    __slots__ = ("meta_json", "transfer", "offset", "length", "data")
    META_JSON_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    meta_json: bytes
    transfer: str
    offset: int
    length: int
    data: bytes
    def __init__(self, meta_json: _Optional[bytes] = ..., transfer: _Optional[str] = ..., offset: _Optional[int] = ..., length: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class PutShardReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DataRangeTicket(_message.Message):
    __slots__ = ("port", "ticket")
    PORT_FIELD_NUMBER: _ClassVar[int]
    TICKET_FIELD_NUMBER: _ClassVar[int]
    port: int
    ticket: bytes
    def __init__(self, port: _Optional[int] = ..., ticket: _Optional[bytes] = ...) -> None: ...

class SealShardRequest(_message.Message):
    __slots__ = ("meta_json", "transfer", "commit_json")
    META_JSON_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_FIELD_NUMBER: _ClassVar[int]
    COMMIT_JSON_FIELD_NUMBER: _ClassVar[int]
    meta_json: bytes
    transfer: str
    commit_json: bytes
    def __init__(self, meta_json: _Optional[bytes] = ..., transfer: _Optional[str] = ..., commit_json: _Optional[bytes] = ...) -> None: ...

class SealShardReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetShardRequest(_message.Message):
    __slots__ = ("job", "step", "rank", "tier", "meta_only", "ranged", "offset", "length")
    JOB_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    META_ONLY_FIELD_NUMBER: _ClassVar[int]
    RANGED_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    job: str
    step: int
    rank: int
    tier: str
    meta_only: bool
    ranged: bool
    offset: int
    length: int
    def __init__(self, job: _Optional[str] = ..., step: _Optional[int] = ..., rank: _Optional[int] = ..., tier: _Optional[str] = ..., meta_only: bool = ..., ranged: bool = ..., offset: _Optional[int] = ..., length: _Optional[int] = ...) -> None: ...

class InventoryRequest(_message.Message):
    __slots__ = ("job", "step")
    JOB_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    job: str
    step: int
    def __init__(self, job: _Optional[str] = ..., step: _Optional[int] = ...) -> None: ...

class Holding(_message.Message):
    __slots__ = ("tier", "rank", "world_size", "data_size_bytes", "meta_xxh3_128", "run_id", "line", "saved_at")
    TIER_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    DATA_SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    META_XXH3_128_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    LINE_FIELD_NUMBER: _ClassVar[int]
    SAVED_AT_FIELD_NUMBER: _ClassVar[int]
    tier: str
    rank: int
    world_size: int
    data_size_bytes: int
    meta_xxh3_128: str
    run_id: str
    line: str
    saved_at: str
    def __init__(self, tier: _Optional[str] = ..., rank: _Optional[int] = ..., world_size: _Optional[int] = ..., data_size_bytes: _Optional[int] = ..., meta_xxh3_128: _Optional[str] = ..., run_id: _Optional[str] = ..., line: _Optional[str] = ..., saved_at: _Optional[str] = ...) -> None: ...

class StepHoldings(_message.Message):
    __slots__ = ("job", "step", "commit_json", "shards")
    JOB_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    COMMIT_JSON_FIELD_NUMBER: _ClassVar[int]
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    job: str
    step: int
    commit_json: bytes
    shards: _containers.RepeatedCompositeFieldContainer[Holding]
    def __init__(self, job: _Optional[str] = ..., step: _Optional[int] = ..., commit_json: _Optional[bytes] = ..., shards: _Optional[_Iterable[_Union[Holding, _Mapping]]] = ...) -> None: ...

class InventoryReply(_message.Message):
    __slots__ = ("node", "steps")
    NODE_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    node: str
    steps: _containers.RepeatedCompositeFieldContainer[StepHoldings]
    def __init__(self, node: _Optional[str] = ..., steps: _Optional[_Iterable[_Union[StepHoldings, _Mapping]]] = ...) -> None: ...

class CommitStepRequest(_message.Message):
    __slots__ = ("commit_json",)
    COMMIT_JSON_FIELD_NUMBER: _ClassVar[int]
    commit_json: bytes
    def __init__(self, commit_json: _Optional[bytes] = ...) -> None: ...

class CommitStepReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
