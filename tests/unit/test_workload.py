"""What a run trains on: the [task] and [env] sections and their cross-checks, the row sources
(toy, dataset, generated) and where the data stands across a resume, reward functions that read a
row's fields, and the coordinator settings the torchrun plugin hands to its workers."""

from __future__ import annotations

import json
import random

import pytest

from elasticrl.config import ConfigError, NodeConfig, load_config, parse_overrides
from elasticrl.rl.rewards import RewardError, RewardFunction, combine_rewards, load_reward, reward_function
from elasticrl.rl.tasks import make_task
from elasticrl.rl.workload import (
    DatasetRows,
    GeneratedRows,
    ToyRows,
    episode_env,
    load_dataset_rows,
    max_new_tokens,
    row_label,
    row_source,
)

pytestmark = pytest.mark.timeout(60)


def config(*overrides: str) -> NodeConfig:
    return load_config(None, parse_overrides(list(overrides)))


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# -- config ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["--task.kind=files"], "task.kind: 'files' must be one of toy, dataset, generated"),
        (["--task.kind=dataset"], "task.path: task.kind = dataset needs the data file"),
        (["--task.eval_fraction=1.5"], r"task.eval_fraction: 1.5 must be in \[0, 1\)"),
        (["--task.kind=dataset", "--task.path=a.jsonl", "--task.eval_path=b.jsonl", "--task.eval_fraction=0.1"],
         "set either task.eval_path .* or task.eval_fraction, not both"),
        (["--task.kind=generated", "--trainer.warmup_steps=0"], "task.kind = generated: .* set env.name"),
        (["--task.chat_template=true"], "task.chat_template: the tiny model has no chat template"),
        (["--task.kind=dataset", "--task.path=a.jsonl", "--task.messages_key=messages", "--trainer.warmup_steps=0"],
         "task.messages_key: 'messages' gives each episode chat messages, which only a chat template"),
        (["--env.name=guess", "--trainer.warmup_steps=5"], "trainer.warmup_steps: the supervised warm-up trains on a toy task's targets"),
        (["--env.max_turns=0"], "env.max_turns: 0 must be at least 1"),
        (["--env.step_timeout_s=0"], "env.step_timeout_s: 0.0 must be > 0 seconds"),
        (["--env.kwargs=[1]"], "env.kwargs: '\\[1\\]' is not a JSON object"),
        (["--rollout.max_task_failures=0"], "rollout.max_task_failures: 0 must be in 1..100"),
    ],
)
def test_bad_task_and_env_settings_name_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message):
        config(*overrides)


