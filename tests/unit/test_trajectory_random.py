"""The multi-turn trajectory contract end to end, under seeded random episodes: from an env's
episode (``rollout.episodes``) through the scheduler's wire format and shards to the trainer's
tensors (``train.rollout_link.batch_from_groups``) and the loss's mask.

What is checked (README "Your own data and environments", ``rollout/episodes.py``, ``rollout/
render.py``, ``env/base.py``, ``scheduler/state.py``, ``proto/elasticrl/v1/scheduler.proto``):

* an episode is one token sequence: the first observation's tokens, then each action's tokens
  exactly as the engine drew them (the next turn's context is exactly that sequence), then the next
  observation's (the chat template's delta, or the plain text), and so on, in order;
* only action tokens are trained and carry the engine's logprobs; observation, template, closing
  and padding tokens have mask 0 (and logprob 0 in the episode);
* rewards are the env's, one per step (plus the final reward as the last entry), the return their sum;
* the context limit (the smaller of ``max_context`` and the engine's) is never exceeded; an episode
  whose next observation does not fit ends as truncated ("length"), and the turn limit truncates;
* the trainer's tensors after the wire (``framing``), the coordinator's shard (``store``) and
  ``FetchShard`` hold the same tokens; column t of the loss mask / old logprobs scores token t + 1;
  the loss has no gradient on a masked position;
* the bundled envs (``guess``, ``web``, ``search``) under random and adversarial actions: only
  their documented errors, deterministic per seed, rewards in their documented range; the
  ``TurnLimit`` wrapper and the prompt env as their docstrings say.

The bugs it found are pinned by the ``test_BUG_*`` tests at the end (each failed before its fix).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import os
import random
import re
import struct
import threading
import zlib

import pytest
import torch

from elasticrl._proto import scheduler_pb2 as spb
from elasticrl.env import load_env
from elasticrl.env.base import call_reset, call_step
from elasticrl.env.prompt import PromptEnv, prompt_text
from elasticrl.env.wrappers import TurnLimit
from elasticrl.policy.codec import CharCodec
from elasticrl.rl.loss import policy_loss
from elasticrl.rollout.engine import Group, Sample, SamplingSpec
from elasticrl.rollout.episodes import (
    EpisodeRunner,
    EpisodeSettings,
    GroupTask,
    episode_seed,
)
from elasticrl.rollout.render import ChatRenderer, PlainRenderer, observation_text
from elasticrl.scheduler import framing
from elasticrl.scheduler.convert import fetched_from_pb, served_fields_pb
from elasticrl.scheduler.state import GroupRecord, SampleRecord, Split, TaskSpec
from elasticrl.scheduler.store import TrajectoryStore
from elasticrl.train.rollout_link import batch_from_groups, group_record

pytestmark = pytest.mark.timeout(120)

SEEDS = range(int(os.environ.get("ELASTICRL_RANDOM_SEEDS", "10")))

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Characters of the tiny Llama's tokenizer beyond tiny_llama.CHARS: newline, HTML-ish and unicode.
EXTRA_CHARS = '\n<>[]_"éü日本😀'
VERSION = 5


def f32(x: float) -> float:
    return struct.unpack("<f", struct.pack("<f", x))[0]


# -- tokenizers and renderers -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    """A tiny random Llama with a character tokenizer (unicode and HTML-ish characters too), the
    ChatML template, and <|im_end|> as its first end-of-turn id (as a Qwen checkpoint has it)."""
    pytest.importorskip("transformers")
    from elasticrl.rollout.tiny_llama import CHARS, write_tiny_llama

    path = write_tiny_llama(tmp_path_factory.mktemp("model") / "chat", vocab_size=96, chars=CHARS + EXTRA_CHARS,
                            extra_tokens=("<|im_start|>", "<|im_end|>"), chat_template=CHATML,
                            max_position_embeddings=256, hidden_size=32, num_hidden_layers=1)
    generation = json.loads((path / "generation_config.json").read_text())
    generation["eos_token_id"] = [5, 2]  # <|im_end|> (after the 4 specials and <|im_start|>), then <eos>
    (path / "generation_config.json").write_text(json.dumps(generation))
    return path


@pytest.fixture(scope="module")
def hf_codec(tiny_llama):
    from elasticrl.policy.hf_policy import HFCodec

    codec = HFCodec.from_dir(tiny_llama)
    assert codec.eos_ids == (5, 2)
    return codec


@dataclasses.dataclass
class Mode:
    """How one kind of run renders and decodes: the tiny char model, an HF model without or with
    its chat template."""

    name: str
    renderer: object
    decode: object
    eos: int
    pad: int
    action_ids: list[int]
    """Token ids the fake engine draws actions from."""
    obs_chars: str
    """Characters an observation may hold (ones the renderer can encode)."""
    chat: bool = False


def char_mode() -> Mode:
    codec = CharCodec()
    n = len(codec.vocab.chars)
    return Mode("char", PlainRenderer(codec.encode), codec.decode, codec.eos_ids[0], codec.pad_id, list(range(3, 3 + n)),
                codec.vocab.chars)


def hf_mode(codec, *, chat: bool) -> Mode:
    from elasticrl.rollout.tiny_llama import CHARS

    tok = codec.tokenizer
    chars = CHARS + EXTRA_CHARS
    ids = [tok.convert_tokens_to_ids(c) for c in chars]
    im_start = tok.convert_tokens_to_ids("<|im_start|>")
    if chat:
        renderer = ChatRenderer(tok, codec.eos_ids)
        # An action may hold a special token mid-way (decoded without it); it ends at <|im_end|>.
        return Mode("chat", renderer, codec.decode, codec.eos_ids[0], codec.pad_id, ids + [im_start], chars, chat=True)
    return Mode("hf", PlainRenderer(codec.encode), codec.decode, codec.eos_ids[1], codec.pad_id, ids, chars)


def modes_for(seed: int, hf_codec) -> list[Mode]:
    return [char_mode(), hf_mode(hf_codec, chat=False), hf_mode(hf_codec, chat=True)]


# -- the fake engine: its answer depends only on the context --------------------------------------


class ContextEngine:
    """A ``RolloutEngine`` whose sample is a function of (context, max_new_tokens): an empty
    action (the stop token alone), a few tokens then the stop token, or exactly max_new_tokens
    tokens ("length"); each logprob a distinct multiple of 1/64 (exact in float32). Identical
    contexts of a batch get identical samples. Records every context it was asked to continue."""

    def __init__(self, mode: Mode, salt: int, max_context: int | None):
        self.mode = mode
        self.salt = salt
        self.max_context = max_context
        self.policy_version = VERSION
        self.seen: dict[tuple[tuple[int, ...], int], Sample] = {}
        self.lock = threading.Lock()

    def sample_for(self, context: list[int], max_new: int) -> Sample:
        h = zlib.crc32(struct.pack(f"<{len(context)}i", *context), self.salt)
        rng = random.Random(h * 7919 + max_new)
        kind = rng.choices(["empty", "stop", "length"], [0.15, 0.55, 0.3])[0]
        if kind == "empty":
            ids = [self.mode.eos]
        elif kind == "stop":
            k = rng.randint(0, max_new - 1)
            ids = [rng.choice(self.mode.action_ids) for _ in range(k)] + [self.mode.eos]
        else:
            ids = [rng.choice(self.mode.action_ids) for _ in range(max_new)]
        if len(ids) > max_new:  # max_new == 1 and a stop: the stop token alone
            ids = ids[:max_new]
        finish = "stop" if ids and ids[-1] == self.mode.eos else "length"
        logprobs = [-(1 + rng.randrange(4096)) / 64 for _ in ids]
        # Some engines have no tokenizer: the runner decodes the ids itself.
        text = self.mode.decode(ids) if rng.random() < 0.7 else None
        return Sample(completion_ids=ids, logprobs=logprobs, finish_reason=finish, text=text)

    def generate(self, requests):
        out = []
        for r in requests:
            ctx = list(r.prompt_ids)
            assert self.max_context is None or len(ctx) < self.max_context, "a context the engine cannot continue"
            s = self.sample_for(ctx, r.sampling.max_new_tokens)
            assert 1 <= len(s.completion_ids) <= r.sampling.max_new_tokens
            with self.lock:
                self.seen[(tuple(ctx), r.sampling.max_new_tokens)] = s
            out.append(Group(task_id=r.task_id, prompt_ids=ctx, samples=[s] * r.sampling.n, policy_version=VERSION,
                             gen_seconds=0.0))
        return out


# -- the random env and its log -----------------------------------------------------------------


@dataclasses.dataclass
class StepLog:
    action: str
    obs: object
    reward: float
    terminated: bool
    truncated: bool


@dataclasses.dataclass
class EpisodeLog:
    obs0: object
    steps: list[StepLog] = dataclasses.field(default_factory=list)


class World:
    """The plan of every episode: a function of (group, episode seed), or of the group alone for
    "twin" groups (every episode identical: the runner merges their contexts into one request)."""

    def __init__(self, seed: int, mode: Mode, rng: random.Random):
        self.seed = seed
        self.mode = mode
        self.big = rng.choice([0.0, 0.1, 0.3])
        self.p_none = rng.choice([0.0, 0.5])
        self.logs: dict[tuple[int, int], EpisodeLog] = {}
        self.lock = threading.Lock()

    def text(self, rng: random.Random, big: bool = False) -> str:
        n = rng.randint(20, 120) if big else rng.choice([0, 1, rng.randint(0, 12)])
        return "".join(rng.choice(self.mode.obs_chars) for _ in range(n))

    def observation(self, rng: random.Random):
        big = rng.random() < self.big
        if not self.mode.chat or rng.random() < 0.5:
            return self.text(rng, big)
        # Any role renders with this template (one that refuses a role fails its group:
        # test_BUG_an_observation_the_renderer_refuses_fails_its_group_not_the_whole_play).
        roles = ["user", "tool", "system"]
        return [{"role": rng.choice(roles), "content": self.text(rng, big)} for _ in range(rng.randint(1, 2))]

    def reward(self, rng: random.Random) -> float:
        return rng.choice([0.0, 1.0, -1.0, 0.5, round(rng.uniform(-3, 3), 3), 2])


class PlanEnv:
    """An env that plays the world's plan for its episode and logs what it saw and returned."""

    def __init__(self, world: World):
        self.world = world

    def reset(self, *, seed=None, options=None):
        gid, twin = options["gid"], options["twin"]
        self.rng = random.Random(f"{self.world.seed}/{gid}" if twin else f"{self.world.seed}/{gid}/{seed}")
        self.turns_planned = self.rng.choice([1, 2, 3, self.rng.randint(1, 8)])
        self.open_ended = self.rng.random() < 0.25  # never ends by itself: the turn or context limit does
        self.turn = 0
        obs0 = self.world.observation(self.rng)
        if not self.world.mode.chat and self.world.mode.name == "char" and not obs0:
            obs0 = ""  # BOS alone: the first observation still renders to one token
        self.log = EpisodeLog(obs0)
        with self.world.lock:
            assert (gid, seed) not in self.world.logs, "an episode reset twice"
            self.world.logs[(gid, seed)] = self.log
        return obs0, {"gid": gid}

    def step(self, action):
        self.turn += 1
        last = not self.open_ended and self.turn >= self.turns_planned
        terminated = last and self.rng.random() < 0.6
        truncated = last and not terminated
        obs = self.world.observation(self.rng)
        if last and self.rng.random() < self.world.p_none:
            obs = None  # a final observation is never shown: None is allowed there
        reward = self.world.reward(self.rng)
        self.log.steps.append(StepLog(action, obs, reward, terminated, truncated))
        return obs, reward, terminated, truncated, {"turn": self.turn}


