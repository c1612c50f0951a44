from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class OpType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    OP_TYPE_UNSPECIFIED: _ClassVar[OpType]
    ALLREDUCE: _ClassVar[OpType]
    ALLGATHER: _ClassVar[OpType]
    BROADCAST: _ClassVar[OpType]
    ALLTOALL: _ClassVar[OpType]
    REDUCESCATTER: _ClassVar[OpType]
    BARRIER: _ClassVar[OpType]
    JOIN: _ClassVar[OpType]
    ADD_PROCESS_SET: _ClassVar[OpType]
    REMOVE_PROCESS_SET: _ClassVar[OpType]

class ReduceOp(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    REDUCE_OP_UNSPECIFIED: _ClassVar[ReduceOp]
    SUM: _ClassVar[ReduceOp]
    AVERAGE: _ClassVar[ReduceOp]
    MIN: _ClassVar[ReduceOp]
    MAX: _ClassVar[ReduceOp]
    PRODUCT: _ClassVar[ReduceOp]
    ADASUM: _ClassVar[ReduceOp]

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    UINT8: _ClassVar[DType]
    INT8: _ClassVar[DType]
    UINT16: _ClassVar[DType]
    INT16: _ClassVar[DType]
    INT32: _ClassVar[DType]
    INT64: _ClassVar[DType]
    FLOAT16: _ClassVar[DType]
    BFLOAT16: _ClassVar[DType]
    FLOAT32: _ClassVar[DType]
    FLOAT64: _ClassVar[DType]
    BOOL: _ClassVar[DType]

class ErrorKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ERROR_KIND_UNSPECIFIED: _ClassVar[ErrorKind]
    MISMATCH: _ClassVar[ErrorKind]
    INVALID: _ClassVar[ErrorKind]
    STALL: _ClassVar[ErrorKind]
    PEER_LOST: _ClassVar[ErrorKind]
    COORDINATOR_LOST: _ClassVar[ErrorKind]
    SHUTDOWN: _ClassVar[ErrorKind]
    UNKNOWN_PROCESS_SET: _ClassVar[ErrorKind]
OP_TYPE_UNSPECIFIED: OpType
ALLREDUCE: OpType
ALLGATHER: OpType
BROADCAST: OpType
ALLTOALL: OpType
REDUCESCATTER: OpType
BARRIER: OpType
JOIN: OpType
ADD_PROCESS_SET: OpType
REMOVE_PROCESS_SET: OpType
REDUCE_OP_UNSPECIFIED: ReduceOp
SUM: ReduceOp
AVERAGE: ReduceOp
MIN: ReduceOp
MAX: ReduceOp
PRODUCT: ReduceOp
ADASUM: ReduceOp
DTYPE_UNSPECIFIED: DType
UINT8: DType
INT8: DType
UINT16: DType
INT16: DType
INT32: DType
INT64: DType
FLOAT16: DType
BFLOAT16: DType
FLOAT32: DType
FLOAT64: DType
BOOL: DType
ERROR_KIND_UNSPECIFIED: ErrorKind
MISMATCH: ErrorKind
INVALID: ErrorKind
STALL: ErrorKind
PEER_LOST: ErrorKind
COORDINATOR_LOST: ErrorKind
SHUTDOWN: ErrorKind
UNKNOWN_PROCESS_SET: ErrorKind

class RegisterRequest(_message.Message):
    __slots__ = ("rank", "size", "hostname", "pid", "data_address", "job_id", "cycle_address")
    RANK_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    HOSTNAME_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    DATA_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    CYCLE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    rank: int
    size: int
    hostname: str
    pid: int
    data_address: str
    job_id: str
    cycle_address: str
    def __init__(self, rank: _Optional[int] = ..., size: _Optional[int] = ..., hostname: _Optional[str] = ..., pid: _Optional[int] = ..., data_address: _Optional[str] = ..., job_id: _Optional[str] = ..., cycle_address: _Optional[str] = ...) -> None: ...

class RegisterResponse(_message.Message):
    __slots__ = ("peers", "local_rank", "local_size", "cross_rank", "cross_size", "is_homogeneous", "fusion_threshold_bytes", "cache_capacity", "error")
    PEERS_FIELD_NUMBER: _ClassVar[int]
    LOCAL_RANK_FIELD_NUMBER: _ClassVar[int]
    LOCAL_SIZE_FIELD_NUMBER: _ClassVar[int]
    CROSS_RANK_FIELD_NUMBER: _ClassVar[int]
    CROSS_SIZE_FIELD_NUMBER: _ClassVar[int]
    IS_HOMOGENEOUS_FIELD_NUMBER: _ClassVar[int]
    FUSION_THRESHOLD_BYTES_FIELD_NUMBER: _ClassVar[int]
    CACHE_CAPACITY_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    peers: _containers.RepeatedCompositeFieldContainer[PeerInfo]
    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int
    is_homogeneous: bool
    fusion_threshold_bytes: int
    cache_capacity: int
    error: Error
    def __init__(self, peers: _Optional[_Iterable[_Union[PeerInfo, _Mapping]]] = ..., local_rank: _Optional[int] = ..., local_size: _Optional[int] = ..., cross_rank: _Optional[int] = ..., cross_size: _Optional[int] = ..., is_homogeneous: bool = ..., fusion_threshold_bytes: _Optional[int] = ..., cache_capacity: _Optional[int] = ..., error: _Optional[_Union[Error, _Mapping]] = ...) -> None: ...

class PeerInfo(_message.Message):
    __slots__ = ("rank", "hostname", "pid", "data_address", "cycle_address")
    RANK_FIELD_NUMBER: _ClassVar[int]
    HOSTNAME_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    DATA_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    CYCLE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    rank: int
    hostname: str
    pid: int
    data_address: str
    cycle_address: str
    def __init__(self, rank: _Optional[int] = ..., hostname: _Optional[str] = ..., pid: _Optional[int] = ..., data_address: _Optional[str] = ..., cycle_address: _Optional[str] = ...) -> None: ...

class Request(_message.Message):
    __slots__ = ("name", "op", "dtype", "shape", "reduce_op", "root_rank", "prescale_factor", "postscale_factor", "process_set_id", "splits", "member_ranks", "local_error", "memory", "group_size", "call_id", "group_names")
    NAME_FIELD_NUMBER: _ClassVar[int]
    OP_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    REDUCE_OP_FIELD_NUMBER: _ClassVar[int]
    ROOT_RANK_FIELD_NUMBER: _ClassVar[int]
    PRESCALE_FACTOR_FIELD_NUMBER: _ClassVar[int]
    POSTSCALE_FACTOR_FIELD_NUMBER: _ClassVar[int]
    PROCESS_SET_ID_FIELD_NUMBER: _ClassVar[int]
    SPLITS_FIELD_NUMBER: _ClassVar[int]
    MEMBER_RANKS_FIELD_NUMBER: _ClassVar[int]
    LOCAL_ERROR_FIELD_NUMBER: _ClassVar[int]
    MEMORY_FIELD_NUMBER: _ClassVar[int]
    GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_NAMES_FIELD_NUMBER: _ClassVar[int]
    name: str
    op: OpType
    dtype: DType
    shape: _containers.RepeatedScalarFieldContainer[int]
    reduce_op: ReduceOp
    root_rank: int
    prescale_factor: float
    postscale_factor: float
    process_set_id: int
    splits: _containers.RepeatedScalarFieldContainer[int]
    member_ranks: _containers.RepeatedScalarFieldContainer[int]
    local_error: str
    memory: str
    group_size: int
    call_id: int
    group_names: int
    def __init__(self, name: _Optional[str] = ..., op: _Optional[_Union[OpType, str]] = ..., dtype: _Optional[_Union[DType, str]] = ..., shape: _Optional[_Iterable[int]] = ..., reduce_op: _Optional[_Union[ReduceOp, str]] = ..., root_rank: _Optional[int] = ..., prescale_factor: _Optional[float] = ..., postscale_factor: _Optional[float] = ..., process_set_id: _Optional[int] = ..., splits: _Optional[_Iterable[int]] = ..., member_ranks: _Optional[_Iterable[int]] = ..., local_error: _Optional[str] = ..., memory: _Optional[str] = ..., group_size: _Optional[int] = ..., call_id: _Optional[int] = ..., group_names: _Optional[int] = ...) -> None: ...

class RequestList(_message.Message):
    __slots__ = ("rank", "requests")
    RANK_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    rank: int
    requests: _containers.RepeatedCompositeFieldContainer[Request]
    def __init__(self, rank: _Optional[int] = ..., requests: _Optional[_Iterable[_Union[Request, _Mapping]]] = ...) -> None: ...

class TensorEntry(_message.Message):
    __slots__ = ("name", "shape", "first_dims", "splits", "cache_slot", "cache_inline_offset", "ready_us")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    FIRST_DIMS_FIELD_NUMBER: _ClassVar[int]
    SPLITS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SLOT_FIELD_NUMBER: _ClassVar[int]
    CACHE_INLINE_OFFSET_FIELD_NUMBER: _ClassVar[int]
    READY_US_FIELD_NUMBER: _ClassVar[int]
    name: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    first_dims: _containers.RepeatedScalarFieldContainer[int]
    splits: _containers.RepeatedScalarFieldContainer[int]
    cache_slot: int
    cache_inline_offset: int
    ready_us: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, name: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., first_dims: _Optional[_Iterable[int]] = ..., splits: _Optional[_Iterable[int]] = ..., cache_slot: _Optional[int] = ..., cache_inline_offset: _Optional[int] = ..., ready_us: _Optional[_Iterable[int]] = ...) -> None: ...

