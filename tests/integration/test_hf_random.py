"""Seeded random differential test of the ``hf`` rollout engine and the trainer's ``hf_token_logprobs``.

For random batches (prompts of different lengths, prompts one token short of the context, random
temperature incl. greedy and near-zero, top-k, top-p, seeds, stop tokens, ignore_eos,
max_new_tokens incl. 1, random ``max_batch_rows``) on a tiny random Llama and a tiny random GPT-2
(CPU, float32; RoPE cannot see a row's positions shifted by its padding, GPT-2's learned absolute
position embeddings can), every sample is checked against a plain forward pass of an
independently loaded copy of the model over the full sequence, one sequence at a time, without a
KV cache:

* "processed" logprobs are ``log_softmax(filter(logits / T))[token]`` (filter = top-k then top-p,
  reimplemented here in float64), "raw" ones ``log_softmax(logits)[token]``, greedy ones raw in both
  modes (``elasticrl.rollout.engine``'s convention);
* no token outside the reference top-k / nucleus is ever drawn; greedy tokens are the argmax;
* stop/EOS tokens end a sample with "stop", the length limit with "length"; the context is never
  exceeded;
* a seeded request gives the same tokens and logprobs alone, in any batch, in any batch split, and
  in "raw" mode (only the reporting differs); unseeded ones are reproducible from the engine seed;
* the trainer's ``hf_token_logprobs`` on a left-padded, right-padded mixed-length batch of the
  engine's samples gives back the engine's logprobs (what the PPO/GRPO ratio assumes);
* after ``update_weights`` (a random subset of tensors, as float32 or bfloat16, Parameters,
  non-contiguous) the logprobs are the new model's; sleep/wake changes nothing;
* many draws of one prompt follow the reported distribution (not only its logprobs);
* batches are packed as ``max_batch_rows`` says, a group never split.

``ELASTICRL_RANDOM_SEEDS=N`` runs seeds 0..N-1 (5 by default).

The bug it found is pinned by the tests at the bottom (they failed before its fix).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import os
import random

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from elasticrl.policy.hf_policy import hf_token_logprobs, load_hf_model
from elasticrl.rollout import EngineStateError, GroupRequest, SamplingSpec
from elasticrl.rollout.hf import HFEngine
from elasticrl.rollout.tiny_llama import write_tiny_llama

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

SEEDS = range(int(os.environ.get("ELASTICRL_RANDOM_SEEDS", "5")))

VOCAB = 64
MAX_CTX = 40
PAD, BOS, EOS = 0, 1, 2
TEMPERATURES = (0.0, 1e-3, 0.05, 0.5, 1.0, 1.0, 1.0, 1.7)
# Float32 logits of a cached, batched decode and of a plain forward differ by ~1e-6; a logprob at
# temperature T moves by about twice that over T.
LOGIT_NOISE = 2e-6


def tol(temperature: float) -> float:
    return 2e-5 + 4 * LOGIT_NOISE / (temperature if temperature > 0 else 1.0)


# ----- fixtures ----------------------------------------------------------------------------------


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The model is tiny: extra intra-op threads only add contention (100x slower on a busy box)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def write_tiny_gpt2(path, *, seed: int):
    """GPT-2 learns absolute position embeddings: RoPE (Llama) is blind to a row's positions all
    being shifted by its padding, GPT-2 is not. No tokenizer (the engine's id-only path)."""
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=MAX_CTX, n_embd=32, n_layer=2, n_head=4, initializer_range=0.3,
        bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        transformers.GPT2LMHeadModel(config).save_pretrained(path)
    return path


def write_model(arch: str, path, seed: int):
    if arch == "gpt2":
        return write_tiny_gpt2(path, seed=seed)
    return write_tiny_llama(path, vocab_size=VOCAB, max_position_embeddings=MAX_CTX, seed=seed)


def is_gpt2(path) -> bool:
    return json.loads((path / "config.json").read_text())["model_type"] == "gpt2"


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def model_dir(request, tmp_path_factory):
    return write_model(request.param, tmp_path_factory.mktemp(f"tiny-{request.param}"), seed=0)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return write_model("llama", tmp_path_factory.mktemp("tiny-llama-edge"), seed=0)


@pytest.fixture(scope="module")
def other_dir(model_dir, tmp_path_factory):
    """Same architecture, other weights: what update_weights pushes."""
    arch = "gpt2" if is_gpt2(model_dir) else "llama"
    return write_model(arch, tmp_path_factory.mktemp(f"tiny-{arch}-2"), seed=1)


@pytest.fixture(scope="module")
def ref_model(model_dir):
    """An independent copy of the weights for the reference forward passes (never the engine's)."""
    return load_hf_model(model_dir).eval().requires_grad_(False)


# ----- the reference -----------------------------------------------------------------------------


def ref_logits(model, prompt: list[int], completion: list[int]) -> torch.Tensor:
    """[len(completion), V] float32 logits predicting each completion token: one sequence, no
    padding, no cache, no position ids given."""
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(input_ids=ids, use_cache=False).logits[0].float()
    return logits[len(prompt) - 1: -1]


def kept_mask(scaled: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """[V] bool: top-k, then the smallest set of most likely tokens whose (renormalised) mass reaches
    top_p. float64, written independently of ``filter_top_k_top_p``."""
    scaled = scaled.double()
    order = scaled.argsort(descending=True, stable=True)
    keep = torch.ones_like(scaled, dtype=torch.bool)
    if top_k > 0:
        keep[top_k:] = False
    if top_p < 1:
        probs = torch.softmax(scaled[order].masked_fill(~keep, -math.inf), dim=0)
        before = torch.cumsum(probs, 0) - probs
        keep &= before < top_p
    out = torch.zeros_like(keep)
    out[order] = keep
    return out


def filter_edge(scaled: torch.Tensor, top_k: int, top_p: float, logit_eps: float) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """(kept, loose, ambiguous): the reference kept set; a superset that float noise of the size we
    tolerate (logits within ``logit_eps``, mass within 1e-4 of top_p) or a tie across the edge could
    also make the engine keep; whether the two can differ (then only ``loose`` is checked)."""
    keep = kept_mask(scaled, top_k, top_p)
    wide = kept_mask(scaled, top_k, min(top_p + 1e-4, 1.0)) if top_p < 1 else keep
    loose = scaled >= scaled[wide].min() - logit_eps
    if 0 < top_k < scaled.numel():
        loose &= scaled >= scaled.sort(descending=True).values[top_k - 1] - logit_eps
    loose |= keep
    return keep, loose, not torch.equal(keep, loose)


def expected_logprobs(logits: torch.Tensor, tokens: list[int], spec: SamplingSpec, mode: str):
    """Per token: (expected logprob, or None when the filter's edge is ambiguous; allowed?)."""
    out = []
    for row, tok in zip(logits, tokens):
        raw = torch.log_softmax(row.double(), dim=0)
        if spec.temperature == 0:
            out.append((raw[tok].item(), bool(row[tok] >= row.max() - 1e-5)))
            continue
        scaled = row.double() / spec.temperature
        keep, loose, ambiguous = filter_edge(scaled, spec.top_k, spec.top_p, 4 * LOGIT_NOISE / spec.temperature)
        allowed = bool(loose[tok])
        if mode == "raw":
            out.append((raw[tok].item(), allowed))
        elif ambiguous:
            out.append((None, allowed))
        else:
            lp = torch.log_softmax(scaled.masked_fill(~keep, -math.inf), dim=0)[tok].item()
            out.append((lp, allowed))
    return out


# ----- random requests ---------------------------------------------------------------------------


def random_spec(rng: random.Random, short: bool = False) -> SamplingSpec:
    stops = tuple(rng.sample(range(VOCAB), rng.choice([0, 0, 1, 3, 8, 16])))
    return SamplingSpec(
        n=rng.choice([1, 1, 2, 3, 4]),
        temperature=rng.choice(TEMPERATURES),
        top_k=rng.choice([0, 0, 0, 1, 2, 5, 20, VOCAB, VOCAB + 7]),
        top_p=rng.choice([1.0, 1.0, 1.0, 0.95, 0.7, 0.3, 0.05]),
        max_new_tokens=rng.choice([1, 1, 2, 5, 13, MAX_CTX // 2] if short else [1, 1, 2, 5, 13, 30, 200]),
        seed=None if rng.random() < 0.2 else rng.randrange(2**63),
        stop_token_ids=stops,
        ignore_eos=rng.random() < 0.5,
    )


def random_prompt(rng: random.Random, short: bool = False) -> list[int]:
    if short:
        length = rng.choice([1, 1, 2, 3, rng.randint(4, 12), rng.randint(13, MAX_CTX // 2)])
    else:
        length = rng.choice([1, 1, 2, 3, rng.randint(4, 12), rng.randint(13, MAX_CTX - 2), MAX_CTX - 1, MAX_CTX - 2])
    return [rng.randrange(VOCAB) for _ in range(length)]


def random_requests(rng: random.Random, count: int | None = None, *, short: bool = False) -> list[GroupRequest]:
    """``short``: prompt + max_new_tokens stay within the context (a finished row was fed positions
    past it, which crashed learned position embeddings:
    test_a_finished_row_past_the_context_does_not_crash_learned_positions)."""
    count = count if count is not None else rng.randint(1, 6)
    reqs = [GroupRequest(task_id=f"t{i}", prompt_ids=random_prompt(rng, short), sampling=random_spec(rng, short)) for i in range(count)]
    if len(reqs) > 1 and rng.random() < 0.3:  # the same seeded request twice in one batch
        dup = rng.choice(reqs)
        reqs.append(GroupRequest(task_id="dup", prompt_ids=dup.prompt_ids, sampling=dup.sampling))
    return reqs


def ids_and_lps(groups):
    return [[(s.completion_ids, s.logprobs, s.finish_reason) for s in g.samples] for g in groups]


def assert_same_samples(a, b, temperature: float, what: str):
    """Same tokens and finish reasons; logprobs equal up to float noise."""
    assert len(a.samples) == len(b.samples), what
    for x, y in zip(a.samples, b.samples):
        assert (x.completion_ids, x.finish_reason) == (y.completion_ids, y.finish_reason), what
        torch.testing.assert_close(torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=tol(temperature), rtol=0, msg=what)


# ----- checks ------------------------------------------------------------------------------------


def check_group(group, req, model, mode: str, tokenizer, version: int) -> None:
    spec = req.sampling
    assert group.task_id == req.task_id and group.prompt_ids == req.prompt_ids
    assert group.policy_version == version and group.gen_seconds >= 0
    assert len(group.samples) == spec.n
    stops = set(spec.stop_token_ids) | (set() if spec.ignore_eos else {EOS})
    limit = min(spec.max_new_tokens, MAX_CTX - len(req.prompt_ids))
    if spec.temperature == 0:  # greedy: every sample of the group is the same
        assert all(s.completion_ids == group.samples[0].completion_ids for s in group.samples)
    for s in group.samples:
        ids = s.completion_ids
        assert 1 <= len(ids) <= limit and len(req.prompt_ids) + len(ids) <= MAX_CTX
        assert len(s.logprobs) == len(ids) and all(0 <= t < VOCAB for t in ids)
        assert not set(ids[:-1]) & stops, "a stop token did not end the sample"
        if s.finish_reason == "stop":
            assert ids[-1] in stops
        else:
            assert s.finish_reason == "length" and ids[-1] not in stops and len(ids) == limit
        assert all(math.isfinite(lp) and lp <= 1e-6 for lp in s.logprobs)
        if tokenizer is not None:
            assert s.text == tokenizer.decode(ids, skip_special_tokens=True)
        else:
            assert s.text is None
        logits = ref_logits(model, req.prompt_ids, ids)
        for i, ((exp, allowed), got, tok) in enumerate(zip(expected_logprobs(logits, ids, spec, mode), s.logprobs, ids)):
            where = f"task {req.task_id} {spec} step {i} token {tok}"
            assert allowed, f"sampled a token outside the allowed set: {where}"
            if exp is not None:
                assert abs(got - exp) <= tol(spec.temperature), f"{where}: engine {got} vs reference {exp}"


def check_batches(groups, max_rows: int) -> None:
    """Groups decoded together share ``gen_seconds``: each batch is a run of consecutive groups with
    at most ``max_rows`` rows, unless it is one group (a group is never split)."""
    runs: list[list] = []
    for g in groups:
        if runs and runs[-1][-1].gen_seconds == g.gen_seconds:
            runs[-1].append(g)
        else:
            runs.append([g])
    assert len({run[0].gen_seconds for run in runs}) == len(runs), "a batch's groups are not consecutive"
    for run in runs:
        assert len(run) == 1 or sum(len(g.samples) for g in run) <= max_rows
    # Greedy packing: a batch is closed only when the next group does not fit.
    for a, b in itertools.pairwise(runs):
        assert sum(len(g.samples) for g in a) + len(b[0].samples) > max_rows


def pack(rows, pad_id=PAD, noise=None):
    """(prompt, sample) rows -> tokens/valid laid out as ``batch_from_groups`` does: prompts
    left-padded to a common width, completions right-padded after them."""
    width = max(len(p) for p, _ in rows)
    length = max(len(s.completion_ids) for _, s in rows)
    tokens = torch.full((len(rows), width + length), pad_id, dtype=torch.long)
    valid = torch.zeros_like(tokens, dtype=torch.bool)
    for r, (p, s) in enumerate(rows):
        seq = p + s.completion_ids
        tokens[r, width - len(p): width + len(s.completion_ids)] = torch.tensor(seq)
        valid[r, width - len(p): width + len(s.completion_ids)] = True
    if noise is not None:
        tokens = torch.where(valid, tokens, torch.randint(0, VOCAB, tokens.shape, generator=noise))
    return tokens, valid, width


def trainer_logprobs(model, rows, temperature, noise):
    tokens, valid, width = pack(rows, noise=noise)
    with torch.no_grad():
        got = hf_token_logprobs(model, tokens, valid, temperature=temperature)
    assert got.shape == (tokens.shape[0], tokens.shape[1] - 1) and got.dtype == torch.float32
    return [got[r, width - 1: width - 1 + len(s.completion_ids)] for r, (_, s) in enumerate(rows)]


# ----- the random tests --------------------------------------------------------------------------


@pytest.mark.parametrize("seed", SEEDS)
def test_engine_matches_the_reference(seed, model_dir, ref_model):
    rng = random.Random(seed)
    engine_seed, version, max_rows = rng.randrange(1000), rng.choice([0, 3]), rng.choice([1, 3, 7, 64])
    with HFEngine(model_dir, seed=engine_seed, max_batch_rows=max_rows, policy_version=version) as engine, \
            HFEngine(model_dir, seed=engine_seed, logprobs_mode="raw", max_batch_rows=rng.choice([1, 4, 64]), policy_version=version) as raw_engine:
        assert engine.generate([]) == []
        for round_ in range(2):
            reqs = random_requests(rng, short=is_gpt2(model_dir) and rng.random() < 0.3)
            groups = engine.generate(reqs)
            assert [g.task_id for g in groups] == [r.task_id for r in reqs]
            check_batches(groups, max_rows)
            for req, group in zip(reqs, groups):
                check_group(group, req, ref_model, "processed", engine.tokenizer, version)
            # Raw mode, same engine seed, another batch split: the same draws, reported unscaled
            # (unseeded requests too in the first round, before the engines' seed streams part).
            raw_groups = raw_engine.generate(reqs)
            for req, group, raw in zip(reqs, groups, raw_groups):
                if round_ == 0 or req.sampling.seed is not None:
                    assert [s.completion_ids for s in raw.samples] == [s.completion_ids for s in group.samples]
                check_group(raw, req, ref_model, "raw", raw_engine.tokenizer, version)
            # A seeded request alone, or in a reshuffled batch, is the same request.
            order = list(range(len(reqs)))
            rng.shuffle(order)
            shuffled = engine.generate([reqs[i] for i in order])
            for pos, i in enumerate(order):
                if reqs[i].sampling.seed is not None:
                    assert_same_samples(groups[i], shuffled[pos], reqs[i].sampling.temperature, f"reshuffled {reqs[i]}")
            for req, group in zip(reqs, groups):
                if req.sampling.seed is not None:
                    (alone,) = engine.generate([req])
                    assert_same_samples(group, alone, req.sampling.temperature, f"alone {req}")
                    if req.task_id == "dup":
                        twin = next(g for g, r in zip(groups, reqs) if r.prompt_ids == req.prompt_ids and r.sampling == req.sampling)
                        assert_same_samples(group, twin, req.sampling.temperature, "duplicate request")
    # Unseeded requests: reproducible from the engine seed, whatever the batch split.
    reqs = random_requests(rng, short=is_gpt2(model_dir) and rng.random() < 0.3)
    reqs = [GroupRequest(task_id=r.task_id, prompt_ids=r.prompt_ids, sampling=SamplingSpec(
        n=r.sampling.n, temperature=r.sampling.temperature or 1.0, max_new_tokens=r.sampling.max_new_tokens)) for r in reqs]
    with HFEngine(model_dir, seed=engine_seed) as a, HFEngine(model_dir, seed=engine_seed, max_batch_rows=rng.randint(1, 5)) as b:
        for ga, gb, req in zip(a.generate(reqs), b.generate(reqs), reqs):
            assert_same_samples(ga, gb, req.sampling.temperature, f"unseeded {req}")


@pytest.mark.parametrize("seed", SEEDS)
def test_trainer_recomputes_the_engines_logprobs(seed, model_dir, ref_model):
    """hf_token_logprobs over a mixed-length, left/right-padded batch == what the engine reported,
    at the sampling temperature, for every sample drawn without top-k/top-p (with them the engine
    reports the renormalised distribution, which can only be larger)."""
    rng = random.Random(1000 + seed)
    noise = torch.Generator().manual_seed(seed)
    with HFEngine(model_dir, seed=seed, max_batch_rows=rng.choice([2, 64])) as engine, \
            HFEngine(model_dir, seed=seed, logprobs_mode="raw") as raw_engine:
        reqs = random_requests(rng, count=rng.randint(3, 8), short=is_gpt2(model_dir) and rng.random() < 0.3)
        groups = engine.generate(reqs)
        raw_groups = raw_engine.generate(reqs)
    rows = [(r, g.prompt_ids, s) for r, g in zip(reqs, groups) for s in g.samples]
    # Raw mode: every sample, one batch, temperature 1.
    raw_rows = [(g.prompt_ids, s) for g in raw_groups for s in g.samples]
    for (_, s), got in zip(raw_rows, trainer_logprobs(ref_model, raw_rows, 1.0, noise)):
        torch.testing.assert_close(got, torch.tensor(s.logprobs), atol=tol(1.0), rtol=0)
    # Processed mode: one batch per sampling temperature (greedy samples report T = 1).
    by_temp: dict[float, list] = {}
    for r, p, s in rows:
        by_temp.setdefault(r.sampling.temperature or 1.0, []).append((r, p, s))
    for temperature, group_rows in by_temp.items():
        got = trainer_logprobs(ref_model, [(p, s) for _, p, s in group_rows], temperature, noise)
        for (r, _, s), lp in zip(group_rows, got):
            engine_lp = torch.tensor(s.logprobs)
            filtered = r.sampling.temperature > 0 and (0 < r.sampling.top_k < VOCAB or r.sampling.top_p < 1)
            if filtered:
                assert bool((engine_lp >= lp - tol(temperature)).all()), "a filtered distribution gave a token less mass"
            else:
                torch.testing.assert_close(lp, engine_lp, atol=tol(temperature), rtol=0)


@pytest.mark.parametrize("seed", SEEDS)
def test_update_weights_and_sleep(seed, model_dir, other_dir):
    rng = random.Random(2000 + seed)
    new_state = load_hf_model(other_dir).state_dict()
    with HFEngine(model_dir, seed=seed) as engine:
        reqs = random_requests(rng, short=is_gpt2(model_dir) and rng.random() < 0.3)
        reqs = [GroupRequest(task_id=r.task_id, prompt_ids=r.prompt_ids, sampling=dataclasses.replace(r.sampling, seed=rng.randrange(2**31))) for r in reqs]
        before = engine.generate(reqs)
        engine.sleep()
        assert engine.is_sleeping
        with pytest.raises(EngineStateError, match="asleep"):
            engine.generate(reqs)
        if rng.random() < 0.5:
            engine.sleep()  # idempotent
        engine.wake()
        again = engine.generate(reqs)
        assert ids_and_lps(again) == ids_and_lps(before), "sleep/wake changed the outputs"

        # Push a random subset of the other model's tensors (a partial update is allowed).
        names = sorted(new_state)
        pushed = set(rng.sample(names, rng.randint(1, len(names)))) if rng.random() < 0.5 else set(names)
        if rng.random() < 0.5:
            engine.sleep()  # update_weights wakes it
        version = rng.randint(1, 10**6)
        # As a trainer sends them: maybe bfloat16 (cast back on load), maybe Parameters that
        # require grad, maybe non-contiguous views.
        wire = rng.choice([torch.float32, torch.bfloat16])
        sent = {n: new_state[n].to(wire) for n in names if n in pushed}

        def stream():
            for n, t in sent.items():
                if t.dim() == 2 and rng.random() < 0.5:
                    t = t.t().contiguous().t()  # same values, transposed strides
                yield n, torch.nn.Parameter(t.clone(), requires_grad=t.is_floating_point() and rng.random() < 0.5)

        engine.update_weights(stream(), version=version)
        assert not engine.is_sleeping and engine.policy_version == version
        expected = load_hf_model(model_dir)
        expected.load_state_dict({n: (sent[n].float() if n in sent else t) for n, t in expected.state_dict().items()})
        expected.eval().requires_grad_(False)
        after = engine.generate(reqs)
        for req, group in zip(reqs, after):
            check_group(group, req, expected, "processed", engine.tokenizer, version)
        # The trainer holding the new weights recomputes the new engine's logprobs.
        plain = [(g.prompt_ids, s) for r, g in zip(reqs, after) for s in g.samples
                 if r.sampling.temperature in (0.0, 1.0) and (r.sampling.top_k in (0, VOCAB, VOCAB + 7)) and r.sampling.top_p == 1]
        if plain:
            for (_, s), got in zip(plain, trainer_logprobs(expected, plain, 1.0, None)):
                torch.testing.assert_close(got, torch.tensor(s.logprobs), atol=tol(1.0), rtol=0)


@pytest.mark.parametrize("seed", SEEDS)
def test_draws_follow_the_reported_distribution(seed, model_dir, ref_model):
    """The reported logprobs are only half the promise: the tokens must be drawn from that same
    distribution. Many one-token draws of one prompt against the reference's processed
    probabilities (each count within 5 sigma of its binomial mean)."""
    rng = random.Random(3000 + seed)
    draws = 3000
    prompt = random_prompt(rng)[: MAX_CTX // 2] or [BOS]
    spec = SamplingSpec(
        n=draws, max_new_tokens=1, seed=rng.randrange(2**31), ignore_eos=True,
        temperature=rng.choice([0.3, 0.7, 1.0, 1.5]), top_k=rng.choice([0, 3, 8]), top_p=rng.choice([1.0, 0.9, 0.6]),
    )
    with HFEngine(model_dir) as engine:
        (group,) = engine.generate([GroupRequest(task_id="many", prompt_ids=prompt, sampling=spec)])
    logits = ref_logits(ref_model, prompt, [0])[0].double() / spec.temperature
    keep, loose, _ = filter_edge(logits, spec.top_k, spec.top_p, 4 * LOGIT_NOISE / spec.temperature)
    probs = torch.softmax(logits.masked_fill(~keep, -math.inf), dim=0)
    counts = torch.bincount(torch.tensor([s.completion_ids[0] for s in group.samples]), minlength=VOCAB).double()
    assert bool((counts[~loose] == 0).all()), "drew a token outside the filtered set"
    if not torch.equal(keep, loose):
        return  # the edge is ambiguous: the exact probabilities are not pinned down
    sigma = (draws * probs * (1 - probs)).sqrt()
    assert bool(((counts - draws * probs).abs() <= 5 * sigma + 1).all()), (spec, counts, draws * probs)


def test_prompt_limits(llama_dir):
    ref_model = load_hf_model(llama_dir).eval()
    with HFEngine(llama_dir) as engine:
        with pytest.raises(ValueError, match="empty"):
            GroupRequest(task_id="e", prompt_ids=[])  # an empty prompt is refused before the engine
        with pytest.raises(ValueError, match="context"):
            engine.generate([GroupRequest(task_id="full", prompt_ids=[BOS] * MAX_CTX)])
        with pytest.raises(ValueError, match="vocab size"):
            engine.generate([GroupRequest(task_id="v", prompt_ids=[BOS, VOCAB])])
        # One token short of the context: exactly one token, next to a short prompt that goes on.
        reqs = [
            GroupRequest(task_id="edge", prompt_ids=[BOS] + [7] * (MAX_CTX - 2), sampling=SamplingSpec(n=2, max_new_tokens=50, ignore_eos=True, seed=1)),
            GroupRequest(task_id="short", prompt_ids=[BOS], sampling=SamplingSpec(n=2, max_new_tokens=50, ignore_eos=True, seed=2)),
        ]
        edge, short = engine.generate(reqs)
        assert all(len(s.completion_ids) == 1 and s.finish_reason == "length" for s in edge.samples)
        assert all(len(s.completion_ids) == MAX_CTX - 1 and s.finish_reason == "length" for s in short.samples)
        for req, group in zip(reqs, (edge, short)):
            check_group(group, req, ref_model, "processed", engine.tokenizer, 0)


# ----- bugs found (fixed; minimal reproducers) ----------------------------------------------------------
#
# A row that has finished (stop token, max_new_tokens, or the context limit) keeps being decoded so
# the batch stays rectangular, and its position id keeps growing (hf.py, _decode: ``step_pos =
# step_pos[:, -1:] + 1``), past ``max_context`` when it is a prompt near the context. Harmless for
# the default RoPE the random test uses, but the module docstring promises "any local Hugging Face
# causal LM" where "each row computes what it would compute alone".


def _edge_and_short(max_ctx: int) -> list[GroupRequest]:
    """A prompt one token short of the context (finishes after one token) next to a short prompt
    that goes on decoding: the first row's positions then run past the context."""
    return [
        GroupRequest(task_id="edge", prompt_ids=[BOS] + [5] * (max_ctx - 2), sampling=SamplingSpec(max_new_tokens=5, seed=0, ignore_eos=True)),
        GroupRequest(task_id="short", prompt_ids=[BOS, 5], sampling=SamplingSpec(max_new_tokens=20, seed=0, ignore_eos=True)),
    ]


def test_a_finished_row_past_the_context_leaves_dynamic_rope_rows_alone(tmp_path):
    path = write_tiny_llama(tmp_path / "dynamic-rope", vocab_size=VOCAB, max_position_embeddings=32, seed=0)
    config = json.loads((path / "config.json").read_text())
    config.pop("rope_parameters", None)  # the legacy keys, read by transformers 4.x and 5.x alike
    config.update(rope_scaling={"rope_type": "dynamic", "factor": 4.0}, rope_theta=10000.0)
    (path / "config.json").write_text(json.dumps(config))
    edge, short = _edge_and_short(32)
    with HFEngine(path) as engine:
        (alone,) = engine.generate([short])
        _, batched = engine.generate([edge, short])
        reference = ref_logits(engine.model, short.prompt_ids, batched.samples[0].completion_ids)
    expected = torch.log_softmax(reference, dim=-1).gather(1, torch.tensor(batched.samples[0].completion_ids)[:, None]).squeeze(1)
    # What the trainer recomputes (hf_token_logprobs never goes past the context) ...
    torch.testing.assert_close(torch.tensor(batched.samples[0].logprobs), expected, atol=1e-4, rtol=0)
    # ... and what the request gives alone.
    assert batched.samples[0].completion_ids == alone.samples[0].completion_ids


def test_a_finished_row_past_the_context_does_not_crash_learned_positions(tmp_path):
    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=4, bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        transformers.GPT2LMHeadModel(config).save_pretrained(tmp_path / "gpt2")
    edge, short = _edge_and_short(32)
    with HFEngine(tmp_path / "gpt2") as engine:
        assert engine.max_context == 32
        alone = [engine.generate([r])[0] for r in (edge, short)]  # each alone is fine
        batched = engine.generate([edge, short])  # IndexError: index out of range in self
    for a, b in zip(batched, alone):
        assert_same_samples(a, b, 1.0, a.task_id)