def final_reward(prompt: str, text: str, row) -> float:
    return (len(prompt) * 3 + len(text)) % 7 / 4 - 0.5


# -- the reference: one episode as the docstrings describe it ---------------------------------------


@dataclasses.dataclass
class Expected:
    tokens: list[int]
    mask: list[int]
    logprobs: list[float]
    rewards: list[float]
    actions: list[list[int]]
    observations: list[list[int]]
    truncated: bool
    finish_reason: str
    prompt: str
    text: str


def expected_episode(log: EpisodeLog, engine: ContextEngine, mode: Mode, limit: int, max_turns: int,
                     max_new: int, final) -> Expected:
    """What the trainer must get for the episode ``log`` records. Raises KeyError if the engine
    was never asked to continue a context this episode must have had."""
    r = mode.renderer
    tokens = r.first(log.obs0)
    assert tokens and len(tokens) < limit
    mask, lps = [0] * len(tokens), [0.0] * len(tokens)
    rewards, actions, observations, transcript = [], [], [], []
    truncated, last = None, "stop"
    for i, st in enumerate(log.steps):
        room = limit - len(tokens)
        assert room >= 1, "the runner generated with no room left"
        s = engine.seen[(tuple(tokens), min(max_new, room))]  # this very context was continued
        tokens, mask, lps = tokens + s.completion_ids, mask + [1] * len(s.completion_ids), lps + list(s.logprobs)
        actions.append(list(s.completion_ids))
        last = s.finish_reason
        closing = r.close_action(s.finish_reason == "stop")
        if closing and len(tokens) + len(closing) <= limit:
            tokens, mask, lps = tokens + closing, mask + [0] * len(closing), lps + [0.0] * len(closing)
        text = s.text if s.text is not None else mode.decode(s.completion_ids)
        assert st.action == text, "the env got another action than the one the engine drew"
        transcript.append(text)
        rewards.append(st.reward)
        cut = st.truncated or (i + 1 >= max_turns and not st.terminated)  # TurnLimit
        if st.terminated or cut:
            assert i == len(log.steps) - 1, "the episode went on after it ended"
            truncated = cut and not st.terminated
            break
        more = r.next(st.obs)
        if len(tokens) + len(more) >= limit:  # no room for the observation and one more token
            assert i == len(log.steps) - 1, "the episode went on past its context"
            truncated = True
            break
        tokens, mask, lps = tokens + more, mask + [0] * len(more), lps + [0.0] * len(more)
        observations.append(more)
        transcript.append(observation_text(st.obs))
    assert truncated is not None, "the episode ended without a reason (env, turn limit or context)"
    prompt, text = observation_text(log.obs0), "\n".join(transcript)
    if final is not None:
        rewards.append(float(final(prompt, text, None)))
    return Expected(tokens, mask, lps, rewards, actions, observations, truncated,
                    "length" if truncated or last == "length" else "stop", prompt, text)


