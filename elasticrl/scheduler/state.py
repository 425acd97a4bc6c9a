"""In-memory state of the rollout scheduler: iterations, tasks, who holds them, workers, results.

Plain dataclasses with no I/O and no protobuf, like ``coordinator.state``. ``policy`` decides on
them, ``core`` mutates them after ``persist`` wrote the change. Times are the coordinator's
monotonic clock in seconds; what must survive a restart (submit time, deadlines) is stored as
durations and re-granted on load.
"""

from __future__ import annotations

import array
import collections
import dataclasses
import enum
import math
import sys


RELEASE_STOPPING = "worker stopping"
"""The reason a worker gives when it releases tasks because it is stopping: the scheduler hands
it nothing more (it would only give it back)."""
MAX_ERRORS = 5
WORK_FEATURES = ("elasticrl-work-features", "renew,running")
"""The Work stream's initial metadata: what this coordinator reads beyond hello, results and
releases. A worker sends ``RenewTasks`` only to a coordinator that names ``renew`` (an older one
ends the stream on a message it does not know), and the releases it made while the stream opened
only to one that names ``running`` (it holds the tasks the hello names for the worker; an older
one queued them again and may have handed them out anew on this stream, whose slots such a
release would free)."""


class Policy(str, enum.Enum):
    DYNAMIC = "dynamic"
    STATIC = "static"


class Split(str, enum.Enum):
    TRAIN = "train"
    EVAL = "eval"


class TaskStatus(str, enum.Enum):
    QUEUED = "queued"
    RUNNING = "running"
    DONE = "done"
    # The iteration sealed before this task finished; it never will.
    DROPPED = "dropped"
    # Its attempts failed ``max_task_failures`` times (the environment raised or timed out).
    FAILED = "failed"


@dataclasses.dataclass(kw_only=True)
class Sampling:
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 0
    seed: int = 0
    stop_token_ids: list[int] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(kw_only=True)
class TaskSpec:
    """One GRPO group to draw: ``num_samples`` completions of one prompt."""

    task_id: str
    prompt_ids: list[int] | array.array
    """A list; the coordinator keeps a submitted task's as an ``array("i")`` (compact, and nothing
    for the garbage collector to walk), which compares unequal to a list of the same ids."""
    prompt_text: str = ""
    num_samples: int = 1
    sampling: Sampling = dataclasses.field(default_factory=Sampling)
    split: Split = Split.TRAIN
    metadata_json: str = ""


@dataclasses.dataclass
class SampleRecord:
    """One episode (a plain completion is an episode of one turn): its tokens after the task's
    prompt, which of them the policy produced, their logprobs, and the return."""

    completion_ids: bytes
    """int32 little-endian token ids: actions, and for a multi-turn episode observations too."""
    logprobs: bytes
    """float32 little-endian, one per token (the engine's on action tokens, 0 elsewhere)."""
    reward: float
    """The episode's return (sum of its step rewards)."""
    finish_reason: str = ""
    text: str = ""
    loss_mask: bytes = b""
    """uint8 per token, 1 = the policy's token (trained); empty = all 1."""
    turns: int = 1
    env_s: float = 0.0
    truncated: bool = False

    @property
    def num_tokens(self) -> int:
        return len(self.completion_ids) // 4

    @property
    def num_trained_tokens(self) -> int:
        return self.num_tokens if not self.loss_mask else self.loss_mask.count(1)

    @staticmethod
    def pack(
        completion_ids, logprobs, reward: float, finish_reason: str = "", text: str = "", *,
        loss_mask=None, turns: int = 1, env_s: float = 0.0, truncated: bool = False,
    ) -> "SampleRecord":
        """From sequences of ints and floats (lists, arrays, tensors' ``.tolist()``); ``loss_mask``
        None or all ones is stored empty (a plain completion)."""
        ids = array.array("i", completion_ids)
        lps = array.array("f", logprobs)
        if len(ids) != len(lps):
            raise ValueError(f"completion_ids has {len(ids)} tokens but logprobs has {len(lps)} values")
        mask = b"" if loss_mask is None else bytes(bytearray(loss_mask))
        if mask and len(mask) != len(ids):
            raise ValueError(f"loss_mask has {len(mask)} values for {len(ids)} tokens")
        if mask.count(1) == len(mask):
            mask = b""
        if sys.byteorder != "little":
            ids.byteswap()
            lps.byteswap()
        return SampleRecord(ids.tobytes(), lps.tobytes(), float(reward), finish_reason, text, mask, int(turns), float(env_s), bool(truncated))

    def token_ids(self) -> list[int]:
        return _unpack("i", self.completion_ids)

    def logprob_list(self) -> list[float]:
        return _unpack("f", self.logprobs)

    def mask_list(self) -> list[int]:
        return list(self.loss_mask) if self.loss_mask else [1] * self.num_tokens


