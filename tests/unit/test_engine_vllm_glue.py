"""``VLLMEngine``'s use of the vLLM API, against a fake ``vllm`` module (runs anywhere, no GPU).

The fake stands at the seam (``vllm.LLM`` / ``vllm.SamplingParams``) and records what the engine
asks of it, so these tests pin down the call sequence the real-GPU test
(``tests/integration/test_engine_vllm.py``) exercises end to end: which ``LLM`` arguments, which
``SamplingParams``, how results are read, and the sleep -> wake(weights) -> collective_rpc ->
wake(kv_cache) order of a weight update.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import types

import pytest

torch = pytest.importorskip("torch")

from elasticrl.rollout import (  # noqa: E402
    EngineStateError,
    GroupRequest,
    RolloutEngine,
    SamplingSpec,
    WeightUpdateError,
    make_engine,
)
from elasticrl.rollout.vllm_engine import _spread_seed  # noqa: E402
from elasticrl.rollout.vllm_worker import WORKER_EXTENSION, WeightLoaderExtension, from_wire, to_wire  # noqa: E402

MSGPACK_NATIVE = (str, int, float, bool, bytes, type(None))


def assert_msgpack_native(value, where="args"):
    """What survives vLLM's untyped msgpack decoding unchanged: no tensors, no arbitrary objects."""
    if isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            assert_msgpack_native(v, f"{where}[{i}]")
    elif isinstance(value, dict):
        for k, v in value.items():
            assert_msgpack_native(k, f"{where} key")
            assert_msgpack_native(v, f"{where}[{k!r}]")
    else:
        assert isinstance(value, MSGPACK_NATIVE), f"{where} is a {type(value).__name__}, which vLLM's RPC does not carry"


@dataclasses.dataclass
class Logprob:
    logprob: float


@dataclasses.dataclass
class CompletionOutput:
    index: int
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]]
    finish_reason: str
    text: str = ""


@dataclasses.dataclass
class RequestOutput:
    outputs: list[CompletionOutput]


class SamplingParams:
    def __init__(self, **kwargs):
        self.__dict__.update(kwargs)


class FakeModel:
    """Stands for vLLM's model: ``load_weights`` copies into a dict of named tensors."""

    def __init__(self):
        self.params = {"model.norm.weight": torch.ones(4), "lm_head.weight": torch.ones(8, 4)}

    def load_weights(self, weights):
        for name, tensor in weights:
            if name not in self.params:
                raise ValueError(f"There is no module or parameter named {name!r}")
            assert self.params[name].shape == tensor.shape, "shape mismatch"
            self.params[name].copy_(tensor)
        return {name for name, _ in weights}

    def named_parameters(self):
        return iter(self.params.items())


class FakeWorker(WeightLoaderExtension):
    def __init__(self):
        self.model_runner = types.SimpleNamespace(model=FakeModel())
        self.device = torch.device("cpu")


class FakeLLM:
    """Records calls; ``wake_up`` takes ``tags`` unless the class says otherwise (old vLLM)."""

    def __init__(self, **kwargs):
        self.kwargs = kwargs
        self.calls: list[tuple] = []
        self.worker = FakeWorker()

    def generate(self, prompts, sampling_params, use_tqdm=True):
        self.calls.append(("generate", len(prompts)))
        self.last_params = sampling_params
        outs = []
        for prompt, params in zip(prompts, sampling_params):
            last = prompt["prompt_token_ids"][-1]
            completions = []
            for i in range(params.n):
                ids = [last + i, 2] if i % 2 == 0 else [last + i] * params.max_tokens
                completions.append(CompletionOutput(
                    index=i, token_ids=ids, logprobs=[{t: Logprob(-0.25)} for t in ids],
                    finish_reason="stop" if i % 2 == 0 else "length", text="x",
                ))
            outs.append(RequestOutput(outputs=completions[::-1]))  # engine must sort by index
        return outs

    def sleep(self, level=1):
        self.calls.append(("sleep", level))

    def wake_up(self, tags=None):
        self.calls.append(("wake_up", tags))

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        assert_msgpack_native(args)
        assert_msgpack_native(kwargs or {}, "kwargs")
        if method == "elasticrl_load_weights":
            self.calls.append(("collective_rpc", method, [record[0] for record in args[0]]))
        else:
            self.calls.append(("collective_rpc", method))
        return [getattr(self.worker, method)(*args, **(kwargs or {}))]

    reset_result = True

    def reset_prefix_cache(self):
        self.calls.append(("reset_prefix_cache",))
        return self.reset_result

    def get_tokenizer(self):
        return "tokenizer"


class OldFakeLLM(FakeLLM):
    def wake_up(self):  # vLLM before tags=
        self.calls.append(("wake_up", None))


