"""Agents end to end (``elasticrl run``: a real coordinator, real torchrun nodes): the bundled
multi-turn demo learns; a user's env file and a user's dataset with a reward reading its own
column run; a node SIGKILLed mid-episode; an env that raises every 5th step and one that sleeps
past its deadline fail only their groups; the web and search envs run with the hf engine on a
tiny local model. Every run must finish every iteration."""

from __future__ import annotations

import json
import re

import pytest

from elasticrl._proto import scheduler_pb2 as spb

from tests.conftest import REPO
from tests.integration.test_demo import metrics, run_demo

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(300)]

AGENT_DEMO = str(REPO / "examples" / "configs" / "agent-demo.toml")


def run(out, *args: str, timeout_s: float = 150):
    return run_demo(out, *args, timeout_s=timeout_s)


def mean(records, key, default=0.0):
    return sum(r.get(key, default) for r in records) / len(records)


def test_the_agent_demo_learns_to_play_over_several_turns(tmp_path):
    """The bundled multi-turn demo, shortened: the policy learns the game within 40 iterations."""
    out = tmp_path / "run"
    result = run(out, "--config", AGENT_DEMO, "--nodes", "2", "--iterations", "40", "--", "--run.eval_interval=0")
    assert result.returncode == 0, result.stdout
    records = metrics(out)
    assert [r["iteration"] for r in records] == list(range(1, 41))
    first, last = records[:5], records[-5:]
    assert mean(last, "reward_mean") > mean(first, "reward_mean") + 0.3, [r["reward_mean"] for r in records]
    assert all(r["turns_mean"] > 1 for r in records) and all(r["env_errors"] == 0 for r in records)
    assert mean(last, "truncated_fraction") < mean(first, "truncated_fraction")  # it wins more games
    assert "ended" in result.stdout and "turns" in result.stdout and "env errors" not in result.stdout
    # The run dir is named after the config, not "demo".
    assert re.search(r"elasticrl: 2 node\(s\) train a tiny policy on generated rows, env guess", result.stdout)


def readme_env() -> str:
    """The env example of the README's "Your own data and environments" section, as written."""
    text = (REPO / "README.md").read_text()
    section = text[text.index("## Your own data and environments"):]
    return section[section.index("```python\n") + len("```python\n"):section.index("```\n", section.index("```python"))]


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    """A tiny random Llama whose character tokenizer covers the bundled envs' pages."""
    from elasticrl.rollout.tiny_llama import CHARS, write_tiny_llama

    return write_tiny_llama(tmp_path_factory.mktemp("model") / "tiny", vocab_size=72, chars=CHARS + '[]<>\n_"',
                            max_position_embeddings=4096, hidden_size=32, num_hidden_layers=1)


def hf_args(model) -> list[str]:
    return ["--model.kind=hf", f"--model.path={model}", "--engine.name=hf", "--trainer.lr=1e-3", "--trainer.warmup_steps=0",
            "--task.group_size=2", "--run.eval_interval=0", "--trainer.updates_per_iteration=1"]


def test_a_users_env_written_as_the_readme_says(tmp_path, hf_model):
    source = readme_env()
    assert "class MyEnv" in source and len(source.splitlines()) <= 25
    (tmp_path / "my_env.py").write_text(source)
    # The README's command, on the tiny policy (a user's first run; its observations must tokenize).
    text = (REPO / "README.md").read_text()
    command = re.search(r"elasticrl run examples/configs/agent-demo.toml --nodes 2 -- (.*)\n", text).group(1).split()
    out = tmp_path / "run"
    result = run(out, "--config", AGENT_DEMO, "--nodes", "1", "--iterations", "2", "--",
                 *[a.replace("my_env.py", f"{tmp_path}/my_env.py") for a in command], "--task.prompts_per_iteration=4")
    assert result.returncode == 0, result.stdout
    records = metrics(out)
    assert [r["iteration"] for r in records] == [1, 2]
    assert all(r["turns_mean"] == 2 and r["truncated_fraction"] == 0 and r["env_errors"] == 0 for r in records), records
    assert "twice=" in records[-1]["example"]
    # And on an HF model.
    out = tmp_path / "run-hf"
    result = run(out, "--config", AGENT_DEMO, "--nodes", "1", "--iterations", "2", "--",
                 f"--env.name={tmp_path}/my_env.py:MyEnv", "--env.kwargs={}", "--env.max_turns=4",
                 "--rollout.max_new_tokens=4", "--task.prompts_per_iteration=4", *hf_args(hf_model))
    assert result.returncode == 0, result.stdout
    assert all(r["turns_mean"] == 2 and r["env_errors"] == 0 for r in metrics(out))


