"""Seeded random tests of the node config (``elasticrl/config``), its CLI front ends
(``python -m elasticrl.node``, ``elasticrl rollout``, ``elasticrl run``) and the torchrun plugin's
``--rdzv-conf`` parsing (``elasticrl/rendezvous/config.py``).

Every field of every section is introspected from the dataclasses and given a domain (``SPECS``,
taken from its docstring and validation; a new field without one fails ``test_every_field_has_a_domain``).
From those:

* random valid configs load, through a TOML file (tables, dotted keys or inline tables), through
  ``--section.key=value`` overrides, and through both (overrides win), to exactly the values written
  (same types: no 1.9 -> 1, no 1 -> True); ``--print-config`` prints them, and what it prints loads
  back to the same config, as TOML and as overrides;
* random invalid inputs (wrong types, out-of-range numbers, nan / inf, typos of sections and keys,
  empty or unicode look-alike choices, duplicated keys, malformed override syntax, booleans spelled
  other ways, lists where scalars go) raise ``ConfigError`` naming ``section.key`` (the CLIs: exit
  status 2 with that message, no traceback), never another exception, never accepted;
* the cross-section rules the docs state are enforced for every combination;
* ``--rdzv-conf`` key=value pairs parse to exactly what was written, or raise ``ValueError`` naming
  the key;
* every field is documented and every default is valid.

The bugs it found are reduced to the ``test_bug_*`` tests at the end (each failed before its fix); the random tests left
those inputs out, each place saying which test covers it.

ELASTICRL_RANDOM_SEEDS=N runs N seeds (default 10).
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import json
import logging
import math
import os
import random
import re
import string
import subprocess
import sys
import textwrap
import typing
from types import SimpleNamespace
from typing import Any, Callable

import pytest

from elasticrl import cli as elasticrl_cli
from elasticrl import config as cfgmod
from elasticrl import node as node_cli
from elasticrl.config import ConfigError, NodeConfig, load_config, parse_overrides, to_dict, write_json
from elasticrl.config import sections as sections_mod
from elasticrl.config import workload as workload_mod
from elasticrl.rendezvous import config as rdzv_mod
from elasticrl.rendezvous.config import RendezvousConfig
from elasticrl.rl.tasks import TASKS
from tests.conftest import REPO

pytestmark = pytest.mark.timeout(120)

SEEDS = range(int(os.environ.get("ELASTICRL_RANDOM_SEEDS", "10")))

ENV_VARS = (cfgmod.COORDINATOR_ENV, cfgmod.TOKEN_FILE_ENV, cfgmod.TLS_CA_ENV, cfgmod.RUN_ID_ENV)


# -- introspection -------------------------------------------------------------------------------


def _fields_of(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


SECTIONS: dict[str, type] = _fields_of(NodeConfig)
FIELDS: dict[tuple[str, str], Any] = {(s, k): typ for s, cls in SECTIONS.items() for k, typ in _fields_of(cls).items()}
DEFAULTS: dict[str, dict[str, Any]] = to_dict(NodeConfig())


# -- value domains -------------------------------------------------------------------------------

# Characters of random text: ASCII, TOML/override/JSON syntax characters, whitespace and control
# characters, accents, CJK, right-to-left and zero-width marks, emoji (no lone surrogates: they
# cannot be written as UTF-8 at all). NUL is added only where no real argv is involved.
_CHARS = (
    string.ascii_letters + string.digits + " _-./:=,;'\"\\#[]{}$%@+~*?!()<>|&^`\t\n\r"
    + "\x01\x1f\x7f" + "éüßñÅ" + "日本語" + "Ωжא" + "\u200b\u202e\u00a0" + "😀🚀"
)


def gen_text(rng: random.Random, lo: int = 0, hi: int = 12, *, nul: bool = False, alphabet: str = _CHARS) -> str:
    pool = alphabet + ("\x00" if nul else "")
    return "".join(rng.choice(pool) for _ in range(rng.randint(lo, hi)))


def gen_list_item(rng: random.Random, override_safe: bool) -> str:
    """A list[str] item; the override syntax (comma-separated, each item stripped, empty ones
    dropped) can only carry non-empty, comma-free items without outer whitespace, not starting with
    '[' (a JSON list then)."""
    if not override_safe:
        return gen_text(rng, 0, 10)
    while True:
        text = gen_text(rng, 1, 10).replace(",", "").strip()
        if text and not text.startswith("["):
            return text


def gen_float(rng: random.Random, lo: float, hi: float) -> float:
    """A finite float in [lo, hi], from several shapes (boundaries, small, round, log-spread)."""
    r = rng.random()
    if r < 0.15:
        x = lo
    elif r < 0.25:
        x = hi
    elif r < 0.45:
        x = round(rng.uniform(lo, hi), rng.randint(0, 3))
    elif r < 0.7 and hi > 0:
        x = 10 ** rng.uniform(-6, math.log10(hi)) if hi > 1e-6 else hi
    else:
        x = rng.uniform(lo, hi)
    return float(x) if lo <= x <= hi else float(rng.uniform(lo, hi))


@dataclasses.dataclass(frozen=True)
class Num:
    """A number in [lo, hi] (open ends where ``*_incl`` is False; None: unbounded). ``soft_hi``
    caps what valid values are drawn (huge is not interesting, and timeouts past ~9e9 s overflow
    gRPC deadlines). ``checked`` False: the config does not bound it (no invalid values drawn)."""

    typ: type
    lo: float | None = None
    lo_incl: bool = True
    hi: float | None = None
    hi_incl: bool = True
    soft_hi: float = 1e6
    checked: bool = True

    def valid(self, rng: random.Random, override_safe: bool = False) -> Any:
        hi = min(self.hi, self.soft_hi) if self.hi is not None else self.soft_hi
        lo = self.lo if self.lo is not None else -hi
        if self.typ is int:
            lo_i = int(lo) + (0 if self.lo_incl else 1)
            hi_i = int(hi) - (0 if self.hi_incl or self.hi is None or hi < self.hi else 1)
            r = rng.random()
            if r < 0.2:
                return lo_i
            if r < 0.3:
                return hi_i
            if r < 0.75:
                return rng.randint(lo_i, min(hi_i, lo_i + 10))
            return rng.randint(lo_i, hi_i)
        lo_f = lo if self.lo_incl else math.nextafter(lo, math.inf)
        hi_f = hi if (self.hi_incl or self.hi is None) else math.nextafter(hi, -math.inf)
        return gen_float(rng, lo_f, hi_f)

    def out_of_range(self, rng: random.Random) -> list[Any]:
        if not self.checked:
            return []
        out: list[Any] = []
        if self.typ is int:
            if self.lo is not None:
                edge = int(self.lo) - (1 if self.lo_incl else 0)
                out += [edge, edge - rng.randint(1, 10**6)]
            if self.hi is not None:
                edge = int(self.hi) + (1 if self.hi_incl else 0)
                out += [edge, edge + rng.randint(1, 10**6)]
        else:
            if self.lo is not None:
                edge = math.nextafter(self.lo, -math.inf) if self.lo_incl else float(self.lo)
                out += [edge, self.lo - 10 ** rng.uniform(-3, 6)]
            if self.hi is not None:
                edge = math.nextafter(self.hi, math.inf) if self.hi_incl else float(self.hi)
                out += [edge, self.hi + 10 ** rng.uniform(-3, 6)]
        return out


@dataclasses.dataclass(frozen=True)
class Choice:
    values: tuple
    fold_case: bool = False  # logging.level: compared upper-cased

    def valid(self, rng: random.Random, override_safe: bool = False) -> Any:
        value = rng.choice(self.values)
        if self.fold_case and rng.random() < 0.5:
            value = "".join(c.upper() if rng.random() < 0.5 else c.lower() for c in value)
        return value

    def is_valid(self, value: Any) -> bool:
        if self.fold_case and isinstance(value, str):
            return value.upper() in self.values
        return value in self.values

    def out_of_range(self, rng: random.Random) -> list[Any]:
        if not isinstance(self.values[0], str):
            return [v for v in (0, 1, 4, -2, rng.randint(5, 10**6)) if v not in self.values]
        base = rng.choice(self.values)
        lookalike = base.replace("a", "а").replace("o", "о").replace("e", "е")  # Cyrillic а о е
        candidates = [
            "", " ", base + " ", " " + base, base + "\n", base[:-1], base + "x", lookalike, base.replace("_", "-"),
            base.upper(), base.title(), base.lower(), gen_text(rng, 1, 8), "none", "null", base + "\u200b",
        ]
        return [c for c in candidates if not self.is_valid(c)]


@dataclasses.dataclass(frozen=True)
class Text:
    """Free text (paths, ids, names): the config takes any string, empty meaning the documented default."""

    def valid(self, rng: random.Random, override_safe: bool = False) -> str:
        return gen_text(rng, 0, 12) if rng.random() < 0.8 else ""

    def out_of_range(self, rng: random.Random) -> list[Any]:
        return []


@dataclasses.dataclass(frozen=True)
class RunId:
    """run.run_id: empty (the default), or the coordinator's id rule, 1-112 characters."""

    def valid(self, rng: random.Random, override_safe: bool = False) -> str:
        if rng.random() < 0.2:
            return ""
        first = "abcXYZ019"
        return rng.choice(first) + gen_text(rng, 0, rng.choice([10, 111]), alphabet="abz09._:@=+-")

    def out_of_range(self, rng: random.Random) -> list[Any]:
        return ["-x", ".x", "a b", "caf\u00e9", "a/b", "a" * 113, gen_text(rng, 1, 5) + "]"]