def test_env_kwargs_come_from_toml_or_json_overrides(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('[task]\nkind = "generated"\n[env]\nname = "guess"\nkwargs = { low = 1, high = 5 }\n[trainer]\nwarmup_steps = 0\n')
    cfg = load_config(path, parse_overrides(['--env.kwargs={"high": 7}', "--env.max_turns=3"]))
    assert cfg.env.kwargs == {"high": 7} and cfg.env.max_turns == 3 and cfg.task.kind == "generated"


def test_the_plugins_settings_reach_the_workers_config(tmp_path):
    """Under torchrun the plugin exports the endpoint, token file and CA: a worker's config needs
    none of them (the README's torchrun command, verbatim)."""
    from types import SimpleNamespace

    from elasticrl.config import COORDINATOR_ENV, TLS_CA_ENV, TOKEN_FILE_ENV
    from elasticrl.rendezvous.config import RendezvousConfig
    from elasticrl.rendezvous.handler import export_to_workers

    params = SimpleNamespace(config={"token_file": "tok", "tls_ca": "ca.pem", "node_id": "n0"}, endpoint="coord:50051",
                             run_id="r", min_nodes=1, max_nodes=2, local_addr=None)
    environ: dict[str, str] = {}
    export_to_workers(RendezvousConfig.from_params(params), environ)
    assert environ[COORDINATOR_ENV] == "coord:50051" and environ[TOKEN_FILE_ENV].endswith("/tok")
    assert environ[TLS_CA_ENV].endswith("/ca.pem")
    cfg = config().resolved(environ)
    assert (cfg.coordinator.address, cfg.coordinator.token_file, cfg.coordinator.tls_ca) == (
        "coord:50051", environ[TOKEN_FILE_ENV], environ[TLS_CA_ENV])
    # What the user exported (or configured) wins.
    mine = {COORDINATOR_ENV: "elsewhere:1"}
    export_to_workers(RendezvousConfig.from_params(params), mine)
    assert mine[COORDINATOR_ENV] == "elsewhere:1"
    assert config("--coordinator.address=a:1").resolved(environ).coordinator.address == "a:1"


# -- rows ----------------------------------------------------------------------------------------------


def test_toy_rows_are_the_tasks_prompts_by_iteration():
    task = make_task("reverse", 4)
    rows = ToyRows(task, seed=7)
    expected = task.sample(random.Random("7/3"), 4)
    assert rows.train_rows(3, 4) == [{"prompt": e.prompt, "target": e.target} for e in expected]
    assert rows.eval_rows(2) == rows.eval_rows(2) and rows.eval_rows(2) != rows.train_rows(1, 2)
    assert rows.position(5)["next_iteration"] == 6


def test_generated_rows_are_instance_numbers_fixed_per_iteration():
    rows = GeneratedRows(seed=1)
    a, b = rows.train_rows(1, 3), rows.train_rows(2, 3)
    assert a == GeneratedRows(seed=1).train_rows(1, 3) and a != b and all(set(r) == {"instance"} for r in a + b)
    assert len({r["instance"] for r in a}) == 3 and GeneratedRows(seed=2).train_rows(1, 3) != a


def test_dataset_rows_resume_without_repeating_or_skipping():
    data = [{"prompt": f"p{i}"} for i in range(10)]
    full = DatasetRows(data, [], seed=3, per_iteration=4)
    seen = [r["prompt"] for i in range(1, 6) for r in full.train_rows(i, 4)]
    # 20 rows = two epochs: each epoch visits every row once, in its own order.
    assert sorted(seen[:10]) == sorted(seen[10:]) == sorted(r["prompt"] for r in data) and seen[:10] != seen[10:]
    position = full.position(2)
    assert (position["next_row"], position["epoch"], position["rows_per_epoch"]) == (8, 0, 10)
    # A run resumed after iteration 2 (a checkpoint with that position) continues at row 8 ...
    resumed = DatasetRows(data, [], seed=3, per_iteration=4)
    resumed.resume(2, position)
    assert [r["prompt"] for i in (3, 4, 5) for r in resumed.train_rows(i, 4)] == seen[8:]
    # ... even with another prompts_per_iteration (positions, not iteration numbers, are saved).
    wider = DatasetRows(data, [], seed=3, per_iteration=6)
    wider.resume(2, position)
    assert [r["prompt"] for r in wider.train_rows(3, 6) + wider.train_rows(4, 6)] == seen[8:20]


def test_a_dataset_run_reads_checks_and_splits_its_rows(tmp_path):
    path = write_jsonl(tmp_path / "train.jsonl", [{"prompt": f"q{i}", "answer": i} for i in range(20)])
    reward = load_reward_file(tmp_path, "def score(prompt, completion, answer):\n    return float(completion == str(answer))\n")
    cfg = config("--task.kind=dataset", f"--task.path={path}", "--task.eval_fraction=0.25", "--trainer.warmup_steps=0",
                 f"--algorithm.rewards={reward.name}", "--run.eval_interval=5")
    rows = row_source(cfg, reward)
    assert isinstance(rows, DatasetRows) and len(rows.stream) == 15 and len(rows.held_out) == 5
    assert {r["prompt"] for r in rows.eval_rows(32)}.isdisjoint({r["prompt"] for r in rows.train_rows(1, 15)})
    env, final = episode_env(cfg, reward)
    assert env.name == "prompt" and final is None
    e = env.make()
    e.reset(options={"prompt": "q3", "answer": 3})
    assert e.step("3")[1] == 1.0 and e.step("4")[1] == 0.0
    assert max_new_tokens(cfg, None) == 256 and max_new_tokens(config("--rollout.max_new_tokens=9"), None) == 9


def load_reward_file(tmp_path, source: str) -> RewardFunction:
    (tmp_path / "my_reward.py").write_text(source)
    return combine_rewards([f"{tmp_path}/my_reward.py:score"])


def test_a_bad_dataset_row_stops_the_run_naming_file_row_and_key(tmp_path):
    path = write_jsonl(tmp_path / "train.jsonl", [{"prompt": "a"}, {"prompt": "b"}, {"question": "c"}])
    cfg = config("--task.kind=dataset", f"--task.path={path}", "--trainer.warmup_steps=0", "--algorithm.rewards=exact_match")
    with pytest.raises(ConfigError, match=r"train.jsonl.*row 2 \(0-based\).*'prompt'"):
        row_source(cfg, reward_function(["exact_match"], None))


def test_a_reward_needing_a_column_the_dataset_lacks_is_refused_at_start(tmp_path):
    path = write_jsonl(tmp_path / "train.jsonl", [{"prompt": "a", "solution": "x"}])
    reward = load_reward_file(tmp_path, "def score(prompt, completion, answer):\n    return 0.0\n")
    cfg = config("--task.kind=dataset", f"--task.path={path}", "--trainer.warmup_steps=0")
    with pytest.raises(ConfigError, match="takes 'answer', but the rows of .*train.jsonl have no such field .*solution"):
        load_dataset_rows(cfg, reward)


def test_a_reward_column_missing_from_the_held_out_file_is_refused_at_start_not_at_the_first_evaluation(tmp_path):
    train = write_jsonl(tmp_path / "train.jsonl", [{"prompt": "ab=", "answer": "ba"}])
    held = write_jsonl(tmp_path / "eval.jsonl", [{"prompt": "ab=", "word": "ab"}])
    reward = load_reward_file(tmp_path, "def score(prompt, completion, answer):\n    return 0.0\n")
    cfg = config("--task.kind=dataset", f"--task.path={train}", f"--task.eval_path={held}", "--trainer.warmup_steps=0")
    with pytest.raises(ConfigError, match=r"takes 'answer', but the rows of .*eval.jsonl have no such field \(they have: word\)"):
        load_dataset_rows(cfg, reward)
    write_jsonl(held, [{"prompt": "ab=", "answer": "ba"}])
    assert load_dataset_rows(cfg, reward).eval_rows(1) == [{"prompt": "ab=", "answer": "ba"}]
    # A column the first row lacks but others have is a column (the reward gets None for that row).
    write_jsonl(train, [{"prompt": "ab="}, {"prompt": "cd=", "answer": "dc"}])
    assert load_dataset_rows(cfg, reward).train_rows(1, 2)[0]["answer"] in (None, "dc")


def test_a_reward_column_that_generated_or_toy_rows_never_have_is_refused_at_start():
    reward = RewardFunction("needs_answer", lambda prompt, completion, answer: 0.0)
    generated = config("--task.kind=generated", "--env.name=guess", "--trainer.warmup_steps=0")
    with pytest.raises(ConfigError, match=r"takes 'answer', but the rows of task.kind = generated .* \(they have: instance\)"):
        row_source(generated, reward)
    two = RewardFunction("two", lambda prompt, completion, answer, unit: 0.0)  # not the 3-argument form
    with pytest.raises(ConfigError, match=r"takes 'answer', 'unit', but the rows of task.kind = toy have no such field \(they have: target\)"):
        row_source(config(), two)
    assert isinstance(row_source(config(), reward), ToyRows)  # fn(prompt, completion, x): x is the target
    instance = RewardFunction("instance", lambda prompt, completion, instance: 0.0)
    assert isinstance(row_source(generated, instance), GeneratedRows)
    assert isinstance(row_source(config(), reward_function([], None, make_task("reverse", 3))), ToyRows)


def test_a_prompt_the_tiny_policy_cannot_tokenize_is_refused_at_start_naming_the_row(tmp_path):
    # Found by a user's run: it failed every episode after start-up, reported as an env error.
    path = write_jsonl(tmp_path / "train.jsonl", [{"prompt": "ab=", "answer": "ba"}, {"prompt": "What is 2+2?", "answer": "4"}])
    exact = reward_function(["exact_match"], None)
    tiny = config("--task.kind=dataset", f"--task.path={path}", "--trainer.warmup_steps=0", "--task.prompt_key=prompt")
    with pytest.raises(ConfigError, match=r"task.path=.*train.jsonl: row 1 \(0-based\): key 'prompt' = 'What is 2\+2\?' has the "
                                          r"character 'W', which the tiny policy cannot tokenize .*model.kind = hf"):
        load_dataset_rows(tiny, exact)
    # An env's rows are options for its reset, not prompts: any text.
    with_env = config("--task.kind=dataset", f"--task.path={path}", "--env.name=guess", "--trainer.warmup_steps=0")
    assert isinstance(load_dataset_rows(with_env, None), DatasetRows)


def test_a_single_turn_dataset_run_needs_a_reward_and_an_env_run_may_add_a_final_one():
    cfg = config("--task.kind=dataset", "--task.path=x.jsonl", "--trainer.warmup_steps=0")
    with pytest.raises(ConfigError, match="algorithm.rewards: a single-turn run on a dataset"):
        episode_env(cfg, None)
    env_cfg = config("--task.kind=generated", "--env.name=guess", "--trainer.warmup_steps=0")
    spec, final = episode_env(env_cfg, None)
    assert spec.name == "guess" and final is None
    bonus = reward_function(["format"], None)
    assert episode_env(env_cfg, bonus)[1] is bonus
    with pytest.raises(ConfigError, match="env.name: env 'nope' is not registered"):
        episode_env(config("--env.name=nope", "--trainer.warmup_steps=0"), None)


def test_row_labels():
    assert row_label({"prompt": "2+2=", "answer": 4}) == "2+2=" and row_label({"question": "who?"}) == "who?"
    assert row_label({"instance": 3}) == '{"instance": 3}'


# -- rewards with row fields ------------------------------------------------------------------------


def test_rewards_take_the_row_fields_they_name_or_all_of_them():
    named = RewardFunction("n", lambda prompt, completion, answer, unit="": float(completion == f"{answer}{unit}"))
    assert named.score("p", "4kg", {"prompt": "p", "answer": 4, "unit": "kg", "other": 1}) == 1.0
    assert named.required == ("answer",) and named.named == ("answer", "unit")
    seen = {}

    def everything(prompt, completion, **row):
        seen.update(row)
        return 0.5

    assert RewardFunction("all", everything).score("p", "c", {"prompt": "p", "answer": 4, "id": "x"}) == 0.5
    assert seen == {"answer": 4, "id": "x"}  # the prompt is the first argument, not a keyword
    with pytest.raises(RewardError, match="takes 'answer' but the task's row has no such field"):
        named.score("p", "c", {"prompt": "p"})


def test_the_three_argument_form_keeps_working_whatever_its_third_name():
    legacy = RewardFunction("legacy", lambda p, c, t: float(c == t))
    assert legacy.score("p", "x", {"prompt": "p", "target": "x"}) == 1.0
    assert legacy("p", "x", "x") == 1.0
    exact = load_reward("exact_match")
    assert exact.score("p", " 12 ", {"target": "12"}) == 1.0
    exact.check_fields(["prompt", "target"], "data.jsonl")
    with pytest.raises(RewardError, match="takes 'target', but the rows of data.jsonl have no such field"):
        exact.check_fields(["prompt", "answer"], "data.jsonl")
    combined = combine_rewards(["exact_match", "format"], [1.0, 0.5])
    assert combined.score("p", "12", {"target": "12"}) == 1.5 and combined.required == ("target",)


def test_an_incomplete_hf_model_directory_is_refused_at_start_naming_all_it_lacks(tmp_path, caplog):
    # Found by a user: a directory without a tokenizer or weights failed in the worker after torchrun
    # had started, four times over (a FileNotFoundError is retried), without naming model.path.
    from elasticrl.rl.workload import check_model

    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "llama", "max_position_embeddings": 64}))

    def check(*overrides):
        check_model(config("--model.kind=hf", f"--model.path={model}", *overrides))

    with pytest.raises(ConfigError, match=r"model.path: .* is not a directory"):
        check_model(config("--model.kind=hf", f"--model.path={tmp_path / 'missing'}"))
    with pytest.raises(ConfigError, match=r"model.path: .*: no weights \(\*.safetensors\); no tokenizer \(none of"):
        check()
    (model / "pytorch_model.bin").write_bytes(b"")
    (model / "tokenizer.json").write_text("{}")
    with pytest.raises(ConfigError, match=r"only pickle weights") as refused:
        check()
    assert "tokenizer" not in str(refused.value).split("Pass a directory")[0]
    (model / "model.safetensors").write_bytes(b"")
    check()  # complete
    with pytest.raises(ConfigError, match=r"task.chat_template = true: the tokenizer in model.path = .* has no chat template"):
        check("--task.chat_template=true")
    (model / "chat_template.jinja").write_text("{{ messages }}")  # where transformers 5 saves it
    check("--task.chat_template=true")
    with caplog.at_level("WARNING"):
        check("--rollout.max_new_tokens=200")
    assert "rollout.max_new_tokens = 200, and the model in" in caplog.text and "has 64 positions" in caplog.text
