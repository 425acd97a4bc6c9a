"""Protobuf <-> scheduler dataclasses, with field validation, for the servicer and the clients.

Only transport modules (``service``, ``client``, ``worker``) and ``persist`` (which stores a task's
spec as its message) import this; ``core`` never sees a message.
"""

from __future__ import annotations

import array
import math

import numpy as np

from elasticrl._proto import scheduler_pb2 as spb
from elasticrl.coordinator import validate as v
from elasticrl.errors import InvalidRequestError
from elasticrl.scheduler.state import FetchedGroup, GroupRecord, Policy, SampleRecord, Sampling, Split, TaskSpec

MAX_PROMPT_TOKENS = 1 << 20
MAX_SAMPLES = 4096
MAX_METADATA = 64 << 10

POLICY_FROM_PB = {
    spb.SCHEDULE_POLICY_UNSPECIFIED: Policy.DYNAMIC,
    spb.SCHEDULE_POLICY_DYNAMIC: Policy.DYNAMIC,
    spb.SCHEDULE_POLICY_STATIC: Policy.STATIC,
}
POLICY_TO_PB = {Policy.DYNAMIC: spb.SCHEDULE_POLICY_DYNAMIC, Policy.STATIC: spb.SCHEDULE_POLICY_STATIC}
SPLIT_FROM_PB = {spb.SPLIT_UNSPECIFIED: Split.TRAIN, spb.SPLIT_TRAIN: Split.TRAIN, spb.SPLIT_EVAL: Split.EVAL}
SPLIT_TO_PB = {Split.TRAIN: spb.SPLIT_TRAIN, Split.EVAL: spb.SPLIT_EVAL}


def task_from_pb(field: str, t: spb.TaskSpec, *, keep_wire: bool = False) -> TaskSpec:
    """``t`` checked and converted. ``keep_wire`` (the coordinator's copy of a submitted or stored
    task, kept while its iteration is): the message's bytes stay with the spec (see ``task_wire``),
    re-serialized from ``t`` without its unknown fields (C, ~1 us for a 200-token prompt), so it is
    stored and handed out as that, not rebuilt from the dataclass in Python; and the spec is kept
    compact: its prompt an ``array("i")``, its ``Sampling`` shared with every
    equal one, so nobody may change it. Without it (a worker's copy): lists and a ``Sampling`` of
    its own."""
    v.ident(f"{field}.task_id", t.task_id, remember=False)
    if len(t.prompt_ids) > MAX_PROMPT_TOKENS:
        raise InvalidRequestError(f"{field}.prompt_ids: {len(t.prompt_ids)} tokens, at most {MAX_PROMPT_TOKENS}")
    if not t.prompt_ids and not t.prompt_text:
        raise InvalidRequestError(f"{field}: needs prompt_ids or prompt_text")
    if not 1 <= t.num_samples <= MAX_SAMPLES:
        raise InvalidRequestError(f"{field}.num_samples: {t.num_samples} must be in 1..{MAX_SAMPLES} (the GRPO group size)")
    s = t.sampling
    for name, value, low, high in (("temperature", s.temperature, 0.0, 100.0), ("top_p", s.top_p, 0.0, 1.0)):
        if not math.isfinite(value) or not low <= value <= high:
            raise InvalidRequestError(f"{field}.sampling.{name}: {value!r} must be in [{low:g}, {high:g}] (0 means the default)")
    if t.split not in SPLIT_FROM_PB:
        raise InvalidRequestError(f"{field}.split: {t.split} is not a known Split value")
    v.text(f"{field}.metadata_json", t.metadata_json, MAX_METADATA)
    v.text(f"{field}.prompt_text", t.prompt_text, MAX_PROMPT_TOKENS)
    if keep_wire:
        # The container's ids as one int32 buffer (it exposes __array__), not an id at a time:
        # 2 us for a 2048-token prompt instead of ~80.
        prompt_ids = array.array("i", np.asarray(t.prompt_ids, dtype=np.intc).tobytes())
        sampling = shared_sampling(_sampling(s))
    else:
        prompt_ids, sampling = list(t.prompt_ids), _sampling(s)
    spec = TaskSpec(
        task_id=t.task_id,
        prompt_ids=prompt_ids,
        prompt_text=t.prompt_text,
        num_samples=t.num_samples,
        sampling=sampling,
        split=SPLIT_FROM_PB[t.split],
        metadata_json=t.metadata_json,
    )
    if keep_wire:
        t.DiscardUnknownFields()  # only what was checked above is stored and handed out
        spec._wire = t.SerializeToString()
    return spec