# -- one random world, played -----------------------------------------------------------------------


@dataclasses.dataclass
class Played:
    world: World
    engine: ContextEngine
    settings: EpisodeSettings
    limit: int
    tasks: list[GroupTask]
    outcomes: list
    final: object


def play_world(seed: int, mode: Mode, *, settings: EpisodeSettings | None = None) -> Played:
    rng = random.Random(f"world/{seed}/{mode.name}")
    floor = 40 if mode.chat else 2  # the chat template's header is ~20 tokens
    drawn = EpisodeSettings(
        max_turns=rng.randint(1, 6), step_timeout_s=10.0, episodes_in_flight=rng.randint(1, 16),
        max_context=rng.choice([0, rng.randint(floor, floor + 40), rng.randint(floor + 40, 250)]),
        linger_s=rng.choice([0.0, 0.005]),
    )
    settings = settings or drawn
    engine_limit = rng.choice([None, rng.randint(floor + 10, 256)])
    engine = ContextEngine(mode, rng.randrange(1 << 30), engine_limit)
    limits = [x for x in (settings.max_context, engine_limit or 0) if x]
    limit = min(limits) if limits else 1 << 62
    world = World(seed, mode, rng)
    final = final_reward if rng.random() < 0.3 else None
    tasks = [
        GroupTask(task_id=f"t{gid}", row={"gid": gid, "twin": rng.random() < 0.25}, episodes=rng.randint(1, 5),
                  seed=seed * 1000 + gid, sampling=SamplingSpec(max_new_tokens=rng.randint(1, 10)))
        for gid in range(rng.randint(2, 7))
    ]
    runner = EpisodeRunner(engine, mode.renderer, lambda: PlanEnv(world), settings, decode=mode.decode,
                           final_reward=(lambda p, t, row: final(p, t, None)) if final else None)
    try:
        outcomes = runner.play(tasks)
    finally:
        runner.close()
    return Played(world, engine, settings, limit, tasks, outcomes, final)


def check_episodes(p: Played, mode: Mode) -> None:
    """Every episode of every group against the reference, plus the properties read off directly."""
    for task, outcome in zip(p.tasks, p.outcomes):
        if outcome.episodes is None:
            # Only a first observation that leaves no room for an action fails an episode here.
            assert "leave room for an action" in outcome.error, outcome.error
            firsts = [len(mode.renderer.first(log.obs0)) for (gid, _), log in p.world.logs.items()
                      if gid == task.row["gid"]]
            assert any(n >= p.limit for n in firsts)
            continue
        assert len(outcome.episodes) == task.episodes
        for j, e in enumerate(outcome.episodes):
            log = p.world.logs[(task.row["gid"], episode_seed(task.seed, j))]
            want = expected_episode(log, p.engine, mode, p.limit, p.settings.max_turns, task.sampling.max_new_tokens,
                                    p.final)
            where = f"group {task.task_id} episode {j}"
            # Aligned, within the context, and trained exactly on the drawn tokens.
            assert len(e.token_ids) == len(e.loss_mask) == len(e.logprobs) <= p.limit, where
            assert set(e.loss_mask) <= {0, 1}, where
            assert all(lp == 0.0 for lp, m in zip(e.logprobs, e.loss_mask) if m == 0), where
            first = mode.renderer.first(log.obs0)
            assert e.token_ids[:len(first)] == first and not any(e.loss_mask[:len(first)]), where
            assert [t for t, m in zip(e.token_ids, e.loss_mask) if m] == [t for a in want.actions for t in a], where
            # The whole sequence: prompt, then each action and observation, in order.
            assert e.token_ids == want.tokens, where
            assert e.loss_mask == want.mask, where
            assert e.logprobs == want.logprobs, where
            # Rewards: the env's, one per step (then the final one); the return is their sum.
            assert e.rewards == want.rewards, where
            assert e.reward == pytest.approx(sum(want.rewards), abs=1e-12), where
            assert e.turns == len(log.steps) == len(want.actions), where
            assert (e.truncated, e.finish_reason) == (want.truncated, want.finish_reason), where
            assert (e.prompt, e.text) == (want.prompt, want.text), where
            assert e.policy_version == VERSION, where
            if mode.chat:
                check_whole_conversation(e, log, want, mode)


def check_whole_conversation(e, log: EpisodeLog, want: Expected, mode: Mode) -> None:
    """README: "every turn's tokens are what the template gives the whole conversation": the
    episode is the template's rendering of [first observation, action 1, observation 1, ...,
    action n] up to the newline the template puts after the last <|im_end|> (which belongs to the
    next observation), or up to that <|im_end|> when the context had no room to close the last
    action. Only for actions whose text re-tokenizes to their ids (characters, then <|im_end|>)."""
    tok = mode.renderer.tokenizer
    end = mode.renderer.turn_end_ids[0]
    plain = [a[:-1] if a and a[-1] == end else a for a in want.actions]
    if any(t not in mode.action_ids or t == tok.convert_tokens_to_ids("<|im_start|>") for a in plain for t in a):
        return
    messages = list(ChatRenderer._messages(log.obs0))
    for i, ids in enumerate(plain):
        messages.append({"role": "assistant", "content": tok.decode(ids)})
        if i < len(want.observations):
            messages += ChatRenderer._messages(log.steps[i].obs)
    full = mode.renderer._render(messages, generation_prompt=False)
    newline = tok.convert_tokens_to_ids("\n")
    assert e.token_ids == full[:len(e.token_ids)], "the episode is not the template's rendering of its conversation"
    assert full[len(e.token_ids):] in ([newline], [end, newline]), full[len(e.token_ids):]


# -- the trainer's side: the wire, the shard, FetchShard, batch_from_groups, the loss ------------------