@dataclasses.dataclass(frozen=True)
class Address:
    """coordinator.address: empty, HOST:PORT with a port in 1-65535, or a gRPC target with a scheme."""

    def valid(self, rng: random.Random, override_safe: bool = False) -> str:
        r = rng.random()
        if r < 0.3:
            return ""
        if r < 0.8:
            host = rng.choice(['127.0.0.1', 'coord', 'node-3.example.com', '[::1]', gen_text(rng, 1, 5)])
            return f"{host}:{rng.randint(1, 65535)}"
        return rng.choice(["unix:/tmp/coord.sock", "dns:///coord:50051", "ipv4:10.0.0.1:50051"])

    def out_of_range(self, rng: random.Random) -> list[Any]:
        plain = [t for t in ("localhost", "127.0.0.1", " ", gen_text(rng, 1, 8).replace(":", "") or "x") if ":" not in t]
        return plain + ["coord:0", f"coord:{rng.randint(65536, 10**6)}", ":50051", "coord:port"]


@dataclasses.dataclass(frozen=True)
class Bool:
    def valid(self, rng: random.Random, override_safe: bool = False) -> bool:
        return rng.random() < 0.5

    def out_of_range(self, rng: random.Random) -> list[Any]:
        return []


def gen_table_value(rng: random.Random, depth: int) -> Any:
    """A value TOML and JSON both carry (no null, no datetime, finite floats)."""
    r = rng.random()
    if r < 0.2:
        return rng.randint(-(2**53), 2**53) if rng.random() < 0.3 else rng.randint(-5, 100)
    if r < 0.35:
        return gen_float(rng, -1e6, 1e6)
    if r < 0.45:
        return rng.random() < 0.5
    if r < 0.65:
        return gen_text(rng, 0, 8)
    if r < 0.8:
        item = rng.choice([lambda: rng.randint(0, 9), lambda: gen_text(rng, 0, 4), lambda: rng.random() < 0.5,
                           lambda: gen_float(rng, -1.0, 1.0)])
        return [item() for _ in range(rng.randint(0, 3))]
    if depth < 2:
        return gen_table(rng, depth + 1)
    return rng.randint(0, 9)


def gen_table(rng: random.Random, depth: int = 0) -> dict[str, Any]:
    return {gen_text(rng, 0, 6): gen_table_value(rng, depth) for _ in range(rng.randint(0, 3))}


@dataclasses.dataclass(frozen=True)
class Table:
    def valid(self, rng: random.Random, override_safe: bool = False) -> dict:
        return gen_table(rng) if rng.random() < 0.7 else {}

    def out_of_range(self, rng: random.Random) -> list[Any]:
        return []


@dataclasses.dataclass(frozen=True)
class TextList:
    def valid(self, rng: random.Random, override_safe: bool = False) -> list[str]:
        return [gen_list_item(rng, override_safe) for _ in range(rng.randint(0, 3))]

    def out_of_range(self, rng: random.Random) -> list[Any]:
        return []


@dataclasses.dataclass(frozen=True)
class FloatList:
    def valid(self, rng: random.Random, override_safe: bool = False) -> list[float]:
        return [gen_float(rng, -10.0, 10.0) for _ in range(rng.randint(0, 3))]

    def out_of_range(self, rng: random.Random) -> list[Any]:
        # (they were accepted: test_bug_non_finite_floats_are_accepted)
        return [[float("nan")], [1.0, float("inf")]]


F, I = float, int
SPECS: dict[tuple[str, str], Any] = {
    ("run", "run_id"): RunId(),
    ("run", "run_dir"): Text(),
    ("run", "iterations"): Num(I, 1),
    # No documented range; torch.manual_seed takes [-2**63, 2**64): test_bug_seed_outside_torchs_range_is_accepted.
    ("run", "seed"): Num(I, 0, hi=2**63 - 1, soft_hi=2**63 - 1, checked=False),
    ("run", "rl_phase"): Choice(sections_mod.RL_PHASES),
    ("run", "eval_interval"): Num(I, 0),
    ("run", "num_threads"): Num(I, 1),
    ("coordinator", "address"): Address(),
    ("coordinator", "token_file"): Text(),
    ("coordinator", "tls_ca"): Text(),
    ("coordinator", "barrier_timeout_s"): Num(F, 0, False),
    ("coordinator", "call_timeout_s"): Num(F, 0, False),
    ("coordinator", "reconnect_timeout_s"): Num(F, 0),
    ("coordinator", "max_message_mb"): Num(F, 1, True, 2048, False),
    ("model", "kind"): Choice(sections_mod.MODEL_KINDS),
    ("model", "path"): Text(),
    ("model", "dtype"): Choice(sections_mod.DTYPES),
    ("model", "d_model"): Num(I, 8, soft_hi=4096),
    ("model", "n_layers"): Num(I, 1),
    ("model", "n_heads"): Num(I, 1, soft_hi=4096),  # and divides d_model (repair / its own invalid values)
    ("model", "max_seq_len"): Num(I, 4),
    ("task", "kind"): Choice(workload_mod.TASK_KINDS),
    ("task", "name"): Choice(tuple(sorted(TASKS))),  # kind = toy; any text otherwise (repair)
    ("task", "num_digits"): Num(I, 1, hi=16),
    ("task", "path"): Text(),
    ("task", "prompt_key"): Text(),
    ("task", "messages_key"): Text(),
    ("task", "eval_path"): Text(),
    ("task", "eval_fraction"): Num(F, 0, True, 1, False),
    ("task", "shuffle"): Bool(),
    ("task", "chat_template"): Bool(),
    ("task", "overlong_prompts"): Choice(workload_mod.OVERLONG_PROMPTS),
    ("task", "prompts_per_iteration"): Num(I, 1),
    ("task", "group_size"): Num(I, 2),
    ("task", "eval_prompts"): Num(I, 1),
    ("env", "name"): Text(),
    ("env", "kwargs"): Table(),
    ("env", "max_turns"): Num(I, 1),
    ("env", "step_timeout_s"): Num(F, 0, False),
    ("env", "episodes_in_flight"): Num(I, 1),
    ("env", "max_context_tokens"): Num(I, 0),
    ("engine", "name"): Choice(sections_mod.ENGINES),
    ("engine", "device"): Text(),
    ("engine", "dtype"): Choice(sections_mod.DTYPES),
    ("engine", "max_batch_rows"): Num(I, 1),
    ("engine", "gpu_memory_utilization"): Num(F, 0, False, 1, True),
    ("engine", "tensor_parallel_size"): Num(I, 1),
    ("engine", "sleep_during_update"): Bool(),
    ("rollout", "temperature"): Num(F, 0, False),
    ("rollout", "max_new_tokens"): Num(I, 0),
    ("rollout", "policy"): Choice(("dynamic", "static")),
    ("rollout", "slots"): Num(I, 1, hi=4096),
    ("rollout", "deadline_s"): Num(F, 0),
    ("rollout", "min_fraction"): Num(F, 0, False, 1, True),
    # Checked as >= 0.001 while the message says "> 0": test_bug_task_lease_message_contradicts_the_check.
    ("rollout", "task_lease_s"): Num(F, 0.001),
    ("rollout", "backup_tasks"): Num(I, 0),
    ("rollout", "max_task_failures"): Num(I, 1, hi=100),
    ("rollout", "seal_timeout_s"): Num(F, 0, False),
    ("rollout", "presubmit"): Bool(),
    ("rollout", "publish_weights"): Bool(),
    ("rollout", "weights_transfer"): Choice(sections_mod.WEIGHTS_TRANSFERS),
    ("rollout", "relay_host"): Text(),
    ("rollout", "relay_port"): Num(I, 0, hi=65535),
    ("rollout", "weights_wait_s"): Num(F, 0, False),
    ("rollout", "max_staleness"): Num(I, 0, hi=64),  # and 0 unless run.rl_phase = both (repair)
    ("algorithm", "loss"): Choice(sections_mod.LOSSES),
    ("algorithm", "advantage"): Choice(sections_mod.ADVANTAGES),
    ("algorithm", "clip_eps"): Num(F, 0, False, 1, False),
    ("algorithm", "kl_coef"): Num(F, 0),
    ("algorithm", "aggregation"): Choice(sections_mod.AGGREGATIONS),
    ("algorithm", "rewards"): TextList(),
    ("algorithm", "reward_weights"): FloatList(),  # empty or one per reward (repair)
    ("algorithm", "off_policy_correction"): Choice(sections_mod.OFF_POLICY_CORRECTIONS),
    ("algorithm", "tis_cap"): Num(F, 1),
    ("trainer", "strategy"): Choice(sections_mod.STRATEGIES),
    ("trainer", "zero_stage"): Choice((2, 3)),
    ("trainer", "bf16"): Bool(),  # needs backend nccl (repair)
    ("trainer", "gradient_checkpointing"): Bool(),
    ("trainer", "deepspeed_config"): Table(),
    ("trainer", "backend"): Choice(("gloo", "nccl")),
    ("trainer", "lr"): Num(F, 0, False),
    ("trainer", "weight_decay"): Num(F, 0),
    ("trainer", "updates_per_iteration"): Num(I, 1),
    ("trainer", "micro_batch_rows"): Num(I, 0),
    ("trainer", "grad_clip_norm"): Num(F, 0),
    ("trainer", "warmup_steps"): Num(I, 0),
    ("trainer", "warmup_batch_size"): Num(I, 1),
    ("trainer", "warmup_lr"): Num(F, 0),
    ("checkpoint", "every_iterations"): Num(I, 0),
    ("checkpoint", "dir"): Text(),
    ("checkpoint", "keep_last"): Num(I, 1),
    ("checkpoint", "every_node"): Bool(),
    ("checkpoint", "resume"): Bool(),
    ("checkpoint", "snapshots"): Bool(),
    ("checkpoint", "snapshot_buddies"): Bool(),
    ("checkpoint", "snapshot_timeout_s"): Num(F, 0, False),
    ("checkpoint", "snapshot_dir"): Text(),
    ("checkpoint", "export_hf"): Text(),  # model.kind = hf only (repair)
    ("logging", "level"): Choice(sections_mod.LOG_LEVELS, fold_case=True),
    ("logging", "tensorboard"): Bool(),
    ("logging", "wandb_project"): Text(),
    ("logging", "wandb_mode"): Choice(("online", "offline", "disabled")),
}