class Response(_message.Message):
    __slots__ = ("seq", "op", "process_set_id", "tensors", "dtype", "reduce_op", "root_rank", "prescale_factor", "postscale_factor", "joined_ranks", "error", "new_process_set_id", "member_ranks", "last_joined_rank", "tuning", "memory")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    OP_FIELD_NUMBER: _ClassVar[int]
    PROCESS_SET_ID_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    REDUCE_OP_FIELD_NUMBER: _ClassVar[int]
    ROOT_RANK_FIELD_NUMBER: _ClassVar[int]
    PRESCALE_FACTOR_FIELD_NUMBER: _ClassVar[int]
    POSTSCALE_FACTOR_FIELD_NUMBER: _ClassVar[int]
    JOINED_RANKS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    NEW_PROCESS_SET_ID_FIELD_NUMBER: _ClassVar[int]
    MEMBER_RANKS_FIELD_NUMBER: _ClassVar[int]
    LAST_JOINED_RANK_FIELD_NUMBER: _ClassVar[int]
    TUNING_FIELD_NUMBER: _ClassVar[int]
    MEMORY_FIELD_NUMBER: _ClassVar[int]
    seq: int
    op: OpType
    process_set_id: int
    tensors: _containers.RepeatedCompositeFieldContainer[TensorEntry]
    dtype: DType
    reduce_op: ReduceOp
    root_rank: int
    prescale_factor: float
    postscale_factor: float
    joined_ranks: _containers.RepeatedScalarFieldContainer[int]
    error: Error
    new_process_set_id: int
    member_ranks: _containers.RepeatedScalarFieldContainer[int]
    last_joined_rank: int
    tuning: TuningSetting
    memory: str
    def __init__(self, seq: _Optional[int] = ..., op: _Optional[_Union[OpType, str]] = ..., process_set_id: _Optional[int] = ..., tensors: _Optional[_Iterable[_Union[TensorEntry, _Mapping]]] = ..., dtype: _Optional[_Union[DType, str]] = ..., reduce_op: _Optional[_Union[ReduceOp, str]] = ..., root_rank: _Optional[int] = ..., prescale_factor: _Optional[float] = ..., postscale_factor: _Optional[float] = ..., joined_ranks: _Optional[_Iterable[int]] = ..., error: _Optional[_Union[Error, _Mapping]] = ..., new_process_set_id: _Optional[int] = ..., member_ranks: _Optional[_Iterable[int]] = ..., last_joined_rank: _Optional[int] = ..., tuning: _Optional[_Union[TuningSetting, _Mapping]] = ..., memory: _Optional[str] = ...) -> None: ...

