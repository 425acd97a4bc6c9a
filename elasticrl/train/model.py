"""The policy a node trains, behind one small surface the loop needs, for either model kind.

``build_policy`` returns the bare module, its text codec (prompt/answer ids, decode, pad/EOS ids)
and the teacher-forced log-probability function the loss uses: the built-in tiny transformer with
its character vocabulary (``model.kind = tiny``), or any local HF causal LM with its tokenizer
(``model.kind = hf``). ``build_engine`` makes the node's rollout engine for it (``engine.name``):
``tiny`` shares the trainer's module when the strategy keeps full replicas (DDP), so pushing a new
policy is a version bump; every other engine holds its own copy and receives the full weights
after each update.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable

import torch
from torch import nn

from elasticrl.config import ConfigError, NodeConfig
from elasticrl.rl.workload import check_model


@dataclasses.dataclass
class PolicyParts:
    model: nn.Module
    """The bare module to train (on the CPU; the strategy moves it)."""
    encode_prompt: Callable[[str], list[int]]
    """Prompt text -> ids, BOS included when the model has one."""
    encode_answer: Callable[[str], list[int]]
    """Answer text -> ids followed by EOS (the supervised warm-up's targets)."""
    decode: Callable[[list[int]], str]
    """Completion ids -> text, special tokens dropped."""
    pad_id: int
    eos_ids: tuple[int, ...]
    logprobs: Callable[..., torch.Tensor]
    """fn(module, tokens [B, T], valid [B, T], *, temperature=1.0) -> [B, T-1] log-probability of
    token t + 1 under ``log_softmax(logits / temperature)``."""
    vocab: object | None = None
    """The tiny model's CharVocab (its engine needs it); None for HF models."""
    encode: Callable[[str, bool], list[int]] | None = None
    """fn(text, bos) -> ids: observations of an episode (BOS only before the first)."""
    tokenizer: object | None = None
    """The HF tokenizer (chat templates); None for the tiny model."""


def build_policy(cfg: NodeConfig) -> PolicyParts:
    """The policy of ``cfg.model``; the same initial weights on every rank (seeded, or loaded)."""
    if cfg.model.kind == "tiny":
        from elasticrl.policy.codec import CharCodec
        from elasticrl.policy.tiny import TinyCausalLM, token_logprobs

        codec = CharCodec()
        torch.manual_seed(cfg.run.seed)
        model = TinyCausalLM(cfg.model, codec.vocab_size)
        logprobs = token_logprobs
    else:
        from elasticrl.policy.hf_policy import HFCodec, hf_token_logprobs, load_hf_model
        check_model(cfg)
        codec = HFCodec.from_dir(cfg.model.path)
        model = load_hf_model(cfg.model.path, dtype=cfg.model.dtype, device="cpu")
        logprobs = hf_token_logprobs
    eos = codec.eos_ids[0]
    return PolicyParts(
        model=model,
        encode_prompt=lambda text: codec.encode(text, bos=True),
        encode_answer=lambda text: codec.encode(text, bos=False) + [eos],
        decode=codec.decode,
        pad_id=codec.pad_id,
        eos_ids=tuple(codec.eos_ids),
        logprobs=logprobs,
        vocab=getattr(codec, "vocab", None),
        encode=lambda text, bos: codec.encode(text, bos=bos),
        tokenizer=getattr(codec, "tokenizer", None),
    )


def build_engine(
    cfg: NodeConfig, parts: PolicyParts, *, device: torch.device, lock: threading.RLock, version: int,
    shared_module: nn.Module | None, seed: int,
):
    """The node's rollout engine; returns ``(engine, shares_trainer_module)``."""
    from elasticrl.rollout.engine import make_engine

    name = cfg.engine_name
    engine_device = torch.device(cfg.engine.device) if cfg.engine.device else device
    if name == "tiny":
        from elasticrl.rollout.tiny_engine import TinyEngine

        if shared_module is not None:
            return TinyEngine(shared_module, parts.vocab, lock=lock, policy_version=version, seed=seed), True
        # A fresh module (a sharded trainer's cannot be copied); the first push fills in the weights.
        own = build_policy(cfg).model.to(engine_device).eval().requires_grad_(False)
        return TinyEngine(own, parts.vocab, lock=lock, policy_version=version, seed=seed), False
    if name == "hf":
        engine = make_engine(
            "hf", model_dir=cfg.model.path, device=engine_device, dtype=cfg.engine.dtype, seed=seed,
            max_batch_rows=cfg.engine.max_batch_rows, policy_version=version,
        )
        return engine, False
    engine = make_engine(
        "vllm", model_dir=cfg.model.path, gpu_memory_utilization=cfg.engine.gpu_memory_utilization,
        tensor_parallel_size=cfg.engine.tensor_parallel_size, dtype=cfg.engine.dtype,
        seed=seed, policy_version=version, enable_sleep_mode=cfg.engine.sleep_during_update, device=engine_device,
    )
    return engine, False


def build_renderer(cfg: NodeConfig, parts: PolicyParts):
    """How observations become tokens for this model: its chat template with
    ``task.chat_template``, else the text as it is.

    Raises:
        ConfigError: the chat template is asked for and the tokenizer has none.
    """
    from elasticrl.rollout.render import ChatRenderer, PlainRenderer

    if cfg.task.chat_template:
        try:
            return ChatRenderer(parts.tokenizer, parts.eos_ids)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
    return PlainRenderer(parts.encode)


def build_runner(cfg: NodeConfig, parts: PolicyParts, engine, *, lock: threading.RLock, reward):
    """The episode runner of this process's engine: the run's env (``[env]``, or one turn on the
    row's prompt), observations rendered for this model (its chat template with
    ``task.chat_template``), the turn limit and deadlines of ``[env]``.

    Raises:
        ConfigError: the env cannot be loaded, a single-turn run has no reward, or the chat template
            is asked for and the tokenizer has none.
    """
    from elasticrl.rl.workload import episode_env
    from elasticrl.rollout.episodes import EpisodeRunner, EpisodeSettings

    spec, final = episode_env(cfg, reward)
    renderer = build_renderer(cfg, parts)
    e = cfg.env
    settings = EpisodeSettings(
        max_turns=e.max_turns if e.name else 1, step_timeout_s=e.step_timeout_s,
        episodes_in_flight=e.episodes_in_flight, max_context=e.max_context_tokens,
    )
    return EpisodeRunner(
        engine, renderer, spec.make, settings, engine_lock=lock, decode=parts.decode,
        final_reward=final.score if final is not None else None,
    )