def ship(records: list[tuple[TaskSpec, object]], iteration: int, store: TrajectoryStore) -> list:
    """Groups as the trainer fetches them: sent by a worker (``framing``), checked and kept by the
    coordinator (``read_group``), written to and read back from a shard, served by FetchShard
    (stored bytes + the coordinator's fields) and parsed by the client."""
    raw = framing.result_batch_request([(iteration, g) for _, g in records], "batch-1")
    batch_id, spans = framing.result_batch_spans(raw)
    assert batch_id == "batch-1" and len(spans) == len(records)
    received = [framing.read_group(f"results.groups[{i}]", raw, a, b, node="n0") for i, (a, b) in enumerate(spans)]
    assert all(it == iteration for it, _ in received)
    name = store.write_shard("run", iteration, [(g, list(spec.prompt_ids)) for (spec, _), (_, g) in zip(records, received)])
    stored = store.read_shard("run", iteration, name)
    specs = {spec.task_id: spec for spec, _ in records}
    parts = []
    for group, _ in stored:
        gp, n = framing.group_parts(iteration, group)
        served = served_fields_pb(group.node, specs[group.task_id])
        parts.append(([*gp, served], n + len(served)))
    total = sum(g.num_tokens for g, _ in stored)
    response = spb.FetchShardResponse.FromString(framing.fetch_response(parts, len(stored), total))
    assert response.total_groups == len(records) and response.total_tokens == total
    return [fetched_from_pb(g) for g in response.groups]


def check_batch(fetched, expected_rows, pad: int) -> None:
    """``expected_rows``: per sample (prompt ids, token ids, loss mask, logprobs, reward, text, turns,
    truncated), in fetch order."""
    batch = batch_from_groups(fetched, pad, torch.device("cpu"))
    width = max(len(g.prompt_ids) for g in fetched)
    length = max([len(r[1]) for r in expected_rows] + [1])
    assert tuple(batch.tokens.shape) == (len(expected_rows), width + length)
    assert tuple(batch.completion_mask.shape) == tuple(batch.old_logprobs.shape) == (len(expected_rows), width + length - 1)
    for row, (prompt, ids, mask, lps, reward, text, _, _) in enumerate(expected_rows):
        full_ids = [pad] * (width - len(prompt)) + list(prompt) + list(ids) + [pad] * (length - len(ids))
        full_valid = [0] * (width - len(prompt)) + [1] * (len(prompt) + len(ids)) + [0] * (length - len(ids))
        full_mask = [0] * width + list(mask) + [0] * (length - len(ids))
        full_lps = [0.0] * width + [f32(x) for x in lps] + [0.0] * (length - len(ids))
        assert batch.tokens[row].tolist() == full_ids, row
        assert batch.valid[row].int().tolist() == full_valid, row
        # Column t scores token t + 1: the mask and the behaviour logprobs of token t + 1.
        assert batch.completion_mask[row].tolist() == [float(m) for m in full_mask[1:]], row
        assert batch.old_logprobs[row].tolist() == full_lps[1:], row
        # Never trained: padding, the prompt, observation and template tokens.
        trained = batch.completion_mask[row].bool()
        assert batch.valid[row, 1:][trained].all(), row
        assert batch.rewards[row].item() == f32(reward), row
        assert batch.completions[row] == text, row
    assert batch.completion_mask.sum().item() == sum(sum(r[2]) for r in expected_rows)
    assert batch.episodes["turns"] == sum(r[6] for r in expected_rows)
    assert batch.episodes["truncated"] == sum(bool(r[7]) for r in expected_rows)
    # The loss: no gradient reaches a masked position, whichever objective and aggregation.
    gen = torch.Generator().manual_seed(len(expected_rows))
    for kind, aggregation in (("grpo_clip", "token"), ("reinforce", "sequence")):
        logprobs = (batch.old_logprobs + 0.1 * torch.randn(batch.old_logprobs.shape, generator=gen)).requires_grad_(True)
        advantages = torch.randn(len(expected_rows), generator=gen)
        loss, _ = policy_loss(logprobs, batch.old_logprobs, advantages, batch.completion_mask, kind=kind,
                              aggregation=aggregation, num_tokens=max(float(batch.completion_mask.sum()), 1.0),
                              num_sequences=float(len(expected_rows)))
        loss.backward()
        assert torch.isfinite(loss)
        assert (logprobs.grad[batch.completion_mask == 0] == 0).all()


def trainer_side(p: Played, mode: Mode, rng: random.Random, tmp_path) -> None:
    records, rows = [], []
    with_prompt = rng.random() < 0.5
    for task, outcome in zip(p.tasks, p.outcomes):
        if outcome.episodes is None:
            continue
        g = group_record(task.task_id, outcome, VERSION - 1, with_prompt=with_prompt)
        assert g.policy_version == VERSION and len(g.samples) == task.episodes
        spec = TaskSpec(task_id=task.task_id, prompt_ids=[], prompt_text=f"row {task.task_id}", num_samples=task.episodes,
                        metadata_json=json.dumps({"row": task.row}))
        records.append((spec, g))
        for e in outcome.episodes:
            rows.append(([], e.token_ids, e.loss_mask, e.logprobs, e.reward,
                         f"{e.prompt}\n{e.text}" if with_prompt else e.text, e.turns, e.truncated))
    # Plain single-turn groups submitted with prompt ids (every token trained) share the batch:
    # their prompts set the left padding of every row.
    for k in range(rng.randint(0, 2)):
        prompt = [rng.choice(mode.action_ids) for _ in range(rng.randint(1, 6))]
        samples, expected = [], []
        for _ in range(rng.randint(1, 3)):
            ids = [rng.choice(mode.action_ids) for _ in range(rng.randint(0, 5))]
            lps = [-(1 + rng.randrange(100)) / 8 for _ in ids]
            reward = rng.choice([0.0, 1.0, 0.25])
            samples.append(SampleRecord.pack(ids, lps, reward, "stop", "plain"))
            expected.append((prompt, ids, [1] * len(ids), lps, reward, "plain", 1, False))
        spec = TaskSpec(task_id=f"plain{k}", prompt_ids=prompt, num_samples=len(samples),
                        metadata_json=json.dumps({"prompt": "p", "target": "t"}))
        records.append((spec, GroupRecord(f"plain{k}", "", VERSION, 0.0, 0.0, samples)))
        rows.extend(expected)
    if not records:
        return
    fetched = ship(records, 3, TrajectoryStore(tmp_path / f"state-{mode.name}"))
    assert [g.task_id for g in fetched] == [spec.task_id for spec, _ in records]
    assert all(g.split == Split.TRAIN and g.iteration == 3 and g.node == "n0" for g in fetched)
    check_batch(fetched, rows, mode.pad)


# -- the random tests ---------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", SEEDS)
def test_random_episodes_are_the_prompt_actions_and_observations_in_order_and_train_only_actions(seed, hf_codec, tmp_path):
    """Random episodes through the runner in three renderings (tiny chars, an HF tokenizer as plain
    text, its chat template), then through the wire, a shard and FetchShard into the trainer's
    tensors and the loss."""
    rng = random.Random(seed)
    for mode in modes_for(seed, hf_codec):
        p = play_world(seed, mode)
        check_episodes(p, mode)
        trainer_side(p, mode, rng, tmp_path)


