"""The rollout-engine contract without a model: registry errors and request/result validation."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

from elasticrl.errors import ElasticRLError
from elasticrl.rollout import (
    Group,
    GroupRequest,
    RolloutEngine,
    Sample,
    SamplingSpec,
    UnknownEngineError,
    engine_names,
    make_engine,
    register_engine,
)
from elasticrl.rollout import engine as engine_module


def test_unknown_engine_lists_the_valid_ones():
    with pytest.raises(UnknownEngineError, match=r"'sglang'.*valid engines: hf, tiny, vllm") as info:
        make_engine("sglang")
    assert isinstance(info.value, ValueError) and isinstance(info.value, ElasticRLError)
    assert engine_names() == ["hf", "tiny", "vllm"]


class FakeEngine:
    """The smallest thing that satisfies the protocol: echoes the prompt's last token."""

    def __init__(self, *, version: int = 0):
        self._version, self._sleeping = version, False

    @property
    def policy_version(self):
        return self._version

    @property
    def is_sleeping(self):
        return self._sleeping

    @property
    def tokenizer(self):
        return None

    def generate(self, requests):
        return [
            Group(
                task_id=r.task_id, prompt_ids=r.prompt_ids, policy_version=self._version, gen_seconds=0.0,
                samples=[Sample(completion_ids=r.prompt_ids[-1:], logprobs=[0.0], finish_reason="stop")] * r.sampling.n,
            )
            for r in requests
        ]

    def update_weights(self, named_tensors, *, version):
        self._version = version

    def sleep(self):
        self._sleeping = True

    def wake(self):
        self._sleeping = False

    def close(self):
        pass


def test_register_a_fake_engine(monkeypatch):
    monkeypatch.setattr(engine_module, "_REGISTRY", dict(engine_module._REGISTRY))
    register_engine("fake", FakeEngine)
    assert "fake" in engine_names()
    eng = make_engine("fake", version=3)
    assert isinstance(eng, RolloutEngine)
    (group,) = eng.generate([GroupRequest(task_id="t", prompt_ids=[5, 6], sampling=SamplingSpec(n=2))])
    assert group.policy_version == 3 and [s.completion_ids for s in group.samples] == [[6], [6]]
    with pytest.raises(ValueError, match="already registered"):
        register_engine("hf", FakeEngine)
    register_engine("hf", FakeEngine, replace=True)
    assert isinstance(make_engine("hf"), FakeEngine)


def test_the_vllm_factory_says_what_is_missing():
    torch = pytest.importorskip("torch")
    if importlib.util.find_spec("vllm") is not None and torch.cuda.is_available():
        pytest.skip("vllm and a GPU are present; tests/integration/test_engine_vllm.py covers this engine")
    from elasticrl.rollout import EngineUnavailableError

    with pytest.raises(EngineUnavailableError, match="vllm|GPU"):
        make_engine("vllm", model_dir="/nonexistent")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"n": 0}, "n: 0 must be an int >= 1"),
        ({"temperature": -0.5}, "temperature: -0.5 must be >= 0"),
        ({"top_p": 0.0}, r"top_p: 0.0 must be in \(0, 1\]"),
        ({"top_p": 1.5}, r"top_p: 1.5 must be in \(0, 1\]"),
        ({"top_k": -1}, "top_k: -1 must be an int >= 0; use 0 to disable"),
        ({"max_new_tokens": 0}, "max_new_tokens: 0 must be an int >= 1"),
        ({"seed": -3}, "seed: -3 must be None or an int >= 0"),
        ({"stop_token_ids": (2, -1, "x")}, r"stop_token_ids: \[-1, 'x'\] are not token ids"),
    ],
)
def test_sampling_spec_validation_quotes_the_bad_value(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingSpec(**kwargs)


def test_sampling_spec_defaults_and_normalisation():
    spec = SamplingSpec(n=8, stop_token_ids=[7, 9])
    assert spec.stop_token_ids == (7, 9)
    assert (spec.temperature, spec.top_p, spec.top_k, spec.seed, spec.ignore_eos) == (1.0, 1.0, 0, None, False)
    hash(spec)  # frozen: usable as a dict key


def test_group_request_validation():
    with pytest.raises(ValueError, match="task_id"):
        GroupRequest(task_id="", prompt_ids=[1])
    with pytest.raises(ValueError, match="prompt_ids of task 't' is empty"):
        GroupRequest(task_id="t", prompt_ids=[])
    with pytest.raises(ValueError, match=r"\[-1, 1.5\] are not token ids"):
        GroupRequest(task_id="t", prompt_ids=[1, -1, 1.5])
    with pytest.raises(ValueError, match="must be a SamplingSpec"):
        GroupRequest(task_id="t", prompt_ids=[1], sampling={"n": 2})
    req = GroupRequest(task_id="t", prompt_ids=(1, 2))
    assert req.prompt_ids == [1, 2] and req.sampling == SamplingSpec()


def test_sample_and_group_validation():
    with pytest.raises(ValueError, match="2 completion ids but 1 logprobs"):
        Sample(completion_ids=[1, 2], logprobs=[-0.1], finish_reason="stop")
    with pytest.raises(ValueError, match="finish_reason: 'abort'"):
        Sample(completion_ids=[1], logprobs=[-0.1], finish_reason="abort")
    with pytest.raises(ValueError, match="no samples"):
        Group(task_id="t", prompt_ids=[1], samples=[], policy_version=0, gen_seconds=0.0)


def test_importing_the_package_loads_no_backend():
    code = "import sys, elasticrl.rollout; print(sorted(m for m in ('torch', 'transformers', 'vllm') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]"
