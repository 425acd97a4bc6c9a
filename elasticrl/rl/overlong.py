"""Dataset prompts that leave no room to generate, found before the first iteration.

A single-turn run renders each row's prompt on the engines, at rollout (``env.prompt.PromptEnv``
through the run's renderer). A prompt of at least the context's tokens (the smaller of
``env.max_context_tokens`` and the model's) leaves no room for one token: every episode of its
group fails, is retried ``rollout.max_task_failures`` times and then dropped, iteration after
iteration. So the trainer renders every row once at start-up, the same way, each rank a share of
them, and either leaves those rows out (``task.overlong_prompts = "drop"``, the default, with a
warning that says how many and which) or stops with the first of them (``"error"``). A prompt that
fits but leaves fewer than ``rollout.max_new_tokens`` is kept: its completions are cut at the
context, as at rollout.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from elasticrl.config import ConfigError
from elasticrl.env.prompt import PromptEnv

log = logging.getLogger(__name__)

# Rows named in the warning about dropped rows.
NAMED = 5
# A scan that takes longer than this logs how far it is, every this many seconds.
PROGRESS_S = 10.0


@dataclasses.dataclass(frozen=True)
class Overlong:
    split: str
    """"train" or "eval"."""
    index: int
    """The row's index in its split's rows."""
    tokens: int


def scan(rows: Sequence[dict[str, Any]], indices: Sequence[int], first_tokens: Callable[[Any], Sequence[int]], limit: int,
         *, prompt_key: str, messages_key: str, split: str) -> list[Overlong]:
    """The rows of ``indices`` whose prompt renders (``first_tokens``, the renderer's ``first``)
    to ``limit`` tokens or more. A row that cannot be rendered at all is left to rollout, which
    reports it as the env's error."""
    env = PromptEnv(score=lambda *_: 0.0, prompt_key=prompt_key, messages_key=messages_key)
    out, started, shown = [], time.monotonic(), time.monotonic()
    for done, i in enumerate(indices):
        try:
            obs, _ = env.reset(options=rows[i])
            n = len(first_tokens(obs))
        except Exception:  # noqa: BLE001 - not this check's to report: the episode says what is wrong
            continue
        if n >= limit:
            out.append(Overlong(split, i, n))
        if time.monotonic() - shown > PROGRESS_S:
            shown = time.monotonic()
            log.info("prompt lengths (%s rows): %d of %d rendered in %.0fs", split, done + 1, len(indices), shown - started)
    return out


def apply(found: list[Overlong], *, mode: str, limit: int, train: int, held_out: int, named: Callable[[Overlong], str],
          warn: bool = True) -> None:
    """Decide on the overlong rows of every rank's share (the same on every rank): raise
    ``ConfigError`` with ``mode == "error"`` or when no training row would be left; else warn
    (where ``warn``)."""
    if not found:
        return
    found = sorted(found, key=lambda o: (o.split != "train", o.index))
    longest = max(found, key=lambda o: o.tokens)
    context = f"the context holds {limit} tokens (the smaller of env.max_context_tokens and the model's)"
    why = f"renders to {limit} tokens or more: {context}, which leaves no room to generate"
    if mode == "error":
        first = found[0]
        raise ConfigError(
            f"task.overlong_prompts = error: {named(first)}: its prompt renders to {first.tokens} tokens, and {context}: "
            f"no room to generate; {len(found)} row(s) are so (the longest {longest.tokens} tokens, {named(longest)}). "
            "Shorten them, use a model with a longer context, or set task.overlong_prompts = drop to leave them out")
    dropped_train = sum(o.split == "train" for o in found)
    if dropped_train >= train:
        raise ConfigError(f"task.path: the prompt of every one of its {train} training rows {why}; shorten the "
                          "prompts or use a model with a longer context")
    if warn:
        log.warning(
            "task.overlong_prompts = drop: leaving out %d of %d training row(s)%s whose prompt %s (the longest %d "
            "tokens); e.g. %s", dropped_train, train,
            f" and {len(found) - dropped_train} of {held_out} held-out row(s)" if len(found) > dropped_train else "",
            why, longest.tokens, "; ".join(named(o) for o in found[:NAMED]))


def leave_out(cfg, rows, first_tokens: Callable[[Any], Sequence[int]], limit: int, *, rank: int, world_size: int,
              gather: Callable[[Any], list], run: Callable[[Callable[[], Any]], Any] = lambda fn: fn()) -> None:
    """*Collective* (``gather``: every rank's value, in rank order). Check every prompt of a
    single-turn dataset run (``rows``: ``workload.DatasetRows``) against the smallest ``limit``
    (tokens; 0: none known) of any rank, each rank ``1/world_size`` of the rows, and apply
    ``task.overlong_prompts`` on every rank alike. Once per process: a world re-formed in place
    keeps its rows. Before the rows are resumed: ``DatasetRows.resume`` compares the rows per epoch
    with the checkpoint's. ``run(fn)`` runs this rank's scan (the trainer: on a thread while the
    ranks poll together, ``background.run_together``; a big dataset takes minutes)."""
    from elasticrl.rl.workload import row_label

    t = cfg.task
    if t.kind != "dataset" or cfg.env.name or rows.checked:
        return
    limits = [x for x in gather(limit) if x]  # every rank the same: the smallest context any of them knows
    limit = min(limits) if limits else 0
    if not limit:
        return
    keys = dict(prompt_key="" if t.messages_key else t.prompt_key, messages_key=t.messages_key)
    mine = run(lambda: [o for split, some in (("train", rows.train), ("eval", rows.held_out))
                        for o in scan(some, range(rank, len(some), world_size), first_tokens, limit, split=split, **keys)])
    found = [Overlong(**o) for share in gather([dataclasses.asdict(o) for o in mine]) for o in share]

    def named(o: Overlong) -> str:
        if o.split == "train" and not t.eval_fraction:
            return f"task.path row {o.index} (0-based)"
        if o.split == "eval" and t.eval_path:
            return f"task.eval_path row {o.index} (0-based)"
        some = rows.train if o.split == "train" else rows.held_out
        return f"the {o.split} row {row_label(some[o.index], 60)!r}"

    apply(found, mode=t.overlong_prompts, limit=limit, train=len(rows.train), held_out=len(rows.held_out), named=named,
          warn=rank == 0)
    rows.drop({o.index for o in found if o.split == "train"}, {o.index for o in found if o.split == "eval"})
    rows.checked = True