@pytest.mark.parametrize("seed", SEEDS)
def test_an_episode_is_a_function_of_its_seeds(seed, hf_codec):
    """The same world played twice (another batching: other episodes in flight, no linger) gives
    the same trajectories, token for token."""
    mode = [char_mode(), hf_mode(hf_codec, chat=True)][seed % 2]
    a = play_world(seed, mode)
    again = dataclasses.replace(a.settings, episodes_in_flight=1 + seed % 3, linger_s=0.0)
    b = play_world(seed, mode, settings=again)
    for x, y in zip(a.outcomes, b.outcomes):
        assert (x.episodes is None) == (y.episodes is None)
        for e, f in zip(x.episodes or [], y.episodes or []):
            assert (e.token_ids, e.loss_mask, e.logprobs, e.rewards, e.truncated, e.text) == (
                f.token_ids, f.loss_mask, f.logprobs, f.rewards, f.truncated, f.text)


# -- real engines: the trainer's teacher-forced logprobs are the engine's, on the action tokens ------------


def groups_to_batch(tasks, outcomes, pad: int, tmp_path, name: str):
    records, rows = [], []
    for task, outcome in zip(tasks, outcomes):
        assert outcome.episodes is not None, outcome.error
        g = group_record(task.task_id, outcome, 0, with_prompt=False)
        spec = TaskSpec(task_id=task.task_id, prompt_ids=[], num_samples=task.episodes, metadata_json=json.dumps({"row": task.row}))
        records.append((spec, g))
        rows += [([], e.token_ids, e.loss_mask, e.logprobs, e.reward, e.text, e.turns, e.truncated) for e in outcome.episodes]
    fetched = ship(records, 1, TrajectoryStore(tmp_path / name))
    check_batch(fetched, rows, pad)
    return batch_from_groups(fetched, pad, torch.device("cpu"))


@pytest.mark.parametrize("seed", SEEDS)
def test_tiny_engine_multi_turn_guess_games_train_on_the_engines_own_logprobs(seed, tmp_path):
    """The built-in tiny model and engine playing the bundled guess game, contexts cut by the
    model's max_seq_len (the engine crops its window): after the wire, the trainer's
    ``token_logprobs`` at the sampling temperature reproduce the engine's logprob of every trained
    token, and observations are never trained."""
    from elasticrl.config import ModelConfig
    from elasticrl.policy.tiny import TinyCausalLM, token_logprobs
    from elasticrl.rollout.tiny_engine import TinyEngine

    rng = random.Random(seed)
    codec = CharCodec()
    torch.manual_seed(seed)
    model = TinyCausalLM(ModelConfig(d_model=16, n_layers=1, n_heads=2, max_seq_len=rng.randint(10, 40)), len(codec.vocab))
    temperature = rng.choice([1.0, 0.7, 1.5])
    engine = TinyEngine(model, codec.vocab, policy_version=VERSION, seed=seed)
    kwargs = {"low": 0, "high": rng.choice([9, 20, 99]), "turn_penalty": rng.choice([0.0, 0.1]),
              "consistent_reward": rng.choice([0.0, 0.2])}
    settings = EpisodeSettings(max_turns=rng.randint(1, 6), step_timeout_s=10.0,
                               max_context=rng.choice([0, rng.randint(9, 40)]), linger_s=0.0)
    tasks = [GroupTask(task_id=f"g{k}", row={"instance": rng.randrange(100)}, episodes=rng.randint(1, 4), seed=seed * 100 + k,
                       sampling=SamplingSpec(max_new_tokens=rng.randint(1, 4), temperature=temperature))
             for k in range(rng.randint(1, 4))]
    runner = EpisodeRunner(engine, PlainRenderer(codec.encode), load_env("guess", kwargs).make, settings, decode=codec.decode)
    try:
        outcomes = runner.play(tasks)
    finally:
        runner.close()
    limit = min(x for x in (settings.max_context, model.config.max_seq_len) if x)
    for outcome in outcomes:
        for e in outcome.episodes:
            first = codec.encode("guess:", bos=True)
            assert len(e.token_ids) <= limit and e.token_ids[:len(first)] == first and not any(e.loss_mask[:len(first)])
            assert all(r in _guess_rewards(kwargs) for r in e.rewards)
    batch = groups_to_batch(tasks, outcomes, codec.pad_id, tmp_path, "tiny")
    with torch.no_grad():
        recomputed = token_logprobs(model, batch.tokens, batch.valid, temperature=temperature)
    mask = batch.completion_mask.bool()
    assert torch.allclose(recomputed[mask], batch.old_logprobs[mask], atol=1e-4)


def _guess_rewards(kw) -> set[float]:
    pen = kw.get("turn_penalty", 0.0)
    return {kw.get("win_reward", 1.0) - pen, kw.get("consistent_reward", 0.0) - pen, 0.0 - pen}


@pytest.mark.parametrize("seed", SEEDS[:3])
def test_hf_engine_chat_episodes_in_the_search_env_train_on_the_engines_own_logprobs(seed, tiny_llama, hf_codec, tmp_path):
    """The HF engine with the chat template playing the bundled search env (a local BM25 server):
    observations are the template's deltas (masked), each action as drawn (trained), closed with
    <|im_end|> when cut; after the wire the trainer's ``hf_token_logprobs`` reproduce the engine's."""
    from elasticrl.policy.hf_policy import hf_token_logprobs, load_hf_model
    from elasticrl.rollout.hf import HFEngine

    rng = random.Random(seed)
    engine = HFEngine(tiny_llama, seed=seed, policy_version=VERSION)
    renderer = ChatRenderer(hf_codec.tokenizer, hf_codec.eos_ids)
    temperature = rng.choice([1.0, 0.8])
    settings = EpisodeSettings(max_turns=rng.randint(1, 4), step_timeout_s=10.0,
                               max_context=rng.choice([0, rng.randint(170, 240)]), linger_s=0.0)
    tasks = [GroupTask(task_id=f"s{k}", row={"instance": rng.randrange(50)}, episodes=rng.randint(1, 3), seed=seed * 10 + k,
                       sampling=SamplingSpec(max_new_tokens=rng.randint(1, 12), temperature=temperature,
                                             stop_token_ids=hf_codec.eos_ids))
             for k in range(2)]
    runner = EpisodeRunner(engine, renderer, load_env("search", {"docs": 20}).make, settings, decode=hf_codec.decode)
    try:
        outcomes = runner.play(tasks)
    finally:
        runner.close()
    end = hf_codec.eos_ids[0]
    for outcome in outcomes:
        assert outcome.episodes is not None, outcome.error
        for e in outcome.episodes:
            assert e.prompt.startswith("question: ") and e.token_ids[:len(renderer.first(e.prompt))] == renderer.first(e.prompt)
            # Every action ends at a turn end: drawn (trained) or supplied (masked), unless the context was full.
            ends = [i for i, t in enumerate(e.token_ids) if t == end]
            assert all(e.loss_mask[i] == 1 or e.logprobs[i] == 0.0 for i in ends)
    batch = groups_to_batch(tasks, outcomes, hf_codec.pad_id, tmp_path, "hf")
    model = load_hf_model(tiny_llama)
    with torch.no_grad():
        recomputed = hf_token_logprobs(model, batch.tokens, batch.valid, temperature=temperature)
    mask = batch.completion_mask.bool()
    assert mask.any()
    assert torch.allclose(recomputed[mask], batch.old_logprobs[mask], atol=1e-4)
    engine.close()


