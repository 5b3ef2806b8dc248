from ckpt_core.wire.v1 import peer_pb2 as _peer_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Iterable as _Iterable, Mapping as _Mapping, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ReportRequest(_message.Message):
    __slots__ = ("node", "steps")
    NODE_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    node: str
    steps: _containers.RepeatedCompositeFieldContainer[_peer_pb2.StepHoldings]
    def __init__(self, node: _Optional[str] = ..., steps: _Optional[_Iterable[_Union[_peer_pb2.StepHoldings, _Mapping]]] = ...) -> None: ...

class ReportReply(_message.Message):
    __slots__ = ("commit_json",)
    COMMIT_JSON_FIELD_NUMBER: _ClassVar[int]
    commit_json: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, commit_json: _Optional[_Iterable[bytes]] = ...) -> None: ...

class AnnounceRequest(_message.Message):
    __slots__ = ("commit_json", "relay")
    COMMIT_JSON_FIELD_NUMBER: _ClassVar[int]
    RELAY_FIELD_NUMBER: _ClassVar[int]
    commit_json: bytes
    relay: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, commit_json: _Optional[bytes] = ..., relay: _Optional[_Iterable[str]] = ...) -> None: ...

class AnnounceReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class JobDigest(_message.Message):
    __slots__ = ("job", "steps", "digest")
    JOB_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    job: str
    steps: _containers.RepeatedScalarFieldContainer[int]
    digest: str
    def __init__(self, job: _Optional[str] = ..., steps: _Optional[_Iterable[int]] = ..., digest: _Optional[str] = ...) -> None: ...

class DigestRequest(_message.Message):
    __slots__ = ("jobs",)
    JOBS_FIELD_NUMBER: _ClassVar[int]
    jobs: _containers.RepeatedCompositeFieldContainer[JobDigest]
    def __init__(self, jobs: _Optional[_Iterable[_Union[JobDigest, _Mapping]]] = ...) -> None: ...

class DigestReply(_message.Message):
    __slots__ = ("commit_json",)
    COMMIT_JSON_FIELD_NUMBER: _ClassVar[int]
    commit_json: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, commit_json: _Optional[_Iterable[bytes]] = ...) -> None: ...

class HoldersRequest(_message.Message):
    __slots__ = ("job", "step", "rank")
    JOB_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    job: str
    step: int
    rank: int
    def __init__(self, job: _Optional[str] = ..., step: _Optional[int] = ..., rank: _Optional[int] = ...) -> None: ...

class NodeHoldings(_message.Message):
    __slots__ = ("node", "held")
    NODE_FIELD_NUMBER: _ClassVar[int]
    HELD_FIELD_NUMBER: _ClassVar[int]
    node: str
    held: _peer_pb2.StepHoldings
    def __init__(self, node: _Optional[str] = ..., held: _Optional[_Union[_peer_pb2.StepHoldings, _Mapping]] = ...) -> None: ...

class HoldersReply(_message.Message):
    __slots__ = ("holders",)
    HOLDERS_FIELD_NUMBER: _ClassVar[int]
    holders: _containers.RepeatedCompositeFieldContainer[NodeHoldings]
    def __init__(self, holders: _Optional[_Iterable[_Union[NodeHoldings, _Mapping]]] = ...) -> None: ...