class TuningSetting(_message.Message):
    __slots__ = ("id", "fusion_threshold_bytes", "small_message_bytes", "tcp_chunk_bytes", "hierarchical_allreduce", "shm_allreduce_algorithm")
    ID_FIELD_NUMBER: _ClassVar[int]
    FUSION_THRESHOLD_BYTES_FIELD_NUMBER: _ClassVar[int]
    SMALL_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    TCP_CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    HIERARCHICAL_ALLREDUCE_FIELD_NUMBER: _ClassVar[int]
    SHM_ALLREDUCE_ALGORITHM_FIELD_NUMBER: _ClassVar[int]
    id: int
    fusion_threshold_bytes: int
    small_message_bytes: int
    tcp_chunk_bytes: int
    hierarchical_allreduce: str
    shm_allreduce_algorithm: str
    def __init__(self, id: _Optional[int] = ..., fusion_threshold_bytes: _Optional[int] = ..., small_message_bytes: _Optional[int] = ..., tcp_chunk_bytes: _Optional[int] = ..., hierarchical_allreduce: _Optional[str] = ..., shm_allreduce_algorithm: _Optional[str] = ...) -> None: ...

class ResponseList(_message.Message):
    __slots__ = ("responses",)
    RESPONSES_FIELD_NUMBER: _ClassVar[int]
    responses: _containers.RepeatedCompositeFieldContainer[Response]
    def __init__(self, responses: _Optional[_Iterable[_Union[Response, _Mapping]]] = ...) -> None: ...