@pytest.fixture
def fake_vllm(monkeypatch, tmp_path):
    module = types.ModuleType("vllm")
    module.LLM = FakeLLM
    module.SamplingParams = SamplingParams
    monkeypatch.setitem(sys.modules, "vllm", module)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    (tmp_path / "config.json").write_text('{"eos_token_id": 2, "tie_word_embeddings": false}')
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": [2, 5]}')
    (tmp_path / "tokenizer.json").write_text("{}")
    return module, tmp_path


def test_llm_is_built_for_rl(fake_vllm):
    _, model_dir = fake_vllm
    eng = make_engine("vllm", model_dir=model_dir, gpu_memory_utilization=0.3, tensor_parallel_size=2, llm_kwargs={"enforce_eager": True})
    assert isinstance(eng, RolloutEngine)
    kw = eng.llm.kwargs
    assert kw["model"] == str(model_dir) and kw["tensor_parallel_size"] == 2 and kw["gpu_memory_utilization"] == 0.3
    assert kw["enable_sleep_mode"] is True and kw["worker_extension_cls"] == WORKER_EXTENSION
    assert kw["logprobs_mode"] == "processed_logprobs" and kw["skip_tokenizer_init"] is False
    assert kw["enforce_eager"] is True  # llm_kwargs override
    assert kw["enable_prefix_caching"] is True  # episodes resend their growing context every turn
    assert eng.eos_token_ids == (2, 5) and eng.tokenizer == "tokenizer"
    assert eng.max_context is None  # this fake exposes no model config
    eng.llm.llm_engine = types.SimpleNamespace(model_config=types.SimpleNamespace(max_model_len=4096))
    assert eng.max_context == 4096


def test_generate_maps_sampling_specs_and_reads_outputs(fake_vllm):
    _, model_dir = fake_vllm
    eng = make_engine("vllm", model_dir=model_dir)
    spec = SamplingSpec(n=3, temperature=0.9, top_p=0.95, max_new_tokens=4, seed=7, stop_token_ids=(9,))
    groups = eng.generate([GroupRequest(task_id="a", prompt_ids=[1, 10], sampling=spec),
                           GroupRequest(task_id="b", prompt_ids=[1, 20], sampling=SamplingSpec(ignore_eos=True, top_k=5))])
    p, q = eng.llm.last_params
    assert (p.n, p.temperature, p.top_p, p.top_k, p.max_tokens, p.logprobs) == (3, 0.9, 0.95, -1, 4, 0)
    # hashed: vLLM draws sample i with seed + i, and tasks carry consecutive seeds
    assert p.seed == _spread_seed(7) and abs(_spread_seed(8) - _spread_seed(7)) > 1000 and q.seed is None
    assert p.stop_token_ids == [2, 5, 9] and p.ignore_eos is False and p.detokenize is True
    assert q.stop_token_ids == [] and q.ignore_eos is True and q.top_k == 5
    a, b = groups
    assert a.task_id == "a" and [s.completion_ids for s in a.samples] == [[10, 2], [11] * 4, [12, 2]]
    assert [s.finish_reason for s in a.samples] == ["stop", "length", "stop"]
    assert a.samples[1].logprobs == [-0.25] * 4 and a.samples[0].text == "x"
    assert b.task_id == "b" and len(b.samples) == 1


def test_update_after_sleep_wakes_weights_then_kv_cache(fake_vllm):
    _, model_dir = fake_vllm
    eng = make_engine("vllm", model_dir=model_dir, weight_chunk_bytes=20)
    llm = eng.llm
    eng.sleep()
    assert llm.calls[-1] == ("sleep", 1) and eng.is_sleeping
    with pytest.raises(EngineStateError, match="asleep"):
        eng.generate([GroupRequest(task_id="t", prompt_ids=[1])])
    llm.calls.clear()
    new = {"model.norm.weight": torch.full((4,), 3.0), "lm_head.weight": torch.full((8, 4), 2.0, dtype=torch.bfloat16)}
    eng.update_weights(iter(new.items()), version=4)
    assert llm.calls == [
        ("wake_up", ["weights"]),
        ("collective_rpc", "elasticrl_load_weights", ["model.norm.weight"]),  # 16 bytes: its own chunk
        ("collective_rpc", "elasticrl_load_weights", ["lm_head.weight"]),
        ("wake_up", ["kv_cache"]),
        ("reset_prefix_cache",),
    ]
    assert not eng.is_sleeping and eng.policy_version == 4
    params = llm.worker.model_runner.model.params
    assert torch.equal(params["model.norm.weight"], new["model.norm.weight"])
    assert torch.equal(params["lm_head.weight"], torch.full((8, 4), 2.0))
    assert llm.worker.elasticrl_weight_checksum() == pytest.approx(3.0 * 4 + 2.0 * 32)


