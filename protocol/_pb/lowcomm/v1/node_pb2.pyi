from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DialBackRequest(_message.Message):
    __slots__ = ("address",)
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    address: str
    def __init__(self, address: _Optional[str] = ...) -> None: ...

class DialBackReply(_message.Message):
    __slots__ = ("checked", "reachable", "error", "observed_host")
    CHECKED_FIELD_NUMBER: _ClassVar[int]
    REACHABLE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    OBSERVED_HOST_FIELD_NUMBER: _ClassVar[int]
    checked: bool
    reachable: bool
    error: str
    observed_host: str
    def __init__(self, checked: _Optional[bool] = ..., reachable: _Optional[bool] = ..., error: _Optional[str] = ..., observed_host: _Optional[str] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SwarmPeer(_message.Message):
    __slots__ = ("peer_id", "address", "outer_step", "params_sha256", "tokens_per_second", "client_mode", "bandwidth_bps")
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    OUTER_STEP_FIELD_NUMBER: _ClassVar[int]
    PARAMS_SHA256_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    CLIENT_MODE_FIELD_NUMBER: _ClassVar[int]
    BANDWIDTH_BPS_FIELD_NUMBER: _ClassVar[int]
    peer_id: str
    address: str
    outer_step: int
    params_sha256: str
    tokens_per_second: float
    client_mode: bool
    bandwidth_bps: float
    def __init__(self, peer_id: _Optional[str] = ..., address: _Optional[str] = ..., outer_step: _Optional[int] = ..., params_sha256: _Optional[str] = ..., tokens_per_second: _Optional[float] = ..., client_mode: _Optional[bool] = ..., bandwidth_bps: _Optional[float] = ...) -> None: ...

class NodeStatus(_message.Message):
    __slots__ = ("peer_id", "outer_step", "params_sha256", "swarm_peers", "loss", "eval_loss", "tokens_total", "phase", "swarm_outer_step_max", "rounds_completed", "tokens_per_second", "swarm", "multiaddrs", "codec", "mode", "consensus_distance", "version", "checkpoint_failure", "checkpoint_failed_step", "unreachable")
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    OUTER_STEP_FIELD_NUMBER: _ClassVar[int]
    PARAMS_SHA256_FIELD_NUMBER: _ClassVar[int]
    SWARM_PEERS_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    EVAL_LOSS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    SWARM_OUTER_STEP_MAX_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_COMPLETED_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    SWARM_FIELD_NUMBER: _ClassVar[int]
    MULTIADDRS_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    CONSENSUS_DISTANCE_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_FAILURE_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_FAILED_STEP_FIELD_NUMBER: _ClassVar[int]
    UNREACHABLE_FIELD_NUMBER: _ClassVar[int]
    peer_id: str
    outer_step: int
    params_sha256: str
    swarm_peers: int
    loss: float
    eval_loss: float
    tokens_total: int
    phase: str
    swarm_outer_step_max: int
    rounds_completed: int
    tokens_per_second: float
    swarm: _containers.RepeatedCompositeFieldContainer[SwarmPeer]
    multiaddrs: _containers.RepeatedScalarFieldContainer[str]
    codec: str
    mode: str
    consensus_distance: float
    version: str
    checkpoint_failure: str
    checkpoint_failed_step: int
    unreachable: str
    def __init__(self, peer_id: _Optional[str] = ..., outer_step: _Optional[int] = ..., params_sha256: _Optional[str] = ..., swarm_peers: _Optional[int] = ..., loss: _Optional[float] = ..., eval_loss: _Optional[float] = ..., tokens_total: _Optional[int] = ..., phase: _Optional[str] = ..., swarm_outer_step_max: _Optional[int] = ..., rounds_completed: _Optional[int] = ..., tokens_per_second: _Optional[float] = ..., swarm: _Optional[_Iterable[_Union[SwarmPeer, _Mapping]]] = ..., multiaddrs: _Optional[_Iterable[str]] = ..., codec: _Optional[str] = ..., mode: _Optional[str] = ..., consensus_distance: _Optional[float] = ..., version: _Optional[str] = ..., checkpoint_failure: _Optional[str] = ..., checkpoint_failed_step: _Optional[int] = ..., unreachable: _Optional[str] = ...) -> None: ...
