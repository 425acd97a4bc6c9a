"""In-memory state of the coordinator: runs, members, barriers, KV and rendezvous rounds.

Plain dataclasses with no I/O and no protobuf. ``policy`` decides on them, ``core`` mutates them
(after ``persist`` has written the change), and the gRPC layer converts them to messages. Times
are floats on the coordinator's monotonic clock (seconds); they are never persisted, because a
restarted coordinator has a new clock: leases and deadlines are re-granted on load instead.
"""

from __future__ import annotations

import collections
import dataclasses
import enum


class MemberStatus(str, enum.Enum):
    LIVE = "live"
    LEFT = "left"
    EVICTED = "evicted"


class TimeoutPolicy(str, enum.Enum):
    EVICT_MISSING = "evict_missing"
    REPORT = "report"


class Outcome(str, enum.Enum):
    COMPLETED = "completed"
    TIMED_OUT = "timed_out"


@dataclasses.dataclass
class Member:
    member_id: str
    incarnation: int
    host: str
    weight: float
    capabilities: dict[str, str]
    joined_epoch: int
    lease_ttl_s: float
    lease_deadline: float
    status: MemberStatus = MemberStatus.LIVE
    # Why the member is not live (empty while live).
    reason: str = ""

    @property
    def live(self) -> bool:
        return self.status is MemberStatus.LIVE


@dataclasses.dataclass
class BarrierResult:
    outcome: Outcome
    arrived: list[str]
    evicted: list[str]
    missing: list[str]
    epoch: int
    reason: str


@dataclasses.dataclass
class Barrier:
    name: str
    timeout_s: float
    policy: TimeoutPolicy
    # member id -> incarnation, fixed when the barrier opens: the live members at that moment.
    # Members that join later may arrive but are never waited for (no livelock under churn).
    expected: dict[str, int]
    # member id -> incarnation of every arrival (expected or not).
    arrived: dict[str, int]
    opened_at: float
    result: BarrierResult | None = None

    @property
    def deadline(self) -> float:
        return self.opened_at + self.timeout_s


DEFAULT_REJOIN_TIMEOUT_S = 30.0
"""How long a re-form holds for live agents of the previous round (``RoundConfig.rejoin_timeout_s``):
torchrun's wait between SIGTERM and SIGKILL of a worker."""


@dataclasses.dataclass
class RoundConfig:
    min_nodes: int
    max_nodes: int
    last_call_s: float
    join_timeout_s: float
    rejoin_timeout_s: float = DEFAULT_REJOIN_TIMEOUT_S
    """A re-form holds this long after min_nodes joined for the previous round's live participants."""


@dataclasses.dataclass(frozen=True)
class RoundResult:
    """What one RoundJoin call got: ``status`` is "complete", "waiting", "timed_out" or "closed"."""

    status: str
    round: int = 0
    rank: int = -1
    participants: tuple[str, ...] = ()
    reason: str = ""
    standby: bool = False
    """"waiting" only: the round is full and all of it live; this node waits for a slot."""

    @property
    def world_size(self) -> int:
        return len(self.participants)


@dataclasses.dataclass
class Rendezvous:
    """Rounds of one run. Round 0 means none has completed yet."""

    config: RoundConfig | None = None
    round: int = 0
    # Participants of ``round`` in rank order: (member id, incarnation).
    participants: list[tuple[str, int]] = dataclasses.field(default_factory=list)
    # Members waiting for the next round: member id -> incarnation, in arrival order.
    waiting: dict[str, int] = dataclasses.field(default_factory=dict)
    # When the waiting set became non-empty and when it first reached min_nodes, for the round it
    # waits for: both start over when a round completes and members are left waiting.
    waiting_since: float | None = None
    min_reached_at: float | None = None
    # Members whose pending round timed out -> reason; each entry is consumed by that member's
    # next RoundJoin, which reports the timeout.
    timed_out: dict[str, str] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class Run:
    run_id: str
    epoch: int = 0
    closed: bool = False
    close_reason: str = ""
    members: dict[str, Member] = dataclasses.field(default_factory=dict)
    barriers: dict[str, Barrier] = dataclasses.field(default_factory=dict)
    # The undecided subset of ``barriers``: ticks and membership changes look only at these, so
    # a long run's thousands of decided barriers cost nothing per tick.
    open_barriers: dict[str, Barrier] = dataclasses.field(default_factory=dict)
    # Names of the decided barriers still held, oldest decision first: the oldest are dropped past
    # ``Limits.keep_decided_barriers``.
    decided: collections.deque[str] = dataclasses.field(default_factory=collections.deque)
    kv: dict[bytes, bytes] = dataclasses.field(default_factory=dict)
    kv_bytes: int = 0
    rendezvous: Rendezvous = dataclasses.field(default_factory=Rendezvous)
    # len(live_members()), kept up to date by the core on every join and departure (and counted
    # once at load): counting on each change made a join storm of N members cost O(N^2).
    live_count: int = 0
    # No live lease ends before this (keep-alives only push deadlines later, joins lower it): the
    # tick scans the members for expired leases only once it passes, not every tick. 0: scan.
    lease_floor: float = 0.0

    def live_members(self) -> dict[str, Member]:
        live = MemberStatus.LIVE  # (m.live inlined: every new barrier asks, over every member)
        return {m.member_id: m for m in self.members.values() if m.status is live}

    def is_live(self, member_id: str, incarnation: int) -> bool:
        m = self.members.get(member_id)
        return m is not None and m.live and m.incarnation == incarnation


def copy_rendezvous(rdzv: Rendezvous) -> Rendezvous:
    """A copy whose containers can be changed without touching ``rdzv`` (the config is never
    changed in place, so it is shared)."""
    return dataclasses.replace(
        rdzv, participants=list(rdzv.participants), waiting=dict(rdzv.waiting), timed_out=dict(rdzv.timed_out),
    )
