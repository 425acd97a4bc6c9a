"""``HostOffload`` (the hf engine's sleep): every parameter and buffer goes to the host and back
with the same values and the same ``Parameter`` objects (tied weights stay tied); after
``allocate`` only what was not written since comes back from the host copy. The logic runs on the
CPU here; the pinned-memory path, with the hf engine on a GPU, where CUDA is present."""

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


@pytest.mark.skipif(not CUDA, reason="the hf engine's pinned sleep needs a GPU")
def test_the_hf_engine_sleeps_into_pinned_memory_and_an_update_refills_it(tmp_path):
    from elasticrl.rollout import GroupRequest, SamplingSpec, WeightUpdateError
    from elasticrl.rollout.hf import HFEngine
    from elasticrl.rollout.tiny_llama import write_tiny_llama

    model_dir = write_tiny_llama(tmp_path / "m", vocab_size=64, seed=0)
    other = write_tiny_llama(tmp_path / "o", vocab_size=64, seed=1)
    reqs = [GroupRequest(task_id="t", prompt_ids=[1, 5, 9], sampling=SamplingSpec(n=3, max_new_tokens=8, seed=4))]
    with HFEngine(model_dir, device="cuda") as eng, HFEngine(other, device="cuda") as ref:
        new = {k: v.clone() for k, v in ref._model.state_dict().items()}
        eng.sleep()
        eng.update_weights(((k, v) for k, v in new.items() if k != "model.norm.weight"), version=1)
        eng.sleep()
        eng.wake()
        got = eng._model.state_dict()
        assert all(torch.equal(got[k], new[k]) for k in new if k != "model.norm.weight")
        with HFEngine(model_dir, device="cuda") as first:  # norm was not sent: the old one stays
            assert torch.equal(got["model.norm.weight"], first._model.state_dict()["model.norm.weight"])
        eng.sleep()
        with pytest.raises(WeightUpdateError):
            eng.update_weights([("model.norm.weight", new["model.norm.weight"]), ("nope", torch.zeros(1))], version=2)
        assert not eng.is_sleeping and torch.equal(eng._model.state_dict()["lm_head.weight"], new["lm_head.weight"])
        eng.update_weights(new.items(), version=3)
        a, b = eng.generate(reqs), ref.generate(reqs)
        assert [s.completion_ids for g in a for s in g.samples] == [s.completion_ids for g in b for s in g.samples]