def _sampling(s: spb.SamplingParams) -> Sampling:
    return Sampling(temperature=s.temperature or 1.0, top_p=s.top_p or 1.0, max_new_tokens=s.max_new_tokens, seed=s.seed,
                    stop_token_ids=list(s.stop_token_ids))


_SHARED_SAMPLING: dict[tuple, Sampling] = {}
_SHARED_SAMPLING_MAX = 1024


def shared_sampling(sampling: Sampling) -> Sampling:
    """One ``Sampling`` per distinct value for the specs the coordinator keeps (nothing there
    changes a spec's sampling; it sends the spec's message). A task's spec held ~8 objects the
    cyclic garbage collector walks, its prompt's ids one by one among them: with 80,000 tasks of
    200-token prompts kept, a full collection stalled the event loop for ~0.4 s, and the ids took
    ~7 KB per task (``bench/scheduler_scale.py``, tasks held). Its prompt is an ``array`` (4 bytes a
    token, nothing to walk), its sampling shared, its message an attribute, not an instance dict."""
    key = (sampling.temperature, sampling.top_p, sampling.max_new_tokens, sampling.seed, tuple(sampling.stop_token_ids))
    shared = _SHARED_SAMPLING.get(key)
    if shared is None:
        if len(_SHARED_SAMPLING) >= _SHARED_SAMPLING_MAX:  # a client seeding every task: no sharing to gain
            _SHARED_SAMPLING.clear()
        shared = _SHARED_SAMPLING[key] = sampling
    return shared


def task_wire(t: TaskSpec) -> bytes:
    """``t`` as a serialized ``TaskSpec`` message, built once per spec and kept on it (a spec does
    not change once submitted): every copy handed out reuses it. Building the message converts the
    prompt's ids one by one in Python, ~50 ns each: a 2048-token prompt cost ~0.1 ms per
    assignment."""
    wire = getattr(t, "_wire", None)
    if wire is None:
        wire = t._wire = task_to_pb(t).SerializeToString()
    return wire


def task_to_pb(t: TaskSpec) -> spb.TaskSpec:
    s = t.sampling
    return spb.TaskSpec(
        task_id=t.task_id,
        prompt_ids=t.prompt_ids,
        prompt_text=t.prompt_text,
        num_samples=t.num_samples,
        sampling=spb.SamplingParams(
            temperature=s.temperature, top_p=s.top_p, max_new_tokens=s.max_new_tokens, seed=s.seed,
            stop_token_ids=s.stop_token_ids,
        ),
        split=SPLIT_TO_PB[t.split],
        metadata_json=t.metadata_json,
    )


def group_from_pb(field: str, g: spb.TrajectoryGroup) -> tuple[int, GroupRecord]:
    v.ident(f"{field}.task_id", g.task_id, remember=False)
    samples = []
    for j, s in enumerate(g.samples):
        if len(s.completion_ids) % 4 or len(s.logprobs) != len(s.completion_ids):
            raise InvalidRequestError(
                f"{field}.samples[{j}]: completion_ids ({len(s.completion_ids)} bytes) must be int32 and "
                f"logprobs ({len(s.logprobs)} bytes) one float32 per token"
            )
        if not math.isfinite(s.reward):
            raise InvalidRequestError(f"{field}.samples[{j}].reward: {s.reward!r} is not finite")
        if s.loss_mask and (len(s.loss_mask) * 4 != len(s.completion_ids) or s.loss_mask.strip(b"\x00\x01")):
            raise InvalidRequestError(
                f"{field}.samples[{j}].loss_mask: {len(s.loss_mask)} bytes for {len(s.completion_ids) // 4} tokens; "
                "it must be empty or one 0/1 byte per token"
            )
        if not math.isfinite(s.env_s) or s.env_s < 0:
            raise InvalidRequestError(f"{field}.samples[{j}].env_s: {s.env_s!r} must be a finite number >= 0")
        samples.append(_sample_from_pb(s))
    if not samples:
        raise InvalidRequestError(f"{field}.samples: must not be empty")
    return g.iteration, GroupRecord(g.task_id, "", g.policy_version, g.gen_seconds, g.reward_seconds, samples)


