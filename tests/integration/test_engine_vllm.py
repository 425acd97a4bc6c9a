"""The ``vllm`` rollout engine on a tiny random Llama: same contract as the hf engine (GPU only)."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm", reason="the vllm engine needs the vllm package (Linux + CUDA)")
if not torch.cuda.is_available():
    pytest.skip("the vllm engine needs a CUDA GPU; none is visible", allow_module_level=True)

from safetensors.torch import load_file  # noqa: E402

from elasticrl.rollout import (  # noqa: E402
    EngineStateError,
    GroupRequest,
    RolloutEngine,
    SamplingSpec,
    WeightUpdateError,
    make_engine,
)
from elasticrl.rollout.tiny_llama import write_tiny_llama  # noqa: E402

VOCAB = 128
HIDDEN = 256
EOS = 2

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    # Head size 64: vLLM's attention kernels do not take the CPU tests' head size of 8.
    return write_tiny_llama(
        tmp_path_factory.mktemp("tiny-llama-vllm"), vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=512,
        num_attention_heads=4, num_key_value_heads=2, initializer_range=0.05, seed=0,
    )


@pytest.fixture(scope="module")
def engine(model_dir):
    eng = make_engine(
        "vllm", model_dir=model_dir, gpu_memory_utilization=0.25, dtype="float16", max_model_len=128,
        enforce_eager=True, seed=0,
    )
    yield eng
    eng.close()


@pytest.fixture
def fresh_weights(engine, model_dir):
    """Put the checkpoint's weights back (and wake the engine) after a test that changes them."""
    yield
    engine.update_weights(load_file(model_dir / "model.safetensors").items(), version=0)


def requests(n=4, max_new_tokens=12, **spec):
    prompts = {"short": [1, 12], "mid": [1, 12, 9, 16, 16, 19], "long": [1, 5, 6, 7, 8, 9, 10, 11, 20, 21, 22]}
    return [
        GroupRequest(task_id=task, prompt_ids=ids, sampling=SamplingSpec(n=n, max_new_tokens=max_new_tokens, **spec))
        for task, ids in prompts.items()
    ]


def ids_of(groups):
    return [[s.completion_ids for s in g.samples] for g in groups]


def checksum(engine) -> float:
    return sum(engine.llm.collective_rpc("elasticrl_weight_checksum"))


def test_groups_have_the_requested_shape(engine):
    assert isinstance(engine, RolloutEngine)
    reqs = requests(n=4, max_new_tokens=12)
    groups = engine.generate(reqs)
    assert [g.task_id for g in groups] == [r.task_id for r in reqs]
    for req, group in zip(reqs, groups):
        assert group.prompt_ids == req.prompt_ids and group.policy_version == 0 and len(group.samples) == 4
        for s in group.samples:
            assert 1 <= len(s.completion_ids) <= 12 and len(s.logprobs) == len(s.completion_ids)
            assert all(lp <= 1e-6 and math.isfinite(lp) for lp in s.logprobs)
            if s.finish_reason == "stop":
                assert s.completion_ids[-1] == EOS
            else:
                assert len(s.completion_ids) == 12


def test_stop_tokens_end_samples(engine):
    stop = tuple(range(10, 70))
    for s in (s for g in engine.generate(requests(n=4, max_new_tokens=60, stop_token_ids=stop, seed=1)) for s in g.samples):
        assert s.finish_reason == "stop" and s.completion_ids[-1] in stop + (EOS,)
    for s in (s for g in engine.generate(requests(n=2, max_new_tokens=7, ignore_eos=True)) for s in g.samples):
        assert s.finish_reason == "length" and len(s.completion_ids) == 7


def test_same_seed_same_samples(engine):
    a, b, c = (engine.generate(requests(seed=s)) for s in (3, 3, 4))
    assert ids_of(a) == ids_of(b) != ids_of(c)
    assert len({tuple(x) for x in ids_of(a)[2]}) > 1  # the n samples are distinct draws


def test_logprobs_match_a_teacher_forced_forward_pass(engine, model_dir):
    from transformers import AutoModelForCausalLM

    ref_model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True).eval()
    diffs = []
    for group in engine.generate(requests(n=4, max_new_tokens=16, seed=11)):
        for s in group.samples:
            ids = torch.tensor([group.prompt_ids + s.completion_ids])
            with torch.no_grad():
                logits = ref_model(input_ids=ids).logits[0, len(group.prompt_ids) - 1: -1].float()
            ref = torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(s.completion_ids)[:, None]).squeeze(1)
            diffs.append((ref - torch.tensor(s.logprobs)).abs())
    diffs = torch.cat(diffs)
    # float16 engine vs float32 reference: close, not equal.
    assert float(diffs.mean()) < 0.02 and float(diffs.max()) < 0.2, (float(diffs.mean()), float(diffs.max()))


def test_sleep_wake_round_trip(engine):
    before = engine.generate(requests(seed=8))
    engine.sleep()
    assert engine.is_sleeping
    with pytest.raises(EngineStateError, match="asleep"):
        engine.generate(requests())
    engine.wake()
    assert not engine.is_sleeping
    assert ids_of(engine.generate(requests(seed=8))) == ids_of(before)


def test_update_weights_in_place_after_sleep(engine, fresh_weights):
    original = checksum(engine)
    engine.sleep()
    engine.update_weights([("model.norm.weight", torch.zeros(HIDDEN))], version=3)  # wakes the engine
    assert not engine.is_sleeping and engine.policy_version == 3
    assert checksum(engine) != pytest.approx(original)
    groups = engine.generate(requests(seed=2))
    assert all(g.policy_version == 3 for g in groups)
    # Zero final norm: every logit is 0, every token has logprob log(1/V).
    for s in (s for g in groups for s in g.samples):
        assert s.logprobs == pytest.approx([-math.log(VOCAB)] * len(s.logprobs), abs=1e-3)


def test_update_weights_rejects_an_unknown_name(engine, fresh_weights):
    with pytest.raises(WeightUpdateError, match="model.layers.0.nope.weight"):
        engine.update_weights([("model.layers.0.nope.weight", torch.zeros(3))], version=9)
    assert engine.policy_version == 0
