"""The ``hf`` rollout engine on a tiny random Llama written to a temp dir (no downloads, CPU)."""

from __future__ import annotations

import json
import math
import shutil

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from elasticrl.rollout import (  # noqa: E402
    EngineStateError,
    GroupRequest,
    RolloutEngine,
    SamplingSpec,
    WeightUpdateError,
    make_engine,
)
from elasticrl.rollout.hf import HFEngine, filter_top_k_top_p  # noqa: E402
from elasticrl.rollout.tiny_llama import write_tiny_llama  # noqa: E402

pytestmark = pytest.mark.integration

VOCAB = 64
EOS = 2


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), vocab_size=VOCAB, seed=0)


@pytest.fixture(scope="module")
def engine(model_dir):
    with HFEngine(model_dir, seed=7) as eng:
        yield eng


def requests(n=4, max_new_tokens=12, **spec):
    # Prompts of different lengths, so the batch is left-padded.
    prompts = {"short": [1, 12], "mid": [1, 12, 9, 16, 16, 19], "long": [1, 5, 6, 7, 8, 9, 10, 11, 20, 21, 22]}
    return [
        GroupRequest(task_id=task, prompt_ids=ids, sampling=SamplingSpec(n=n, max_new_tokens=max_new_tokens, **spec))
        for task, ids in prompts.items()
    ]


def teacher_forced(model, prompt, completion, temperature=1.0):
    """[len(completion), V] log-softmax of the logits that predict each completion token."""
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float()  # [T, V]
    return torch.log_softmax(logits[len(prompt) - 1: -1] / temperature, dim=-1)


def test_groups_have_the_requested_shape(engine):
    reqs = requests(n=4, max_new_tokens=12)
    groups = engine.generate(reqs)
    assert [g.task_id for g in groups] == [r.task_id for r in reqs]
    for req, group in zip(reqs, groups):
        assert group.prompt_ids == req.prompt_ids
        assert group.policy_version == engine.policy_version == 0
        assert group.gen_seconds > 0
        assert len(group.samples) == 4
        for s in group.samples:
            assert 1 <= len(s.completion_ids) <= 12
            assert len(s.logprobs) == len(s.completion_ids)
            assert all(0 <= t < VOCAB for t in s.completion_ids)
            assert all(lp <= 0 and math.isfinite(lp) for lp in s.logprobs)
            if s.finish_reason == "stop":
                assert s.completion_ids[-1] == EOS and EOS not in s.completion_ids[:-1]
            else:
                assert len(s.completion_ids) == 12 and EOS not in s.completion_ids
            assert isinstance(s.text, str)


def test_logprobs_match_a_teacher_forced_forward_pass(engine):
    # Temperature 1, no top-k/top-p: "processed" logprobs are the model's own, which is what a
    # trainer recomputes. Left padding + KV cache must not change them.
    groups = engine.generate(requests(n=4, max_new_tokens=16, seed=11))
    for group in groups:
        for s in group.samples:
            ref = teacher_forced(engine.model, group.prompt_ids, s.completion_ids)
            expected = ref.gather(1, torch.tensor(s.completion_ids)[:, None]).squeeze(1)
            torch.testing.assert_close(torch.tensor(s.logprobs), expected, atol=1e-4, rtol=0)


def test_processed_logprobs_follow_temperature_and_top_k(engine, model_dir):
    groups = engine.generate(requests(n=3, max_new_tokens=10, temperature=0.7, top_k=5, seed=5))
    with HFEngine(model_dir, logprobs_mode="raw") as raw_engine:
        raw_groups = raw_engine.generate(requests(n=3, max_new_tokens=10, temperature=0.7, top_k=5, seed=5))
    for group, raw_group in zip(groups, raw_groups):
        for s, raw in zip(group.samples, raw_group.samples):
            assert s.completion_ids == raw.completion_ids  # same seed, same draws; only the reporting differs
            ids = torch.tensor(s.completion_ids)[:, None]
            scaled = teacher_forced(engine.model, group.prompt_ids, s.completion_ids, temperature=0.7)
            top5 = scaled.topk(5, dim=-1).indices
            assert bool((top5 == ids).any(dim=1).all()), "a token outside the top 5 was sampled"
            kept = torch.full_like(scaled, float("-inf")).scatter(1, top5, scaled.gather(1, top5))
            expected = torch.log_softmax(kept, dim=-1).gather(1, ids).squeeze(1)
            torch.testing.assert_close(torch.tensor(s.logprobs), expected, atol=1e-4, rtol=0)
            unscaled = teacher_forced(engine.model, group.prompt_ids, s.completion_ids).gather(1, ids).squeeze(1)
            torch.testing.assert_close(torch.tensor(raw.logprobs), unscaled, atol=1e-4, rtol=0)