def test_update_errors_name_the_tensor_and_keep_the_version(fake_vllm):
    _, model_dir = fake_vllm
    eng = make_engine("vllm", model_dir=model_dir)
    eng.sleep()
    with pytest.raises(WeightUpdateError, match="model.layers.0.nope.weight"):
        eng.update_weights([("model.layers.0.nope.weight", torch.zeros(3))], version=1)
    assert eng.policy_version == 0
    assert eng.llm.calls[-2:] == [("wake_up", ["kv_cache"]), ("reset_prefix_cache",)]  # not left half awake


def test_level_two_sleep_needs_every_weight_again(fake_vllm):
    _, model_dir = fake_vllm
    eng = make_engine("vllm", model_dir=model_dir, sleep_level=2)
    eng.sleep()
    assert eng.llm.calls[-1] == ("sleep", 2)
    with pytest.raises(EngineStateError, match="level 2"):
        eng.wake()
    for _ in range(2):  # a retry of the same partial update is no more complete
        with pytest.raises(WeightUpdateError, match="1 parameter.*lm_head.weight"):
            eng.update_weights([("model.norm.weight", torch.zeros(4))], version=1)
    with pytest.raises(EngineStateError, match="discarded"):  # still refuses to generate from garbage
        eng.generate([GroupRequest(task_id="t", prompt_ids=[1])])
    assert eng.policy_version == 0
    eng.update_weights([("model.norm.weight", torch.zeros(4)), ("lm_head.weight", torch.ones(8, 4))], version=1)
    assert ("collective_rpc", "elasticrl_missing_params") in eng.llm.calls
    eng.generate([GroupRequest(task_id="t", prompt_ids=[1])])
    assert eng.policy_version == 1


def test_level_one_updates_may_be_partial(fake_vllm):
    _, model_dir = fake_vllm
    eng = make_engine("vllm", model_dir=model_dir)
    eng.sleep()
    eng.update_weights([("model.norm.weight", torch.zeros(4))], version=1)  # the rest stayed on the GPU
    assert ("collective_rpc", "elasticrl_missing_params") not in eng.llm.calls and eng.policy_version == 1


def test_a_refused_prefix_cache_reset_fails_the_update(fake_vllm):
    _, model_dir = fake_vllm
    eng = make_engine("vllm", model_dir=model_dir)
    eng.llm.reset_result = False
    with pytest.raises(WeightUpdateError, match="prefix cache"):
        eng.update_weights([("model.norm.weight", torch.zeros(4))], version=1)
    assert eng.policy_version == 0


def test_quantized_engines_are_refused(fake_vllm):
    _, model_dir = fake_vllm
    with pytest.raises(ValueError, match="quantization='awq'.*not supported"):
        make_engine("vllm", model_dir=model_dir, llm_kwargs={"quantization": "awq"})


@pytest.mark.parametrize("tensor", [
    torch.arange(12, dtype=torch.float32).reshape(3, 4),
    torch.randn(2, 3, dtype=torch.bfloat16),
    torch.tensor(2.5, dtype=torch.float16),  # 0-dim
    torch.zeros(0, 4),
    torch.arange(10, dtype=torch.int64)[::2],  # not contiguous
    torch.tensor([True, False]),
])
def test_wire_records_rebuild_the_tensor_exactly(tensor):
    record = to_wire("w", tensor)
    assert_msgpack_native(record)
    name, back = from_wire(list(record))  # msgpack hands tuples back as lists
    assert name == "w" and back.dtype == tensor.dtype and back.shape == tensor.shape and torch.equal(back, tensor)


def test_malformed_wire_records_name_the_problem():
    with pytest.raises(ValueError, match="unknown dtype 'float99'"):
        from_wire(["w", "float99", [1], b"\0\0\0\0"])
    with pytest.raises(ValueError, match="no bytes for a float32 tensor of shape \\[2\\]"):
        from_wire(["w", "float32", [2], b""])
    with pytest.raises(ValueError, match="3 bytes do not make a float32 tensor"):
        from_wire(["w", "float32", [1], b"abc"])
    with pytest.raises(ValueError, match="must be \\(name, dtype, shape, bytes\\)"):
        from_wire(["w", "float32"])


def test_old_vllm_without_wake_tags_and_without_tokenizer(fake_vllm, monkeypatch):
    module, model_dir = fake_vllm
    monkeypatch.setattr(module, "LLM", OldFakeLLM)
    (model_dir / "tokenizer.json").unlink()
    eng = make_engine("vllm", model_dir=model_dir, logprobs_mode="raw")
    assert eng.llm.kwargs["skip_tokenizer_init"] is True and eng.llm.kwargs["logprobs_mode"] == "raw_logprobs"
    assert eng.tokenizer is None
    eng.sleep()
    eng.update_weights([("model.norm.weight", torch.zeros(4))], version=2)
    assert ("wake_up", None) in eng.llm.calls
    (group,) = eng.generate([GroupRequest(task_id="t", prompt_ids=[1, 3])])
    assert eng.llm.last_params[0].detokenize is False and group.samples[0].text is None
    eng.close()
    with pytest.raises(EngineStateError, match="closed"):
        eng.generate([])


