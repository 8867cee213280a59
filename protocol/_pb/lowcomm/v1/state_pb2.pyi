from . import handshake_pb2 as _handshake_pb2
from . import tensor_pb2 as _tensor_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class StateInfoRequest(_message.Message):
    __slots__ = ("hello",)
    HELLO_FIELD_NUMBER: _ClassVar[int]
    hello: _handshake_pb2.Hello
    def __init__(self, hello: _Optional[_Union[_handshake_pb2.Hello, _Mapping]] = ...) -> None: ...

class StateInfo(_message.Message):
    __slots__ = ("step", "params_sha256", "state_sha256", "total_bytes", "numel")
    STEP_FIELD_NUMBER: _ClassVar[int]
    PARAMS_SHA256_FIELD_NUMBER: _ClassVar[int]
    STATE_SHA256_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUMEL_FIELD_NUMBER: _ClassVar[int]
    step: int
    params_sha256: str
    state_sha256: str
    total_bytes: int
    numel: int
    def __init__(self, step: _Optional[int] = ..., params_sha256: _Optional[str] = ..., state_sha256: _Optional[str] = ..., total_bytes: _Optional[int] = ..., numel: _Optional[int] = ...) -> None: ...

class StateRequest(_message.Message):
    __slots__ = ("hello", "step", "offset", "length")
    HELLO_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    hello: _handshake_pb2.Hello
    step: int
    offset: int
    length: int
    def __init__(self, hello: _Optional[_Union[_handshake_pb2.Hello, _Mapping]] = ..., step: _Optional[int] = ..., offset: _Optional[int] = ..., length: _Optional[int] = ...) -> None: ...

class StateChunk(_message.Message):
    __slots__ = ("offset", "data", "sha256")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    offset: int
    data: bytes
    sha256: str
    def __init__(self, offset: _Optional[int] = ..., data: _Optional[bytes] = ..., sha256: _Optional[str] = ...) -> None: ...

class MissedRoundsRequest(_message.Message):
    __slots__ = ("hello", "from_step", "params_sha256", "to_step")
    HELLO_FIELD_NUMBER: _ClassVar[int]
    FROM_STEP_FIELD_NUMBER: _ClassVar[int]
    PARAMS_SHA256_FIELD_NUMBER: _ClassVar[int]
    TO_STEP_FIELD_NUMBER: _ClassVar[int]
    hello: _handshake_pb2.Hello
    from_step: int
    params_sha256: str
    to_step: int
    def __init__(self, hello: _Optional[_Union[_handshake_pb2.Hello, _Mapping]] = ..., from_step: _Optional[int] = ..., params_sha256: _Optional[str] = ..., to_step: _Optional[int] = ...) -> None: ...

class MissedRoundsMessage(_message.Message):
    __slots__ = ("round", "chunk")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    round: MissedRound
    chunk: bytes
    def __init__(self, round: _Optional[_Union[MissedRound, _Mapping]] = ..., chunk: _Optional[bytes] = ...) -> None: ...

class MissedRound(_message.Message):
    __slots__ = ("step", "base_sha256", "result_sha256", "codec", "shards")
    STEP_FIELD_NUMBER: _ClassVar[int]
    BASE_SHA256_FIELD_NUMBER: _ClassVar[int]
    RESULT_SHA256_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    step: int
    base_sha256: str
    result_sha256: str
    codec: _tensor_pb2.Codec
    shards: _containers.RepeatedCompositeFieldContainer[AppliedShard]
    def __init__(self, step: _Optional[int] = ..., base_sha256: _Optional[str] = ..., result_sha256: _Optional[str] = ..., codec: _Optional[_Union[_tensor_pb2.Codec, str]] = ..., shards: _Optional[_Iterable[_Union[AppliedShard, _Mapping]]] = ...) -> None: ...

class AppliedShard(_message.Message):
    __slots__ = ("start", "numel", "payload_bytes")
    START_FIELD_NUMBER: _ClassVar[int]
    NUMEL_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    start: int
    numel: int
    payload_bytes: int
    def __init__(self, start: _Optional[int] = ..., numel: _Optional[int] = ..., payload_bytes: _Optional[int] = ...) -> None: ...