# Float fields with no upper bound: +inf passed their "> 0" / ">= 0" checks
# (test_bug_non_finite_floats_are_accepted); none is accepted now.
INF_ACCEPTED: set = set()


def nonempty_text(rng: random.Random) -> str:
    return gen_text(rng, 1, 10)


def repair(raw: dict[str, dict[str, Any]], rng: random.Random, override_safe: bool) -> None:
    """Make a config of individually valid fields satisfy the rules that span fields, as the
    docstrings and checks state them."""
    m, t, e, en = raw["model"], raw["task"], raw["env"], raw["engine"]
    if m["kind"] == "hf" and not m["path"]:
        m["path"] = nonempty_text(rng)
    d = m["d_model"]
    if m["n_heads"] < 1 or d % m["n_heads"]:
        divisors = sorted({x for i in range(1, math.isqrt(d) + 1) if d % i == 0 for x in (i, d // i)})
        m["n_heads"] = rng.choice(divisors)
    if t["kind"] == "toy" and t["name"] not in TASKS:
        t["name"] = rng.choice(sorted(TASKS))
    elif t["kind"] != "toy" and rng.random() < 0.3:
        t["name"] = gen_text(rng, 0, 8)  # only a toy task's name is looked up
    if t["kind"] == "dataset" and not t["path"]:
        t["path"] = nonempty_text(rng)
    if not t["prompt_key"] and not t["messages_key"]:
        t["prompt_key"] = nonempty_text(rng)
    if t["eval_path"] and t["eval_fraction"]:
        if rng.random() < 0.5:
            t["eval_path"] = ""
        else:
            t["eval_fraction"] = 0.0
    if t["kind"] == "generated" and not e["name"]:
        e["name"] = nonempty_text(rng)
    if m["kind"] == "tiny" and en["name"] not in ("auto", "tiny"):
        en["name"] = rng.choice(["auto", "tiny"])
    if m["kind"] == "hf" and en["name"] == "tiny":
        en["name"] = rng.choice(["auto", "hf", "vllm"])
    if raw["checkpoint"]["export_hf"] and m["kind"] != "hf":
        raw["checkpoint"]["export_hf"] = ""
    if t["chat_template"] and m["kind"] != "hf":
        t["chat_template"] = False
    if t["messages_key"] and not t["chat_template"] and t["kind"] == "dataset" and not e["name"]:
        t["messages_key"] = ""  # chat messages need a chat template
        t["prompt_key"] = t["prompt_key"] or nonempty_text(rng)
    tr = raw["trainer"]
    if tr["warmup_steps"] and not (t["kind"] == "toy" and not e["name"]):
        tr["warmup_steps"] = 0
    if raw["rollout"]["max_staleness"] and raw["run"]["rl_phase"] != "both":
        raw["rollout"]["max_staleness"] = 0
    if tr["bf16"] and tr["backend"] == "gloo":
        if rng.random() < 0.5:
            tr["bf16"] = False
        else:
            tr["backend"] = "nccl"
    a = raw["algorithm"]
    if a["reward_weights"] and len(a["reward_weights"]) != len(a["rewards"]):
        a["reward_weights"] = [] if rng.random() < 0.5 else [gen_float(rng, -10.0, 10.0) for _ in a["rewards"]]


def gen_config(rng: random.Random, *, override_safe: bool = False) -> dict[str, dict[str, Any]]:
    """A random valid config as {section: {key: value}}, every field present; some at their default."""
    raw = {s: {k: SPECS[(s, k)].valid(rng, override_safe) for k in _fields_of(cls)} for s, cls in SECTIONS.items()}
    repair(raw, rng, override_safe)
    keep_default = rng.random() * 0.6
    for s, k in FIELDS:
        if rng.random() < keep_default:
            raw[s][k] = json.loads(json.dumps(DEFAULTS[s][k]))
    repair(raw, rng, override_safe)
    return raw


def build(raw: dict[str, dict[str, Any]]) -> NodeConfig:
    """The config the raw values stand for, built directly (no loader involved)."""
    return NodeConfig(**{s: SECTIONS[s](**values) for s, values in raw.items()})


# -- strict comparison ---------------------------------------------------------------------------


def first_difference(a: Any, b: Any, path: str = "") -> str | None:
    """Where ``a`` and ``b`` differ in value or type (1 vs 1.0, True vs 1 and 0.0 vs -0.0 differ)."""
    if type(a) is not type(b):
        return f"{path}: {a!r} ({type(a).__name__}) != {b!r} ({type(b).__name__})"
    if isinstance(a, float):
        return None if repr(a) == repr(b) else f"{path}: {a!r} != {b!r}"
    if isinstance(a, dict):
        if list(a) != list(b) and set(a) != set(b):
            return f"{path}: keys {sorted(map(repr, a))} != {sorted(map(repr, b))}"
        for k in a:
            diff = first_difference(a[k], b[k], f"{path}.{k}" if path else str(k))
            if diff:
                return diff
        return None
    if isinstance(a, list):
        if len(a) != len(b):
            return f"{path}: {a!r} != {b!r}"
        for i, (x, y) in enumerate(zip(a, b)):
            diff = first_difference(x, y, f"{path}[{i}]")
            if diff:
                return diff
        return None
    return None if a == b else f"{path}: {a!r} != {b!r}"


def assert_same(got: Any, want: Any, context: str) -> None:
    got = to_dict(got) if dataclasses.is_dataclass(got) else got
    want = to_dict(want) if dataclasses.is_dataclass(want) else want
    diff = first_difference(got, want)
    assert diff is None, f"{context}: {diff}"


# -- writing TOML and overrides ------------------------------------------------------------------


def toml_str(s: str, rng: random.Random | None = None) -> str:
    if rng is not None and rng.random() < 0.3 and "'" not in s and not any(ord(c) < 0x20 and c != "\t" or ord(c) == 0x7F for c in s):
        return f"'{s}'"  # a literal string
    out = []
    for ch in s:
        o = ord(ch)
        if ch == '"':
            out.append('\\"')
        elif ch == "\\":
            out.append("\\\\")
        elif o < 0x20 or o == 0x7F:
            out.append(rng.choice(["\\u%04x", "\\U%08x"]) % o if rng else "\\u%04x" % o)
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def toml_key(k: str, rng: random.Random | None = None) -> str:
    if re.fullmatch(r"[A-Za-z0-9_-]+", k) and (rng is None or rng.random() < 0.7):
        return k
    return toml_str(k, rng)


def toml_float(x: float) -> str:
    if math.isnan(x):
        return "nan"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    return repr(x)


def toml_value(v: Any, rng: random.Random | None = None, *, int_floats: bool = False) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if int_floats and v.is_integer() and abs(v) < 1e15 and rng is not None and rng.random() < 0.5:
            return str(int(v))  # "ints are fine where floats are expected"
        return toml_float(v)
    if isinstance(v, str):
        return toml_str(v, rng)
    if isinstance(v, list):
        return "[" + ", ".join(toml_value(x, rng, int_floats=int_floats) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{toml_key(k, rng)} = {toml_value(x, rng)}" for k, x in v.items()) + "}"
    if isinstance(v, RawToml):
        return v.text
    raise TypeError(v)


@dataclasses.dataclass(frozen=True)
class RawToml:
    """A TOML literal written as is (datetimes, ...)."""

    text: str


def toml_doc(raw: dict[str, dict[str, Any]], rng: random.Random, *, omit_defaults: bool = True) -> str:
    """``raw`` as a TOML document, each section as a [table], dotted keys or an inline table, in a
    random order; fields at their default are sometimes left out."""
    top: list[str] = []
    tables: list[str] = []
    names = list(raw)
    rng.shuffle(names)
    for s in names:
        items = [(k, v) for k, v in raw[s].items()
                 if not (omit_defaults and first_difference(v, DEFAULTS.get(s, {}).get(k, object())) is None and rng.random() < 0.5)]
        rng.shuffle(items)
        style = rng.choice(["table", "table", "dotted", "inline"])
        float_field = {k for k in raw[s] if FIELDS.get((s, k)) is float}
        if style == "table":
            tables.append(f"[{toml_key(s, rng)}]")
            tables += [f"{toml_key(k, rng)} = {toml_value(v, rng, int_floats=k in float_field)}" for k, v in items]
            tables.append("")
        elif style == "dotted":
            top += [f"{toml_key(s, rng)}.{toml_key(k, rng)} = {toml_value(v, rng, int_floats=k in float_field)}" for k, v in items]
        else:
            body = ", ".join(f"{toml_key(k, rng)} = {toml_value(v, rng, int_floats=k in float_field)}" for k, v in items)
            top.append(f"{toml_key(s, rng)} = {{{body}}}")
    return "\n".join(top + [""] + tables) + "\n"


TRUE_SPELLINGS = ("true", "True", "TRUE", "1", "yes", "YES", "on", "On", " true ")
FALSE_SPELLINGS = ("false", "False", "FALSE", "0", "no", "No", "off", "OFF", " false")


def override_text(v: Any, typ: Any, rng: random.Random) -> str:
    if typ is bool:
        return rng.choice(TRUE_SPELLINGS if v else FALSE_SPELLINGS)
    if typ is int:
        return rng.choice([str(v), str(v), f" {v}", f"{v} "] + ([f"+{v}"] if v >= 0 else []))
    if typ is float:
        if v.is_integer() and abs(v) < 1e15 and rng.random() < 0.3:
            return str(int(v))
        return repr(v)
    if typing.get_origin(typ) is list:
        (item,) = typing.get_args(typ)
        parts = [repr(x) if item is float else x for x in v]
        return rng.choice([",", ", ", " ,"]).join(parts) + ("," if parts and rng.random() < 0.2 else "")
    if typing.get_origin(typ) is dict:
        return json.dumps(v, ensure_ascii=rng.random() < 0.5)
    return v


def override_args(items: list[tuple[str, str, Any]], rng: random.Random, *, cli: bool = False) -> list[str]:
    """``--section.key=value`` (or ``--section.key value``) arguments setting ``items``. The
    separate form is used only for a value that does not start with '-': argparse (the node CLI)
    reads such a value as an option, and a following ``--x.y=1`` taken as a missing value's value is
    test_bug_override_without_value_swallows_the_next_override."""
    args: list[str] = []
    for s, k, v in items:
        text = override_text(v, FIELDS[(s, k)], rng)
        if text and not text.startswith("-") and rng.random() < 0.3 and not (cli and "\x00" in text):
            args += [f"--{s}.{k}", text]
        else:
            args.append(f"--{s}.{k}={text}")
    return args


def raw_items(raw: dict[str, dict[str, Any]]) -> list[tuple[str, str, Any]]:
    return [(s, k, v) for s, values in raw.items() for k, v in values.items()]


def error_of(fn: Callable[[], Any]) -> BaseException | None:
    try:
        fn()
    except BaseException as exc:  # noqa: BLE001 - the type is what is being checked
        return exc
    return None


def assert_config_error(fn: Callable[[], Any], *needles: str, context: str = "") -> ConfigError:
    """``fn`` raises ConfigError (nothing else, and not nothing) whose message names every needle."""
    exc = error_of(fn)
    assert exc is not None, f"{context}: accepted, expected a ConfigError naming {needles}"
    assert type(exc) is ConfigError, f"{context}: raised {type(exc).__name__}: {exc} (expected ConfigError naming {needles})"
    for needle in needles:
        assert needle in str(exc), f"{context}: {exc} does not name {needle!r}"
    return exc


@pytest.fixture
def clean_env(monkeypatch):
    for name in ENV_VARS:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def run_node(argv: list[str], capsys) -> tuple[int, str, str]:
    """``python -m elasticrl.node ARGV`` in this process: (exit status, stdout, stderr)."""
    capsys.readouterr()
    try:
        code = node_cli.main(argv)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    out, err = capsys.readouterr()
    return code, out, err


# -- meta ----------------------------------------------------------------------------------------


def test_every_field_has_a_domain():
    assert set(SPECS) == set(FIELDS), f"fields without a domain here: {sorted(set(FIELDS) - set(SPECS))}; stale: {sorted(set(SPECS) - set(FIELDS))}"
    for key, spec in SPECS.items():
        typ = FIELDS[key]
        if isinstance(spec, Num):
            assert typ is spec.typ, key
        elif isinstance(spec, (Text, Address)):
            assert typ is str, key
        elif isinstance(spec, Bool):
            assert typ is bool, key
        elif isinstance(spec, Choice):
            assert all(type(v) is typ for v in spec.values), key
        elif isinstance(spec, Table):
            assert typing.get_origin(typ) is dict, key
        elif isinstance(spec, TextList):
            assert typ == list[str], key
        elif isinstance(spec, FloatList):
            assert typ == list[float], key


def _field_docstrings(cls: type) -> dict[str, str]:
    """Field name -> the string literal right after its annotation in the class body."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    docs: dict[str, str] = {}
    for node, following in zip(body, body[1:] + [None]):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            doc = following.value.value if (isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant)
                                            and isinstance(following.value.value, str)) else ""
            docs[node.target.id] = doc.strip()
    return docs


@pytest.mark.parametrize("cls", [*SECTIONS.values(), RendezvousConfig], ids=lambda c: c.__name__)
def test_every_field_is_documented(cls):
    """The package docstring: each section is a dataclass "whose fields carry a docstring"."""
    if cls is not RendezvousConfig:  # its module's docstring describes it
        assert (cls.__doc__ or "").strip() and not cls.__doc__.startswith(f"{cls.__name__}("), f"{cls.__name__} has no docstring"
    docs = _field_docstrings(cls)
    missing = [f.name for f in dataclasses.fields(cls) if not docs.get(f.name)]
    assert not missing, f"{cls.__name__}: undocumented fields {missing}"


def test_node_config_sections_are_documented():
    assert NodeConfig.__doc__ and all(cls.__doc__ for cls in SECTIONS.values())
    readme = (REPO / "README.md").read_text()
    table = {m for m in re.findall(r"^\| `\[(\w+)\]` \|", readme, re.M)}
    assert table == set(SECTIONS), f"README section table {sorted(table)} != NodeConfig sections {sorted(SECTIONS)}"
    epilog = node_cli.build_parser().epilog
    assert all(s in epilog for s in SECTIONS)


def test_defaults_are_valid():
    for s, cls in SECTIONS.items():
        cls()  # each section's defaults pass its own checks
    cfg = NodeConfig()
    assert_same(load_config(), cfg, "load_config() vs NodeConfig()")
    for (s, k), spec in SPECS.items():
        value = DEFAULTS[s][k]
        if isinstance(spec, Num):
            assert spec.lo is None or (value >= spec.lo if spec.lo_incl else value > spec.lo), (s, k, value)
            assert spec.hi is None or (value <= spec.hi if spec.hi_incl else value < spec.hi), (s, k, value)
        elif isinstance(spec, Choice):
            assert spec.is_valid(value), (s, k, value)
    resolved = cfg.resolved({}, require_address=False)
    assert (resolved.run.run_id, resolved.run.run_dir) == ("local", os.path.join("runs", "local"))


def test_rdzv_conf_keys_are_documented_with_their_defaults():
    """The table in the elasticrl.rendezvous docstring and the README's list name every key, with
    the defaults the dataclass has."""
    import elasticrl.rendezvous as rdzv_pkg

    doc = rdzv_pkg.__doc__
    rows = dict(re.findall(r"^(\w+)\s{2,}(\S+)\s{2,}", doc, re.M))
    rows.pop("key", None)
    assert set(rows) == set(rdzv_mod._CONF_KEYS), (sorted(rows), sorted(rdzv_mod._CONF_KEYS))
    defaults = {f.name: f.default for f in dataclasses.fields(RendezvousConfig)}
    for key, field in rdzv_mod._CONF_KEYS.items():
        shown, default = rows[key], defaults[field]
        if isinstance(default, bool):
            assert shown == str(default).lower(), (key, shown, default)
        elif isinstance(default, float) and key != "lease_ttl":
            assert float(shown) == default, (key, shown, default)
    readme = (REPO / "README.md").read_text()
    listed = re.search(r"`--rdzv-conf` keys of the torchrun plugin \(([^)]*)\)", readme).group(1)
    assert set(re.findall(r"`(\w+)`", listed)) == set(rdzv_mod._CONF_KEYS)


# -- valid configs round trip --------------------------------------------------------------------


@pytest.mark.parametrize("seed", SEEDS)
def test_random_valid_configs_load_exactly_from_toml(seed, tmp_path):
    rng = random.Random(seed)
    for i in range(6):
        raw = gen_config(rng)
        want = build(raw)
        assert_same(want, raw, "building the raw values")  # the dataclasses keep what they are given
        doc = toml_doc(raw, rng)
        path = tmp_path / f"c{i}.toml"
        path.write_text(doc, encoding="utf-8")
        assert_same(load_config(path), want, f"seed {seed} config {i}:\n{doc}")


@pytest.mark.parametrize("seed", SEEDS)
def test_random_valid_configs_load_exactly_from_overrides(seed):
    rng = random.Random(1000 + seed)
    for i in range(6):
        raw = gen_config(rng, override_safe=True)
        want = build(raw)
        items = raw_items(raw)
        rng.shuffle(items)
        items = items[: rng.randint(0, len(items))] if rng.random() < 0.3 else items
        # Fields not overridden keep their defaults: rebuild what that means.
        partial = json.loads(json.dumps(DEFAULTS))
        for s, k, v in items:
            partial[s][k] = v
        if error_of(lambda: build(partial)) is not None:
            items, partial = raw_items(raw), raw  # a subset may break a cross-field rule; use all
        want = build(partial)
        args = override_args(items, rng)
        # An earlier value of the same key is overridden by the later one ("later wins").
        s, k, v = rng.choice(raw_items(raw))
        args = override_args([(s, k, SPECS[(s, k)].valid(rng, True))], rng) + args + override_args([(s, k, partial[s][k])], rng)
        assert_same(load_config(None, parse_overrides(args)), want, f"seed {seed} case {i}: {args}")


@pytest.mark.parametrize("seed", SEEDS)
def test_overrides_beat_the_file_which_beats_the_defaults(seed, tmp_path):
    rng = random.Random(2000 + seed)
    for i in range(4):
        in_file = gen_config(rng)
        final = gen_config(rng, override_safe=True)
        items = raw_items(final)
        rng.shuffle(items)
        overridden = items[: rng.randint(0, len(items))]
        merged = json.loads(json.dumps(in_file))
        for s, k, v in overridden:
            merged[s][k] = v
        if error_of(lambda: build(merged)) is not None:
            overridden, merged = raw_items(final), final
        path = tmp_path / f"c{i}.toml"
        path.write_text(toml_doc(in_file, rng), encoding="utf-8")
        got = load_config(path, parse_overrides(override_args(overridden, rng)))
        assert_same(got, build(merged), f"seed {seed} case {i}")


@pytest.mark.parametrize("seed", SEEDS)
def test_print_config_loads_back_to_the_same_config(seed, tmp_path, capsys, clean_env):
    """``python -m elasticrl.node --print-config`` prints the resolved config; that output, written
    back as a TOML file or as overrides, resolves to the same config."""
    rng = random.Random(3000 + seed)
    for i in range(3):
        raw = gen_config(rng, override_safe=True)
        want = to_dict(build(raw).resolved({}, require_address=False))
        path = tmp_path / f"c{i}.toml"
        if rng.random() < 0.5:
            path.write_text(toml_doc(raw, rng), encoding="utf-8")
            argv = ["--config", str(path)]
        else:
            argv = override_args(raw_items(raw), rng, cli=True)
        argv = [*argv, "--print-config"] if rng.random() < 0.5 else ["--print-config", *argv]
        code, out, err = run_node(argv, capsys)
        assert code == 0, err
        printed = json.loads(out)
        assert_same(printed, want, f"seed {seed} case {i}: printed config")

        back = tmp_path / f"printed{i}.toml"
        back.write_text(toml_doc(printed, rng, omit_defaults=False), encoding="utf-8")
        code, out, err = run_node(["--config", str(back), "--print-config"], capsys)
        assert code == 0, err
        assert_same(json.loads(out), printed, f"seed {seed} case {i}: printed -> TOML -> printed")

        code, out, err = run_node(["--print-config", *override_args(raw_items(printed), rng, cli=True)], capsys)
        assert code == 0, err
        assert_same(json.loads(out), printed, f"seed {seed} case {i}: printed -> overrides -> printed")

        write_json(build(raw).resolved({}, require_address=False), tmp_path / "config.json")
        assert_same(json.loads((tmp_path / "config.json").read_text()), want, "write_json")


def _cli(*argv: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ENV_VARS}
    return subprocess.run([sys.executable, *argv], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("seed", SEEDS[:3])
def test_print_config_subprocess(seed, tmp_path):
    """The real command line, once per seed: a random file plus overrides, and one bad override."""
    rng = random.Random(4000 + seed)
    raw = gen_config(rng, override_safe=True)
    path = tmp_path / "c.toml"
    path.write_text(toml_doc(raw, rng), encoding="utf-8")
    # Some scalars again as overrides (argv cannot carry NUL; lists and tables stay in the file).
    scalars = [(s, k, v) for s, k, v in raw_items(raw)
               if not isinstance(v, (list, dict)) and "\x00" not in str(v) and rng.random() < 0.5]
    done = _cli("-m", "elasticrl.node", "--config", str(path), "--print-config", *override_args(scalars, rng, cli=True))
    assert done.returncode == 0, done.stderr
    assert_same(json.loads(done.stdout), to_dict(build(raw).resolved({}, require_address=False)), "subprocess --print-config")
    (s, k), spec = rng.choice([(key, sp) for key, sp in SPECS.items() if isinstance(sp, Num) and sp.checked])
    bad = rng.choice(spec.out_of_range(rng))
    done = _cli("-m", "elasticrl.node", "--config", str(path), "--print-config", f"--{s}.{k}={bad!r}")
    assert done.returncode == 2 and f"{s}.{k}" in done.stderr and "Traceback" not in done.stderr, done.stderr


# -- invalid inputs ------------------------------------------------------------------------------


def _datetime_literal(rng: random.Random) -> RawToml:
    return RawToml(rng.choice(["1979-05-27T07:32:00Z", "1979-05-27", "07:32:00", "1979-05-27 07:32:00.5"]))


def wrong_toml_values(typ: Any, rng: random.Random) -> list[Any]:
    """TOML values of a type the field does not take (ints for floats are fine: not here)."""
    common = [_datetime_literal(rng), {"x": 1}, {}]
    if typ is int:
        return [1.5, 2.0, -0.0, True, False, "3", "", "1_000", [1], [], float("nan"), *common]
    if typ is float:
        return [True, "1.0", "", "nan", [1.0], [], *common]
    if typ is str:
        return [1, 0, 1.5, True, ["a"], [], *common]
    if typ is bool:
        return [1, 0, "true", "yes", "", 1.0, [True], *common]
    if typ == list[str]:
        return ["a", "a,b", 1, True, 1.5, [1], [True], [["a"]], [{}], ["a", 2], *common]
    if typ == list[float]:
        return ["1.0", 1.0, 1, True, ["1"], [True], [[1.0]], [1.0, "x"], [{}], *common[:2]]
    if typing.get_origin(typ) is dict:
        # A datetime *inside* a table is accepted: test_bug_toml_datetime_in_a_table_breaks_print_config.
        return ["{}", "", 1, 1.5, True, [], [{}], _datetime_literal(rng)]
    raise AssertionError(typ)


def wrong_override_texts(typ: Any, rng: random.Random) -> list[str]:
    if typ is int:
        return ["1.9", "2.0", "1e3", "abc", "", " ", "[1]", "0x10", "0b1", "true", "1,2", "nan", "inf", "1 2", "--1", "1-", "١.٥"]
    if typ is float:
        return ["abc", "", " ", "1,2", "[1.0]", "true", "1.0.0", "0x1p3", "1e", "e5", "1,5", "--1", "½"]
    if typ is bool:
        return ["maybe", "2", "-1", "", " ", "tru", "ture", "t", "f", "y", "n", "enable", "disabled", "yes please",
                "[true]", "1.0", "none", "null", "truee", "ｔｒｕｅ"]
    if typ == list[float]:
        return ["1,x", "[1.0]", "true", "1;2", "1 2", "x"]
    if typ == list[str]:
        return []
    if typing.get_origin(typ) is dict:
        return ["[]", "[{}]", "1", "x", "", "null", '"s"', "{", "{'a': 1}", "{a: 1}", "true", "1.5", "[1, 2]"]
    if typ is str:
        return []
    raise AssertionError(typ)


def out_of_domain_values(s: str, k: str, rng: random.Random, base: dict[str, dict[str, Any]]) -> list[Any]:
    """Values of the right type the docs rule out for (s, k), given the rest of ``base``."""
    spec = SPECS[(s, k)]
    values = list(spec.out_of_range(rng))
    if (s, k) == ("model", "n_heads"):
        d = base["model"]["d_model"]
        values = [v for v in values if v < 1] + [v for v in (3, 5, 7, d + 1, d * 2, rng.randint(2, 10**4)) if d % v]
    if isinstance(spec, Num) and spec.typ is float:
        values.append(float("nan"))
        values.append(float("-inf"))
        if (s, k) not in INF_ACCEPTED:  # test_bug_non_finite_floats_are_accepted
            values.append(float("inf"))
    return values


def _context_for(s: str, k: str, base: dict[str, dict[str, Any]]) -> None:
    """Make (s, k) matter in ``base`` (task.name is only checked for toy tasks)."""
    if (s, k) == ("task", "name"):
        base["task"]["kind"] = "toy"
        base["task"]["name"] = "copy"
        base["trainer"]["warmup_steps"] = 0


@pytest.mark.parametrize("seed", SEEDS)
def test_random_bad_values_are_refused_naming_the_field(seed, tmp_path):
    """Out of the documented domain, a wrong TOML type or an override text that is not the field's
    type: ConfigError naming section.key, through the file and through an override."""
    rng = random.Random(5000 + seed)
    keys = list(FIELDS)[seed % 4::4]  # every field once in any 4 consecutive seeds
    rng.shuffle(keys)
    for n, (s, k) in enumerate(keys):
        base = gen_config(rng)
        _context_for(s, k, base)
        build(base)
        typ = FIELDS[(s, k)]
        domain = out_of_domain_values(s, k, rng, base)
        candidates = [("domain", v) for v in domain] + [("toml-type", v) for v in wrong_toml_values(typ, rng)]
        candidates += [("override-text", t) for t in wrong_override_texts(typ, rng)]
        for kind, bad in rng.sample(candidates, min(len(candidates), 4)):
            field = f"{s}.{k}"
            if kind in ("domain", "toml-type"):
                bad_raw = json.loads(json.dumps(base))
                bad_raw[s][k] = bad
                path = tmp_path / f"bad{n}.toml"
                doc = toml_doc(bad_raw, rng, omit_defaults=False)
                path.write_text(doc, encoding="utf-8")
                assert_config_error(lambda: load_config(path), field, context=f"seed {seed}: {field} = {bad!r} in TOML")
            if kind == "domain":
                text = override_text(bad, typ, rng) if not isinstance(bad, float) or math.isfinite(bad) else rng.choice(
                    [repr(bad), repr(bad).upper(), "NaN" if math.isnan(bad) else ("-Infinity" if bad < 0 else "1e999")])
                good = tmp_path / f"good{n}.toml"
                good.write_text(toml_doc(base, rng), encoding="utf-8")
                assert_config_error(lambda: load_config(good, parse_overrides([f"--{field}={text}"])), field,
                                    context=f"seed {seed}: --{field}={text}")
            if kind == "override-text":
                assert_config_error(lambda: load_config(None, parse_overrides([f"--{field}={bad}"])), field,
                                    context=f"seed {seed}: --{field}={bad!r}")


@pytest.mark.parametrize("seed", SEEDS)
def test_nan_and_inf_are_refused_for_every_float_field(seed):
    rng = random.Random(5500 + seed)
    for (s, k), typ in FIELDS.items():
        if typ is not float:
            continue
        texts = ["nan", "NaN", "-nan", "-inf", "-Infinity", "-1e999"]
        if (s, k) not in INF_ACCEPTED:  # the rest: test_bug_non_finite_floats_are_accepted
            texts += ["inf", "Infinity", "1e999", "+inf"]
        text = rng.choice(texts)
        assert_config_error(lambda: load_config(None, parse_overrides([f"--{s}.{k}={text}"])), f"{s}.{k}", context=f"--{s}.{k}={text}")


def _typos(name: str, rng: random.Random, *, no: str = "") -> list[str]:
    """Misspellings of ``name``: a character dropped, doubled, swapped or replaced, other case,
    '-' for '_', a plural, look-alike unicode, surrounding blanks."""
    i = rng.randrange(len(name))
    j = min(i + 1, len(name) - 1)
    swapped = list(name)
    swapped[i], swapped[j] = swapped[j], swapped[i]
    out = [
        name[:i] + name[i + 1:], name[:i] + name[i] + name[i:], "".join(swapped),
        name[:i] + rng.choice(string.ascii_lowercase) + name[i + 1:], name.upper(), name.capitalize(),
        name.replace("_", "-"), name + "s", name.replace("a", "а").replace("e", "е"), " " + name, name + " ",
        name + "\u200b", gen_text(rng, 1, 8),
    ]
    return [t for t in out if t and not any(c in t for c in no)]


@pytest.mark.parametrize("seed", SEEDS)
def test_unknown_sections_and_keys_are_refused_by_name(seed, tmp_path):
    rng = random.Random(6000 + seed)
    for n in range(12):
        s, k = rng.choice(list(FIELDS))
        fields = _fields_of(SECTIONS[s])
        value = SPECS[(s, k)].valid(rng)
        # a mistyped key
        typo = rng.choice([t for t in _typos(k, rng) if t not in fields] or ["zz"])
        path = tmp_path / f"k{n}.toml"
        path.write_text(f"[{s}]\n{toml_key(typo, rng)} = {toml_value(value, rng)}\n", encoding="utf-8")
        assert_config_error(lambda: load_config(path), f"{s}.{typo}", "unknown key", context=f"TOML [{s}] {typo!r}")
        otypo = rng.choice([t for t in _typos(k, rng, no="=") if t not in fields] or ["zz"])
        assert_config_error(lambda: load_config(None, parse_overrides([f"--{s}.{otypo}=1"])), f"--{s}.{otypo}", "unknown key",
                            context=f"override --{s}.{otypo}")
        # a mistyped section
        styp = rng.choice([t for t in _typos(s, rng, no="=.") if t not in SECTIONS] or ["zz"])
        path.write_text(f"[{toml_key(styp, rng)}]\n{k} = {toml_value(value, rng)}\n", encoding="utf-8")
        assert_config_error(lambda: load_config(path), f"[{styp}]", "unknown section", context=f"TOML section {styp!r}")
        assert_config_error(lambda: load_config(None, parse_overrides([f"--{styp}.{k}=1"])), repr(styp), "unknown section",
                            context=f"override section {styp!r}")
        # a key at the top level, or a section that is not a table
        path.write_text(f"{toml_key(k)} = {toml_value(value)}\n", encoding="utf-8")
        assert_config_error(lambda: load_config(path), context=f"top-level key {k}")
        path.write_text(f"{s} = {toml_value(value)}\n" if not isinstance(value, dict) else f"[[{s}]]\n", encoding="utf-8")
        assert_config_error(lambda: load_config(path), s, context=f"{s} = {value!r}")


@pytest.mark.parametrize("seed", SEEDS)
def test_duplicated_keys_and_sections_are_refused(seed, tmp_path):
    """The duplicate is refused; that the message names the key is
    test_bug_duplicated_toml_key_error_does_not_name_the_key."""
    rng = random.Random(7000 + seed)
    for n in range(6):
        s, k = rng.choice(list(FIELDS))
        a, b = SPECS[(s, k)].valid(rng), SPECS[(s, k)].valid(rng)
        path = tmp_path / f"d{n}.toml"
        doc = rng.choice([
            f"[{s}]\n{k} = {toml_value(a)}\n{k} = {toml_value(b)}\n",
            f"[{s}]\n{k} = {toml_value(a)}\n[{s}]\n{k} = {toml_value(b)}\n",
            f"{s}.{k} = {toml_value(a)}\n[{s}]\n{k} = {toml_value(b)}\n",
            f"{s} = {{{k} = {toml_value(a)}}}\n[{s}]\n{k} = {toml_value(b)}\n",
            f"[{s}]\n{k} = {toml_value(a)}\n\"{k}\" = {toml_value(b)}\n",
        ])
        path.write_text(doc, encoding="utf-8")
        assert_config_error(lambda: load_config(path), "--config", str(path), "not valid TOML", context=doc)


MALFORMED_OVERRIDES = [
    # (argv, text the message must contain)
    (["--a"], "--a"),
    (["--a.b"], "--a.b"),
    (["--a.b.c=1"], "'a'"),
    (["=1"], "=1"),
    (["a.b=1"], "a.b=1"),
    (["run.iterations=3"], "run.iterations=3"),
    (["-run.iterations=3"], "-run.iterations=3"),
    (["--=1"], "--=1"),
    (["--.=1"], "''"),
    (["--.iterations=1"], "''"),
    (["---run.iterations=3"], "'-run'"),
    (["--run.iterations"], "--run.iterations"),
    (["--run.=3"], "--run."),
    (["--run..iterations=3"], "'.iterations'"),
    (["--run.iterations.x=3"], "'iterations.x'"),
    (["--run.iterations==3"], "--run.iterations"),
    (["--run.iterations=3=4"], "--run.iterations"),
    (["--run.iterations=3 4"], "--run.iterations"),
    (["--RUN.iterations=3"], "'RUN'"),
    ([" --run.iterations=3"], "--run.iterations=3"),
    (["--run .iterations=3"], "'run '"),
    ([""], "''"),
    (["--"], "'--'"),
    (["--run.iterations=3", "extra"], "'extra'"),
    (["--trainer.lr=1e-3", "--trainer.lr"], "--trainer.lr"),
]


@pytest.mark.parametrize("seed", SEEDS)
def test_malformed_override_syntax_is_refused(seed, capsys, clean_env):
    """Each malformed argument, among random good ones: ConfigError naming it (the node CLI: exit 2
    with that message). A separate-form key followed by another override is not here:
    test_bug_override_without_value_swallows_the_next_override."""
    rng = random.Random(8000 + seed)
    for _ in range(8):
        bad, needle = rng.choice(MALFORMED_OVERRIDES)
        raw = gen_config(rng, override_safe=True)
        good = [f"--{s}.{k}={override_text(v, FIELDS[(s, k)], rng)}" for s, k, v in raw_items(raw)
                if rng.random() < 0.15 and not isinstance(v, (list, dict))]
        if bad[-1] in ("--a.b", "--run.iterations", "--trainer.lr"):  # a key without its value: last
            argv = good + bad
        else:
            i = rng.randint(0, len(good))
            argv = good[:i] + bad + good[i:]
        assert_config_error(lambda: load_config(None, parse_overrides(argv)), needle, context=f"{argv}")
        # argparse reads "--" as the end of its options and "" and " --x" as positionals, which
        # Python versions treat differently: only through the loader.
        if all(a and a == a.strip() and a != "--" for a in bad):
            code, out, err = run_node(["--print-config", *argv], capsys)
            assert code == 2 and needle in err and "Traceback" not in err, (argv, code, err)


def test_values_with_equals_signs_and_dashes_are_kept():
    cfg = load_config(None, parse_overrides([
        "--run.run_id=a=b", "--task.path==x", "--env.name", "pkg.mod:Cls=1", "--logging.wandb_project=--x",
        "--checkpoint.dir", "a b", "--engine.device=", "--algorithm.rewards=a=b, c:d", "--env.kwargs={\"k=v\": \"--x\"}",
    ]))
    assert (cfg.run.run_id, cfg.task.path, cfg.env.name, cfg.logging.wandb_project) == ("a=b", "=x", "pkg.mod:Cls=1", "--x")
    assert (cfg.checkpoint.dir, cfg.engine.device, cfg.algorithm.rewards) == ("a b", "", ["a=b", "c:d"])
    assert cfg.env.kwargs == {"k=v": "--x"}


@pytest.mark.parametrize("seed", SEEDS)
def test_booleans_spelled_other_ways(seed, tmp_path):
    """Overrides take true/false/1/0/yes/no/on/off in any case; TOML takes only its own true and
    false; anything else names the field."""
    rng = random.Random(9000 + seed)
    bools = [key for key, typ in FIELDS.items() if typ is bool]
    for _ in range(10):
        s, k = rng.choice(bools)
        want = rng.random() < 0.5
        text = rng.choice(TRUE_SPELLINGS if want else FALSE_SPELLINGS)
        base = json.loads(json.dumps(DEFAULTS))
        base[s][k] = want
        if error_of(lambda: build(base)) is None:
            assert getattr(getattr(load_config(None, parse_overrides([f"--{s}.{k}={text}"])), s), k) is want
        bad = rng.choice(wrong_override_texts(bool, rng))
        assert_config_error(lambda: load_config(None, parse_overrides([f"--{s}.{k}={bad}"])), f"{s}.{k}", context=repr(bad))
        bad_toml = rng.choice(['"true"', '"false"', "1", "0", "yes", "True", "FALSE", "[true]", "on"])
        path = tmp_path / "b.toml"
        path.write_text(f"[{s}]\n{k} = {bad_toml}\n", encoding="utf-8")
        # Bare words (yes, True, on) are not TOML at all: the file is refused as invalid TOML.
        needle = f"{s}.{k}" if bad_toml[0] in '"[01' else "not valid TOML"
        assert_config_error(lambda: load_config(path), needle, context=bad_toml)


# -- rules across sections -----------------------------------------------------------------------

CROSS_AXES = {
    ("model", "kind"): ["tiny", "hf"],
    ("model", "path"): ["", "m"],
    ("engine", "name"): list(sections_mod.ENGINES),
    ("checkpoint", "export_hf"): ["", "out"],
    ("task", "kind"): list(workload_mod.TASK_KINDS),
    ("task", "path"): ["", "d.jsonl"],
    ("env", "name"): ["", "guess"],
    ("task", "chat_template"): [False, True],
    ("task", "messages_key"): ["", "messages"],
    ("trainer", "warmup_steps"): [0, 5],
    ("rollout", "max_staleness"): [0, 1],
    ("run", "rl_phase"): list(sections_mod.RL_PHASES),
    ("trainer", "bf16"): [False, True],
    ("trainer", "backend"): ["gloo", "nccl"],
}


def violated_rules(v: dict[tuple[str, str], Any]) -> set[str]:
    """The documented rules the combination breaks, by the field each error names."""
    kind = v[("model", "kind")]
    out = set()
    if kind == "hf" and not v[("model", "path")]:
        out.add("model.path")  # "model.kind = hf needs the HF model directory"
    if v[("task", "kind")] == "dataset" and not v[("task", "path")]:
        out.add("task.path")  # "task.kind = dataset needs the data file"
    if v[("trainer", "bf16")] and v[("trainer", "backend")] != "nccl":
        out.add("trainer.bf16")  # "bf16 compute needs GPUs (trainer.backend = nccl)"
    engine = v[("engine", "name")]
    if (kind == "tiny" and engine not in ("auto", "tiny")) or (kind == "hf" and engine == "tiny"):
        out.add("engine.name")  # "auto: tiny for model.kind = tiny, hf for model.kind = hf"
    if v[("checkpoint", "export_hf")] and kind != "hf":
        out.add("checkpoint.export_hf")  # "model.kind = hf: after the last iteration write ..."
    if v[("task", "kind")] == "generated" and not v[("env", "name")]:
        out.add("task.kind")  # "generated: ... for an env that makes its own instances (env.name)"
    if v[("task", "chat_template")] and kind != "hf":
        out.add("task.chat_template")  # "(model.kind = hf)"
    if v[("task", "messages_key")] and not v[("task", "chat_template")] and v[("task", "kind")] == "dataset" and not v[("env", "name")]:
        out.add("task.messages_key")  # "chat messages ... need task.chat_template"
    if v[("trainer", "warmup_steps")] and not (v[("task", "kind")] == "toy" and not v[("env", "name")]):
        out.add("trainer.warmup_steps")  # "Supervised steps on (prompt, target) pairs of the task"
    if v[("rollout", "max_staleness")] and v[("run", "rl_phase")] != "both":
        out.add("rollout.max_staleness")  # "With run.rl_phase rollout or update ... it must stay 0"
    return out


def named_field(exc: BaseException) -> str:
    """The section.key a config error starts with ("task.kind = generated: ..." -> task.kind)."""
    m = re.match(r"-*([A-Za-z0-9_]+\.[A-Za-z0-9_]+)", str(exc))
    return m.group(1) if m else str(exc)


_SECTION_CACHE: dict[tuple, Any] = {}


def _section(s: str, values: dict[str, Any]) -> Any:
    """SECTIONS[s](**values), or the error it raises; cached (the exhaustive test builds each
    distinct section many times)."""
    key = (s, tuple(sorted(values.items())))
    if key not in _SECTION_CACHE:
        try:
            _SECTION_CACHE[key] = SECTIONS[s](**values)
        except ConfigError as exc:
            _SECTION_CACHE[key] = exc
    return _SECTION_CACHE[key]


def _combination_config(v: dict[tuple[str, str], Any]) -> NodeConfig:
    """The defaults with ``v`` set, built section by section in NodeConfig's order."""
    sections = {}
    for s in SECTIONS:
        values = {k: value for (sec, k), value in v.items() if sec == s}
        built = _section(s, values)
        if isinstance(built, ConfigError):
            raise built
        sections[s] = built
    return NodeConfig(**sections)


def test_cross_section_rules_hold_for_every_combination():
    """Every combination of the fields the rules involve (a path only matters with its kind, so
    each kind comes with and without one)."""
    import itertools

    model = [{("model", "kind"): "tiny", ("model", "path"): p} for p in ("", "m")][:1] + [
        {("model", "kind"): "hf", ("model", "path"): p} for p in ("", "m")]
    task = [{("task", "kind"): "toy", ("task", "path"): ""}, {("task", "kind"): "generated", ("task", "path"): ""}] + [
        {("task", "kind"): "dataset", ("task", "path"): p} for p in ("", "d.jsonl")]
    trainer = [{("trainer", "bf16"): b, ("trainer", "backend"): be} for b in (False, True) for be in ("gloo", "nccl")]
    rest = {key: options for key, options in CROSS_AXES.items()
            if key not in {("model", "kind"), ("model", "path"), ("task", "kind"), ("task", "path"), ("trainer", "bf16"),
                           ("trainer", "backend")}}
    checked = 0
    for m, t, tr, values in itertools.product(model, task, trainer, itertools.product(*rest.values())):
        v = {**m, **t, **tr, **dict(zip(rest, values))}
        broken = violated_rules(v)
        exc = error_of(lambda: _combination_config(v))
        if not broken:
            assert exc is None, f"{v}: refused although no documented rule is broken: {exc!r}"
        else:
            assert type(exc) is ConfigError, f"{v}: breaks {sorted(broken)} but got {exc!r}"
            named = named_field(exc)
            assert named in broken, f"{v}: breaks {sorted(broken)}, the error names {named!r}: {exc}"
        checked += 1
    assert checked == len(model) * len(task) * len(trainer) * math.prod(len(a) for a in rest.values())


@pytest.mark.parametrize("seed", SEEDS)
def test_cross_section_rules_through_the_loader(seed, tmp_path):
    """Random combinations, through TOML and overrides on top of a random valid config."""
    rng = random.Random(10000 + seed)
    for n in range(20):
        base = gen_config(rng, override_safe=True)
        base["task"]["name"] = rng.choice(sorted(TASKS))  # whatever task.kind becomes
        base["task"]["prompt_key"] = base["task"]["prompt_key"] or "prompt"  # whatever task.messages_key becomes
        v = {key: rng.choice(options) for key, options in CROSS_AXES.items()}
        if rng.random() < 0.5:  # half of them valid
            merged = json.loads(json.dumps(base))
            for (s, k), value in v.items():
                merged[s][k] = value
            repair(merged, rng, True)
            v = {key: merged[key[0]][key[1]] for key in CROSS_AXES}
        broken = violated_rules(v)
        raw = json.loads(json.dumps(base))
        via_file = rng.random() < 0.5
        for (s, k), value in v.items():
            if via_file:
                raw[s][k] = value
        path = tmp_path / f"x{n}.toml"
        path.write_text(toml_doc(raw, rng), encoding="utf-8")
        args = [] if via_file else override_args([(s, k, value) for (s, k), value in v.items()], rng)
        exc = error_of(lambda: load_config(path, parse_overrides(args)))
        if not broken:
            assert exc is None, f"{v}: {exc!r}"
        else:
            assert type(exc) is ConfigError and named_field(exc) in broken, (v, broken, exc)


# -- the other front ends ------------------------------------------------------------------------


@pytest.mark.parametrize("seed", SEEDS[:5])
def test_rollout_and_run_front_ends_refuse_bad_overrides_by_name(seed, tmp_path, capsys, clean_env):
    """``elasticrl rollout`` (status 2) and ``elasticrl run`` (argparse's usage error, status 2)
    name the field. Only inputs load_config refuses are passed, so nothing is ever started."""
    rng = random.Random(11000 + seed)
    path = tmp_path / "c.toml"
    path.write_text(toml_doc(gen_config(rng), rng), encoding="utf-8")
    numeric = [key for key, spec in SPECS.items() if isinstance(spec, Num) and spec.checked]
    for _ in range(3):
        (s, k) = rng.choice(numeric)
        bad = f"--{s}.{k}={rng.choice(SPECS[(s, k)].out_of_range(rng))!r}"
        typ_bad = f"--{s}.{k}=" + rng.choice(wrong_override_texts(FIELDS[(s, k)], rng))
        for arg in (bad, typ_bad):
            assert_config_error(lambda: load_config(path, parse_overrides([arg])), f"{s}.{k}")  # the guard
            capsys.readouterr()
            code = elasticrl_cli.main(["rollout", "--config", str(path), "--coordinator", "127.0.0.1:9", "--run-id", "r", arg])
            err = capsys.readouterr().err
            assert code == 2 and f"{s}.{k}" in err and "Traceback" not in err, (arg, code, err)
            exc = error_of(lambda: elasticrl_cli.main(["run", str(path), "--", arg]))
            err = capsys.readouterr().err
            assert isinstance(exc, SystemExit) and exc.code == 2 and f"{s}.{k}" in err, (arg, exc, err)


# -- --rdzv-conf ---------------------------------------------------------------------------------

SECONDS_KEYS = {key for key, field in rdzv_mod._CONF_KEYS.items() if field.endswith("_s")}
BOOL_KEYS = {"in_place", "session_relay"}
POSITIVE_KEYS = {"last_call_timeout", "join_timeout", "read_timeout", "call_timeout", "connect_timeout"}


def rdzv_params(conf: dict[str, Any], *, endpoint: str = "coord:50051", run_id: str = "run-1", min_nodes: int = 1,
                max_nodes: int = 2) -> SimpleNamespace:
    """What torchrun hands the handler creator (``RendezvousParameters``: its ``config`` is the
    parsed --rdzv-conf plus torchrun's own keys)."""
    return SimpleNamespace(config=conf, endpoint=endpoint, run_id=run_id, min_nodes=min_nodes, max_nodes=max_nodes, local_addr=None)


def parse_rdzv_conf(text: str) -> dict[str, str]:
    """torch.distributed.elastic.rendezvous.utils._parse_rendezvous_config (torch is not imported
    here): comma-separated key=value pairs, both stripped, neither empty."""
    conf: dict[str, str] = {}
    for kv in text.strip().split(",") if text.strip() else []:
        key, *values = kv.split("=", 1)
        key, value = key.strip(), (values[0].strip() if values else "")
        assert key and value, f"torch refuses {kv!r}"
        conf[key] = value
    return conf


def valid_seconds(key: str, rng: random.Random) -> tuple[str, float]:
    if key == "lease_ttl" and rng.random() < 0.3:
        value = 0.0
    else:
        lo = 0.1 if key == "lease_ttl" else (0.0 if key == "rejoin_timeout" else 1e-3)
        value = gen_float(rng, lo, 1e5)
    text = rng.choice([repr(value), f"{value:g}" if float(f"{value:g}") == value else repr(value),
                       str(int(value)) if value.is_integer() else repr(value)])
    return text, float(text)


def invalid_seconds(key: str, rng: random.Random) -> str:
    # nan and inf passed: test_bug_rdzv_conf_accepts_non_finite_durations.
    texts = ["abc", "5s", "1e", "0x10", "--5", "1..2", "five", "1_", "½", "1 2", "-1", "-0.5", "-1e-9", "nan", "inf"]
    if key in POSITIVE_KEYS:
        texts += ["0", "0.0", "-0"]
    if key == "lease_ttl":
        texts += ["0.05", "1e-3", "0.0999"]
    return rng.choice(texts)


def valid_node_id(rng: random.Random) -> str:
    first = rng.choice(string.ascii_letters + string.digits)
    return first + "".join(rng.choice(string.ascii_letters + string.digits + "._:@=+-") for _ in range(rng.randint(0, 40)))


def invalid_node_id(rng: random.Random) -> str:
    return rng.choice([".x", "-x", "_x", "a b", "a/b", "é", "x" * 129, "a\tb", "a#b", "日本", "a,b".replace(",", ";"), "x😀"])


@pytest.mark.parametrize("seed", SEEDS)
def test_random_rdzv_conf_parses_exactly_or_names_the_key(seed, caplog):
    rng = random.Random(12000 + seed)
    keys = list(rdzv_mod._CONF_KEYS)
    for n in range(20):
        pairs: list[tuple[str, str]] = []
        want: dict[str, Any] = {}
        bad_key = rng.choice(keys) if rng.random() < 0.5 else None
        for key in rng.sample(keys, rng.randint(0, len(keys))) + ([bad_key] if bad_key else []):
            field = rdzv_mod._CONF_KEYS[key]
            if key == bad_key:
                if key in SECONDS_KEYS:
                    text = invalid_seconds(key, rng)
                elif key in BOOL_KEYS:
                    text = rng.choice(["maybe", "2", "tru", "y", "enable", "nope", "-1", "1.0", "none"])
                elif key == "node_id":
                    text = invalid_node_id(rng)
                else:
                    bad_key = None  # token_file and tls_ca take any path
                    continue
            elif key in SECONDS_KEYS:
                text, want[field] = valid_seconds(key, rng)
            elif key in BOOL_KEYS:
                want[field] = rng.random() < 0.5
                text = rng.choice(TRUE_SPELLINGS if want[field] else FALSE_SPELLINGS).strip()
            elif key == "node_id":
                text = want[field] = valid_node_id(rng)
            else:
                text = want[field] = gen_text(rng, 1, 12, alphabet=string.ascii_letters + "/._-=é 日").strip() or "f"
            pairs = [p for p in pairs if p[0] != key] + [(key, text)]
        unknown = [t for t in _typos(rng.choice(keys), rng, no="=, ")
                   if t.strip() and t not in rdzv_mod._CONF_KEYS and t not in rdzv_mod.TORCHRUN_KEYS][:rng.randint(0, 2)]
        pairs += [(u, "1") for u in unknown]
        pairs += [(k, v) for k, v in (("timeout", "900"), ("rank", "0"), ("is_host", "true")) if rng.random() < 0.5]
        rng.shuffle(pairs)
        text = ",".join(f"{k}={v}" for k, v in pairs)
        conf = parse_rdzv_conf(text)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger=rdzv_mod.__name__):
            got: list[RendezvousConfig] = []
            exc = error_of(lambda: got.append(RendezvousConfig.from_params(rdzv_params(conf))))
            result = got[0] if got else None
        if bad_key:
            assert isinstance(exc, ValueError) and not isinstance(exc, (TypeError, AttributeError)), (text, exc)
            assert bad_key in str(exc), f"--rdzv-conf {text!r}: {exc} does not name {bad_key}"
            continue
        assert exc is None, f"--rdzv-conf {text!r}: {exc!r}"
        for field, value in want.items():
            got = getattr(result, field)
            assert type(got) is type(value) and (got == value), f"--rdzv-conf {text!r}: {field} = {got!r}, wrote {value!r}"
        # Unknown keys are accepted but named in a warning (the from_params docstring: "unknown
        # keys are logged"); torchrun's own keys are not.
        warned = [r.getMessage() for r in caplog.records if "unknown --rdzv-conf" in r.getMessage()]
        if unknown:
            assert len(warned) == 1, warned
            listed = warned[0].split("key(s) ", 1)[1].split("; the elasticrl backend knows", 1)[0]
            assert sorted(listed.split(", ")) == sorted(set(unknown)), (unknown, warned)
        else:
            assert not warned, warned


@pytest.mark.parametrize("seed", SEEDS)
def test_rdzv_endpoint_and_nnodes(seed):
    rng = random.Random(13000 + seed)
    for _ in range(10):
        host = rng.choice(["coord", "10.0.0.7", "node-1.example.com", "[::1]", "h"])
        port = rng.randint(1, 65535)
        endpoint, want = rng.choice([(f"{host}:{port}", f"{host}:{port}"), (host, f"{host}:{rdzv_mod.DEFAULT_PORT}"),
                                     (f" {host}:{port} ", f"{host}:{port}")])
        if host == "[::1]" and endpoint == host:
            endpoint, want = f"{host}:{port}", f"{host}:{port}"
        assert RendezvousConfig.from_params(rdzv_params({}, endpoint=endpoint)).endpoint == want
        bad = rng.choice(["", "   ", f"{host}:", f"{host}:x", f"{host}:5x", ":", f"{host}:-1", f"{host}: 5"])
        exc = error_of(lambda: RendezvousConfig.from_params(rdzv_params({}, endpoint=bad)))
        assert isinstance(exc, ValueError) and "--rdzv-endpoint" in str(exc), (bad, exc)
        lo, hi = rng.choice([(0, 1), (2, 1), (-1, 3), (0, 0), (5, 4)])
        exc = error_of(lambda: RendezvousConfig.from_params(rdzv_params({}, min_nodes=lo, max_nodes=hi)))
        assert isinstance(exc, ValueError) and "--nnodes" in str(exc), (lo, hi, exc)
        bad_id = rng.choice(["", ".run", "a b", "x" * 129, "ü"])
        exc = error_of(lambda: RendezvousConfig.from_params(rdzv_params({}, run_id=bad_id)))
        assert isinstance(exc, ValueError) and "--rdzv-id" in str(exc), (bad_id, exc)


# -- bugs this file found (fixed): each test failed before its fix --------------------------------------------


@pytest.mark.parametrize("case", ["not-utf8", "directory"])
def test_bug_unreadable_config_file_is_not_a_config_error(case, tmp_path):
    if case == "not-utf8":
        path = tmp_path / "latin1.toml"
        path.write_bytes('[run]\nrun_id = "caf\u00e9"\n'.encode("latin-1"))
    else:
        path = tmp_path
    exc = error_of(lambda: load_config(path))
    assert type(exc) is ConfigError and "--config" in str(exc), repr(exc)


def test_bug_toml_datetime_in_a_table_breaks_print_config(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("[env]\nkwargs = {when = 1979-05-27}\n")
    exc = error_of(lambda: json.dumps(to_dict(load_config(path))))
    assert exc is None or (type(exc) is ConfigError and "env.kwargs" in str(exc)), repr(exc)


def test_bug_override_without_value_swallows_the_next_override():
    exc = error_of(lambda: parse_overrides(["--logging.wandb_project", "--trainer.lr=1e-4"]))
    assert type(exc) is ConfigError and "--logging.wandb_project" in str(exc), parse_overrides(["--logging.wandb_project", "--trainer.lr=1e-4"])


@pytest.mark.parametrize("args", [
    ["--trainer.lr=inf"],
    ["--coordinator.call_timeout_s=inf"],
    ["--rollout.temperature=1e999"],
    ["--algorithm.rewards=format", "--algorithm.reward_weights=nan"],
], ids=lambda a: a[-1])
def test_bug_non_finite_floats_are_accepted(args):
    field = args[-1][2:].split("=")[0]
    assert_config_error(lambda: load_config(None, parse_overrides(args)), field)


@pytest.mark.parametrize("pair", ["last_call_timeout=nan", "join_timeout=inf", "lease_ttl=nan", "rejoin_timeout=nan"])
def test_bug_rdzv_conf_accepts_non_finite_durations(pair):
    key, value = pair.split("=")
    exc = error_of(lambda: RendezvousConfig.from_params(rdzv_params({key: value})))
    assert isinstance(exc, ValueError) and key in str(exc), repr(exc)


def test_bug_duplicated_toml_key_error_does_not_name_the_key(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("[run]\niterations = 3\niterations = 4\n")
    assert_config_error(lambda: load_config(path), "iterations")


def test_bug_seed_outside_torchs_range_is_accepted():
    assert_config_error(lambda: load_config(None, parse_overrides([f"--run.seed={2**64}"])), "run.seed")


def test_bug_task_lease_message_contradicts_the_check():
    exc = error_of(lambda: load_config(None, parse_overrides(["--rollout.task_lease_s=0.0005"])))
    assert exc is None or "must be > 0 seconds" not in str(exc), str(exc)


@pytest.mark.parametrize("doc", ["[run]\niterations = " + "9" * 5000 + "\n", "[trainer]\nlr = 1" + "0" * 400 + "\n"], ids=["int-digits", "float-overflow"])
def test_bug_oversized_toml_numbers_crash(doc, tmp_path):
    path = tmp_path / "c.toml"
    path.write_text(doc)
    exc = error_of(lambda: load_config(path))
    assert type(exc) is ConfigError, repr(exc)
