"""A tiny random Llama model with a character-level tokenizer, written as a local HF directory.

For tests and CPU smoke runs of the rollout engines: built offline in well under a second, no
download, loadable by ``AutoModelForCausalLM`` / ``AutoTokenizer`` and by vLLM. Token ids 0-3 are
``<pad> <bos> <eos> <unk>``; then one token per character of ``CHARS``; the rest of the vocabulary
is filler tokens ``<x0> <x1> ...``.
"""

from __future__ import annotations

import os
import pathlib

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
CHARS = " abcdefghijklmnopqrstuvwxyz0123456789.,!?+-=*/:;()'"


def write_tiny_llama(
    model_dir: str | os.PathLike[str],
    *,
    vocab_size: int = 64,
    hidden_size: int = 32,
    intermediate_size: int = 64,
    num_hidden_layers: int = 2,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    max_position_embeddings: int = 128,
    initializer_range: float = 0.3,
    seed: int = 0,
    chars: str = CHARS,
    extra_tokens: tuple[str, ...] = (),
    chat_template: str | None = None,
) -> pathlib.Path:
    """Write config, random weights (safetensors, float32) and tokenizer into ``model_dir``.

    The weights are drawn wider than a real model's (``initializer_range`` 0.3, not 0.02) so that
    attention depends on position and the next-token distributions are far from uniform: a
    padding or position bug then changes the logprobs visibly. vLLM's attention kernels want a head size of at least 32 (``hidden_size / num_attention_heads``);
    the defaults (head size 8) are for the CPU engine.

    ``chars``: the characters that get a token each (more, e.g. newline and ``<>[]``, for the
    bundled web and search envs' pages). ``extra_tokens``: whole-string special tokens after them
    (``"<|im_end|>"``), matched before the characters. ``chat_template``: a Jinja chat template
    saved with the tokenizer (for ``task.chat_template``).
    """
    import torch
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    specials = [PAD, BOS, EOS, UNK]
    if vocab_size < len(specials) + 1:
        raise ValueError(f"vocab_size {vocab_size} must be at least {len(specials) + 1}")
    if len(specials) + len(extra_tokens) + len(chars) > vocab_size:
        raise ValueError(f"vocab_size {vocab_size} is too small for {len(chars)} characters and {len(extra_tokens)} extra tokens")
    tokens = specials + list(extra_tokens) + list(chars)
    tokens += [f"<x{i}>" for i in range(vocab_size - len(tokens))]
    vocab = {tok: i for i, tok in enumerate(tokens)}

    path = pathlib.Path(model_dir)
    path.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")  # one token per char
    tok.decoder = decoders.Fuse()  # join characters back without spaces
    if extra_tokens:
        from tokenizers import AddedToken

        tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in extra_tokens])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=PAD, bos_token=BOS, eos_token=EOS, unk_token=UNK)
    if chat_template is not None:
        fast.chat_template = chat_template
    fast.save_pretrained(path)

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        max_position_embeddings=max_position_embeddings,
        pad_token_id=vocab[PAD],
        bos_token_id=vocab[BOS],
        eos_token_id=vocab[EOS],
        tie_word_embeddings=False,
        initializer_range=initializer_range,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.save_pretrained(path)
    return path
