"""The ``tiny`` rollout engine on CPU: same draws as ``sample_groups``, stop/length, the trainer's
lock and version, weight copies, states and the registry."""

from __future__ import annotations

import math
import threading

import pytest
import torch

from elasticrl.config import ModelConfig
from elasticrl.policy.codec import CharCodec, TextCodec
from elasticrl.policy.tiny import TinyCausalLM, token_logprobs
from elasticrl.policy.vocab import CharVocab
from elasticrl.rl.rollout import sample_groups
from elasticrl.rl.tasks import Example, make_task
from elasticrl.rollout import (
    EngineStateError,
    GroupRequest,
    RolloutEngine,
    SamplingSpec,
    WeightUpdateError,
    engine_names,
    make_engine,
)
from elasticrl.rollout.tiny_engine import TinyEngine

VOCAB = CharVocab()
SPECIALS = [VOCAB.pad_id, VOCAB.bos_id]
MAX_SEQ = 32

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny matrices: one thread is fastest, and kind to a shared machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _model(seed: int = 0, std: float = 0.3) -> TinyCausalLM:
    torch.manual_seed(seed)
    model = TinyCausalLM(ModelConfig(d_model=32, n_layers=1, n_heads=2, max_seq_len=MAX_SEQ), len(VOCAB))
    # Wider weights than the 0.02 init: peaked, position-dependent distributions, so EOS is
    # drawn sometimes and a padding or position bug changes the numbers visibly.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, std)
    return model


EXAMPLES = [Example(prompt="12=", target="21"), Example(prompt="4567=", target="7654"), Example(prompt="9=", target="9")]


def _requests(n=4, max_new_tokens=8, seeds=(5, 6, 7), prompts=None, **spec):
    prompts = prompts if prompts is not None else [VOCAB.encode(ex.prompt, bos=True) for ex in EXAMPLES]
    return [
        GroupRequest(task_id=f"t{i}", prompt_ids=p, sampling=SamplingSpec(n=n, max_new_tokens=max_new_tokens, seed=seed, **spec))
        for i, (p, seed) in enumerate(zip(prompts, seeds))
    ]


def _teacher_forced(model, prompt, completion):
    """[len(completion), V] logits that predict each completion token, one sequence alone."""
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        return model(ids, torch.ones_like(ids, dtype=torch.bool))[0, len(prompt) - 1:-1].float()


def _ids(groups):
    return [[s.completion_ids for s in g.samples] for g in groups]


@pytest.mark.parametrize("max_new_tokens", [3, 8])
def test_draws_equal_sample_groups_for_the_same_seed(max_new_tokens):
    model, task = _model(), make_task("reverse", 3)
    batch = sample_groups(model, VOCAB, task, EXAMPLES, group_size=4, max_new_tokens=max_new_tokens, temperature=1.0,
                          generator=torch.Generator().manual_seed(5))
    engine = TinyEngine(model, VOCAB)
    # Only the first request's seed counts: the batch shares one generator, as in sample_groups.
    groups = engine.generate(_requests(n=4, max_new_tokens=max_new_tokens, seeds=(5, 77, 78)))
    width = max(len(VOCAB.encode(ex.prompt, bos=True)) for ex in EXAMPLES)
    stops = lengths = 0
    for i, group in enumerate(groups):
        for j, s in enumerate(group.samples):
            row = 4 * i + j
            n = int(batch.completion_mask[row].sum())
            assert s.completion_ids == batch.tokens[row, width:width + n].tolist()
            torch.testing.assert_close(torch.tensor(s.logprobs), batch.old_logprobs[row, width - 1:width - 1 + n], atol=1e-5, rtol=0)
            assert s.text == batch.completions[row]
            if s.finish_reason == "stop":
                stops += 1
                assert s.completion_ids[-1] == VOCAB.eos_id and VOCAB.eos_id not in s.completion_ids[:-1]
            else:
                lengths += 1
                assert len(s.completion_ids) == max_new_tokens and VOCAB.eos_id not in s.completion_ids
            assert not set(s.completion_ids) & set(SPECIALS)
    if max_new_tokens == 8:
        assert stops and lengths, "the comparison should cover both finish reasons"