class Error(_message.Message):
    __slots__ = ("kind", "message", "op", "name", "rank_a", "value_a", "rank_b", "value_b", "origin_rank", "origin_host", "origin_pid", "cause", "seq")
    KIND_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    OP_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    RANK_A_FIELD_NUMBER: _ClassVar[int]
    VALUE_A_FIELD_NUMBER: _ClassVar[int]
    RANK_B_FIELD_NUMBER: _ClassVar[int]
    VALUE_B_FIELD_NUMBER: _ClassVar[int]
    ORIGIN_RANK_FIELD_NUMBER: _ClassVar[int]
    ORIGIN_HOST_FIELD_NUMBER: _ClassVar[int]
    ORIGIN_PID_FIELD_NUMBER: _ClassVar[int]
    CAUSE_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    kind: ErrorKind
    message: str
    op: str
    name: str
    rank_a: int
    value_a: str
    rank_b: int
    value_b: str
    origin_rank: int
    origin_host: str
    origin_pid: int
    cause: str
    seq: int
    def __init__(self, kind: _Optional[_Union[ErrorKind, str]] = ..., message: _Optional[str] = ..., op: _Optional[str] = ..., name: _Optional[str] = ..., rank_a: _Optional[int] = ..., value_a: _Optional[str] = ..., rank_b: _Optional[int] = ..., value_b: _Optional[str] = ..., origin_rank: _Optional[int] = ..., origin_host: _Optional[str] = ..., origin_pid: _Optional[int] = ..., cause: _Optional[str] = ..., seq: _Optional[int] = ...) -> None: ...

class Heartbeat(_message.Message):
    __slots__ = ("sent_unix_s",)
    SENT_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    sent_unix_s: float
    def __init__(self, sent_unix_s: _Optional[float] = ...) -> None: ...