def test_top_p_keeps_the_smallest_nucleus():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.5, 0.3, 0.15, 0.05]]))
    out = filter_top_k_top_p(logits, torch.tensor([0, 0]), torch.tensor([0.8, 1.0]))
    assert torch.isinf(out[0]).tolist() == [False, False, True, True]  # 0.5 + 0.3 reaches 0.8
    assert not bool(torch.isinf(out[1]).any())


def test_same_seed_same_samples_and_seeds_differ(engine, model_dir):
    a = engine.generate(requests(n=4, seed=3))
    b = engine.generate(requests(n=4, seed=3))
    c = engine.generate(requests(n=4, seed=4))
    ids = lambda groups: [[s.completion_ids for s in g.samples] for g in groups]  # noqa: E731
    assert ids(a) == ids(b)
    assert ids(a) != ids(c)
    assert [[s.logprobs for s in g.samples] for g in a] == [[s.logprobs for s in g.samples] for g in b]
    # The n samples of a group are distinct draws, not copies.
    assert len({tuple(x) for x in ids(a)[2]}) > 1
    # Unseeded requests take seeds from the engine's generator: same engine seed, same run.
    with HFEngine(model_dir, seed=99) as e1, HFEngine(model_dir, seed=99) as e2:
        assert ids(e1.generate(requests())) == ids(e2.generate(requests()))


def test_greedy_samples_are_the_argmax_chain(engine):
    (group,) = engine.generate([GroupRequest(task_id="g", prompt_ids=[1, 12, 9], sampling=SamplingSpec(n=3, temperature=0, max_new_tokens=8, ignore_eos=True))])
    first = group.samples[0].completion_ids
    assert all(s.completion_ids == first for s in group.samples)
    ref = teacher_forced(engine.model, group.prompt_ids, first)
    assert ref.argmax(dim=-1).tolist() == first


def test_stop_tokens_eos_list_and_ignore_eos(engine, model_dir, tmp_path):
    stop = tuple(range(10, 40))  # about half the vocabulary: every sample stops within a few tokens
    groups = engine.generate(requests(n=4, max_new_tokens=60, stop_token_ids=stop, ignore_eos=True, seed=1))
    for s in (s for g in groups for s in g.samples):
        assert s.finish_reason == "stop" and s.completion_ids[-1] in stop
        assert not set(s.completion_ids[:-1]) & set(stop)
    # A generation_config with a list of EOS ids: every one of them ends a sample.
    many_eos = shutil.copytree(model_dir, tmp_path / "many-eos")
    gen_config = json.loads((many_eos / "generation_config.json").read_text())
    gen_config["eos_token_id"] = list(stop)
    (many_eos / "generation_config.json").write_text(json.dumps(gen_config))
    with HFEngine(many_eos) as eng:
        assert eng.eos_token_ids == stop
        for s in (s for g in eng.generate(requests(n=4, max_new_tokens=60)) for s in g.samples):
            assert s.finish_reason == "stop" and s.completion_ids[-1] in stop
        for s in (s for g in eng.generate(requests(n=2, max_new_tokens=7, ignore_eos=True)) for s in g.samples):
            assert s.finish_reason == "length" and len(s.completion_ids) == 7