def test_groups_carry_request_order_version_and_batch_time():
    engine = TinyEngine(_model(), VOCAB, policy_version=4)
    reqs = _requests(n=3)
    groups = engine.generate(reqs)
    assert [g.task_id for g in groups] == ["t0", "t1", "t2"]
    assert [g.prompt_ids for g in groups] == [r.prompt_ids for r in reqs]
    assert all(g.policy_version == 4 and len(g.samples) == 3 for g in groups)
    assert len({g.gen_seconds for g in groups}) == 1 and groups[0].gen_seconds > 0  # one batch
    assert engine.tokenizer is VOCAB


def test_requests_of_different_kinds_batch_separately():
    engine = TinyEngine(_model(), VOCAB)
    a, b, c = _requests(n=2, seeds=(1, 2, 3))
    b = GroupRequest(task_id=b.task_id, prompt_ids=b.prompt_ids, sampling=SamplingSpec(n=2, max_new_tokens=8, temperature=0.7, seed=2))
    mixed = engine.generate([a, b, c])
    assert [g.task_id for g in mixed] == ["t0", "t1", "t2"]
    # a and c share a batch seeded by a; b is alone, seeded by itself.
    ac = engine.generate([a, c])
    (b_alone,) = engine.generate([b])
    assert _ids(mixed) == [_ids(ac)[0], _ids([b_alone])[0], _ids(ac)[1]]
    assert mixed[0].gen_seconds == mixed[2].gen_seconds  # one batch, one time


def test_logprobs_follow_temperature_and_top_k():
    model = _model()
    engine = TinyEngine(model, VOCAB)
    for group in engine.generate(_requests(n=4, temperature=0.6, top_k=3)):
        for s in group.samples:
            scaled = _teacher_forced(model, group.prompt_ids, s.completion_ids) / 0.6
            drawable = scaled.clone()
            drawable[:, SPECIALS] = float("-inf")
            top3 = drawable.topk(3, dim=-1).indices
            ids = torch.tensor(s.completion_ids)[:, None]
            assert bool((top3 == ids).any(dim=1).all()), "a token outside the top 3 was drawn"
            # Reported under the kept tokens plus pad/BOS at their own logits (module docstring).
            kept = torch.full_like(scaled, float("-inf")).scatter(1, top3, scaled.gather(1, top3))
            kept[:, SPECIALS] = scaled[:, SPECIALS]
            expected = torch.log_softmax(kept, dim=-1).gather(1, ids).squeeze(1)
            torch.testing.assert_close(torch.tensor(s.logprobs), expected, atol=1e-5, rtol=0)
    # Without top-k the report is log_softmax(logits / T), padding invariant.
    for group in engine.generate(_requests(n=2, temperature=0.6)):
        for s in group.samples:
            scaled = _teacher_forced(model, group.prompt_ids, s.completion_ids) / 0.6
            expected = torch.log_softmax(scaled, dim=-1).gather(1, torch.tensor(s.completion_ids)[:, None]).squeeze(1)
            torch.testing.assert_close(torch.tensor(s.logprobs), expected, atol=1e-5, rtol=0)


def test_greedy_is_the_argmax_chain_without_specials():
    model = _model()
    (group,) = TinyEngine(model, VOCAB).generate(
        [GroupRequest(task_id="g", prompt_ids=VOCAB.encode("31=", bos=True), sampling=SamplingSpec(n=3, temperature=0, max_new_tokens=6, ignore_eos=True))]
    )
    first = group.samples[0].completion_ids
    assert all(s.completion_ids == first for s in group.samples) and len(first) == 6
    logits = _teacher_forced(model, group.prompt_ids, first)
    raw = torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(first)[:, None]).squeeze(1)
    logits[:, SPECIALS] = float("-inf")
    assert logits.argmax(dim=-1).tolist() == first
    torch.testing.assert_close(torch.tensor(group.samples[0].logprobs), raw, atol=1e-5, rtol=0)