def test_a_dataset_of_200_rows_with_a_reward_that_reads_an_extra_column(tmp_path):
    import random

    rng = random.Random(0)
    rows = []
    for i in range(200):
        digits = "".join(rng.choice("0123456789") for _ in range(4))
        rows.append({"prompt": f"{digits}=", "answer": digits[::-1], "id": i})
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "my_reward.py").write_text(
        "def score(prompt, completion, answer, **row):\n"
        "    assert isinstance(row['id'], int)\n"
        "    return sum(a == b for a, b in zip(completion, answer)) / max(len(answer), len(completion), 1)\n"
    )
    out = tmp_path / "run"
    result = run(out, "--nodes", "2", "--iterations", "4", "--checkpoint-every", "2", "--",
                 "--task.kind=dataset", f"--task.path={data}", "--task.eval_fraction=0.1", "--run.eval_interval=2",
                 f"--algorithm.rewards={tmp_path}/my_reward.py:score", "--trainer.warmup_steps=0",
                 "--task.prompts_per_iteration=32", "--rollout.max_new_tokens=5")
    assert result.returncode == 0, result.stdout
    records = metrics(out)
    assert [r["iteration"] for r in records] == [1, 2, 3, 4] and all(0 <= r["reward_mean"] <= 1 for r in records)
    assert "eval_reward" in records[1] and records[0]["turns_mean"] == 1
    # The 20 held-out groups of iterations 2 and 4 are counted apart from the 32 trained on.
    assert [(r["groups"], r["groups_total"], r["eval_groups"]) for r in records] == [(32, 32, 0), (32, 32, 20)] * 2
    meta = json.loads((out / "checkpoints" / "iter-000004" / "meta.json").read_text())
    # 180 training rows, 32 a step: after 4 iterations the next row is 128 of epoch 0.
    assert meta["data_position"]["next_row"] == 128 and meta["data_position"]["rows_per_epoch"] == 180
    assert re.search(r"train a tiny policy on dataset .*train.jsonl", result.stdout)

    # Resumed from that checkpoint (a new run id, the same coordinator state): iterations 5 and 6
    # take the next rows, so the first 180 positions are every training row exactly once.
    again = run(out, "--nodes", "1", "--iterations", "6", "--checkpoint-every", "2", "--",
                "--task.kind=dataset", f"--task.path={data}", "--task.eval_fraction=0.1", "--run.eval_interval=0",
                f"--algorithm.rewards={tmp_path}/my_reward.py:score", "--trainer.warmup_steps=0",
                "--task.prompts_per_iteration=32", "--rollout.max_new_tokens=5")
    assert again.returncode == 0 and "resumed from iteration 4" in again.stdout, again.stdout
    trained = rows_of_train_tasks(out / "coordinator" / "coordinator.sqlite")
    assert sorted(trained) == list(range(1, 7)) and all(len(ids) == 32 for ids in trained.values())
    order = [i for it in sorted(trained) for i in trained[it]]
    held_out = {r["id"] for r in rows} - set(order)
    assert len(held_out) == 20 and sorted(order[:180]) == sorted(set(range(200)) - held_out)
    assert len(set(order[180:])) == 12 and not set(order[180:]) & held_out  # epoch 2 has begun