# -- the bundled envs under random and adversarial actions ------------------------------------------------


UNICODE = "éü日本😀\u200b\u202e\u0301\x00\u2028\t\r\x7f\ufeff\U0001f9e0ß\u0130Ω"
HTMLISH = ["<a href='/e/1'>x</a>", "<script>alert(1)</script>", "&amp;&lt;", "</p><div>", "<!-- -->", "<br/>", "<html>"]


def wild_action(rng: random.Random, extra: list[str]) -> str:
    """A random action: valid ones (``extra``), malformed tool calls, HTML-ish text, unicode, huge
    strings, empty ones."""
    pick = rng.random()
    if pick < 0.35 and extra:
        return rng.choice(extra)
    if pick < 0.45:
        return rng.choice(["", " ", "\n", "\n\n\n", "\t", "\u2028"])
    if pick < 0.55:
        return "".join(rng.choice(UNICODE + "abc 123<>/") for _ in range(rng.randint(1, 40)))
    if pick < 0.65:
        return rng.choice(HTMLISH) + rng.choice(["", " click 1", "<search>x</search>", " answer x"])
    if pick < 0.72:  # huge
        unit = rng.choice(["a", "9", "<search>", "click ", "é", " ", "<answer>x", "\n", "日本"])
        return unit * rng.randint(1_000, 50_000)
    tool = rng.choice([
        "<search>", "<search>q", "</search>", "<search></search>", "<search>   </search>", "<SEARCH>zorbin</SEARCH>",
        "<answer>", "<answer></answer>", "<answer>a</search>", "<search><answer>1843</answer></search>",
        "< search >q</ search >", "<search>q</search><answer>x</answer>", "<search>" + "q " * 500 + "</search>",
        "click", "click -1", "click 0", "click 99999", "click [2].", "CLICK 1", "click 1 2", "click \u0663", "click 1x",
        "answer", "answer:", "answer    ", "ANSWER: 1843", "answer " + UNICODE, "1 answer x", "click\n2",
        "guess 5", "-5", "1e9", "\u0663", "05", "99", "100", "٣٣",
    ])
    return tool


def run_actions(env, seed: int, options, actions: list[str]) -> list:
    """reset then step through ``actions`` (stopping at the end of the episode); what it returned."""
    out = [env.reset(seed=seed, options=options)]
    for a in actions:
        result = env.step(a)
        out.append(result)
        if result[2] or result[3]:
            break
    return out


def check_step_shape(result) -> None:
    obs, reward, terminated, truncated, info = result
    assert isinstance(obs, str) and isinstance(info, dict)
    assert isinstance(terminated, bool) and isinstance(truncated, bool) and not truncated
    assert isinstance(reward, float) and math.isfinite(reward)
    # What the runner checks of every step: it would take this one.
    checked = asyncio.run(call_step(_Returns(result), "x"))
    assert checked[1:4] == (reward, terminated, truncated)


class _Returns:
    def __init__(self, result):
        self.result = result

    def step(self, action):
        return self.result


def guess_reference(kw, secret: int, actions: list[str]) -> list[tuple]:
    """The guess game as ``guess.py``'s docstrings describe it: (obs, reward, terminated) per step."""
    low, high = kw["low"], kw["high"]
    pen, win, cons = kw["turn_penalty"], kw["win_reward"], kw["consistent_reward"]
    out, lo, hi = [], low, high
    for a in actions:
        m = re.search(r"[0-9]+", a)
        if m is None:
            out.append(("bad:", -pen, False))
            continue
        g = int(m.group()[:2])
        if g == secret:
            out.append(("", win - pen, True))
            break
        reward = (cons if lo <= g <= hi else 0.0) - pen
        if secret > g:
            lo = max(lo, g + 1)
            out.append(("hi:", reward, False))
        else:
            hi = min(hi, g - 1)
            out.append(("lo:", reward, False))
    return out


@pytest.mark.parametrize("seed", SEEDS)
def test_guess_env_under_random_actions_follows_its_docstring(seed):
    from elasticrl.env.guess import GuessEnv

    rng = random.Random(seed)
    low = rng.randint(0, 50)
    kw = {"low": low, "high": rng.randint(low + 1, 99), "win_reward": rng.choice([1.0, 2.5]),
          "turn_penalty": rng.choice([0.0, 0.05]), "consistent_reward": rng.choice([0.0, 0.2])}
    for episode in range(6):
        options = rng.choice([None, {}, {"instance": rng.randrange(1000)}, {"secret": rng.randint(kw["low"], kw["high"])}])
        digits = [str(rng.randint(kw["low"], kw["high"])) for _ in range(5)]
        actions = [wild_action(rng, digits) for _ in range(rng.randint(1, 12))]
        ep_seed = rng.randrange(1 << 31)
        a, b = GuessEnv(**kw), GuessEnv(**kw)
        got = run_actions(a, ep_seed, options, actions)
        assert got == run_actions(b, ep_seed, options, actions)  # deterministic per seed
        obs0, info0 = got[0]
        assert obs0 == "guess:" and kw["low"] <= info0["secret"] <= kw["high"]
        options = options or {}
        if "secret" in options:
            assert info0["secret"] == options["secret"]
        elif "instance" in options:  # every episode of a group plays the same secret
            assert info0["secret"] == kw["low"] + options["instance"] % (kw["high"] - kw["low"] + 1)
            assert GuessEnv(**kw).reset(seed=ep_seed + 1, options=options)[1]["secret"] == info0["secret"]
        want = guess_reference(kw, info0["secret"], actions)
        assert [(o, r, t) for o, r, t, _, _ in got[1:]] == want
        for step in got[1:]:
            check_step_shape(step)


def test_guess_bisection_wins_within_the_documented_number_of_turns():
    """``guess.py``: "a policy that reads the earlier turns bisects and always wins within
    ceil(log2(high - low + 2)) guesses" (powers of two: test_BUG_guess_bisection_bound_fails_for_a_power_of_two_span)."""
    from elasticrl.env.guess import GuessEnv

    for low, high in ((0, 9), (0, 99), (3, 9), (10, 20), (0, 2), (5, 50), (0, 7), (1, 16)):
        for secret in range(low, high + 1):
            assert _bisect_turns(GuessEnv(low=low, high=high), secret) <= math.ceil(math.log2(high - low + 2))