def test_stop_token_ids_ignore_eos_and_length():
    engine = TinyEngine(_model(), VOCAB)
    stop = tuple(range(3, 23))  # half the vocabulary: every sample stops within a few tokens
    for s in (s for g in engine.generate(_requests(n=4, max_new_tokens=20, stop_token_ids=stop, ignore_eos=True)) for s in g.samples):
        assert s.finish_reason == "stop" and s.completion_ids[-1] in stop
        assert not set(s.completion_ids[:-1]) & set(stop)
        assert s.text == VOCAB.decode(s.completion_ids)
    for s in (s for g in engine.generate(_requests(n=4, max_new_tokens=5, ignore_eos=True)) for s in g.samples):
        assert s.finish_reason == "length" and len(s.completion_ids) == 5


def test_generation_stops_at_the_context_limit_and_crops_padding():
    model = _model()
    long_prompt = [VOCAB.bos_id] + VOCAB.encode("1234567890" * 3)[:27]  # 28 tokens of 32
    short_prompt = VOCAB.encode("12=", bos=True)
    (long_group, short_group) = TinyEngine(model, VOCAB).generate(
        _requests(n=2, max_new_tokens=50, prompts=[long_prompt, short_prompt], seeds=(1, 1), ignore_eos=True)
    )
    assert all(len(s.completion_ids) == 4 and s.finish_reason == "length" for s in long_group.samples)
    for s in short_group.samples:
        # The batch grew past max_seq_len; the short rows were decoded on a cropped window.
        assert len(s.completion_ids) == MAX_SEQ - len(short_prompt)
        ids = torch.tensor([short_prompt + s.completion_ids])
        expected = token_logprobs(model, ids, torch.ones_like(ids, dtype=torch.bool))[0, len(short_prompt) - 1:]
        torch.testing.assert_close(torch.tensor(s.logprobs), expected, atol=1e-5, rtol=0)


def test_same_seed_same_samples_and_engine_seed_for_unseeded_requests():
    model = _model()
    engine = TinyEngine(model, VOCAB)
    assert _ids(engine.generate(_requests(seeds=(3, 0, 0)))) == _ids(engine.generate(_requests(seeds=(3, 1, 1))))
    assert _ids(engine.generate(_requests(seeds=(3, 0, 0)))) != _ids(engine.generate(_requests(seeds=(4, 0, 0))))
    unseeded = _requests(seeds=(None, None, None))
    e1, e2 = TinyEngine(model, VOCAB, seed=9), TinyEngine(model, VOCAB, seed=9)
    assert _ids(e1.generate(unseeded)) == _ids(e2.generate(unseeded))


def test_prompt_errors():
    engine = TinyEngine(_model(), VOCAB)
    with pytest.raises(ValueError, match="context"):
        engine.generate([GroupRequest(task_id="t", prompt_ids=[1] * MAX_SEQ)])
    with pytest.raises(ValueError, match="vocab size"):
        engine.generate([GroupRequest(task_id="t", prompt_ids=[1, len(VOCAB)])])
    with pytest.raises(ValueError, match="pad id"):
        engine.generate([GroupRequest(task_id="t", prompt_ids=[1, VOCAB.pad_id, 5])])