def test_prompts_longer_than_the_context_are_left_out_at_start_up_or_stop_the_run(tmp_path):
    """Rows whose prompt leaves no room to generate (the tiny model holds 64 tokens) are found by
    the two ranks before the first iteration: left out with a warning, so no episode fails on them;
    or, with task.overlong_prompts = error, the run stops naming the first."""
    rows = [{"prompt": ("7" * 70 if i % 8 == 3 else f"{1000 + i}") + "=", "target": "1", "id": i} for i in range(40)]
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = ["--task.kind=dataset", f"--task.path={data}", "--algorithm.rewards=exact_match", "--trainer.warmup_steps=0",
            "--task.prompts_per_iteration=16", "--rollout.max_new_tokens=4"]
    out = tmp_path / "run"
    result = run(out, "--nodes", "2", "--iterations", "3", "--", *args)
    assert result.returncode == 0, result.stdout
    logs = "".join(f.read_text() for f in sorted((out / "logs").glob("node-*.log")))
    warned = [line for line in logs.splitlines() if "task.overlong_prompts = drop" in line]
    assert len(warned) == 1, logs  # rank 0's
    assert "leaving out 5 of 40 training row(s) whose prompt renders to 64 tokens or more: the context holds 64" in warned[0]
    assert "e.g. task.path row 3 (0-based); task.path row 11 (0-based); task.path row 19" in warned[0]
    records = metrics(out)
    assert [r["iteration"] for r in records] == [1, 2, 3] and all(r["env_errors"] == r["groups_failed"] == 0 for r in records)
    trained = rows_of_train_tasks(out / "coordinator" / "coordinator.sqlite")
    order = [i for it in sorted(trained) for i in trained[it]]
    assert len(order) == 48 and sorted(order[:35]) == [i for i in range(40) if i % 8 != 3]  # an epoch of the 35 kept

    stopped = run(tmp_path / "stopped", "--nodes", "1", "--iterations", "1", "--", *args, "--task.overlong_prompts=error")
    assert stopped.returncode != 0
    assert "task.overlong_prompts = error: task.path row 3 (0-based): its prompt renders to 72 tokens" in stopped.stdout, stopped.stdout
    assert not (tmp_path / "stopped" / "metrics.jsonl").exists()


def rows_of_train_tasks(db_path) -> dict[int, list[int]]:
    """Iteration -> the dataset ``id`` of each training task, from the coordinator's SQLite state."""
    import sqlite3

    with sqlite3.connect(db_path) as db:
        specs = db.execute("SELECT iteration, spec FROM sched_tasks ORDER BY iteration, seq").fetchall()
    out: dict[int, list[int]] = {}
    for iteration, spec in specs:
        spec = spb.TaskSpec.FromString(spec)  # a task's spec is stored as its message
        if spec.split in (spb.SPLIT_UNSPECIFIED, spb.SPLIT_TRAIN):
            out.setdefault(iteration, []).append(json.loads(spec.metadata_json)["row"]["id"])
    return out


def test_a_bad_row_stops_the_run_before_anything_starts(tmp_path):
    data = tmp_path / "train.jsonl"
    data.write_text('{"prompt": "12="}\n{"prompt": 12}\n')
    out = tmp_path / "run"
    result = run(out, "--nodes", "1", "--", "--task.kind=dataset", f"--task.path={data}", "--trainer.warmup_steps=0",
                 "--algorithm.rewards=exact_match")
    assert result.returncode == 2, result.stdout
    assert "train.jsonl: row 1 (0-based): key 'prompt' must be a string" in result.stdout, result.stdout
    assert not (out / "logs").exists()  # no coordinator, no node


SLOW_GUESS = '''
import time
from elasticrl.env.guess import GuessEnv

class SlowGuess(GuessEnv):
    def step(self, action):
        time.sleep(0.02)
        return super().step(action)
'''


