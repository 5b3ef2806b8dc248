from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Iterable as _Iterable, Mapping as _Mapping, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ShardId(_message.Message):
    __slots__ = ("job", "step", "rank", "world_size")
    JOB_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    job: str
    step: int
    rank: int
    world_size: int
    def __init__(self, job: _Optional[str] = ..., step: _Optional[int] = ..., rank: _Optional[int] = ..., world_size: _Optional[int] = ...) -> None: ...

class ReserveRequest(_message.Message):
    __slots__ = ("shard", "size_bytes", "prepare", "has_line", "line", "after", "retention")
    SHARD_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    PREPARE_FIELD_NUMBER: _ClassVar[int]
    HAS_LINE_FIELD_NUMBER: _ClassVar[int]
    LINE_FIELD_NUMBER: _ClassVar[int]
    AFTER_FIELD_NUMBER: _ClassVar[int]
    RETENTION_FIELD_NUMBER: _ClassVar[int]
    shard: ShardId
    size_bytes: int
    prepare: bool
    has_line: bool
    line: str
    after: int
    retention: JobRetention
    def __init__(self, shard: _Optional[_Union[ShardId, _Mapping]] = ..., size_bytes: _Optional[int] = ..., prepare: bool = ..., has_line: bool = ..., line: _Optional[str] = ..., after: _Optional[int] = ..., retention: _Optional[_Union[JobRetention, _Mapping]] = ...) -> None: ...

class JobRetention(_message.Message):
    __slots__ = ("keep", "keep_every")
    KEEP_FIELD_NUMBER: _ClassVar[int]
    KEEP_EVERY_FIELD_NUMBER: _ClassVar[int]
    keep: int
    keep_every: int
    def __init__(self, keep: _Optional[int] = ..., keep_every: _Optional[int] = ...) -> None: ...

class ReserveReply(_message.Message):
    __slots__ = ("skipped", "slot_path", "slot_size_bytes", "blocked_s", "reason", "reservation", "spare_slot_path", "spare_slot_size_bytes", "layout_in_slot", "line")
    SKIPPED_FIELD_NUMBER: _ClassVar[int]
    SLOT_PATH_FIELD_NUMBER: _ClassVar[int]
    SLOT_SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    BLOCKED_S_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    RESERVATION_FIELD_NUMBER: _ClassVar[int]
    SPARE_SLOT_PATH_FIELD_NUMBER: _ClassVar[int]
    SPARE_SLOT_SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_IN_SLOT_FIELD_NUMBER: _ClassVar[int]
    LINE_FIELD_NUMBER: _ClassVar[int]
    skipped: bool
    slot_path: str
    slot_size_bytes: int
    blocked_s: float
    reason: str
    reservation: int
    spare_slot_path: str
    spare_slot_size_bytes: int
    layout_in_slot: bool
    line: str
    def __init__(self, skipped: bool = ..., slot_path: _Optional[str] = ..., slot_size_bytes: _Optional[int] = ..., blocked_s: _Optional[float] = ..., reason: _Optional[str] = ..., reservation: _Optional[int] = ..., spare_slot_path: _Optional[str] = ..., spare_slot_size_bytes: _Optional[int] = ..., layout_in_slot: bool = ..., line: _Optional[str] = ...) -> None: ...

class CommitRequest(_message.Message):
    __slots__ = ("shard", "slot_path", "data_size_bytes", "layout_json", "reservation", "run_id", "layout_size_bytes", "line")
    SHARD_FIELD_NUMBER: _ClassVar[int]
    SLOT_PATH_FIELD_NUMBER: _ClassVar[int]
    DATA_SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_JSON_FIELD_NUMBER: _ClassVar[int]
    RESERVATION_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    LINE_FIELD_NUMBER: _ClassVar[int]
    shard: ShardId
    slot_path: str
    data_size_bytes: int
    layout_json: bytes
    reservation: int
    run_id: str
    layout_size_bytes: int
    line: str
    def __init__(self, shard: _Optional[_Union[ShardId, _Mapping]] = ..., slot_path: _Optional[str] = ..., data_size_bytes: _Optional[int] = ..., layout_json: _Optional[bytes] = ..., reservation: _Optional[int] = ..., run_id: _Optional[str] = ..., layout_size_bytes: _Optional[int] = ..., line: _Optional[str] = ...) -> None: ...

class CommitReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WaitShardRequest(_message.Message):
    __slots__ = ("shard", "tier", "timeout_s")
    SHARD_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    shard: ShardId
    tier: str
    timeout_s: float
    def __init__(self, shard: _Optional[_Union[ShardId, _Mapping]] = ..., tier: _Optional[str] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class WaitShardReply(_message.Message):
    __slots__ = ("done", "error", "passed_over")
    DONE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    PASSED_OVER_FIELD_NUMBER: _ClassVar[int]
    done: bool
    error: str
    passed_over: bool
    def __init__(self, done: bool = ..., error: _Optional[str] = ..., passed_over: bool = ...) -> None: ...

class LocateRequest(_message.Message):
    __slots__ = ("job", "step", "rank", "tier", "refetch")
    JOB_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    REFETCH_FIELD_NUMBER: _ClassVar[int]
    job: str
    step: int
    rank: int
    tier: str
    refetch: bool
    def __init__(self, job: _Optional[str] = ..., step: _Optional[int] = ..., rank: _Optional[int] = ..., tier: _Optional[str] = ..., refetch: bool = ...) -> None: ...

class Source(_message.Message):
    __slots__ = ("tier", "kind", "path")
    TIER_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    tier: str
    kind: str
    path: str
    def __init__(self, tier: _Optional[str] = ..., kind: _Optional[str] = ..., path: _Optional[str] = ...) -> None: ...

class LocateReply(_message.Message):
    __slots__ = ("found", "step", "world_size", "sources", "next_line")
    FOUND_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    SOURCES_FIELD_NUMBER: _ClassVar[int]
    NEXT_LINE_FIELD_NUMBER: _ClassVar[int]
    found: bool
    step: int
    world_size: int
    sources: _containers.RepeatedCompositeFieldContainer[Source]
    next_line: str
    def __init__(self, found: bool = ..., step: _Optional[int] = ..., world_size: _Optional[int] = ..., sources: _Optional[_Iterable[_Union[Source, _Mapping]]] = ..., next_line: _Optional[str] = ...) -> None: ...

class LocateStepRequest(_message.Message):
    __slots__ = ("job", "step", "tier")
    JOB_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    job: str
    step: int
    tier: str
    def __init__(self, job: _Optional[str] = ..., step: _Optional[int] = ..., tier: _Optional[str] = ...) -> None: ...

class RankSources(_message.Message):
    __slots__ = ("sources",)
    SOURCES_FIELD_NUMBER: _ClassVar[int]
    sources: _containers.RepeatedCompositeFieldContainer[Source]
    def __init__(self, sources: _Optional[_Iterable[_Union[Source, _Mapping]]] = ...) -> None: ...

class LocateStepReply(_message.Message):
    __slots__ = ("step", "world_size", "commit_json", "index_json", "ranks", "next_line")
    STEP_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    COMMIT_JSON_FIELD_NUMBER: _ClassVar[int]
    INDEX_JSON_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    NEXT_LINE_FIELD_NUMBER: _ClassVar[int]
    step: int
    world_size: int
    commit_json: bytes
    index_json: bytes
    ranks: _containers.RepeatedCompositeFieldContainer[RankSources]
    next_line: str
    def __init__(self, step: _Optional[int] = ..., world_size: _Optional[int] = ..., commit_json: _Optional[bytes] = ..., index_json: _Optional[bytes] = ..., ranks: _Optional[_Iterable[_Union[RankSources, _Mapping]]] = ..., next_line: _Optional[str] = ...) -> None: ...

class ByteRange(_message.Message):
    __slots__ = ("offset", "length")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    offset: int
    length: int
    def __init__(self, offset: _Optional[int] = ..., length: _Optional[int] = ...) -> None: ...

class ReadShardRequest(_message.Message):
    __slots__ = ("job", "step", "rank", "ranges")
    JOB_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    RANGES_FIELD_NUMBER: _ClassVar[int]
    job: str
    step: int
    rank: int
    ranges: _containers.RepeatedCompositeFieldContainer[ByteRange]
    def __init__(self, job: _Optional[str] = ..., step: _Optional[int] = ..., rank: _Optional[int] = ..., ranges: _Optional[_Iterable[_Union[ByteRange, _Mapping]]] = ...) -> None: ...

class ReadShardPiece(_message.Message):
    __slots__ = ("meta_json", "data")
    META_JSON_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    meta_json: bytes
    data: bytes
    def __init__(self, meta_json: _Optional[bytes] = ..., data: _Optional[bytes] = ...) -> None: ...

class ListRequest(_message.Message):
    __slots__ = ("job", "newest")
    JOB_FIELD_NUMBER: _ClassVar[int]
    NEWEST_FIELD_NUMBER: _ClassVar[int]
    job: str
    newest: bool
    def __init__(self, job: _Optional[str] = ..., newest: bool = ...) -> None: ...

class StepInfo(_message.Message):
    __slots__ = ("job", "step", "world_size", "size_bytes", "tiers", "committed_at", "superseded", "pinned")
    JOB_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_AT_FIELD_NUMBER: _ClassVar[int]
    SUPERSEDED_FIELD_NUMBER: _ClassVar[int]
    PINNED_FIELD_NUMBER: _ClassVar[int]
    job: str
    step: int
    world_size: int
    size_bytes: int
    tiers: _containers.RepeatedScalarFieldContainer[str]
    committed_at: str
    superseded: bool
    pinned: bool
    def __init__(self, job: _Optional[str] = ..., step: _Optional[int] = ..., world_size: _Optional[int] = ..., size_bytes: _Optional[int] = ..., tiers: _Optional[_Iterable[str]] = ..., committed_at: _Optional[str] = ..., superseded: bool = ..., pinned: bool = ...) -> None: ...

class ListReply(_message.Message):
    __slots__ = ("steps",)
    STEPS_FIELD_NUMBER: _ClassVar[int]
    steps: _containers.RepeatedCompositeFieldContainer[StepInfo]
    def __init__(self, steps: _Optional[_Iterable[_Union[StepInfo, _Mapping]]] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatusReply(_message.Message):
    __slots__ = ("json",)
    JSON_FIELD_NUMBER: _ClassVar[int]
    json: str
    def __init__(self, json: _Optional[str] = ...) -> None: ...

class CollectRequest(_message.Message):
    __slots__ = ("dry_run", "job", "all", "object")
    DRY_RUN_FIELD_NUMBER: _ClassVar[int]
    JOB_FIELD_NUMBER: _ClassVar[int]
    ALL_FIELD_NUMBER: _ClassVar[int]
    OBJECT_FIELD_NUMBER: _ClassVar[int]
    dry_run: bool
    job: str
    all: bool
    object: bool
    def __init__(self, dry_run: bool = ..., job: _Optional[str] = ..., all: bool = ..., object: bool = ...) -> None: ...

class Removal(_message.Message):
    __slots__ = ("tier", "job", "step", "reason")
    TIER_FIELD_NUMBER: _ClassVar[int]
    JOB_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    tier: str
    job: str
    step: int
    reason: str
    def __init__(self, tier: _Optional[str] = ..., job: _Optional[str] = ..., step: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class PinRequest(_message.Message):
    __slots__ = ("job", "step", "pin")
    JOB_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    PIN_FIELD_NUMBER: _ClassVar[int]
    job: str
    step: int
    pin: bool
    def __init__(self, job: _Optional[str] = ..., step: _Optional[int] = ..., pin: bool = ...) -> None: ...

class PinReply(_message.Message):
    __slots__ = ("pinned",)
    PINNED_FIELD_NUMBER: _ClassVar[int]
    pinned: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, pinned: _Optional[_Iterable[int]] = ...) -> None: ...

class RemoveStepRequest(_message.Message):
    __slots__ = ("job", "step", "force", "dry_run", "object")
    JOB_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    FORCE_FIELD_NUMBER: _ClassVar[int]
    DRY_RUN_FIELD_NUMBER: _ClassVar[int]
    OBJECT_FIELD_NUMBER: _ClassVar[int]
    job: str
    step: int
    force: bool
    dry_run: bool
    object: bool
    def __init__(self, job: _Optional[str] = ..., step: _Optional[int] = ..., force: bool = ..., dry_run: bool = ..., object: bool = ...) -> None: ...

class CollectReply(_message.Message):
    __slots__ = ("removals",)
    REMOVALS_FIELD_NUMBER: _ClassVar[int]
    removals: _containers.RepeatedCompositeFieldContainer[Removal]
    def __init__(self, removals: _Optional[_Iterable[_Union[Removal, _Mapping]]] = ...) -> None: ...