def served_fields_pb(node: str, spec: TaskSpec) -> bytes:
    """The ``TrajectoryGroup`` fields the coordinator fills when a trainer fetches a group (node,
    prompt_ids, split, metadata_json), serialized: appended to the stored group's bytes they make
    the group a trainer receives (protobuf merges concatenated messages)."""
    return spb.TrajectoryGroup(
        node=node, prompt_ids=spec.prompt_ids, split=SPLIT_TO_PB[spec.split], metadata_json=spec.metadata_json,
    ).SerializeToString()


def manifest_to_pb(m: dict) -> spb.IterationManifest:
    return spb.IterationManifest(
        **{k: m[k] for k in _MANIFEST_FIELDS},
        evicted=m["evicted"],
        errors=m["errors"],
        nodes=[spb.NodeCounts(**n) for n in m["nodes"]],
        policy=POLICY_TO_PB[Policy(m["policy"])],
    )


_MANIFEST_FIELDS = (
    "run_id", "iteration", "sealed", "seal_reason", "tasks_total", "tasks_done", "tasks_queued",
    "tasks_running", "requeued", "refused_duplicate", "refused_fenced", "refused_sealed",
    "backups_issued", "elapsed_s", "tokens", "sealed_ago_s", "tasks_failed", "env_errors", "groups_lost",
    "eval_total", "eval_done", "eval_failed",
)
_NODE_FIELDS = ("node", "assigned", "done", "running", "refused", "tokens", "tasks_per_s", "slots", "evicted")


def manifest_from_pb(m: spb.IterationManifest) -> dict:
    """The same dict ``SchedulerCore.manifest`` builds (and ``manifest.json`` holds)."""
    out = {k: getattr(m, k) for k in _MANIFEST_FIELDS}
    out["evicted"] = list(m.evicted)
    out["errors"] = list(m.errors)
    out["nodes"] = [{k: getattr(n, k) for k in _NODE_FIELDS} for n in m.nodes]
    out["policy"] = POLICY_FROM_PB.get(m.policy, Policy.DYNAMIC).value
    return out


def fetched_from_pb(g: spb.TrajectoryGroup) -> FetchedGroup:
    return FetchedGroup(
        iteration=g.iteration,
        task_id=g.task_id,
        node=g.node,
        policy_version=g.policy_version,
        gen_seconds=g.gen_seconds,
        reward_seconds=g.reward_seconds,
        prompt_ids=list(g.prompt_ids),
        split=SPLIT_FROM_PB.get(g.split, Split.TRAIN),
        metadata_json=g.metadata_json,
        samples=[_sample_from_pb(s) for s in g.samples],
    )


def result_to_pb(iteration: int, g: GroupRecord) -> spb.TrajectoryGroup:
    """What a worker sends for one finished task (as a message; ``RolloutWorker`` itself sends the
    same bytes built by ``framing.result_batch_request``)."""
    return spb.TrajectoryGroup(
        iteration=iteration,
        task_id=g.task_id,
        samples=[
            spb.Sample(completion_ids=s.completion_ids, logprobs=s.logprobs, reward=s.reward,
                       finish_reason=s.finish_reason, text=s.text, loss_mask=s.loss_mask,
                       turns=s.turns, env_s=s.env_s, truncated=s.truncated)
            for s in g.samples
        ],
        policy_version=g.policy_version,
        gen_seconds=g.gen_seconds,
        reward_seconds=g.reward_seconds,
    )


def _sample_from_pb(s: spb.Sample) -> SampleRecord:
    return SampleRecord(s.completion_ids, s.logprobs, s.reward, s.finish_reason, s.text, s.loss_mask,
                        s.turns or 1, s.env_s, s.truncated)