def test_a_node_killed_mid_episode_loses_nothing_and_its_groups_are_played_again(tmp_path):
    (tmp_path / "slow_guess.py").write_text(SLOW_GUESS)
    out = tmp_path / "run"
    result = run(out, "--config", AGENT_DEMO, "--nodes", "3", "--iterations", "5", "--checkpoint-every", "2",
                 "--kill-at", "3", "--kill-phase", "rollout", "--own-checkpoints", "--",
                 f"--env.name={tmp_path}/slow_guess.py:SlowGuess", "--rollout.slots=2", "--task.prompts_per_iteration=24",
                 "--run.eval_interval=0", timeout_s=200)
    assert result.returncode == 0, result.stdout
    found = re.search(r"killing node-2 \(SIGKILL, agent and worker\) during the rollout of iteration (\d)", result.stdout)
    assert found, result.stdout
    k = int(found.group(1))
    by_iteration = {r["iteration"]: r for r in metrics(out)}
    assert sorted(by_iteration) == [1, 2, 3, 4, 5] and by_iteration[5]["world_size"] == 2
    (manifest_path,) = (out / "coordinator" / "trajectories").glob(f"*.rollout/{k:08d}/manifest.json")
    manifest = json.loads(manifest_path.read_text())
    assert manifest["tasks_done"] == manifest["tasks_total"] == 24 and manifest["tasks_failed"] == 0, manifest
    (victim,) = [n for n in manifest["nodes"] if n["node"] == "node-2-0"]
    assert victim["done"] > 0  # its finished groups were kept
    # The groups it was playing went back to the queue, and the survivors played them. Its agent is
    # evicted within the stream grace, so the survivors' agents may restart their workers while
    # the iteration still rolls out: what those held is requeued too, hence at least.
    assert manifest["requeued"] >= victim["assigned"] - victim["done"] > 0, manifest


FLAKY = '''
import itertools, os, threading, time
from elasticrl.env.guess import GuessEnv

_count = itertools.count(1)
_lock = threading.Lock()

class EveryFifthStepRaises(GuessEnv):
    """Every 5th step taken in this process raises."""

    def step(self, action):
        with _lock:
            n = next(_count)
        if n % 5 == 0:
            raise ConnectionError("the page did not load")
        return super().step(action)


class AlwaysRaises(GuessEnv):
    def step(self, action):
        raise KeyError("no such element: #search-box")


class SleepsOnce(GuessEnv):
    """The 3rd step of the whole run sleeps far past env.step_timeout_s: once, in one process (the
    first to create the marker file), so the retry on another node meets a healthy env."""

    def __init__(self, marker, **kwargs):
        super().__init__(**kwargs)
        self.marker = marker

    def step(self, action):
        with _lock:
            n = next(_count)
        if n == 3:
            try:
                os.close(os.open(self.marker, os.O_CREAT | os.O_EXCL))
            except FileExistsError:
                pass
            else:
                time.sleep(5)
        return super().step(action)
'''


def test_an_env_that_raises_every_5th_step_fails_only_those_groups(tmp_path):
    (tmp_path / "flaky.py").write_text(FLAKY)
    out = tmp_path / "run"
    result = run(out, "--config", AGENT_DEMO, "--nodes", "2", "--iterations", "4", "--",
                 f"--env.name={tmp_path}/flaky.py:EveryFifthStepRaises", "--env.max_turns=2", "--task.group_size=2",
                 # Up to 4 steps an attempt: about half the groups fail twice and are dropped.
                 "--rollout.min_fraction=0.1", "--task.prompts_per_iteration=16", "--run.eval_interval=0")
    assert result.returncode == 0, result.stdout
    records = metrics(out)
    assert [r["iteration"] for r in records] == [1, 2, 3, 4]
    assert sum(r["env_errors"] for r in records) > 0 and sum(r["groups_failed"] for r in records) > 0
    assert all(r["groups"] + r["groups_failed"] == 16 and r["groups"] >= 2 for r in records)
    manifests = sorted((out / "coordinator" / "trajectories").glob("*.rollout/*/manifest.json"))
    errors = [e for m in manifests for e in json.loads(m.read_text())["errors"]]
    assert any("EveryFifthStepRaises.step() raised ConnectionError: the page did not load" in e for e in errors), errors