class Goodbye(_message.Message):
    __slots__ = ("rank", "reason")
    RANK_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    rank: int
    reason: str
    def __init__(self, rank: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class WorkerMessage(_message.Message):
    __slots__ = ("hello", "requests", "heartbeat", "goodbye")
    HELLO_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    GOODBYE_FIELD_NUMBER: _ClassVar[int]
    hello: Hello
    requests: RequestList
    heartbeat: Heartbeat
    goodbye: Goodbye
    def __init__(self, hello: _Optional[_Union[Hello, _Mapping]] = ..., requests: _Optional[_Union[RequestList, _Mapping]] = ..., heartbeat: _Optional[_Union[Heartbeat, _Mapping]] = ..., goodbye: _Optional[_Union[Goodbye, _Mapping]] = ...) -> None: ...

class Hello(_message.Message):
    __slots__ = ("rank", "job_id")
    RANK_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    rank: int
    job_id: str
    def __init__(self, rank: _Optional[int] = ..., job_id: _Optional[str] = ...) -> None: ...

class CoordinatorMessage(_message.Message):
    __slots__ = ("responses", "abort", "heartbeat", "warning", "cache_flush")
    RESPONSES_FIELD_NUMBER: _ClassVar[int]
    ABORT_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    WARNING_FIELD_NUMBER: _ClassVar[int]
    CACHE_FLUSH_FIELD_NUMBER: _ClassVar[int]
    responses: ResponseList
    abort: Error
    heartbeat: Heartbeat
    warning: Error
    cache_flush: CacheFlush
    def __init__(self, responses: _Optional[_Union[ResponseList, _Mapping]] = ..., abort: _Optional[_Union[Error, _Mapping]] = ..., heartbeat: _Optional[_Union[Heartbeat, _Mapping]] = ..., warning: _Optional[_Union[Error, _Mapping]] = ..., cache_flush: _Optional[_Union[CacheFlush, _Mapping]] = ...) -> None: ...

class CacheFlush(_message.Message):
    __slots__ = ("reason",)
    REASON_FIELD_NUMBER: _ClassVar[int]
    reason: str
    def __init__(self, reason: _Optional[str] = ...) -> None: ...

class PeerMessage(_message.Message):
    __slots__ = ("hello", "worker", "heartbeat", "closed")
    HELLO_FIELD_NUMBER: _ClassVar[int]
    WORKER_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    CLOSED_FIELD_NUMBER: _ClassVar[int]
    hello: PeerHello
    worker: RankMessage
    heartbeat: Heartbeat
    closed: RankClosed
    def __init__(self, hello: _Optional[_Union[PeerHello, _Mapping]] = ..., worker: _Optional[_Union[RankMessage, _Mapping]] = ..., heartbeat: _Optional[_Union[Heartbeat, _Mapping]] = ..., closed: _Optional[_Union[RankClosed, _Mapping]] = ...) -> None: ...

class PeerHello(_message.Message):
    __slots__ = ("job_id", "hostname", "pid")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    HOSTNAME_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    hostname: str
    pid: int
    def __init__(self, job_id: _Optional[str] = ..., hostname: _Optional[str] = ..., pid: _Optional[int] = ...) -> None: ...

class RankMessage(_message.Message):
    __slots__ = ("rank", "message")
    RANK_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    rank: int
    message: WorkerMessage
    def __init__(self, rank: _Optional[int] = ..., message: _Optional[_Union[WorkerMessage, _Mapping]] = ...) -> None: ...

class RankClosed(_message.Message):
    __slots__ = ("rank", "cause")
    RANK_FIELD_NUMBER: _ClassVar[int]
    CAUSE_FIELD_NUMBER: _ClassVar[int]
    rank: int
    cause: str
    def __init__(self, rank: _Optional[int] = ..., cause: _Optional[str] = ...) -> None: ...

class LeaderMessage(_message.Message):
    __slots__ = ("workers", "heartbeat", "abort")
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    ABORT_FIELD_NUMBER: _ClassVar[int]
    workers: RanksMessage
    heartbeat: Heartbeat
    abort: Error
    def __init__(self, workers: _Optional[_Union[RanksMessage, _Mapping]] = ..., heartbeat: _Optional[_Union[Heartbeat, _Mapping]] = ..., abort: _Optional[_Union[Error, _Mapping]] = ...) -> None: ...

class RanksMessage(_message.Message):
    __slots__ = ("ranks", "message")
    RANKS_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    ranks: _containers.RepeatedScalarFieldContainer[int]
    message: CoordinatorMessage
    def __init__(self, ranks: _Optional[_Iterable[int]] = ..., message: _Optional[_Union[CoordinatorMessage, _Mapping]] = ...) -> None: ...

class PingRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PingResponse(_message.Message):
    __slots__ = ("job_id", "registered", "size", "leader", "pid")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    REGISTERED_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    LEADER_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    registered: int
    size: int
    leader: bool
    pid: int
    def __init__(self, job_id: _Optional[str] = ..., registered: _Optional[int] = ..., size: _Optional[int] = ..., leader: bool = ..., pid: _Optional[int] = ...) -> None: ...