def _bisect_turns(env, secret: int) -> int:
    obs, _ = env.reset(options={"secret": secret})
    lo, hi = env.low, env.high
    for turn in range(1, 100):
        g = (lo + hi) // 2
        obs, _, terminated, _, _ = env.step(str(g))
        if terminated:
            return turn
        lo, hi = (g + 1, hi) if obs == "hi:" else (lo, g - 1)
    raise AssertionError("never won")


WEB_ACT = "act: click <n> or answer <text>"


@pytest.mark.parametrize("seed", SEEDS)
def test_web_env_under_random_and_adversarial_actions(seed):
    """Only its documented errors (RuntimeError after the end), deterministic per seed, reward 1.0
    exactly for a correct answer and 0.0 otherwise, every page observation in the documented
    layout, numbers of more than 4300 digits in a click too (they raised:
    test_BUG_web_click_with_a_huge_number_raises_instead_of_an_invalid_action)."""
    from elasticrl.env.web import WebEnv, make_rows

    rng = random.Random(seed)
    kw = {"site_seed": rng.randrange(5), "pages": rng.choice([3, 12, 30])}
    a, b = WebEnv(**kw), WebEnv(**kw)
    try:
        rows = make_rows(4, **kw)
        for i, row in enumerate(rows):  # row i is the question options={"instance": i} asks
            assert a.reset(options=row)[1]["question"] == a.reset(options={"instance": i})[1]["question"]
        for episode in range(4):
            options = rng.choice([None, {"instance": rng.randrange(100)}, rng.choice(rows)])
            ep_seed = rng.randrange(1 << 31)
            obs0, info0 = a.reset(seed=ep_seed, options=options)
            answer = a.question.answer
            valid = [f"click {k}" for k in range(1, 8)] + [f"answer {answer}", f"Answer: {answer.upper()}.", "answer nope"]
            actions = [wild_action(rng, valid) for _ in range(rng.randint(1, 15))]
            got = run_actions(a, ep_seed, options, actions)
            assert got == run_actions(b, ep_seed, options, actions)
            assert got[0] == (obs0, info0)
            for (obs, reward, terminated, truncated, info), action in zip(got[1:], actions):
                check_step_shape((obs, reward, terminated, truncated, info))
                assert reward in (0.0, 1.0) and (reward == 1.0) == bool(info.get("correct"))
                assert terminated == (obs in ("correct.", "wrong.")) and info["valid_action"] in (True, False)
                if terminated:
                    assert info["answer"] == answer
                    with pytest.raises(RuntimeError, match="after the episode ended"):
                        a.step(action)
                else:
                    assert obs.endswith(WEB_ACT) or WEB_ACT + ", e.g. click 1" in obs
                    if info["valid_action"]:
                        assert obs.startswith(f"page: {info['url']} ") and f"\nquestion: {a.question.text}\n" in obs
    finally:
        a.close()
        b.close()
        a.close()  # idempotent


@pytest.mark.parametrize("seed", SEEDS)
def test_search_env_under_random_and_adversarial_actions(seed):
    """Only its documented errors, deterministic per seed, reward 1.0 exactly for a matching
    <answer>, the first tag deciding the action, search results as <information>."""
    from elasticrl.env.search import SearchEnv, make_rows

    rng = random.Random(seed)
    kw = {"corpus_seed": rng.randrange(5), "docs": rng.choice([5, 30, 60]), "top_k": rng.randint(1, 4)}
    a, b = SearchEnv(**kw), SearchEnv(**kw)
    try:
        rows = make_rows(3, corpus_seed=kw["corpus_seed"], docs=kw["docs"])
        for i, row in enumerate(rows):
            assert a.reset(options=row)[1]["question"] == a.reset(options={"instance": i})[1]["question"]
        names = sorted({w for d in a.documents for w in d.split()[:1]})
        for episode in range(4):
            options = rng.choice([None, {"instance": rng.randrange(100)}, rng.choice(rows)])
            ep_seed = rng.randrange(1 << 31)
            obs0, info0 = a.reset(seed=ep_seed, options=options)
            assert info0 == {"question": a.question.text}
            assert obs0 == f"question: {a.question.text}\nuse <search>query</search> to search and <answer>text</answer> to answer."
            answer = a.question.answer
            valid = [f"<search>{rng.choice(names)} {rng.choice(['born', 'capital', 'job', ''])}</search>",
                     f"<answer>{answer}</answer>", f"I think <answer> {answer.upper()} </answer>", "<answer>no</answer>",
                     f"<search>{answer}"]
            actions = [wild_action(rng, valid) for _ in range(rng.randint(1, 12))]
            got = run_actions(a, ep_seed, options, actions)
            assert got == run_actions(b, ep_seed, options, actions)
            for (obs, reward, terminated, truncated, info), action in zip(got[1:], actions):
                check_step_shape((obs, reward, terminated, truncated, info))
                tag = re.search(r"<(search|answer)>", action.lower())
                assert reward in (0.0, 1.0) and (reward == 1.0) == bool(info.get("correct"))
                assert terminated == (tag is not None and tag.group(1) == "answer")
                if terminated:
                    with pytest.raises(RuntimeError, match="after the episode ended"):
                        a.step(action)
                elif info["valid_action"]:
                    assert obs.startswith("<information>") and obs.endswith("</information>")
                    assert info["num_results"] <= kw["top_k"] and len(info["query"]) <= 200
                else:
                    assert obs.startswith("invalid")
    finally:
        for env in (a, b):
            env.close()


@pytest.mark.parametrize("seed", SEEDS[:3])
def test_bundled_envs_step_before_reset_raises_their_documented_error(seed):
    from elasticrl.env.search import SearchEnv
    from elasticrl.env.web import WebEnv

    for cls in (WebEnv, SearchEnv):
        env = cls()
        with pytest.raises(RuntimeError, match="before reset"):
            env.step(wild_action(random.Random(seed), []))
        env.close()


# -- the wrappers and the prompt env ---------------------------------------------------------------------


@pytest.mark.parametrize("seed", SEEDS)
def test_turn_limit_truncates_exactly_at_max_turns_since_the_last_reset_sync_and_async(seed):
    """``TurnLimit``: "Sets ``truncated`` once ``max_turns`` steps were taken since the last
    ``reset``"; a wrapped ``async def`` method stays awaitable; everything else passes through."""
    rng = random.Random(seed)

    class Random:
        def reset(self, *, seed=None, options=None):
            return "o", {"seed": seed}

        def step(self, action):
            self.last = ("s", rng.choice([0.5, -1.0]), rng.random() < 0.2, rng.random() < 0.1, {"a": action})
            return self.last

    class AsyncRandom(Random):
        async def step(self, action):
            return Random.step(self, action)

    for cls in (Random, AsyncRandom):
        max_turns = rng.randint(1, 5)
        inner = cls()
        env = TurnLimit(inner, max_turns)
        assert env.unwrapped is inner
        for episode in range(4):
            assert asyncio.run(call_reset(env, seed=episode, options={})) == ("o", {"seed": episode})
            for turn in range(1, max_turns + 1):
                out = asyncio.run(call_step(env, f"a{turn}"))
                obs, reward, terminated, truncated, info = inner.last
                assert out == (obs, reward, terminated, truncated or (turn == max_turns and not terminated), info)
                if out[2] or out[3]:
                    break
            assert out[2] or out[3], "not ended at max_turns"


