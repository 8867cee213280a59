from . import handshake_pb2 as _handshake_pb2
from . import tensor_pb2 as _tensor_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class AllReduceSchedule(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ALL_REDUCE_SCHEDULE_BUTTERFLY: _ClassVar[AllReduceSchedule]
    ALL_REDUCE_SCHEDULE_RING: _ClassVar[AllReduceSchedule]
    ALL_REDUCE_SCHEDULE_AUTO: _ClassVar[AllReduceSchedule]
ALL_REDUCE_SCHEDULE_BUTTERFLY: AllReduceSchedule
ALL_REDUCE_SCHEDULE_RING: AllReduceSchedule
ALL_REDUCE_SCHEDULE_AUTO: AllReduceSchedule

class JoinRequest(_message.Message):
    __slots__ = ("hello", "step", "address", "weight", "bandwidth_bps", "params_sha256", "wait_s", "direct", "bucket", "closed_bucket", "bucket_members")
    HELLO_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    BANDWIDTH_BPS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_SHA256_FIELD_NUMBER: _ClassVar[int]
    WAIT_S_FIELD_NUMBER: _ClassVar[int]
    DIRECT_FIELD_NUMBER: _ClassVar[int]
    BUCKET_FIELD_NUMBER: _ClassVar[int]
    CLOSED_BUCKET_FIELD_NUMBER: _ClassVar[int]
    BUCKET_MEMBERS_FIELD_NUMBER: _ClassVar[int]
    hello: _handshake_pb2.Hello
    step: int
    address: str
    weight: float
    bandwidth_bps: float
    params_sha256: str
    wait_s: float
    direct: bool
    bucket: str
    closed_bucket: str
    bucket_members: _containers.RepeatedCompositeFieldContainer[BucketMember]
    def __init__(self, hello: _Optional[_Union[_handshake_pb2.Hello, _Mapping]] = ..., step: _Optional[int] = ..., address: _Optional[str] = ..., weight: _Optional[float] = ..., bandwidth_bps: _Optional[float] = ..., params_sha256: _Optional[str] = ..., wait_s: _Optional[float] = ..., direct: _Optional[bool] = ..., bucket: _Optional[str] = ..., closed_bucket: _Optional[str] = ..., bucket_members: _Optional[_Iterable[_Union[BucketMember, _Mapping]]] = ...) -> None: ...

class BucketMember(_message.Message):
    __slots__ = ("member", "bandwidth_bps")
    MEMBER_FIELD_NUMBER: _ClassVar[int]
    BANDWIDTH_BPS_FIELD_NUMBER: _ClassVar[int]
    member: Member
    bandwidth_bps: float
    def __init__(self, member: _Optional[_Union[Member, _Mapping]] = ..., bandwidth_bps: _Optional[float] = ...) -> None: ...

class Member(_message.Message):
    __slots__ = ("peer_id", "address", "weight")
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    peer_id: str
    address: str
    weight: float
    def __init__(self, peer_id: _Optional[str] = ..., address: _Optional[str] = ..., weight: _Optional[float] = ...) -> None: ...

class Group(_message.Message):
    __slots__ = ("group_id", "step", "members", "shard_bounds", "shard_owners", "codec", "reduce_timeout_s", "step_groups", "group_index", "team_reducers", "team_subreducers", "schedule")
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    SHARD_BOUNDS_FIELD_NUMBER: _ClassVar[int]
    SHARD_OWNERS_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    REDUCE_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    STEP_GROUPS_FIELD_NUMBER: _ClassVar[int]
    GROUP_INDEX_FIELD_NUMBER: _ClassVar[int]
    TEAM_REDUCERS_FIELD_NUMBER: _ClassVar[int]
    TEAM_SUBREDUCERS_FIELD_NUMBER: _ClassVar[int]
    SCHEDULE_FIELD_NUMBER: _ClassVar[int]
    group_id: bytes
    step: int
    members: _containers.RepeatedCompositeFieldContainer[Member]
    shard_bounds: _containers.RepeatedScalarFieldContainer[int]
    shard_owners: _containers.RepeatedScalarFieldContainer[int]
    codec: _tensor_pb2.Codec
    reduce_timeout_s: float
    step_groups: _containers.RepeatedCompositeFieldContainer[StepGroup]
    group_index: int
    team_reducers: _containers.RepeatedScalarFieldContainer[int]
    team_subreducers: _containers.RepeatedScalarFieldContainer[int]
    schedule: AllReduceSchedule
    def __init__(self, group_id: _Optional[bytes] = ..., step: _Optional[int] = ..., members: _Optional[_Iterable[_Union[Member, _Mapping]]] = ..., shard_bounds: _Optional[_Iterable[int]] = ..., shard_owners: _Optional[_Iterable[int]] = ..., codec: _Optional[_Union[_tensor_pb2.Codec, str]] = ..., reduce_timeout_s: _Optional[float] = ..., step_groups: _Optional[_Iterable[_Union[StepGroup, _Mapping]]] = ..., group_index: _Optional[int] = ..., team_reducers: _Optional[_Iterable[int]] = ..., team_subreducers: _Optional[_Iterable[int]] = ..., schedule: _Optional[_Union[AllReduceSchedule, str]] = ...) -> None: ...

class StepGroup(_message.Message):
    __slots__ = ("group_id", "members", "shard_owners")
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    SHARD_OWNERS_FIELD_NUMBER: _ClassVar[int]
    group_id: bytes
    members: _containers.RepeatedCompositeFieldContainer[Member]
    shard_owners: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, group_id: _Optional[bytes] = ..., members: _Optional[_Iterable[_Union[Member, _Mapping]]] = ..., shard_owners: _Optional[_Iterable[int]] = ...) -> None: ...