def test_update_weights_changes_outputs_and_bumps_version(model_dir):
    with HFEngine(model_dir) as eng:
        before = eng.generate(requests(seed=2))
        # Zero the final norm: hidden state 0, all logits 0, every token exactly log(1/V).
        eng.update_weights([("model.norm.weight", torch.zeros(32))], version=5)
        assert eng.policy_version == 5
        after = eng.generate(requests(seed=2))
        assert all(g.policy_version == 5 for g in after)
        assert [s.completion_ids for g in before for s in g.samples] != [s.completion_ids for g in after for s in g.samples]
        for s in (s for g in after for s in g.samples):
            assert s.logprobs == pytest.approx([-math.log(VOCAB)] * len(s.logprobs), abs=1e-5)
        # A full state dict (tied/other names included) round-trips.
        state = {k: v.clone() for k, v in eng.model.state_dict().items()}
        state["lm_head.weight"] += 1.0
        eng.update_weights(state.items(), version=6)
        assert torch.equal(eng.model.lm_head.weight, state["lm_head.weight"])


def test_update_weights_rejects_bad_names_and_shapes(model_dir):
    with HFEngine(model_dir) as eng:
        with pytest.raises(WeightUpdateError, match="model.layers.0.nope.weight"):
            eng.update_weights([("model.layers.0.nope.weight", torch.zeros(3))], version=1)
        with pytest.raises(WeightUpdateError, match=r"model.norm.weight.*\(31,\).*\(32,\)"):
            eng.update_weights([("model.norm.weight", torch.zeros(31))], version=1)
        with pytest.raises(ValueError, match="version"):
            eng.update_weights([], version=-1)
        assert eng.policy_version == 0


def test_sleep_wake_round_trip(model_dir):
    with HFEngine(model_dir) as eng:
        before = eng.generate(requests(seed=8))
        eng.sleep()
        assert eng.is_sleeping
        with pytest.raises(EngineStateError, match="asleep"):
            eng.generate(requests())
        eng.wake()
        assert not eng.is_sleeping
        after = eng.generate(requests(seed=8))
        assert [s.completion_ids for g in before for s in g.samples] == [s.completion_ids for g in after for s in g.samples]
        eng.sleep()
        eng.update_weights([("model.norm.weight", torch.ones(32))], version=1)  # wakes the engine
        assert not eng.is_sleeping and eng.policy_version == 1
    with pytest.raises(EngineStateError, match="closed"):
        eng.generate(requests())
    eng.close()  # idempotent


def test_prompt_errors(engine):
    with pytest.raises(ValueError, match="context"):
        engine.generate([GroupRequest(task_id="t", prompt_ids=[1] * 128)])
    with pytest.raises(ValueError, match="vocab size"):
        engine.generate([GroupRequest(task_id="t", prompt_ids=[1, VOCAB])])


def test_generation_stops_at_the_context_limit(engine):
    (group,) = engine.generate([GroupRequest(task_id="t", prompt_ids=[1] * 120, sampling=SamplingSpec(n=2, max_new_tokens=50, ignore_eos=True))])
    assert all(len(s.completion_ids) == 8 and s.finish_reason == "length" for s in group.samples)


def test_batches_split_between_groups(model_dir):
    with HFEngine(model_dir, max_batch_rows=5) as eng:
        groups = eng.generate(requests(n=4, seed=6))
    with HFEngine(model_dir) as eng:
        whole = eng.generate(requests(n=4, seed=6))
    assert [len(g.samples) for g in groups] == [4, 4, 4]
    # Each group has its own generator, so batching does not change which tokens are drawn.
    assert [s.completion_ids for g in groups for s in g.samples] == [s.completion_ids for g in whole for s in g.samples]


def test_registry_builds_it_without_a_tokenizer(model_dir, tmp_path):
    bare = shutil.copytree(model_dir, tmp_path / "bare")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (bare / name).unlink()
    eng = make_engine("hf", model_dir=bare)
    try:
        assert isinstance(eng, RolloutEngine) and eng.tokenizer is None
        (group,) = eng.generate([GroupRequest(task_id="t", prompt_ids=[1, 2, 3])])
        assert group.samples[0].text is None
    finally:
        eng.close()
    with pytest.raises(FileNotFoundError, match="config.json"):
        make_engine("hf", model_dir=tmp_path / "missing")


def test_each_decoding_step_reports_progress(engine):
    from elasticrl.rollout.engine import reporting_progress

    steps = []
    with reporting_progress(lambda: steps.append(1)):
        engine.generate(requests(n=2, max_new_tokens=6, ignore_eos=True))
    assert len(steps) == 5  # each step but the last
