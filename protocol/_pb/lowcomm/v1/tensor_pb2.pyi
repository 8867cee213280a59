from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from typing import ClassVar as _ClassVar

DESCRIPTOR: _descriptor.FileDescriptor

class Codec(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CODEC_UNSPECIFIED: _ClassVar[Codec]
    CODEC_FP32: _ClassVar[Codec]
    CODEC_FP16: _ClassVar[Codec]
    CODEC_BF16: _ClassVar[Codec]
    CODEC_INT8: _ClassVar[Codec]
    CODEC_INT4: _ClassVar[Codec]
    CODEC_TOPK: _ClassVar[Codec]
    CODEC_SPARSELOCO: _ClassVar[Codec]
CODEC_UNSPECIFIED: Codec
CODEC_FP32: Codec
CODEC_FP16: Codec
CODEC_BF16: Codec
CODEC_INT8: Codec
CODEC_INT4: Codec
CODEC_TOPK: Codec
CODEC_SPARSELOCO: Codec