def test_an_env_that_fails_every_episode_stops_the_run_with_its_error(tmp_path):
    import time

    (tmp_path / "flaky.py").write_text(FLAKY)
    out = tmp_path / "run"
    started = time.monotonic()
    result = run(out, "--config", AGENT_DEMO, "--nodes", "1", "--iterations", "3", "--",
                 f"--env.name={tmp_path}/flaky.py:AlwaysRaises", "--task.prompts_per_iteration=4", "--run.eval_interval=0")
    assert result.returncode != 0, result.stdout
    assert time.monotonic() - started < 100  # not rollout.seal_timeout_s (600 s)
    log = (out / "logs" / "node-0.log").read_text()
    assert "4 of 4 groups failed in their environment" in log, log[-3000:]
    assert "AlwaysRaises.step() raised KeyError: 'no such element: #search-box'" in log, log[-3000:]
    assert not (out / "metrics.jsonl").exists()
    # The console: the reason each node stopped, in a line, and the env named by its file; not a
    # warning per task, nor torch's traceback of the node's agent.
    assert re.search(r"node-0 exited with status 1: node-0 rank 0: EnvError: iteration 1: 4 of 4 groups failed in their "
                     r"environment .*flaky.py:AlwaysRaises.step\(\) raised KeyError", result.stdout), result.stdout
    assert "Traceback" not in result.stdout and "elasticrl demo: training failed after 0/3 iterations" in result.stdout
    assert result.stdout.count("failed in its environment") <= 2, result.stdout  # one a 30 s, on each of two tries


def test_a_step_past_its_deadline_fails_its_episode_and_the_retry_succeeds(tmp_path):
    (tmp_path / "flaky.py").write_text(FLAKY)
    out = tmp_path / "run"
    result = run(out, "--config", AGENT_DEMO, "--nodes", "2", "--iterations", "3", "--",
                 f"--env.name={tmp_path}/flaky.py:SleepsOnce", "--env.step_timeout_s=0.5",
                 "--env.kwargs=" + json.dumps({"marker": str(tmp_path / "slept"), "low": 0, "high": 9}),
                 "--task.prompts_per_iteration=8", "--task.group_size=4", "--run.eval_interval=0")
    assert result.returncode == 0, result.stdout
    records = metrics(out)
    assert [r["iteration"] for r in records] == [1, 2, 3]
    assert sum(r["env_errors"] for r in records) == 1  # the one stuck step of the run
    assert all(r["groups_failed"] == 0 and r["groups"] == 8 for r in records)  # every retry succeeded
    manifests = sorted((out / "coordinator" / "trajectories").glob("*.rollout/*/manifest.json"))
    errors = [e for m in manifests for e in json.loads(m.read_text())["errors"]]
    assert any("did not return within env.step_timeout_s = 0.5s" in e for e in errors), errors


@pytest.mark.parametrize("env, needle", [("web", "page: /"), ("search", "question: ")])
def test_the_web_and_search_envs_run_end_to_end_with_the_hf_engine(tmp_path, hf_model, env, needle):
    out = tmp_path / "run"
    result = run(out, "--config", AGENT_DEMO, "--nodes", "2", "--iterations", "2", "--",
                 f"--env.name={env}", "--env.kwargs={}", "--env.max_turns=3", "--rollout.max_new_tokens=12",
                 "--task.prompts_per_iteration=4", *hf_args(hf_model))
    assert result.returncode == 0, result.stdout
    records = metrics(out)
    assert [r["iteration"] for r in records] == [1, 2]
    assert all(r["env_errors"] == 0 and r["groups"] == 4 and 1 <= r["turns_mean"] <= 3 for r in records), records
    assert needle in records[0]["example"], records[0]["example"]


CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_chat_messages_rendered_with_the_models_template_over_several_turns(tmp_path):
    """A dataset of chat messages (messages_key), task.chat_template = true, the hf engine, and a
    multi-turn env: the rows' system prompt opens every episode, the env's answers come in as user
    turns rendered by the template, and the model's end-of-turn token (<|im_end|>) ends each action."""
    from elasticrl.rollout.tiny_llama import CHARS, write_tiny_llama

    model = write_tiny_llama(tmp_path / "chat", vocab_size=80, chars=CHARS + "\n", extra_tokens=("<|im_start|>", "<|im_end|>"),
                             chat_template=CHATML, max_position_embeddings=2048, hidden_size=32, num_hidden_layers=1)
    generation = json.loads((model / "generation_config.json").read_text())
    generation["eos_token_id"] = [5, 2]  # <|im_end|> (after the 4 specials and <|im_start|>) ends a turn
    (model / "generation_config.json").write_text(json.dumps(generation))
    rows = [{"messages": [{"role": "system", "content": "answer with a number."}, {"role": "user", "content": f"{i}+1=?"}],
             "answer": str(i + 1)} for i in range(8)]
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "chat_env.py").write_text(
        "class Chat:\n"
        "    def reset(self, seed=None, options=None):\n"
        "        self.answer, self.turn = options['answer'], 0\n"
        "        return options['messages'], {}\n"
        "    def step(self, action):\n"
        "        self.turn += 1\n"
        "        if action.strip() == self.answer or self.turn == 2:\n"
        "            return '', float(action.strip() == self.answer), True, False, {}\n"
        "        return 'try again.', 0.0, False, False, {}\n"
    )
    out = tmp_path / "run"
    result = run(out, "--config", AGENT_DEMO, "--nodes", "1", "--iterations", "2", "--",
                 "--task.kind=dataset", f"--task.path={data}", "--task.chat_template=true", "--task.messages_key=messages",
                 f"--env.name={tmp_path}/chat_env.py:Chat", "--env.kwargs={}", "--rollout.max_new_tokens=6",
                 "--task.prompts_per_iteration=4", *hf_args(model))
    assert result.returncode == 0, result.stdout
    records = metrics(out)
    assert [r["iteration"] for r in records] == [1, 2] and all(r["env_errors"] == 0 for r in records), records
    assert all(1 <= r["turns_mean"] <= 2 for r in records)
    assert "system: answer with a number." in records[0]["example"], records[0]["example"]
    # The stored episodes: the template's tokens, masked out; the actions, trained.
    from transformers import AutoTokenizer

    from elasticrl.scheduler.store import decode_shard

    tok = AutoTokenizer.from_pretrained(model, local_files_only=True)
    samples = [s for shard in sorted((out / "coordinator" / "trajectories").glob("*.rollout/00000001/shard-*"))
               for g, _ in decode_shard(shard.read_bytes()) for s in g.samples]
    assert len(samples) == 4 * 2
    for sample in samples:
        ids, mask = sample.token_ids(), sample.mask_list()
        text = tok.decode(ids)
        assert re.match(r"<\|im_start\|>system\nanswer with a number\.<\|im_end\|>\n<\|im_start\|>user\n\d\+1=\?<\|im_end\|>\n"
                        r"<\|im_start\|>assistant\n", text), text
        masked = tok.decode([t for t, m in zip(ids, mask) if m == 0])
        assert "<|im_start|>assistant\n" in masked and all(t not in tok.convert_tokens_to_ids(["<|im_start|>"]) or m == 0
                                                             for t, m in zip(ids, mask))
        if sample.turns == 2:  # the env's answer came in as a user turn, rendered by the template
            assert "<|im_start|>user\ntry again.<|im_end|>\n<|im_start|>assistant\n" in masked, masked
