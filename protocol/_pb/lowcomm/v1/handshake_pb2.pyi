from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class Hello(_message.Message):
    __slots__ = ("protocol_version", "config_fingerprint", "run_config_json", "peer_id")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    CONFIG_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    RUN_CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    config_fingerprint: str
    run_config_json: str
    peer_id: str
    def __init__(self, protocol_version: _Optional[int] = ..., config_fingerprint: _Optional[str] = ..., run_config_json: _Optional[str] = ..., peer_id: _Optional[str] = ...) -> None: ...