class JoinResponse(_message.Message):
    __slots__ = ("group", "redirect")
    GROUP_FIELD_NUMBER: _ClassVar[int]
    REDIRECT_FIELD_NUMBER: _ClassVar[int]
    group: Group
    redirect: Redirect
    def __init__(self, group: _Optional[_Union[Group, _Mapping]] = ..., redirect: _Optional[_Union[Redirect, _Mapping]] = ...) -> None: ...

class Redirect(_message.Message):
    __slots__ = ("peer_id", "address")
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    peer_id: str
    address: str
    def __init__(self, peer_id: _Optional[str] = ..., address: _Optional[str] = ...) -> None: ...

class ReduceHeader(_message.Message):
    __slots__ = ("group_id", "shard_index", "sender_peer_id", "codec", "numel", "payload_bytes")
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    SHARD_INDEX_FIELD_NUMBER: _ClassVar[int]
    SENDER_PEER_ID_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    NUMEL_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    group_id: bytes
    shard_index: int
    sender_peer_id: str
    codec: _tensor_pb2.Codec
    numel: int
    payload_bytes: int
    def __init__(self, group_id: _Optional[bytes] = ..., shard_index: _Optional[int] = ..., sender_peer_id: _Optional[str] = ..., codec: _Optional[_Union[_tensor_pb2.Codec, str]] = ..., numel: _Optional[int] = ..., payload_bytes: _Optional[int] = ...) -> None: ...

class ReduceResult(_message.Message):
    __slots__ = ("codec", "numel", "payload_bytes", "contributors", "upload_seconds")
    CODEC_FIELD_NUMBER: _ClassVar[int]
    NUMEL_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    CONTRIBUTORS_FIELD_NUMBER: _ClassVar[int]
    UPLOAD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    codec: _tensor_pb2.Codec
    numel: int
    payload_bytes: int
    contributors: _containers.RepeatedScalarFieldContainer[str]
    upload_seconds: float
    def __init__(self, codec: _Optional[_Union[_tensor_pb2.Codec, str]] = ..., numel: _Optional[int] = ..., payload_bytes: _Optional[int] = ..., contributors: _Optional[_Iterable[str]] = ..., upload_seconds: _Optional[float] = ...) -> None: ...

class ReduceMessage(_message.Message):
    __slots__ = ("header", "result", "chunk", "team_header", "ring_header")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    TEAM_HEADER_FIELD_NUMBER: _ClassVar[int]
    RING_HEADER_FIELD_NUMBER: _ClassVar[int]
    header: ReduceHeader
    result: ReduceResult
    chunk: bytes
    team_header: TeamHeader
    ring_header: RingHeader
    def __init__(self, header: _Optional[_Union[ReduceHeader, _Mapping]] = ..., result: _Optional[_Union[ReduceResult, _Mapping]] = ..., chunk: _Optional[bytes] = ..., team_header: _Optional[_Union[TeamHeader, _Mapping]] = ..., ring_header: _Optional[_Union[RingHeader, _Mapping]] = ...) -> None: ...

class RingHeader(_message.Message):
    __slots__ = ("group_id", "sender_peer_id")
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    SENDER_PEER_ID_FIELD_NUMBER: _ClassVar[int]
    group_id: bytes
    sender_peer_id: str
    def __init__(self, group_id: _Optional[bytes] = ..., sender_peer_id: _Optional[str] = ...) -> None: ...

class TeamHeader(_message.Message):
    __slots__ = ("group_id", "shard_index", "from_group", "sender_peer_id", "numel", "contributors", "payload_bytes", "fetch")
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    SHARD_INDEX_FIELD_NUMBER: _ClassVar[int]
    FROM_GROUP_FIELD_NUMBER: _ClassVar[int]
    SENDER_PEER_ID_FIELD_NUMBER: _ClassVar[int]
    NUMEL_FIELD_NUMBER: _ClassVar[int]
    CONTRIBUTORS_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    FETCH_FIELD_NUMBER: _ClassVar[int]
    group_id: bytes
    shard_index: int
    from_group: int
    sender_peer_id: str
    numel: int
    contributors: _containers.RepeatedScalarFieldContainer[str]
    payload_bytes: int
    fetch: bool
    def __init__(self, group_id: _Optional[bytes] = ..., shard_index: _Optional[int] = ..., from_group: _Optional[int] = ..., sender_peer_id: _Optional[str] = ..., numel: _Optional[int] = ..., contributors: _Optional[_Iterable[str]] = ..., payload_bytes: _Optional[int] = ..., fetch: _Optional[bool] = ...) -> None: ...

class ShardReport(_message.Message):
    __slots__ = ("group_id", "sender_peer_id", "skip")
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    SENDER_PEER_ID_FIELD_NUMBER: _ClassVar[int]
    SKIP_FIELD_NUMBER: _ClassVar[int]
    group_id: bytes
    sender_peer_id: str
    skip: _containers.RepeatedScalarFieldContainer[bool]
    def __init__(self, group_id: _Optional[bytes] = ..., sender_peer_id: _Optional[str] = ..., skip: _Optional[_Iterable[bool]] = ...) -> None: ...
