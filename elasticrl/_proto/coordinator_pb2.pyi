from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class MemberState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MEMBER_STATE_UNSPECIFIED: _ClassVar[MemberState]
    MEMBER_STATE_LIVE: _ClassVar[MemberState]
    MEMBER_STATE_LEFT: _ClassVar[MemberState]
    MEMBER_STATE_EVICTED: _ClassVar[MemberState]

class EventType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    EVENT_TYPE_UNSPECIFIED: _ClassVar[EventType]
    EVENT_TYPE_JOINED: _ClassVar[EventType]
    EVENT_TYPE_LEFT: _ClassVar[EventType]
    EVENT_TYPE_EVICTED: _ClassVar[EventType]
    EVENT_TYPE_ROUND: _ClassVar[EventType]
    EVENT_TYPE_CLOSED: _ClassVar[EventType]

class TimeoutPolicy(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TIMEOUT_POLICY_UNSPECIFIED: _ClassVar[TimeoutPolicy]
    TIMEOUT_POLICY_EVICT_MISSING: _ClassVar[TimeoutPolicy]
    TIMEOUT_POLICY_REPORT: _ClassVar[TimeoutPolicy]

class BarrierOutcome(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    BARRIER_OUTCOME_UNSPECIFIED: _ClassVar[BarrierOutcome]
    BARRIER_OUTCOME_COMPLETED: _ClassVar[BarrierOutcome]
    BARRIER_OUTCOME_TIMED_OUT: _ClassVar[BarrierOutcome]
    BARRIER_OUTCOME_PENDING: _ClassVar[BarrierOutcome]

class RoundStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ROUND_STATUS_UNSPECIFIED: _ClassVar[RoundStatus]
    ROUND_STATUS_COMPLETE: _ClassVar[RoundStatus]
    ROUND_STATUS_WAITING: _ClassVar[RoundStatus]
    ROUND_STATUS_TIMED_OUT: _ClassVar[RoundStatus]
    ROUND_STATUS_CLOSED: _ClassVar[RoundStatus]
MEMBER_STATE_UNSPECIFIED: MemberState
MEMBER_STATE_LIVE: MemberState
MEMBER_STATE_LEFT: MemberState
MEMBER_STATE_EVICTED: MemberState
EVENT_TYPE_UNSPECIFIED: EventType
EVENT_TYPE_JOINED: EventType
EVENT_TYPE_LEFT: EventType
EVENT_TYPE_EVICTED: EventType
EVENT_TYPE_ROUND: EventType
EVENT_TYPE_CLOSED: EventType
TIMEOUT_POLICY_UNSPECIFIED: TimeoutPolicy
TIMEOUT_POLICY_EVICT_MISSING: TimeoutPolicy
TIMEOUT_POLICY_REPORT: TimeoutPolicy
BARRIER_OUTCOME_UNSPECIFIED: BarrierOutcome
BARRIER_OUTCOME_COMPLETED: BarrierOutcome
BARRIER_OUTCOME_TIMED_OUT: BarrierOutcome
BARRIER_OUTCOME_PENDING: BarrierOutcome
ROUND_STATUS_UNSPECIFIED: RoundStatus
ROUND_STATUS_COMPLETE: RoundStatus
ROUND_STATUS_WAITING: RoundStatus
ROUND_STATUS_TIMED_OUT: RoundStatus
ROUND_STATUS_CLOSED: RoundStatus

class MemberRef(_message.Message):
    __slots__ = ("member_id", "incarnation")
    MEMBER_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    member_id: str
    incarnation: int
    def __init__(self, member_id: _Optional[str] = ..., incarnation: _Optional[int] = ...) -> None: ...

class MemberInfo(_message.Message):
    __slots__ = ("member_id", "incarnation", "host", "weight", "capabilities", "state", "lease_left_ms", "joined_epoch", "reason")
    class CapabilitiesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    MEMBER_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    CAPABILITIES_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    LEASE_LEFT_MS_FIELD_NUMBER: _ClassVar[int]
    JOINED_EPOCH_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    member_id: str
    incarnation: int
    host: str
    weight: float
    capabilities: _containers.ScalarMap[str, str]
    state: MemberState
    lease_left_ms: int
    joined_epoch: int
    reason: str
    def __init__(self, member_id: _Optional[str] = ..., incarnation: _Optional[int] = ..., host: _Optional[str] = ..., weight: _Optional[float] = ..., capabilities: _Optional[_Mapping[str, str]] = ..., state: _Optional[_Union[MemberState, str]] = ..., lease_left_ms: _Optional[int] = ..., joined_epoch: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class JoinRequest(_message.Message):
    __slots__ = ("run_id", "member_id", "host", "weight", "capabilities", "lease_ttl_ms", "request_id")
    class CapabilitiesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    MEMBER_ID_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    CAPABILITIES_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_MS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    member_id: str
    host: str
    weight: float
    capabilities: _containers.ScalarMap[str, str]
    lease_ttl_ms: int
    request_id: str
    def __init__(self, run_id: _Optional[str] = ..., member_id: _Optional[str] = ..., host: _Optional[str] = ..., weight: _Optional[float] = ..., capabilities: _Optional[_Mapping[str, str]] = ..., lease_ttl_ms: _Optional[int] = ..., request_id: _Optional[str] = ...) -> None: ...

class JoinResponse(_message.Message):
    __slots__ = ("member", "epoch", "lease_ttl_ms")
    MEMBER_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_MS_FIELD_NUMBER: _ClassVar[int]
    member: MemberRef
    epoch: int
    lease_ttl_ms: int
    def __init__(self, member: _Optional[_Union[MemberRef, _Mapping]] = ..., epoch: _Optional[int] = ..., lease_ttl_ms: _Optional[int] = ...) -> None: ...

class KeepAliveRequest(_message.Message):
    __slots__ = ("run_id", "member")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    MEMBER_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    member: MemberRef
    def __init__(self, run_id: _Optional[str] = ..., member: _Optional[_Union[MemberRef, _Mapping]] = ...) -> None: ...

class KeepAliveResponse(_message.Message):
    __slots__ = ("epoch", "lease_ttl_ms")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_MS_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    lease_ttl_ms: int
    def __init__(self, epoch: _Optional[int] = ..., lease_ttl_ms: _Optional[int] = ...) -> None: ...

class LeaveRequest(_message.Message):
    __slots__ = ("run_id", "member", "reason", "request_id")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    MEMBER_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    member: MemberRef
    reason: str
    request_id: str
    def __init__(self, run_id: _Optional[str] = ..., member: _Optional[_Union[MemberRef, _Mapping]] = ..., reason: _Optional[str] = ..., request_id: _Optional[str] = ...) -> None: ...

class LeaveResponse(_message.Message):
    __slots__ = ("epoch",)
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    def __init__(self, epoch: _Optional[int] = ...) -> None: ...

class MembershipEvent(_message.Message):
    __slots__ = ("type", "member", "epoch", "reason")
    TYPE_FIELD_NUMBER: _ClassVar[int]
    MEMBER_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    type: EventType
    member: MemberInfo
    epoch: int
    reason: str
    def __init__(self, type: _Optional[_Union[EventType, str]] = ..., member: _Optional[_Union[MemberInfo, _Mapping]] = ..., epoch: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class WatchRequest(_message.Message):
    __slots__ = ("run_id",)
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    def __init__(self, run_id: _Optional[str] = ...) -> None: ...

class WatchResponse(_message.Message):
    __slots__ = ("events", "snapshot")
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    events: _containers.RepeatedCompositeFieldContainer[MembershipEvent]
    snapshot: RunSnapshot
    def __init__(self, events: _Optional[_Iterable[_Union[MembershipEvent, _Mapping]]] = ..., snapshot: _Optional[_Union[RunSnapshot, _Mapping]] = ...) -> None: ...

class RunSnapshot(_message.Message):
    __slots__ = ("run_id", "epoch", "closed", "members", "round")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    CLOSED_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    epoch: int
    closed: bool
    members: _containers.RepeatedCompositeFieldContainer[MemberInfo]
    round: RoundInfo
    def __init__(self, run_id: _Optional[str] = ..., epoch: _Optional[int] = ..., closed: _Optional[bool] = ..., members: _Optional[_Iterable[_Union[MemberInfo, _Mapping]]] = ..., round: _Optional[_Union[RoundInfo, _Mapping]] = ...) -> None: ...

class ArriveRequest(_message.Message):
    __slots__ = ("run_id", "member", "name", "epoch", "timeout_ms", "policy", "wait_ms")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    MEMBER_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    member: MemberRef
    name: str
    epoch: int
    timeout_ms: int
    policy: TimeoutPolicy
    wait_ms: int
    def __init__(self, run_id: _Optional[str] = ..., member: _Optional[_Union[MemberRef, _Mapping]] = ..., name: _Optional[str] = ..., epoch: _Optional[int] = ..., timeout_ms: _Optional[int] = ..., policy: _Optional[_Union[TimeoutPolicy, str]] = ..., wait_ms: _Optional[int] = ...) -> None: ...

class ArriveResponse(_message.Message):
    __slots__ = ("outcome", "arrived", "evicted", "missing", "epoch", "reason")
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    ARRIVED_FIELD_NUMBER: _ClassVar[int]
    EVICTED_FIELD_NUMBER: _ClassVar[int]
    MISSING_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    outcome: BarrierOutcome
    arrived: _containers.RepeatedScalarFieldContainer[str]
    evicted: _containers.RepeatedScalarFieldContainer[str]
    missing: _containers.RepeatedScalarFieldContainer[str]
    epoch: int
    reason: str
    def __init__(self, outcome: _Optional[_Union[BarrierOutcome, str]] = ..., arrived: _Optional[_Iterable[str]] = ..., evicted: _Optional[_Iterable[str]] = ..., missing: _Optional[_Iterable[str]] = ..., epoch: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class BarrierInfo(_message.Message):
    __slots__ = ("name", "arrived", "waiting_for", "age_ms", "timeout_ms")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ARRIVED_FIELD_NUMBER: _ClassVar[int]
    WAITING_FOR_FIELD_NUMBER: _ClassVar[int]
    AGE_MS_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    name: str
    arrived: _containers.RepeatedScalarFieldContainer[str]
    waiting_for: _containers.RepeatedScalarFieldContainer[str]
    age_ms: int
    timeout_ms: int
    def __init__(self, name: _Optional[str] = ..., arrived: _Optional[_Iterable[str]] = ..., waiting_for: _Optional[_Iterable[str]] = ..., age_ms: _Optional[int] = ..., timeout_ms: _Optional[int] = ...) -> None: ...

class KVSetRequest(_message.Message):
    __slots__ = ("run_id", "pairs", "request_id", "member")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    PAIRS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MEMBER_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    pairs: _containers.RepeatedCompositeFieldContainer[KVPair]
    request_id: str
    member: MemberRef
    def __init__(self, run_id: _Optional[str] = ..., pairs: _Optional[_Iterable[_Union[KVPair, _Mapping]]] = ..., request_id: _Optional[str] = ..., member: _Optional[_Union[MemberRef, _Mapping]] = ...) -> None: ...

class KVPair(_message.Message):
    __slots__ = ("key", "value")
    KEY_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    key: bytes
    value: bytes
    def __init__(self, key: _Optional[bytes] = ..., value: _Optional[bytes] = ...) -> None: ...

class KVSetResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class KVGetRequest(_message.Message):
    __slots__ = ("run_id", "keys", "wait_ms")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    wait_ms: int
    def __init__(self, run_id: _Optional[str] = ..., keys: _Optional[_Iterable[bytes]] = ..., wait_ms: _Optional[int] = ...) -> None: ...

class KVGetResponse(_message.Message):
    __slots__ = ("values", "missing")
    VALUES_FIELD_NUMBER: _ClassVar[int]
    MISSING_FIELD_NUMBER: _ClassVar[int]
    values: _containers.RepeatedScalarFieldContainer[bytes]
    missing: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, values: _Optional[_Iterable[bytes]] = ..., missing: _Optional[_Iterable[bytes]] = ...) -> None: ...

class KVCompareSetRequest(_message.Message):
    __slots__ = ("run_id", "key", "expected", "desired", "request_id", "member")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_FIELD_NUMBER: _ClassVar[int]
    DESIRED_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MEMBER_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    key: bytes
    expected: bytes
    desired: bytes
    request_id: str
    member: MemberRef
    def __init__(self, run_id: _Optional[str] = ..., key: _Optional[bytes] = ..., expected: _Optional[bytes] = ..., desired: _Optional[bytes] = ..., request_id: _Optional[str] = ..., member: _Optional[_Union[MemberRef, _Mapping]] = ...) -> None: ...

class KVCompareSetResponse(_message.Message):
    __slots__ = ("value", "swapped")
    VALUE_FIELD_NUMBER: _ClassVar[int]
    SWAPPED_FIELD_NUMBER: _ClassVar[int]
    value: bytes
    swapped: bool
    def __init__(self, value: _Optional[bytes] = ..., swapped: _Optional[bool] = ...) -> None: ...

class KVAddRequest(_message.Message):
    __slots__ = ("run_id", "key", "delta", "request_id", "member")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MEMBER_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    key: bytes
    delta: int
    request_id: str
    member: MemberRef
    def __init__(self, run_id: _Optional[str] = ..., key: _Optional[bytes] = ..., delta: _Optional[int] = ..., request_id: _Optional[str] = ..., member: _Optional[_Union[MemberRef, _Mapping]] = ...) -> None: ...

class KVAddResponse(_message.Message):
    __slots__ = ("value",)
    VALUE_FIELD_NUMBER: _ClassVar[int]
    value: int
    def __init__(self, value: _Optional[int] = ...) -> None: ...

class KVDeleteRequest(_message.Message):
    __slots__ = ("run_id", "key", "request_id", "member")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MEMBER_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    key: bytes
    request_id: str
    member: MemberRef
    def __init__(self, run_id: _Optional[str] = ..., key: _Optional[bytes] = ..., request_id: _Optional[str] = ..., member: _Optional[_Union[MemberRef, _Mapping]] = ...) -> None: ...

class KVDeleteResponse(_message.Message):
    __slots__ = ("deleted",)
    DELETED_FIELD_NUMBER: _ClassVar[int]
    deleted: bool
    def __init__(self, deleted: _Optional[bool] = ...) -> None: ...

class KVNumKeysRequest(_message.Message):
    __slots__ = ("run_id",)
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    def __init__(self, run_id: _Optional[str] = ...) -> None: ...

class KVNumKeysResponse(_message.Message):
    __slots__ = ("count",)
    COUNT_FIELD_NUMBER: _ClassVar[int]
    count: int
    def __init__(self, count: _Optional[int] = ...) -> None: ...

class RoundConfig(_message.Message):
    __slots__ = ("min_nodes", "max_nodes", "last_call_ms", "join_timeout_ms", "rejoin_timeout_ms")
    MIN_NODES_FIELD_NUMBER: _ClassVar[int]
    MAX_NODES_FIELD_NUMBER: _ClassVar[int]
    LAST_CALL_MS_FIELD_NUMBER: _ClassVar[int]
    JOIN_TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    REJOIN_TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    min_nodes: int
    max_nodes: int
    last_call_ms: int
    join_timeout_ms: int
    rejoin_timeout_ms: int
    def __init__(self, min_nodes: _Optional[int] = ..., max_nodes: _Optional[int] = ..., last_call_ms: _Optional[int] = ..., join_timeout_ms: _Optional[int] = ..., rejoin_timeout_ms: _Optional[int] = ...) -> None: ...

class RoundInfo(_message.Message):
    __slots__ = ("round", "participants", "waiting", "lost", "config")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    PARTICIPANTS_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    LOST_FIELD_NUMBER: _ClassVar[int]
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    round: int
    participants: _containers.RepeatedScalarFieldContainer[str]
    waiting: _containers.RepeatedScalarFieldContainer[str]
    lost: _containers.RepeatedScalarFieldContainer[str]
    config: RoundConfig
    def __init__(self, round: _Optional[int] = ..., participants: _Optional[_Iterable[str]] = ..., waiting: _Optional[_Iterable[str]] = ..., lost: _Optional[_Iterable[str]] = ..., config: _Optional[_Union[RoundConfig, _Mapping]] = ...) -> None: ...

class RoundJoinRequest(_message.Message):
    __slots__ = ("run_id", "member", "config", "after_round", "wait_ms")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    MEMBER_FIELD_NUMBER: _ClassVar[int]
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    AFTER_ROUND_FIELD_NUMBER: _ClassVar[int]
    WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    member: MemberRef
    config: RoundConfig
    after_round: int
    wait_ms: int
    def __init__(self, run_id: _Optional[str] = ..., member: _Optional[_Union[MemberRef, _Mapping]] = ..., config: _Optional[_Union[RoundConfig, _Mapping]] = ..., after_round: _Optional[int] = ..., wait_ms: _Optional[int] = ...) -> None: ...

class RoundJoinResponse(_message.Message):
    __slots__ = ("status", "round", "rank", "world_size", "participants", "reason", "standby")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    PARTICIPANTS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    STANDBY_FIELD_NUMBER: _ClassVar[int]
    status: RoundStatus
    round: int
    rank: int
    world_size: int
    participants: _containers.RepeatedScalarFieldContainer[str]
    reason: str
    standby: bool
    def __init__(self, status: _Optional[_Union[RoundStatus, str]] = ..., round: _Optional[int] = ..., rank: _Optional[int] = ..., world_size: _Optional[int] = ..., participants: _Optional[_Iterable[str]] = ..., reason: _Optional[str] = ..., standby: _Optional[bool] = ...) -> None: ...

class CloseRunRequest(_message.Message):
    __slots__ = ("run_id", "reason")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    reason: str
    def __init__(self, run_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class CloseRunResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ("run_id", "include_departed")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_DEPARTED_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    include_departed: bool
    def __init__(self, run_id: _Optional[str] = ..., include_departed: _Optional[bool] = ...) -> None: ...

class RunStatus(_message.Message):
    __slots__ = ("snapshot", "open_barriers", "departed", "kv_keys")
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    OPEN_BARRIERS_FIELD_NUMBER: _ClassVar[int]
    DEPARTED_FIELD_NUMBER: _ClassVar[int]
    KV_KEYS_FIELD_NUMBER: _ClassVar[int]
    snapshot: RunSnapshot
    open_barriers: _containers.RepeatedCompositeFieldContainer[BarrierInfo]
    departed: _containers.RepeatedCompositeFieldContainer[MemberInfo]
    kv_keys: int
    def __init__(self, snapshot: _Optional[_Union[RunSnapshot, _Mapping]] = ..., open_barriers: _Optional[_Iterable[_Union[BarrierInfo, _Mapping]]] = ..., departed: _Optional[_Iterable[_Union[MemberInfo, _Mapping]]] = ..., kv_keys: _Optional[int] = ...) -> None: ...

class StatusResponse(_message.Message):
    __slots__ = ("runs", "uptime_s", "version", "lease_ttl_ms")
    RUNS_FIELD_NUMBER: _ClassVar[int]
    UPTIME_S_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_MS_FIELD_NUMBER: _ClassVar[int]
    runs: _containers.RepeatedCompositeFieldContainer[RunStatus]
    uptime_s: float
    version: str
    lease_ttl_ms: int
    def __init__(self, runs: _Optional[_Iterable[_Union[RunStatus, _Mapping]]] = ..., uptime_s: _Optional[float] = ..., version: _Optional[str] = ..., lease_ttl_ms: _Optional[int] = ...) -> None: ...

class Error(_message.Message):
    __slots__ = ("code", "error_class", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    ERROR_CLASS_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: int
    error_class: str
    message: str
    def __init__(self, code: _Optional[int] = ..., error_class: _Optional[str] = ..., message: _Optional[str] = ...) -> None: ...

class SessionRequest(_message.Message):
    __slots__ = ("id", "keep_alive", "arrive", "close", "batch", "detach")
    ID_FIELD_NUMBER: _ClassVar[int]
    KEEP_ALIVE_FIELD_NUMBER: _ClassVar[int]
    ARRIVE_FIELD_NUMBER: _ClassVar[int]
    CLOSE_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    DETACH_FIELD_NUMBER: _ClassVar[int]
    id: int
    keep_alive: KeepAliveRequest
    arrive: ArriveRequest
    close: SessionClose
    batch: SessionBatch
    detach: SessionDetach
    def __init__(self, id: _Optional[int] = ..., keep_alive: _Optional[_Union[KeepAliveRequest, _Mapping]] = ..., arrive: _Optional[_Union[ArriveRequest, _Mapping]] = ..., close: _Optional[_Union[SessionClose, _Mapping]] = ..., batch: _Optional[_Union[SessionBatch, _Mapping]] = ..., detach: _Optional[_Union[SessionDetach, _Mapping]] = ...) -> None: ...

class SessionClose(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SessionDetach(_message.Message):
    __slots__ = ("run_id", "member", "broken")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    MEMBER_FIELD_NUMBER: _ClassVar[int]
    BROKEN_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    member: MemberRef
    broken: bool
    def __init__(self, run_id: _Optional[str] = ..., member: _Optional[_Union[MemberRef, _Mapping]] = ..., broken: _Optional[bool] = ...) -> None: ...

class SessionBatch(_message.Message):
    __slots__ = ("ops",)
    OPS_FIELD_NUMBER: _ClassVar[int]
    ops: _containers.RepeatedCompositeFieldContainer[SessionRequest]
    def __init__(self, ops: _Optional[_Iterable[_Union[SessionRequest, _Mapping]]] = ...) -> None: ...

class SessionResponse(_message.Message):
    __slots__ = ("id", "keep_alive", "arrive", "error", "batch")
    ID_FIELD_NUMBER: _ClassVar[int]
    KEEP_ALIVE_FIELD_NUMBER: _ClassVar[int]
    ARRIVE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    id: int
    keep_alive: KeepAliveResponse
    arrive: ArriveResponse
    error: Error
    batch: SessionResponseBatch
    def __init__(self, id: _Optional[int] = ..., keep_alive: _Optional[_Union[KeepAliveResponse, _Mapping]] = ..., arrive: _Optional[_Union[ArriveResponse, _Mapping]] = ..., error: _Optional[_Union[Error, _Mapping]] = ..., batch: _Optional[_Union[SessionResponseBatch, _Mapping]] = ...) -> None: ...

class SessionResponseBatch(_message.Message):
    __slots__ = ("results", "shared")
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    SHARED_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[SessionResponse]
    shared: _containers.RepeatedCompositeFieldContainer[SharedSessionResponse]
    def __init__(self, results: _Optional[_Iterable[_Union[SessionResponse, _Mapping]]] = ..., shared: _Optional[_Iterable[_Union[SharedSessionResponse, _Mapping]]] = ...) -> None: ...

class SharedSessionResponse(_message.Message):
    __slots__ = ("ids", "response")
    IDS_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    response: SessionResponse
    def __init__(self, ids: _Optional[_Iterable[int]] = ..., response: _Optional[_Union[SessionResponse, _Mapping]] = ...) -> None: ...