def _unpack(code: str, data: bytes) -> list:
    values = array.array(code)
    values.frombytes(data)
    if sys.byteorder != "little":
        values.byteswap()
    return values.tolist()


@dataclasses.dataclass
class GroupRecord:
    """An accepted result: one task's samples, as a worker produced them."""

    task_id: str
    node: str
    policy_version: int
    gen_seconds: float
    reward_seconds: float
    samples: list[SampleRecord]

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.samples)

    @property
    def num_bytes(self) -> int:
        return sum(len(s.completion_ids) + len(s.logprobs) + len(s.loss_mask) + len(s.text) for s in self.samples)


@dataclasses.dataclass
class TaskFailure:
    """What an engine returns in place of a group whose episodes failed (an environment raised or
    passed its deadline): the worker reports it, the scheduler retries the task elsewhere or, after
    ``max_task_failures`` failures, gives it up."""

    task_id: str
    reason: str
    env_errors: int = 1


@dataclasses.dataclass
class FetchedGroup:
    """A group as a trainer rank receives it: the result plus the task it answers."""

    iteration: int
    task_id: str
    node: str
    policy_version: int
    gen_seconds: float
    reward_seconds: float
    prompt_ids: list[int]
    split: Split
    metadata_json: str
    samples: list[SampleRecord]

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.samples)


@dataclasses.dataclass
class Holder:
    """One worker running one copy of a task."""

    member_id: str
    incarnation: int
    assigned_at: float
    deadline: float
    backup: bool = False


@dataclasses.dataclass
class Task:
    spec: TaskSpec
    seq: int
    """Position in the submitted list: the order tasks are handed out and stored in."""
    _status: TaskStatus = TaskStatus.QUEUED
    holders: dict[str, Holder] = dataclasses.field(default_factory=dict)
    requeues: int = 0
    done_by: str = ""
    failures: int = 0
    """Failed attempts (environment errors); at ``max_task_failures`` the task is FAILED."""
    failed_on: tuple[str, ...] = ()
    """Workers an attempt failed on: a retry goes elsewhere while another worker can take it."""
    storing: bool = False
    """A result for it arrived and is being stored (its shard written, then committed): a second
    copy is refused as a duplicate meanwhile, and it is not handed out as a backup."""
    copies_on: tuple[str, ...] = ()
    """Workers ever handed a copy: a superset of those still running one (a copy whose task
    lease expired leaves its holder but still runs), so a cancel looks at these, not every worker.
    Tuples, not sets: one or two names each, and a tuple of strings is one object fewer per task for
    the garbage collector to walk (an empty set is one too)."""
    _tally: collections.Counter | None = dataclasses.field(default=None, repr=False, compare=False)
    """The status counts of the ``TaskTable`` holding it, kept current by ``status``."""

    @property
    def status(self) -> TaskStatus:
        return self._status

    @status.setter
    def status(self, status: TaskStatus) -> None:
        if self._tally is not None:
            _tally(self._tally, self, self._status, -1)
            _tally(self._tally, self, status, 1)
        self._status = status


def _tally(tally: collections.Counter, task: Task, status: TaskStatus, by: int) -> None:
    """Count ``task`` as in ``status`` (``by`` 1) or no longer (-1): under the status, and a held-out
    task under ``(Split.EVAL, status)`` too (``Iteration.count``)."""
    tally[status] += by
    if task.spec.split is Split.EVAL:
        tally[Split.EVAL, status] += by


class TaskTable(dict):
    """An iteration's tasks by id, counted by status as their statuses change (``tally``): the
    seal check after every result batch reads two counts instead of passing over every task, which
    at thousands of tasks and a batch per group made an iteration's seal checks quadratic. Tasks
    are only ever added (``table[id] = task``); nothing removes one. Held-out tasks are counted
    again under ``(Split.EVAL, status)``."""

    def __init__(self, tasks: dict[str, Task] | None = None):
        super().__init__()
        self.tally: collections.Counter = collections.Counter()
        for task_id, task in (tasks or {}).items():
            self[task_id] = task

    def __setitem__(self, task_id: str, task: Task) -> None:
        old = self.get(task_id)
        if old is not None:
            _tally(self.tally, old, old.status, -1)
            old._tally = None
        super().__setitem__(task_id, task)
        task._tally = self.tally
        _tally(self.tally, task, task.status, 1)


@dataclasses.dataclass(kw_only=True)
class IterationConfig:
    policy: Policy = Policy.DYNAMIC
    deadline_s: float = 0.0
    """0: no deadline; the iteration seals only when every task is done."""
    min_fraction: float = 1.0
    task_lease_s: float = 600.0
    backup_tasks: int = 0
    max_task_failures: int = 2
    """Failed attempts after which a task is given up (2: one retry on another engine)."""