@pytest.mark.parametrize("seed", SEEDS)
def test_prompt_env_shows_the_rows_prompt_and_scores_one_turn(seed):
    rng = random.Random(seed)
    seen = []

    def score(prompt, completion, row):
        seen.append((prompt, completion, dict(row)))
        return len(completion) / 10

    text = "".join(rng.choice(UNICODE + "abc ") for _ in range(rng.randint(0, 20)))
    messages = [{"role": rng.choice(["system", "user", "assistant"]), "content": f"m{i}"} for i in range(rng.randint(0, 4))]
    env = PromptEnv(score=score, prompt_key="q", messages_key=rng.choice(["", "msgs"]))
    row = {"q": text, "msgs": messages, "answer": "x"}
    obs, info = env.reset(seed=seed, options=row)
    assert info == {} and (obs == messages if env.messages_key else obs == text)
    users = [m["content"] for m in messages if m["role"] == "user"]
    want_prompt = text if not env.messages_key else (users[-1] if users else (messages[-1]["content"] if messages else ""))
    assert prompt_text(obs) == want_prompt
    action = wild_action(rng, ["42"])
    assert env.step(action) == ("", len(action) / 10, True, False, {})
    assert seen == [(want_prompt, action, row)]
    with pytest.raises(KeyError, match="no 'missing' field"):
        PromptEnv(score=score, prompt_key="missing").reset(options=row)


# -- bugs this file found (fixed): each test failed on the code before its fix ------------------------


STRICT_CHATML = (
    "{% for m in messages %}{% if m['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('Only system, user and assistant roles are supported!') }}{% endif %}"
    "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


class _OneStepEngine:
    policy_version = VERSION
    max_context = None

    def __init__(self, end: int):
        self.end = end

    def generate(self, requests):
        return [Group(task_id=r.task_id, prompt_ids=list(r.prompt_ids), policy_version=VERSION, gen_seconds=0.0,
                      samples=[Sample(completion_ids=[self.end], logprobs=[-1.0], finish_reason="stop", text="")] * r.sampling.n)
                for r in requests]


@pytest.mark.parametrize("bad", ["tool_role", "lone_surrogate"])
def test_BUG_an_observation_the_renderer_refuses_fails_its_group_not_the_whole_play(bad, tiny_llama):
    """README: "An env that raises, returns something malformed or passes env.step_timeout_s fails
    that episode; its group goes back to the scheduler and is retried" and "An engine error is not
    the env's fault: it propagates" (episodes.py). ``env/base.py`` documents "tool" as a chat role,
    and many chat templates refuse it (``raise_exception``); a str observation holding a lone
    surrogate (bytes decoded with ``surrogateescape``) makes the tokenizer raise TypeError.
    ``EpisodeRunner._render`` converts only EnvError and ValueError, so play() raises, the
    EngineWorker counts it as an engine failure (the node stops after 3), and the good group
    played in the same call is thrown away."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_llama, local_files_only=True)
    tok.chat_template = STRICT_CHATML
    end = tok.convert_tokens_to_ids("<|im_end|>")
    later = [{"role": "tool", "content": "42"}] if bad == "tool_role" else "result: \udcff"

    class Env:  # the "bad" row's second observation is the one the renderer refuses
        def reset(self, *, seed=None, options=None):
            self.bad = options["kind"] == "bad"
            return "q", {}

        def step(self, action):
            return (later, 0.0, False, False, {}) if self.bad else ("", 1.0, True, False, {})

    runner = EpisodeRunner(_OneStepEngine(end), ChatRenderer(tok, [end, 2]), Env, EpisodeSettings(max_turns=3))
    tasks = [GroupTask(task_id=k, row={"kind": k}, episodes=1, seed=1, sampling=SamplingSpec(max_new_tokens=4))
             for k in ("bad", "good")]
    try:
        bad_group, good_group = runner.play(tasks)
    finally:
        runner.close()
    assert bad_group.episodes is None and bad_group.env_errors == 1 and "env " in bad_group.error
    assert good_group.episodes is not None and good_group.episodes[0].reward == 1.0


def test_BUG_an_env_returning_numpy_bools_is_refused():
    """README: "An environment is any class with Gymnasium's two methods". ``call_step`` accepts
    bool and int flags but not ``np.bool_`` (what ``terminated = x > 0`` on a numpy value gives),
    and fails every episode with "terminated is np.False_; it must be a bool"."""
    import numpy as np

    class NumpyEnv:
        def step(self, action):
            return "obs", np.float32(0.5), np.bool_(False), np.bool_(True), {}

    assert asyncio.run(call_step(NumpyEnv(), "a")) == ("obs", 0.5, False, True, {})


def test_BUG_web_click_with_a_huge_number_raises_instead_of_an_invalid_action():
    """``web.py``: a click on a link number the page does not have answers "invalid: no link N on
    this page" (reward 0, the episode goes on). A number of more than 4300 digits (Python's
    int-from-str limit) raises ValueError in ``int(clicked.group(1))``, which fails the episode
    and its group (retried, then dropped). A policy that emits a run of digits does that."""
    from elasticrl.env.web import WebEnv

    env = WebEnv(pages=3)
    try:
        env.reset(seed=1)
        obs, reward, terminated, _, info = env.step("click " + "1" * 4301)
        assert obs.startswith("invalid") and (reward, terminated, info["valid_action"]) == (0.0, False, False)
    finally:
        env.close()


def test_BUG_guess_bisection_bound_fails_for_a_power_of_two_span():
    """``guess.py``: "a policy that reads the earlier turns bisects and always wins within
    ceil(log2(high - low + 1)) guesses". With hi/lo feedback k guesses separate at most 2**k - 1
    secrets, so the bound is ceil(log2(span + 1)); for span 8 (low=0, high=7) bisection needs 4
    guesses for secret 7, not 3. A max_turns set from the docstring cuts winnable games."""
    from elasticrl.env.guess import GuessEnv

    low, high = 0, 7
    import elasticrl.env.guess as guess

    worst = max(_bisect_turns(GuessEnv(low=low, high=high), s) for s in range(low, high + 1))
    assert worst == 4 == math.ceil(math.log2(high - low + 2))
    assert "ceil(log2(high - low + 2))" in guess.__doc__  # the docstring said + 1
