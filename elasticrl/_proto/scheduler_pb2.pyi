from elasticrl._proto import coordinator_pb2 as _coordinator_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SchedulePolicy(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SCHEDULE_POLICY_UNSPECIFIED: _ClassVar[SchedulePolicy]
    SCHEDULE_POLICY_DYNAMIC: _ClassVar[SchedulePolicy]
    SCHEDULE_POLICY_STATIC: _ClassVar[SchedulePolicy]

class Split(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SPLIT_UNSPECIFIED: _ClassVar[Split]
    SPLIT_TRAIN: _ClassVar[Split]
    SPLIT_EVAL: _ClassVar[Split]
SCHEDULE_POLICY_UNSPECIFIED: SchedulePolicy
SCHEDULE_POLICY_DYNAMIC: SchedulePolicy
SCHEDULE_POLICY_STATIC: SchedulePolicy
SPLIT_UNSPECIFIED: Split
SPLIT_TRAIN: Split
SPLIT_EVAL: Split

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "max_new_tokens", "seed", "stop_token_ids")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    max_new_tokens: int
    seed: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., max_new_tokens: _Optional[int] = ..., seed: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class TaskSpec(_message.Message):
    __slots__ = ("task_id", "prompt_ids", "prompt_text", "num_samples", "sampling", "split", "metadata_json")
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TEXT_FIELD_NUMBER: _ClassVar[int]
    NUM_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    SPLIT_FIELD_NUMBER: _ClassVar[int]
    METADATA_JSON_FIELD_NUMBER: _ClassVar[int]
    task_id: str
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    prompt_text: str
    num_samples: int
    sampling: SamplingParams
    split: Split
    metadata_json: str
    def __init__(self, task_id: _Optional[str] = ..., prompt_ids: _Optional[_Iterable[int]] = ..., prompt_text: _Optional[str] = ..., num_samples: _Optional[int] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., split: _Optional[_Union[Split, str]] = ..., metadata_json: _Optional[str] = ...) -> None: ...

class Sample(_message.Message):
    __slots__ = ("completion_ids", "logprobs", "reward", "finish_reason", "text", "loss_mask", "turns", "env_s", "truncated")
    COMPLETION_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    LOSS_MASK_FIELD_NUMBER: _ClassVar[int]
    TURNS_FIELD_NUMBER: _ClassVar[int]
    ENV_S_FIELD_NUMBER: _ClassVar[int]
    TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    completion_ids: bytes
    logprobs: bytes
    reward: float
    finish_reason: str
    text: str
    loss_mask: bytes
    turns: int
    env_s: float
    truncated: bool
    def __init__(self, completion_ids: _Optional[bytes] = ..., logprobs: _Optional[bytes] = ..., reward: _Optional[float] = ..., finish_reason: _Optional[str] = ..., text: _Optional[str] = ..., loss_mask: _Optional[bytes] = ..., turns: _Optional[int] = ..., env_s: _Optional[float] = ..., truncated: _Optional[bool] = ...) -> None: ...

class TrajectoryGroup(_message.Message):
    __slots__ = ("iteration", "task_id", "samples", "policy_version", "gen_seconds", "reward_seconds", "node", "prompt_ids", "split", "metadata_json")
    ITERATION_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    GEN_SECONDS_FIELD_NUMBER: _ClassVar[int]
    REWARD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    SPLIT_FIELD_NUMBER: _ClassVar[int]
    METADATA_JSON_FIELD_NUMBER: _ClassVar[int]
    iteration: int
    task_id: str
    samples: _containers.RepeatedCompositeFieldContainer[Sample]
    policy_version: int
    gen_seconds: float
    reward_seconds: float
    node: str
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    split: Split
    metadata_json: str
    def __init__(self, iteration: _Optional[int] = ..., task_id: _Optional[str] = ..., samples: _Optional[_Iterable[_Union[Sample, _Mapping]]] = ..., policy_version: _Optional[int] = ..., gen_seconds: _Optional[float] = ..., reward_seconds: _Optional[float] = ..., node: _Optional[str] = ..., prompt_ids: _Optional[_Iterable[int]] = ..., split: _Optional[_Union[Split, str]] = ..., metadata_json: _Optional[str] = ...) -> None: ...

class SubmitIterationRequest(_message.Message):
    __slots__ = ("run_id", "iteration", "tasks", "policy", "deadline_ms", "min_fraction", "task_lease_ms", "backup_tasks", "max_task_failures", "request_id", "member")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    ITERATION_FIELD_NUMBER: _ClassVar[int]
    TASKS_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_MS_FIELD_NUMBER: _ClassVar[int]
    MIN_FRACTION_FIELD_NUMBER: _ClassVar[int]
    TASK_LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    BACKUP_TASKS_FIELD_NUMBER: _ClassVar[int]
    MAX_TASK_FAILURES_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MEMBER_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    iteration: int
    tasks: _containers.RepeatedCompositeFieldContainer[TaskSpec]
    policy: SchedulePolicy
    deadline_ms: int
    min_fraction: float
    task_lease_ms: int
    backup_tasks: int
    max_task_failures: int
    request_id: str
    member: _coordinator_pb2.MemberRef
    def __init__(self, run_id: _Optional[str] = ..., iteration: _Optional[int] = ..., tasks: _Optional[_Iterable[_Union[TaskSpec, _Mapping]]] = ..., policy: _Optional[_Union[SchedulePolicy, str]] = ..., deadline_ms: _Optional[int] = ..., min_fraction: _Optional[float] = ..., task_lease_ms: _Optional[int] = ..., backup_tasks: _Optional[int] = ..., max_task_failures: _Optional[int] = ..., request_id: _Optional[str] = ..., member: _Optional[_Union[_coordinator_pb2.MemberRef, _Mapping]] = ...) -> None: ...

class SubmitIterationResponse(_message.Message):
    __slots__ = ("created", "num_tasks")
    CREATED_FIELD_NUMBER: _ClassVar[int]
    NUM_TASKS_FIELD_NUMBER: _ClassVar[int]
    created: bool
    num_tasks: int
    def __init__(self, created: _Optional[bool] = ..., num_tasks: _Optional[int] = ...) -> None: ...

class WorkerHello(_message.Message):
    __slots__ = ("run_id", "member", "slots", "weight", "combined_acks", "running", "reports_running")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    MEMBER_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    COMBINED_ACKS_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    REPORTS_RUNNING_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    member: _coordinator_pb2.MemberRef
    slots: int
    weight: float
    combined_acks: bool
    running: _containers.RepeatedCompositeFieldContainer[TaskKeys]
    reports_running: bool
    def __init__(self, run_id: _Optional[str] = ..., member: _Optional[_Union[_coordinator_pb2.MemberRef, _Mapping]] = ..., slots: _Optional[int] = ..., weight: _Optional[float] = ..., combined_acks: _Optional[bool] = ..., running: _Optional[_Iterable[_Union[TaskKeys, _Mapping]]] = ..., reports_running: _Optional[bool] = ...) -> None: ...

class TaskKeys(_message.Message):
    __slots__ = ("iteration", "task_ids")
    ITERATION_FIELD_NUMBER: _ClassVar[int]
    TASK_IDS_FIELD_NUMBER: _ClassVar[int]
    iteration: int
    task_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, iteration: _Optional[int] = ..., task_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class ResultBatch(_message.Message):
    __slots__ = ("groups", "batch_id")
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    groups: _containers.RepeatedCompositeFieldContainer[TrajectoryGroup]
    batch_id: str
    def __init__(self, groups: _Optional[_Iterable[_Union[TrajectoryGroup, _Mapping]]] = ..., batch_id: _Optional[str] = ...) -> None: ...

class ReleaseTasks(_message.Message):
    __slots__ = ("iteration", "task_ids", "reason", "failed", "env_errors")
    ITERATION_FIELD_NUMBER: _ClassVar[int]
    TASK_IDS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    ENV_ERRORS_FIELD_NUMBER: _ClassVar[int]
    iteration: int
    task_ids: _containers.RepeatedScalarFieldContainer[str]
    reason: str
    failed: bool
    env_errors: int
    def __init__(self, iteration: _Optional[int] = ..., task_ids: _Optional[_Iterable[str]] = ..., reason: _Optional[str] = ..., failed: _Optional[bool] = ..., env_errors: _Optional[int] = ...) -> None: ...

class RenewTasks(_message.Message):
    __slots__ = ("iteration", "task_ids")
    ITERATION_FIELD_NUMBER: _ClassVar[int]
    TASK_IDS_FIELD_NUMBER: _ClassVar[int]
    iteration: int
    task_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, iteration: _Optional[int] = ..., task_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class WorkRequest(_message.Message):
    __slots__ = ("hello", "results", "release", "renew")
    HELLO_FIELD_NUMBER: _ClassVar[int]
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    RELEASE_FIELD_NUMBER: _ClassVar[int]
    RENEW_FIELD_NUMBER: _ClassVar[int]
    hello: WorkerHello
    results: ResultBatch
    release: ReleaseTasks
    renew: RenewTasks
    def __init__(self, hello: _Optional[_Union[WorkerHello, _Mapping]] = ..., results: _Optional[_Union[ResultBatch, _Mapping]] = ..., release: _Optional[_Union[ReleaseTasks, _Mapping]] = ..., renew: _Optional[_Union[RenewTasks, _Mapping]] = ...) -> None: ...

class TaskAssignment(_message.Message):
    __slots__ = ("iteration", "task", "lease_ms", "backup")
    ITERATION_FIELD_NUMBER: _ClassVar[int]
    TASK_FIELD_NUMBER: _ClassVar[int]
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    BACKUP_FIELD_NUMBER: _ClassVar[int]
    iteration: int
    task: TaskSpec
    lease_ms: int
    backup: bool
    def __init__(self, iteration: _Optional[int] = ..., task: _Optional[_Union[TaskSpec, _Mapping]] = ..., lease_ms: _Optional[int] = ..., backup: _Optional[bool] = ...) -> None: ...

class Assignments(_message.Message):
    __slots__ = ("tasks",)
    TASKS_FIELD_NUMBER: _ClassVar[int]
    tasks: _containers.RepeatedCompositeFieldContainer[TaskAssignment]
    def __init__(self, tasks: _Optional[_Iterable[_Union[TaskAssignment, _Mapping]]] = ...) -> None: ...

class CancelTasks(_message.Message):
    __slots__ = ("iteration", "task_ids")
    ITERATION_FIELD_NUMBER: _ClassVar[int]
    TASK_IDS_FIELD_NUMBER: _ClassVar[int]
    iteration: int
    task_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, iteration: _Optional[int] = ..., task_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class RefusedResult(_message.Message):
    __slots__ = ("iteration", "task_id", "reason")
    ITERATION_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    iteration: int
    task_id: str
    reason: str
    def __init__(self, iteration: _Optional[int] = ..., task_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class ResultAck(_message.Message):
    __slots__ = ("accepted", "refused")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    accepted: int
    refused: _containers.RepeatedCompositeFieldContainer[RefusedResult]
    def __init__(self, accepted: _Optional[int] = ..., refused: _Optional[_Iterable[_Union[RefusedResult, _Mapping]]] = ...) -> None: ...

class WorkResponse(_message.Message):
    __slots__ = ("assign", "cancel", "ack", "acks")
    ASSIGN_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    ACK_FIELD_NUMBER: _ClassVar[int]
    ACKS_FIELD_NUMBER: _ClassVar[int]
    assign: Assignments
    cancel: CancelTasks
    ack: ResultAck
    acks: _containers.RepeatedCompositeFieldContainer[ResultAck]
    def __init__(self, assign: _Optional[_Union[Assignments, _Mapping]] = ..., cancel: _Optional[_Union[CancelTasks, _Mapping]] = ..., ack: _Optional[_Union[ResultAck, _Mapping]] = ..., acks: _Optional[_Iterable[_Union[ResultAck, _Mapping]]] = ...) -> None: ...

class NodeCounts(_message.Message):
    __slots__ = ("node", "assigned", "done", "running", "refused", "tokens", "tasks_per_s", "slots", "evicted")
    NODE_FIELD_NUMBER: _ClassVar[int]
    ASSIGNED_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    TASKS_PER_S_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    EVICTED_FIELD_NUMBER: _ClassVar[int]
    node: str
    assigned: int
    done: int
    running: int
    refused: int
    tokens: int
    tasks_per_s: float
    slots: int
    evicted: bool
    def __init__(self, node: _Optional[str] = ..., assigned: _Optional[int] = ..., done: _Optional[int] = ..., running: _Optional[int] = ..., refused: _Optional[int] = ..., tokens: _Optional[int] = ..., tasks_per_s: _Optional[float] = ..., slots: _Optional[int] = ..., evicted: _Optional[bool] = ...) -> None: ...

class IterationManifest(_message.Message):
    __slots__ = ("run_id", "iteration", "sealed", "seal_reason", "tasks_total", "tasks_done", "tasks_queued", "tasks_running", "requeued", "refused_duplicate", "refused_fenced", "refused_sealed", "backups_issued", "nodes", "evicted", "elapsed_s", "tokens", "policy", "sealed_ago_s", "tasks_failed", "env_errors", "errors", "groups_lost", "eval_total", "eval_done", "eval_failed")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    ITERATION_FIELD_NUMBER: _ClassVar[int]
    SEALED_FIELD_NUMBER: _ClassVar[int]
    SEAL_REASON_FIELD_NUMBER: _ClassVar[int]
    TASKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    TASKS_DONE_FIELD_NUMBER: _ClassVar[int]
    TASKS_QUEUED_FIELD_NUMBER: _ClassVar[int]
    TASKS_RUNNING_FIELD_NUMBER: _ClassVar[int]
    REQUEUED_FIELD_NUMBER: _ClassVar[int]
    REFUSED_DUPLICATE_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FENCED_FIELD_NUMBER: _ClassVar[int]
    REFUSED_SEALED_FIELD_NUMBER: _ClassVar[int]
    BACKUPS_ISSUED_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    EVICTED_FIELD_NUMBER: _ClassVar[int]
    ELAPSED_S_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    SEALED_AGO_S_FIELD_NUMBER: _ClassVar[int]
    TASKS_FAILED_FIELD_NUMBER: _ClassVar[int]
    ENV_ERRORS_FIELD_NUMBER: _ClassVar[int]
    ERRORS_FIELD_NUMBER: _ClassVar[int]
    GROUPS_LOST_FIELD_NUMBER: _ClassVar[int]
    EVAL_TOTAL_FIELD_NUMBER: _ClassVar[int]
    EVAL_DONE_FIELD_NUMBER: _ClassVar[int]
    EVAL_FAILED_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    iteration: int
    sealed: bool
    seal_reason: str
    tasks_total: int
    tasks_done: int
    tasks_queued: int
    tasks_running: int
    requeued: int
    refused_duplicate: int
    refused_fenced: int
    refused_sealed: int
    backups_issued: int
    nodes: _containers.RepeatedCompositeFieldContainer[NodeCounts]
    evicted: _containers.RepeatedScalarFieldContainer[str]
    elapsed_s: float
    tokens: int
    policy: SchedulePolicy
    sealed_ago_s: float
    tasks_failed: int
    env_errors: int
    errors: _containers.RepeatedScalarFieldContainer[str]
    groups_lost: int
    eval_total: int
    eval_done: int
    eval_failed: int
    def __init__(self, run_id: _Optional[str] = ..., iteration: _Optional[int] = ..., sealed: _Optional[bool] = ..., seal_reason: _Optional[str] = ..., tasks_total: _Optional[int] = ..., tasks_done: _Optional[int] = ..., tasks_queued: _Optional[int] = ..., tasks_running: _Optional[int] = ..., requeued: _Optional[int] = ..., refused_duplicate: _Optional[int] = ..., refused_fenced: _Optional[int] = ..., refused_sealed: _Optional[int] = ..., backups_issued: _Optional[int] = ..., nodes: _Optional[_Iterable[_Union[NodeCounts, _Mapping]]] = ..., evicted: _Optional[_Iterable[str]] = ..., elapsed_s: _Optional[float] = ..., tokens: _Optional[int] = ..., policy: _Optional[_Union[SchedulePolicy, str]] = ..., sealed_ago_s: _Optional[float] = ..., tasks_failed: _Optional[int] = ..., env_errors: _Optional[int] = ..., errors: _Optional[_Iterable[str]] = ..., groups_lost: _Optional[int] = ..., eval_total: _Optional[int] = ..., eval_done: _Optional[int] = ..., eval_failed: _Optional[int] = ...) -> None: ...

class WaitSealedRequest(_message.Message):
    __slots__ = ("run_id", "iteration", "wait_ms")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    ITERATION_FIELD_NUMBER: _ClassVar[int]
    WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    iteration: int
    wait_ms: int
    def __init__(self, run_id: _Optional[str] = ..., iteration: _Optional[int] = ..., wait_ms: _Optional[int] = ...) -> None: ...

class WaitSealedResponse(_message.Message):
    __slots__ = ("manifest",)
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    manifest: IterationManifest
    def __init__(self, manifest: _Optional[_Union[IterationManifest, _Mapping]] = ...) -> None: ...

class IterationStatusRequest(_message.Message):
    __slots__ = ("run_id", "iteration", "latest")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    ITERATION_FIELD_NUMBER: _ClassVar[int]
    LATEST_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    iteration: int
    latest: bool
    def __init__(self, run_id: _Optional[str] = ..., iteration: _Optional[int] = ..., latest: _Optional[bool] = ...) -> None: ...

class IterationStatusResponse(_message.Message):
    __slots__ = ("found", "manifest")
    FOUND_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    found: bool
    manifest: IterationManifest
    def __init__(self, found: _Optional[bool] = ..., manifest: _Optional[_Union[IterationManifest, _Mapping]] = ...) -> None: ...

class FetchShardRequest(_message.Message):
    __slots__ = ("run_id", "iteration", "rank", "world_size", "split", "max_message_bytes")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    ITERATION_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    SPLIT_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    iteration: int
    rank: int
    world_size: int
    split: Split
    max_message_bytes: int
    def __init__(self, run_id: _Optional[str] = ..., iteration: _Optional[int] = ..., rank: _Optional[int] = ..., world_size: _Optional[int] = ..., split: _Optional[_Union[Split, str]] = ..., max_message_bytes: _Optional[int] = ...) -> None: ...

class FetchShardResponse(_message.Message):
    __slots__ = ("groups", "total_groups", "total_tokens")
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_GROUPS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    groups: _containers.RepeatedCompositeFieldContainer[TrajectoryGroup]
    total_groups: int
    total_tokens: int
    def __init__(self, groups: _Optional[_Iterable[_Union[TrajectoryGroup, _Mapping]]] = ..., total_groups: _Optional[int] = ..., total_tokens: _Optional[int] = ...) -> None: ...

class WeightChunk(_message.Message):
    __slots__ = ("run_id", "version", "total_bytes", "offset", "data", "sha256", "format")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    FORMAT_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    version: int
    total_bytes: int
    offset: int
    data: bytes
    sha256: str
    format: str
    def __init__(self, run_id: _Optional[str] = ..., version: _Optional[int] = ..., total_bytes: _Optional[int] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ..., sha256: _Optional[str] = ..., format: _Optional[str] = ...) -> None: ...

class PublishWeightsReply(_message.Message):
    __slots__ = ("version", "total_bytes", "sha256", "created")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    CREATED_FIELD_NUMBER: _ClassVar[int]
    version: int
    total_bytes: int
    sha256: str
    created: bool
    def __init__(self, version: _Optional[int] = ..., total_bytes: _Optional[int] = ..., sha256: _Optional[str] = ..., created: _Optional[bool] = ...) -> None: ...

class FetchWeightsRequest(_message.Message):
    __slots__ = ("run_id", "have_version", "wait_s")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    HAVE_VERSION_FIELD_NUMBER: _ClassVar[int]
    WAIT_S_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    have_version: int
    wait_s: float
    def __init__(self, run_id: _Optional[str] = ..., have_version: _Optional[int] = ..., wait_s: _Optional[float] = ...) -> None: ...

class AnnounceWeightsRequest(_message.Message):
    __slots__ = ("run_id", "version", "total_bytes", "sha256", "format", "member_id", "address", "complete")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    FORMAT_FIELD_NUMBER: _ClassVar[int]
    MEMBER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    COMPLETE_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    version: int
    total_bytes: int
    sha256: str
    format: str
    member_id: str
    address: str
    complete: bool
    def __init__(self, run_id: _Optional[str] = ..., version: _Optional[int] = ..., total_bytes: _Optional[int] = ..., sha256: _Optional[str] = ..., format: _Optional[str] = ..., member_id: _Optional[str] = ..., address: _Optional[str] = ..., complete: _Optional[bool] = ...) -> None: ...

class AnnounceWeightsReply(_message.Message):
    __slots__ = ("newest_version",)
    NEWEST_VERSION_FIELD_NUMBER: _ClassVar[int]
    newest_version: int
    def __init__(self, newest_version: _Optional[int] = ...) -> None: ...

class LocateWeightsRequest(_message.Message):
    __slots__ = ("run_id", "member_id", "address", "have_version", "wait_s", "unreachable")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    MEMBER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    HAVE_VERSION_FIELD_NUMBER: _ClassVar[int]
    WAIT_S_FIELD_NUMBER: _ClassVar[int]
    UNREACHABLE_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    member_id: str
    address: str
    have_version: int
    wait_s: float
    unreachable: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, run_id: _Optional[str] = ..., member_id: _Optional[str] = ..., address: _Optional[str] = ..., have_version: _Optional[int] = ..., wait_s: _Optional[float] = ..., unreachable: _Optional[_Iterable[str]] = ...) -> None: ...

class LocateWeightsReply(_message.Message):
    __slots__ = ("found", "version", "total_bytes", "sha256", "format", "address", "source_member", "source_complete")
    FOUND_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    FORMAT_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    SOURCE_MEMBER_FIELD_NUMBER: _ClassVar[int]
    SOURCE_COMPLETE_FIELD_NUMBER: _ClassVar[int]
    found: bool
    version: int
    total_bytes: int
    sha256: str
    format: str
    address: str
    source_member: str
    source_complete: bool
    def __init__(self, found: _Optional[bool] = ..., version: _Optional[int] = ..., total_bytes: _Optional[int] = ..., sha256: _Optional[str] = ..., format: _Optional[str] = ..., address: _Optional[str] = ..., source_member: _Optional[str] = ..., source_complete: _Optional[bool] = ...) -> None: ...