@dataclasses.dataclass
class NodeStats:
    assigned: int = 0
    done: int = 0
    refused: int = 0
    tokens: int = 0
    first_assigned_at: float | None = None
    last_result_at: float | None = None
    evicted: bool = False


@dataclasses.dataclass
class Counters:
    requeued: int = 0
    refused_duplicate: int = 0
    refused_fenced: int = 0
    refused_sealed: int = 0
    backups_issued: int = 0
    env_errors: int = 0
    """Episodes whose environment failed, over every attempt."""
    errors: list[str] = dataclasses.field(default_factory=list)
    """Distinct reasons of failed attempts, newest last (at most ``MAX_ERRORS``)."""
    groups_lost: int = 0
    """Accepted groups whose shard was missing or unreadable at a start-up (their tasks were
    queued again, or dropped if the iteration had sealed)."""


@dataclasses.dataclass
class Iteration:
    run_id: str
    iteration: int
    config: IterationConfig
    tasks: TaskTable
    """task id -> task; a plain dict given here becomes a ``TaskTable``."""
    submitted_at: float
    queue: collections.deque[str] = dataclasses.field(default_factory=collections.deque)
    """Tasks anyone may take, in order (dynamic: all of them; static: requeued ones)."""
    shares: dict[str, collections.deque[str]] = dataclasses.field(default_factory=dict)
    """Static policy: member id -> the tasks set aside for it when the iteration was submitted."""
    groups: dict[str, GroupRecord] = dataclasses.field(default_factory=dict)
    """task id -> its accepted result. Every completed group, including an evicted node's."""
    shard_of: dict[str, str] = dataclasses.field(default_factory=dict)
    """task id -> the stored shard holding its group."""
    nodes: dict[str, NodeStats] = dataclasses.field(default_factory=dict)
    counters: Counters = dataclasses.field(default_factory=Counters)
    evicted: list[str] = dataclasses.field(default_factory=list)
    sealed_at: float | None = None
    seal_reason: str = ""
    seal_order: int = 0
    """Sealed iterations in the order they sealed (retention keeps the newest); those a restart
    loads come first, in the order of their seal times."""
    train_fetched: dict[int, set[int]] = dataclasses.field(default_factory=dict)
    """world size -> the ranks that fetched their train shard (retention keeps an iteration no
    world has fetched in full: trainers fetch in number order, which is not the seal order)."""
    shard_plans: dict[tuple[Split, int], list[list[str]]] = dataclasses.field(default_factory=dict)
    """(split, world size) -> each rank's task ids, balanced once per sealed iteration (its groups
    no longer change): every rank of a world fetches, and the balance is O(tasks)."""
    next_expiry: float = math.inf
    """No running copy's task lease ends before this (a lower bound ``core`` keeps as it hands
    out copies; inf: none): the tick looks for expired leases only once it has passed, not over
    every task at every tick."""

    def __post_init__(self) -> None:
        if not isinstance(self.tasks, TaskTable):
            self.tasks = TaskTable(self.tasks)

    @property
    def sealed(self) -> bool:
        return self.sealed_at is not None

    @property
    def awaits_fetch(self) -> bool:
        """Sealed with train groups that no world of trainers has fetched in full yet."""
        return (self.sealed and not any(len(ranks) >= n for n, ranks in self.train_fetched.items())
                and any(t.spec.split is Split.TRAIN for t in self.tasks.values()))

    @property
    def deadline(self) -> float | None:
        return self.submitted_at + self.config.deadline_s if self.config.deadline_s > 0 else None

    def count(self, status: TaskStatus, split: Split | None = None) -> int:
        """Tasks in ``status``: of every split, or of ``split`` alone (``Split.TRAIN``: all but the held-out ones)."""
        tally = self.tasks.tally
        if split is None:
            return tally[status]
        held_out = tally[Split.EVAL, status]
        return held_out if split is Split.EVAL else tally[status] - held_out

    def node(self, member_id: str) -> NodeStats:
        stats = self.nodes.get(member_id)
        if stats is None:
            stats = self.nodes[member_id] = NodeStats()
        return stats


@dataclasses.dataclass
class Worker:
    """A connected engine stream. ``holding`` counts against its slots until a result, a
    release or a cancel frees them."""

    member_id: str
    incarnation: int
    slots: int
    weight: float
    connected_at: float
    holding: set[tuple[int, str]] = dataclasses.field(default_factory=set)
    """(iteration, task id) of every copy this worker runs."""
    fenced: bool = False

    @property
    def free(self) -> int:
        return 0 if self.fenced else max(0, self.slots - len(self.holding))
