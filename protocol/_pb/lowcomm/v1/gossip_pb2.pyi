from . import handshake_pb2 as _handshake_pb2
from . import tensor_pb2 as _tensor_pb2
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GossipHeader(_message.Message):
    __slots__ = ("step", "codec", "numel", "payload_bytes")
    STEP_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    NUMEL_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    step: int
    codec: _tensor_pb2.Codec
    numel: int
    payload_bytes: int
    def __init__(self, step: _Optional[int] = ..., codec: _Optional[_Union[_tensor_pb2.Codec, str]] = ..., numel: _Optional[int] = ..., payload_bytes: _Optional[int] = ...) -> None: ...

class GossipMessage(_message.Message):
    __slots__ = ("hello", "header", "chunk")
    HELLO_FIELD_NUMBER: _ClassVar[int]
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    hello: _handshake_pb2.Hello
    header: GossipHeader
    chunk: bytes
    def __init__(self, hello: _Optional[_Union[_handshake_pb2.Hello, _Mapping]] = ..., header: _Optional[_Union[GossipHeader, _Mapping]] = ..., chunk: _Optional[bytes] = ...) -> None: ...
