"""``HostOffload`` (the hf engine's sleep): every parameter and buffer goes to the host and back
with the same values and the same ``Parameter`` objects (tied weights stay tied); after
``allocate`` only what was not written since comes back from the host copy. On the CPU an hf
engine gets a HostOffload put in by hand (it sleeps by state only there); where CUDA is present the
same tests run on the GPU, pinned memory included."""

import random

import pytest
import torch
from torch import nn

from elasticrl.rollout.offload import HostOffload

pytestmark = pytest.mark.timeout(120)

CUDA = torch.cuda.is_available()


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(11, 6)
        self.body = nn.Linear(6, 6)
        self.head = nn.Linear(6, 11, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("scale", torch.arange(6.0))
        self.register_buffer("cache", torch.ones(3), persistent=False)


def snapshot(module):
    return {k: v.detach().clone() for k, v in module.state_dict().items()} | {"cache": module.cache.clone()}


@pytest.mark.parametrize("device", ["cpu", *(["cuda"] if CUDA else [])])
def test_offload_and_wake_keep_values_objects_and_ties(device):
    device = torch.device(device)
    module = Tied().to(device)
    before, params = snapshot(module), list(module.parameters())
    offload = HostOffload(module, device)
    for _ in range(3):  # the host buffers are allocated once and reused
        offload.offload()
        assert all(p.device.type == "cpu" for p in module.parameters())
        assert all(b.device.type == "cpu" for b in module.buffers())
        if device.type == "cuda":
            assert all(p.is_pinned() for p in module.parameters())
        offload.wake()
        assert all(p.device.type == device.type for p in module.parameters())
        after = snapshot(module)
        assert all(torch.equal(before[k], after[k]) for k in before)
        assert list(module.parameters()) == params and module.head.weight is module.embed.weight


@pytest.mark.parametrize("seed", range(6))
def test_only_what_an_update_did_not_write_comes_back_from_the_host(seed):
    rng = random.Random(seed)
    module, device = Tied(), torch.device("cpu")
    before = snapshot(module)
    offload = HostOffload(module, device)
    offload.offload()
    offload.allocate()
    written = {}
    targets = module.state_dict(keep_vars=True)
    for name in rng.sample(sorted(targets), rng.randint(0, len(targets))):  # in random order
        value = torch.randn(targets[name].shape)
        with torch.no_grad():
            targets[name].copy_(value)
        offload.filled(targets[name])
        written[name] = value
    tied = [n for n in ("embed.weight", "head.weight") if n in written]
    for name in ("embed.weight", "head.weight"):  # one tensor under two names: the last write is both
        if tied:
            written[name] = written[tied[-1]]
    restored = offload.restore()
    distinct = {id(targets[n]) for n in written}
    assert restored == len(offload.tensors) - len(distinct)
    after = snapshot(module)
    for name, value in before.items():
        assert torch.equal(after[name], written.get(name, value)), name


def test_a_tensor_replaced_after_the_first_sleep_is_offloaded_too():
    module, device = Tied(), torch.device("cpu")
    offload = HostOffload(module, device)
    offload.offload()
    offload.wake()
    kept = {id(t): h for t, h in zip(offload.tensors, offload.host)}
    module.register_buffer("scale", torch.full((6,), 3.0))  # a new buffer object (a dynamic RoPE does this)
    offload.offload()
    reused = [h is kept.get(id(t)) for t, h in zip(offload.tensors, offload.host)]
    assert reused.count(False) == 1  # only the new buffer got a new host buffer
    assert any(t is module.scale for t in offload.tensors)
    assert module.scale.data_ptr() == offload.host[[id(t) for t in offload.tensors].index(id(module.scale))].data_ptr()
    offload.wake()
    assert torch.equal(module.scale, torch.full((6,), 3.0))


def engine_on(device: str, model_dir):
    """An hf engine whose sleep goes through HostOffload: on a GPU its own; on the CPU (where the
    engine sleeps by state only) one put in by hand, so that CI runs the refill path too."""
    from elasticrl.rollout.hf import HFEngine

    engine = HFEngine(model_dir, device=device)
    if engine._offload is None:
        engine._offload = HostOffload(engine._model, torch.device(device))
    return engine


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from elasticrl.rollout.tiny_llama import write_tiny_llama

    root = tmp_path_factory.mktemp("llama")
    return write_tiny_llama(root / "m", vocab_size=64, seed=0), write_tiny_llama(root / "o", vocab_size=64, seed=1)


def drawn(engine):
    from elasticrl.rollout import GroupRequest, SamplingSpec

    reqs = [GroupRequest(task_id="t", prompt_ids=[1, 5, 9], sampling=SamplingSpec(n=3, max_new_tokens=8, seed=4))]
    return [s.completion_ids for g in engine.generate(reqs) for s in g.samples]


DEVICES = ["cpu", *(["cuda"] if CUDA else [])]


@pytest.mark.parametrize("device", DEVICES)
def test_an_update_after_a_sleep_refills_the_engine(device, models):
    from elasticrl.rollout import WeightUpdateError

    model_dir, other = models
    with engine_on(device, model_dir) as eng, engine_on(device, other) as ref, engine_on(device, model_dir) as first:
        new = {k: v.clone() for k, v in ref._model.state_dict().items()}
        old = {k: v.clone() for k, v in first._model.state_dict().items()}
        eng.sleep()
        if device == "cuda":
            assert all(p.is_pinned() for p in eng._model.parameters())
        eng.update_weights(((k, v) for k, v in new.items() if k != "model.norm.weight"), version=1)
        eng.sleep()
        eng.wake()
        got = eng._model.state_dict()
        assert all(torch.equal(got[k], new[k]) for k in new if k != "model.norm.weight")
        assert torch.equal(got["model.norm.weight"], old["model.norm.weight"])  # not sent: the old one came back
        eng.sleep()
        sent = ["model.norm.weight", "lm_head.weight"]
        with pytest.raises(WeightUpdateError, match="nope"):
            eng.update_weights([(k, old[k]) for k in sent] + [("nope", torch.zeros(1))], version=2)
        assert not eng.is_sleeping and eng.policy_version == 1  # awake, at the version it had
        got = eng._model.state_dict()
        assert all(torch.equal(got[k], old[k] if k in sent else new[k] if k != "model.norm.weight" else old[k]) for k in new)
        eng.sleep()
        eng.update_weights(new.items(), version=3)
        assert drawn(eng) == drawn(ref)


@pytest.mark.parametrize("device", DEVICES)
def test_an_engine_that_cannot_get_its_memory_back_stays_asleep_with_its_weights(device, models, monkeypatch):
    model_dir, other = models
    with engine_on(device, model_dir) as eng, engine_on(device, other) as ref:
        before = drawn(eng)
        eng.sleep()
        calls, real = [], torch.empty_like

        def out_of_memory(*args, **kwargs):
            calls.append(1)
            if len(calls) > 3:
                raise torch.OutOfMemoryError("no memory")
            return real(*args, **kwargs)

        monkeypatch.setattr(torch, "empty_like", out_of_memory)
        with pytest.raises(torch.OutOfMemoryError):
            eng.update_weights(ref._model.state_dict().items(), version=1)
        monkeypatch.undo()
        assert eng.is_sleeping and eng.policy_version == 0
        offload = eng._offload  # every tensor back on its host copy: nothing new held on the device
        assert all(t.data_ptr() == h.data_ptr() for t, h in zip(offload.tensors, offload.host))
        eng.wake()
        assert drawn(eng) == before