class ProbeLock:
    """The trainer's lock, telling the test when another thread starts waiting for it."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.waiting = threading.Event()

    def __enter__(self):
        if threading.current_thread() is not threading.main_thread():
            self.waiting.set()
        self.lock.acquire()
        return self

    def __exit__(self, *exc):
        self.lock.release()


def test_a_trainer_holding_the_lock_blocks_generation_and_sets_the_version():
    model = _model()
    probe = ProbeLock()
    engine = TinyEngine(model, VOCAB, lock=probe)
    results, errors = [], []

    def rollout():
        try:
            results.append(engine.generate(_requests(n=2, max_new_tokens=4)))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    thread = threading.Thread(target=rollout, daemon=True)
    with probe:  # the optimizer step
        thread.start()
        assert probe.waiting.wait(timeout=30), "generate() never asked for the lock"
        assert thread.is_alive() and not results, "generate() ran while the trainer held the lock"
        with torch.no_grad():
            model.ln_f.weight.zero_()  # hidden state 0: every logit 0, every token log(1/V)
        engine.set_version(3)
    thread.join(timeout=60)
    assert not thread.is_alive() and not errors, errors
    (groups,) = results
    assert all(g.policy_version == 3 for g in groups)
    for s in (s for g in groups for s in g.samples):
        assert s.logprobs == pytest.approx([-math.log(len(VOCAB))] * len(s.logprobs), abs=1e-6)


def test_update_weights_copies_tensors_and_rejects_bad_ones():
    source, target = _model(seed=1), _model(seed=2)
    reqs = _requests()
    expected = TinyEngine(source, VOCAB).generate(reqs)
    engine = TinyEngine(target, VOCAB)
    assert _ids(engine.generate(reqs)) != _ids(expected)
    engine.sleep()
    engine.update_weights(source.state_dict().items(), version=2)  # also wakes it
    assert not engine.is_sleeping and engine.policy_version == 2
    assert target.tok.weight.data_ptr() != source.tok.weight.data_ptr()  # copied, not shared
    got = engine.generate(reqs)
    assert _ids(got) == _ids(expected) and all(g.policy_version == 2 for g in got)
    with pytest.raises(WeightUpdateError, match="blocks.0.nope.weight"):
        engine.update_weights([("blocks.0.nope.weight", torch.zeros(3))], version=3)
    with pytest.raises(WeightUpdateError, match=r"ln_f.weight.*\(31,\).*\(32,\)"):
        engine.update_weights([("ln_f.weight", torch.zeros(31))], version=3)
    with pytest.raises(ValueError, match="version"):
        engine.update_weights([], version=-1)
    assert engine.policy_version == 2


def test_sleep_wake_close_states():
    engine = TinyEngine(_model(), VOCAB)
    assert isinstance(engine, RolloutEngine)
    engine.sleep()
    assert engine.is_sleeping
    with pytest.raises(EngineStateError, match="asleep"):
        engine.generate(_requests())
    engine.wake()
    assert not engine.is_sleeping
    engine.generate(_requests(n=1, max_new_tokens=2))
    engine.close()
    for call in (lambda: engine.generate(_requests()), engine.sleep, engine.wake, lambda: engine.set_version(1),
                 lambda: engine.update_weights([], version=1)):
        with pytest.raises(EngineStateError, match="closed"):
            call()
    engine.close()  # idempotent


def test_registry_builds_it():
    assert "tiny" in engine_names()
    model = _model()
    engine = make_engine("tiny", model=model, vocab=VOCAB, policy_version=1, seed=3)
    assert isinstance(engine, TinyEngine) and isinstance(engine, RolloutEngine)
    (group,) = engine.generate(_requests(n=2)[:1])
    assert group.policy_version == 1 and len(group.samples) == 2


def test_char_codec_is_a_text_codec():
    codec = CharCodec(VOCAB)
    assert isinstance(codec, TextCodec)
    assert codec.encode("12=") == [VOCAB.bos_id, *VOCAB.encode("12=")]
    assert codec.encode("12=", bos=False) == VOCAB.encode("12=")
    assert (codec.pad_id, codec.eos_ids, codec.bos_id) == (VOCAB.pad_id, (VOCAB.eos_id,), VOCAB.bos_id)
    assert codec.decode(VOCAB.encode("ab") + [VOCAB.eos_id] + VOCAB.encode("c")) == "ab"


def test_each_decoding_step_reports_progress_to_the_caller_that_asked_for_it():
    """What keeps a task's lease while one long ``generate`` runs (``reporting_progress``)."""
    from elasticrl.rollout.engine import reporting_progress

    engine, steps = TinyEngine(_model(), VOCAB), []
    reqs = _requests(n=2, max_new_tokens=8, ignore_eos=True)
    with reporting_progress(lambda: steps.append(threading.current_thread().name)):
        engine.generate(reqs)
    assert len(steps) == 7 and set(steps) == {threading.current_thread().name}  # each step but the last
    engine.generate(reqs)  # outside the block: reported to nobody
    assert len(steps) == 7