def test_sleep_needs_sleep_mode(fake_vllm):
    _, model_dir = fake_vllm
    eng = make_engine("vllm", model_dir=model_dir, enable_sleep_mode=False)
    with pytest.raises(EngineStateError, match="enable_sleep_mode=False"):
        eng.sleep()


def test_a_tied_head_is_not_sent_and_tensors_go_in_the_engines_dtype(fake_vllm):
    # From vLLM 0.33's source: AutoWeightsLoader refuses lm_head.weight of a tied model loaded
    # without model.embed_tokens.weight in the same call, and warns per tensor it has to cast.
    _, model_dir = fake_vllm
    (model_dir / "config.json").write_text('{"eos_token_id": 2}')  # tie_word_embeddings defaults to true

    class BF16LLM(FakeLLM):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.llm_engine = types.SimpleNamespace(model_config=types.SimpleNamespace(dtype=torch.bfloat16, max_model_len=64))
            self.worker.model_runner.model.params = {"model.norm.weight": torch.ones(4, dtype=torch.bfloat16)}

    fake_vllm[0].LLM = BF16LLM
    eng = make_engine("vllm", model_dir=model_dir)
    eng.update_weights([("model.norm.weight", torch.full((4,), 2.0)), ("lm_head.weight", torch.ones(8, 4))], version=1)
    sent = [c for c in eng.llm.calls if c[0] == "collective_rpc" and c[1] == "elasticrl_load_weights"]
    assert [c[2] for c in sent] == [["model.norm.weight"]]
    assert eng.llm.worker.model_runner.model.params["model.norm.weight"].tolist() == [2.0] * 4


def test_the_engine_takes_this_processs_gpu(fake_vllm, monkeypatch):
    # From vLLM 0.33's source: the engine core is a process of its own, so without a device every
    # rank's engine went to GPU 0.
    module, model_dir = fake_vllm
    seen = []

    class RecordingLLM(FakeLLM):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            seen.append(os.environ.get("CUDA_VISIBLE_DEVICES"))

    module.LLM = RecordingLLM
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    eng = make_engine("vllm", model_dir=model_dir, device="cuda:1", tensor_parallel_size=2)  # an older vLLM
    # rank 1 of a node with tp = 2: GPUs 2 and 3 of those visible (rank 0 has 0 and 1)
    assert "device_ids" not in eng.llm.kwargs and seen == ["6,7"] and os.environ["CUDA_VISIBLE_DEVICES"] == "4,5,6,7"

    @dataclasses.dataclass
    class EngineArgs:  # vLLM >= 0.33 has device_ids, indices into CUDA_VISIBLE_DEVICES
        device_ids: list | None = None

    module.EngineArgs = EngineArgs
    eng = make_engine("vllm", model_dir=model_dir, device="cuda:3")
    assert eng.llm.kwargs["device_ids"] == [3] and seen[-1] == "4,5,6,7"
    with pytest.raises(ValueError, match=r"takes GPUs \[6, 7\] \(each process of a node a block of its own\), and 4 are visible"):
        make_engine("vllm", model_dir=model_dir, device="cuda:3", tensor_parallel_size=2)


def test_a_gpu_memory_refusal_names_the_setting_to_lower(fake_vllm, monkeypatch):
    module, model_dir = fake_vllm
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")

    class Refusing(FakeLLM):
        def __init__(self, **kwargs):
            raise ValueError("Free memory on device cuda:0 (30.1/79.2 GiB) on startup is less than desired GPU memory "
                             "utilization (0.5, 39.6 GiB)")

    module.LLM = Refusing
    from elasticrl.rollout import EngineUnavailableError

    with pytest.raises(EngineUnavailableError, match=r"lower engine.gpu_memory_utilization=0.5: it is a share of the whole GPU"):
        make_engine("vllm", model_dir=model_dir, device="cuda:0")


def test_an_engine_core_that_fails_to_start_is_explained_and_retried_as_before(fake_vllm, monkeypatch, caplog):
    module, model_dir = fake_vllm
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")

    class Failing(FakeLLM):
        def __init__(self, **kwargs):
            raise RuntimeError("Engine core initialization failed. See root cause above. Failed core proc(s): {}")

    module.LLM = Failing
    with caplog.at_level("ERROR"), pytest.raises(RuntimeError, match="Engine core initialization failed"):
        make_engine("vllm", model_dir=model_dir, device="cuda:0")  # not EngineUnavailableError: a node retries it
    assert "lower engine.gpu_memory_utilization=0.5" in caplog.text
