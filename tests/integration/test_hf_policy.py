"""The HF policy helpers on a tiny random Llama written to a temp dir (no downloads, CPU):
teacher-forced logprobs agree with what the ``hf`` engine reported, export round-trips, the codec."""

from __future__ import annotations

import json
import shutil

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from elasticrl.policy.codec import TextCodec  # noqa: E402
from elasticrl.policy.hf_policy import (  # noqa: E402
    HFCodec,
    export_hf,
    hf_token_logprobs,
    load_hf_model,
    load_hf_tokenizer,
)
from elasticrl.rollout import GroupRequest, SamplingSpec  # noqa: E402
from elasticrl.rollout.hf import HFEngine  # noqa: E402
from elasticrl.rollout.tiny_llama import write_tiny_llama  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

VOCAB = 64
PAD, BOS, EOS = 0, 1, 2


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), vocab_size=VOCAB, seed=0)


def _batch(groups, pad_id):
    """Left-padded prompts, right-padded completions, as ``batch_from_groups`` lays them out.
    Returns tokens [B, T], valid [B, T], and (row, first column, logprobs) per sample."""
    rows = [(g.prompt_ids, s) for g in groups for s in g.samples]
    width = max(len(p) for p, _ in rows)
    length = max(len(s.completion_ids) for _, s in rows)
    tokens = torch.full((len(rows), width + length), pad_id, dtype=torch.long)
    valid = torch.zeros_like(tokens, dtype=torch.bool)
    expected = []
    for r, (p, s) in enumerate(rows):
        seq = p + s.completion_ids
        tokens[r, width - len(p):width - len(p) + len(seq)] = torch.tensor(seq)
        valid[r, width - len(p):width - len(p) + len(seq)] = True
        expected.append((r, width - 1, s.logprobs))
    return tokens, valid, expected


def test_teacher_forced_logprobs_equal_the_engines(model_dir):
    prompts = {"short": [BOS, 12], "mid": [BOS, 12, 9, 16, 16, 19], "long": [BOS, 5, 6, 7, 8, 9, 10, 11, 20, 21, 22]}
    requests = [
        GroupRequest(task_id=t, prompt_ids=ids, sampling=SamplingSpec(n=4, max_new_tokens=16, seed=11, stop_token_ids=tuple(range(10, 18))))
        for t, ids in prompts.items()
    ]
    with HFEngine(model_dir, seed=3) as engine:
        groups = engine.generate(requests)
    lengths = {len(s.completion_ids) for g in groups for s in g.samples}
    assert len(lengths) > 1, "completions of different lengths exercise the right padding"
    model = load_hf_model(model_dir)
    tokens, valid, expected = _batch(groups, PAD)
    with torch.no_grad():
        got = hf_token_logprobs(model, tokens, valid)
    assert got.shape == (tokens.shape[0], tokens.shape[1] - 1) and got.dtype == torch.float32
    for row, start, lps in expected:
        torch.testing.assert_close(got[row, start:start + len(lps)], torch.tensor(lps), atol=1e-5, rtol=0)
    # Padding rows hold any id: the numbers of the real tokens do not move.
    noisy = torch.where(valid, tokens, torch.full_like(tokens, 40))
    with torch.no_grad():
        again = hf_token_logprobs(model, noisy, valid)
    for row, start, lps in expected:
        torch.testing.assert_close(again[row, start:start + len(lps)], torch.tensor(lps), atol=1e-5, rtol=0)


def test_temperature_and_gradients(model_dir):
    model = load_hf_model(model_dir)
    tokens = torch.tensor([[PAD, PAD, BOS, 12, 9, 16], [BOS, 5, 6, 7, 8, 9]])
    valid = torch.tensor([[False, False, True, True, True, True], [True] * 6])
    with torch.no_grad():
        logits = model(input_ids=tokens[1:, :-1]).logits.float()
    cold = hf_token_logprobs(model, tokens, valid, temperature=0.5)
    expected = torch.log_softmax(logits / 0.5, dim=-1).gather(-1, tokens[1:, 1:, None]).squeeze(-1)
    torch.testing.assert_close(cold[1].detach(), expected[0], atol=1e-5, rtol=0)
    model.train()
    loss = -(hf_token_logprobs(model, tokens, valid)[:, 2:]).sum()
    loss.backward()
    assert model.lm_head.weight.grad is not None and bool(model.lm_head.weight.grad.abs().sum() > 0)
    with pytest.raises(ValueError, match="temperature"):
        hf_token_logprobs(model, tokens, valid, temperature=0)


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits


def test_export_round_trip(model_dir, tmp_path):
    model = load_hf_model(model_dir)
    with torch.no_grad():  # "training": move every weight away from the base checkpoint
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    ids = [BOS, 12, 9, 16, 16, 19, 20]
    out = export_hf(model.state_dict(), model_dir, tmp_path / "export")
    assert (out / "model.safetensors").is_file() and (out / "generation_config.json").is_file()
    assert (out / "tokenizer.json").is_file() and not list(out.glob("*.partial"))
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    torch.testing.assert_close(_logits(loaded, ids), _logits(model, ids), atol=0, rtol=0)
    assert not torch.equal(_logits(load_hf_model(model_dir), ids), _logits(model, ids))
    assert load_hf_tokenizer(out).decode([12, 9]) == load_hf_tokenizer(model_dir).decode([12, 9])

    with pytest.raises(FileExistsError, match="not empty.*overwrite=True"):
        export_hf(model.state_dict(), model_dir, out)
    with pytest.raises(ValueError, match="base directory"):
        export_hf(model.state_dict(), model_dir, model_dir, overwrite=True)
    bf16 = export_hf(model.state_dict(), model_dir, out, overwrite=True, dtype="bfloat16")
    assert json.loads((bf16 / "config.json").read_text()).get("dtype", "bfloat16") == "bfloat16"
    assert transformers.AutoModelForCausalLM.from_pretrained(bf16, local_files_only=True, dtype="auto").dtype == torch.bfloat16


def test_export_rejects_names_and_shapes_the_base_lacks(model_dir, tmp_path):
    state = load_hf_model(model_dir).state_dict()
    with pytest.raises(ValueError, match=r"21 tensors are not in the base checkpoint.*module\.lm_head\.weight.*unwrap"):
        export_hf({"module." + k: v for k, v in state.items()}, model_dir, tmp_path / "a")
    partial = dict(state)
    partial.pop("model.norm.weight")
    with pytest.raises(ValueError, match=r"missing.*model\.norm\.weight"):
        export_hf(partial, model_dir, tmp_path / "b")
    with pytest.raises(ValueError, match=r"model\.norm\.weight.*\(31,\).*\(32,\)"):
        export_hf({**state, "model.norm.weight": torch.zeros(31)}, model_dir, tmp_path / "c")
    assert not (tmp_path / "a").exists(), "nothing is written when the check fails"


def test_export_writes_tied_embeddings_once(model_dir, tmp_path):
    config = transformers.AutoConfig.from_pretrained(model_dir, local_files_only=True)
    config.tie_word_embeddings = True
    torch.manual_seed(1)
    tied = transformers.AutoModelForCausalLM.from_config(config)
    assert tied.lm_head.weight.data_ptr() == tied.model.embed_tokens.weight.data_ptr()
    base = tmp_path / "tied-base"
    tied.save_pretrained(base)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(model_dir / name, base / name)
    with torch.no_grad():
        tied.model.embed_tokens.weight.mul_(1.5)
    out = export_hf(tied.state_dict(), base, tmp_path / "tied-export")
    loaded = load_hf_model(out)
    assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()
    ids = [BOS, 30, 31, 32]
    torch.testing.assert_close(_logits(loaded, ids), _logits(tied, ids), atol=0, rtol=0)
    # A gathered state dict holds an untied copy of the head: still written once.
    copied = {k: v.clone() for k, v in tied.state_dict().items()}
    export_hf(copied, base, tmp_path / "tied-copies")
    torch.testing.assert_close(_logits(load_hf_model(tmp_path / "tied-copies"), ids), _logits(tied, ids), atol=0, rtol=0)


def test_load_errors_say_what_is_missing(model_dir, tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_hf_model(tmp_path / "nothing")
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copyfile(model_dir / "config.json", bare / "config.json")
    with pytest.raises(FileNotFoundError, match=r"no weights \(\*\.safetensors\)"):
        load_hf_model(bare)
    (bare / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(FileNotFoundError, match="pickle weights"):
        load_hf_model(bare)
    with pytest.raises(FileNotFoundError, match="no tokenizer"):
        load_hf_tokenizer(bare)


def test_codec_over_the_tiny_llama_tokenizer(model_dir, tmp_path):
    codec = HFCodec.from_dir(model_dir)
    assert isinstance(codec, TextCodec)
    assert (codec.pad_id, codec.eos_ids, codec.bos_id, codec.vocab_size) == (PAD, (EOS,), BOS, VOCAB)
    ids = codec.encode("abc 12")
    assert ids[0] == BOS and len(ids) == 7 and EOS not in ids
    assert codec.encode("abc 12", bos=False) == ids[1:]
    assert codec.decode(ids + [EOS, PAD]) == "abc 12"
    # The EOS list of generation_config.json wins over the tokenizer's single EOS token.
    many = shutil.copytree(model_dir, tmp_path / "many-eos")
    gen = json.loads((many / "generation_config.json").read_text())
    gen["eos_token_id"] = [EOS, 40]
    (many / "generation_config.json").write_text(json.dumps(gen))
    assert HFCodec.from_dir(many).eos_ids == (EOS, 40)
    # A tokenizer without BOS or pad token: nothing in front, pad falls back to the first EOS.
    tokenizer = load_hf_tokenizer(model_dir)
    tokenizer.bos_token = None
    tokenizer.pad_token = None
    bare = HFCodec(tokenizer, eos_ids=[40, EOS])
    assert bare.bos_id is None and bare.pad_id == 40 and bare.encode("ab") == ids[1:3]
