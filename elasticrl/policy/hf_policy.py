"""Training a Hugging Face causal LM as the policy: load it, score tokens, write it back out.

The trainer needs three things from an HF checkpoint that the rollout engines do not: the
log-probability of every sampled token under the weights being trained (``hf_token_logprobs``,
with the same left-padding, position-id and mask conventions as ``elasticrl.rollout.hf.HFEngine``,
so the numbers match what the engine reported while sampling), the tokenizer behind the loop's
``TextCodec`` surface (``HFCodec``), and a way to turn trained weights into a directory that
``from_pretrained`` and vLLM load (``export_hf``). Local files only, safetensors only (no pickle).
torch and transformers are imported inside the functions, so importing this module is cheap.
"""

from __future__ import annotations

import json
import logging
import os
import pathlib
import shutil
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from elasticrl.rollout.hf_dir import (
    TOKENIZER_FILES, check_model_dir, eos_token_ids, has_tokenizer, tied_embeddings, weights_problem,
)

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

WEIGHTS_NAME = "model.safetensors"
CONFIG_FILES = ("config.json", "generation_config.json")
# Every file a tokenizer may keep next to the model; export copies those the base directory has.
TOKENIZER_COPY_FILES = (
    *TOKENIZER_FILES,
    "special_tokens_map.json", "added_tokens.json", "merges.txt", "vocab.txt", "spiece.model",
    "chat_template.jinja", "chat_template.json",
)
_STALE_WEIGHT_GLOBS = ("*.safetensors", "*.safetensors.index.json", "*.bin", "*.bin.index.json")


# ----- scoring -----------------------------------------------------------------------------------


def hf_token_logprobs(model: Any, tokens: torch.Tensor, valid: torch.Tensor, *, temperature: float = 1.0) -> torch.Tensor:
    """Teacher-forced log-probability of every token given the ones before it, for an HF causal LM.

    tokens: [B, T] ids, prompts left-padded and completions right-padded (any valid id on padding);
    valid: [B, T] bool, False on padding. Returns [B, T - 1] float32: entry t is
    log p(tokens[:, t + 1] | tokens[:, :t + 1]) under ``log_softmax(logits / temperature)``
    (entries that predict padding are meaningless; mask them). Same contract as
    ``elasticrl.policy.tiny.token_logprobs``; positions count real tokens only
    (``cumsum(valid) - 1``) and padding is masked out of attention, as in ``HFEngine``, so at
    temperature 1 these equal the logprobs the engine reported for a float32 model. Gradients flow
    when the caller has them enabled.
    """
    import torch

    if tokens.shape != valid.shape or tokens.dim() != 2:
        raise ValueError(f"hf_token_logprobs: tokens {tuple(tokens.shape)} and valid {tuple(valid.shape)} must both be [B, T]")
    if not temperature > 0:
        raise ValueError(f"hf_token_logprobs: temperature {temperature!r} must be > 0 (the sampling temperature, 1 for none)")
    inputs = tokens[:, :-1]
    mask = valid[:, :-1].long()  # [B, T-1]
    positions = (mask.cumsum(dim=1) - 1).clamp(min=0)
    logits = model(input_ids=inputs, attention_mask=mask, position_ids=positions, use_cache=False).logits.float()  # [B, T-1, V]
    if temperature != 1.0:
        logits = logits / temperature
    targets = tokens[:, 1:, None]
    # gather - logsumexp: the same numbers as log_softmax(...).gather(...) without a second [B, T-1, V].
    return logits.gather(-1, targets).squeeze(-1) - torch.logsumexp(logits, dim=-1)


# ----- loading -----------------------------------------------------------------------------------


def _check_weights(path: pathlib.Path) -> None:
    problem = weights_problem(path)
    if problem is not None:
        raise FileNotFoundError(f"{str(path)!r} has a config.json but {problem}; pass a directory written by "
                                "save_pretrained() or export_hf()")


def load_hf_model(path: str | os.PathLike[str], *, dtype: str = "float32", device: str = "cpu") -> Any:
    """``AutoModelForCausalLM`` from a local directory (nothing is downloaded), in eval mode.

    dtype: "float32" (default: exact master weights), "bfloat16", "float16" or "auto".

    Raises:
        FileNotFoundError: no config.json, or no safetensors weights (the message says what to do).
        ValueError: unknown dtype.
    """
    model_dir = check_model_dir(path)
    _check_weights(model_dir)
    import transformers

    from elasticrl.rollout.hf import _dtype_kwarg, _resolve_dtype

    kwargs: dict[str, Any] = {
        _dtype_kwarg(transformers.__version__): _resolve_dtype(dtype), "local_files_only": True, "use_safetensors": True,
    }
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, **kwargs)
    return model.to(device)


def load_hf_tokenizer(path: str | os.PathLike[str]) -> Any:
    """``AutoTokenizer`` from a local directory (nothing is downloaded).

    Raises:
        FileNotFoundError: the directory holds no tokenizer files.
    """
    model_dir = pathlib.Path(path)
    if not has_tokenizer(model_dir):
        raise FileNotFoundError(
            f"{str(model_dir)!r} has no tokenizer (none of {', '.join(TOKENIZER_FILES)}); save the tokenizer "
            "next to the model with tokenizer.save_pretrained(dir)"
        )
    import transformers

    return transformers.AutoTokenizer.from_pretrained(model_dir, local_files_only=True)


# ----- the loop's codec --------------------------------------------------------------------------


class HFCodec:
    """``elasticrl.policy.codec.TextCodec`` over a Hugging Face tokenizer.

    ``encode`` never adds the tokenizer's own special tokens (a chat template or an EOS would
    change the prompt behind the task's back); it puts ``bos_id`` in front when asked and the model
    has one. ``pad_id`` falls back to the first EOS id when the tokenizer has no pad token
    (padding is masked out, so any embeddable id works).

    Args:
        tokenizer: a loaded HF tokenizer.
        eos_ids: ids that end a sample; default: the tokenizer's EOS token.
    """

    def __init__(self, tokenizer: Any, *, eos_ids: Sequence[int] | None = None):
        self.tokenizer = tokenizer
        ids = tuple(int(i) for i in eos_ids) if eos_ids is not None else ()
        if not ids and tokenizer.eos_token_id is not None:
            ids = (int(tokenizer.eos_token_id),)
        if not ids:
            raise ValueError(
                "HFCodec: the tokenizer has no EOS token and no eos_ids were given; pass eos_ids=(...) "
                "with the ids that end a completion"
            )
        self._eos_ids = ids
        bos = tokenizer.bos_token_id
        self._bos_id = int(bos) if bos is not None else None
        pad = tokenizer.pad_token_id
        self._pad_id = int(pad) if pad is not None else ids[0]

    @classmethod
    def from_dir(cls, path: str | os.PathLike[str]) -> "HFCodec":
        """Load the directory's tokenizer; EOS ids from generation_config.json / config.json (as the
        engines read them), else the tokenizer's."""
        tokenizer = load_hf_tokenizer(path)
        model_dir = pathlib.Path(path)
        ids = eos_token_ids(model_dir) if (model_dir / "config.json").is_file() else ()
        return cls(tokenizer, eos_ids=ids or None)

    @property
    def pad_id(self) -> int:
        return self._pad_id

    @property
    def eos_ids(self) -> tuple[int, ...]:
        return self._eos_ids

    @property
    def bos_id(self) -> int | None:
        return self._bos_id

    @property
    def vocab_size(self) -> int:
        return len(self.tokenizer)

    def encode(self, text: str, bos: bool = True) -> list[int]:
        ids = list(self.tokenizer.encode(text, add_special_tokens=False))
        return [self._bos_id, *ids] if bos and self._bos_id is not None else ids

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def __repr__(self) -> str:
        return f"HFCodec({type(self.tokenizer).__name__}, eos={list(self._eos_ids)}, bos={self._bos_id}, pad={self._pad_id})"


# ----- export ------------------------------------------------------------------------------------


def _base_shapes(base: pathlib.Path) -> dict[str, tuple[int, ...]] | None:
    """Name -> shape of every tensor in the base directory's safetensors files (headers only)."""
    from safetensors import safe_open

    files = sorted(base.glob("*.safetensors"))
    if not files:
        return None
    shapes: dict[str, tuple[int, ...]] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a Mapping
                shapes[name] = tuple(f.get_slice(name).get_shape())
    return shapes


def _export_tensors(
    state_dict: Mapping[str, torch.Tensor], base: pathlib.Path, dtype: str | None,
) -> dict[str, torch.Tensor]:
    """The tensors to write: on CPU, contiguous, one copy per storage, checked against the base."""
    import torch

    from elasticrl.rollout.hf import _resolve_dtype

    cast = _resolve_dtype(dtype) if dtype is not None else None
    if cast == "auto":
        raise ValueError("export_hf: dtype 'auto' is not allowed; pass float32, bfloat16, float16 or None (keep)")
    shapes = _base_shapes(base)
    tied = tied_embeddings(base)

    # Tied weights (input and output embeddings) share one storage; safetensors refuses aliases,
    # and from_pretrained re-ties them from the config. Keep the name the base checkpoint uses.
    seen: dict[tuple[int, int, tuple[int, ...], tuple[int, ...]], str] = {}
    kept: dict[str, torch.Tensor] = {}
    for name, tensor in state_dict.items():
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"export_hf: state_dict[{name!r}] is a {type(tensor).__name__}, not a tensor")
        t = tensor.detach()
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()))
        if t.numel() and key in seen:
            other = seen[key]
            if shapes is not None and name in shapes and other not in shapes:
                kept.pop(other)
                kept[name], seen[key] = t, name
            continue
        seen[key] = name
        kept[name] = t
    if shapes is not None:
        if tied and "lm_head.weight" in kept and "lm_head.weight" not in shapes:
            kept.pop("lm_head.weight")  # an untied copy of a tied head (e.g. a gathered FSDP state dict)
        unknown = sorted(set(kept) - set(shapes))
        missing = sorted(set(shapes) - set(kept))
        if unknown:
            raise ValueError(
                f"export_hf: {len(unknown)} tensors are not in the base checkpoint {str(base)!r}, e.g. {unknown[:5]}; "
                "the state dict must use the base model's HF names (unwrap DDP/FSDP prefixes first)"
            )
        if missing:
            raise ValueError(
                f"export_hf: {len(missing)} tensors of the base checkpoint {str(base)!r} are missing, e.g. {missing[:5]}; "
                "pass the full state dict"
            )
        for name, t in kept.items():
            if tuple(t.shape) != shapes[name]:
                raise ValueError(f"export_hf: {name!r} has shape {tuple(t.shape)} but the base checkpoint's is {shapes[name]}")
    else:
        logger.warning("export_hf: %s has no safetensors weights; tensor names and shapes are not checked", base)

    out: dict[str, torch.Tensor] = {}
    storages: set[int] = set()
    for name, t in kept.items():
        t = t.to("cpu")
        if cast is not None and t.is_floating_point():
            t = t.to(cast)
        t = t.contiguous()
        ptr = t.untyped_storage().data_ptr()
        if ptr in storages:  # views into one storage that are not aliases: give each its own
            t = t.clone()
        storages.add(t.untyped_storage().data_ptr())
        out[name] = t
    return out


def export_hf(
    state_dict: Mapping[str, torch.Tensor],
    base_dir: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    overwrite: bool = False,
    dtype: str | None = None,
) -> pathlib.Path:
    """Write trained weights as a self-contained Hugging Face model directory.

    ``out_dir`` gets the base directory's ``config.json`` (and ``generation_config.json``), its
    tokenizer files, and ``state_dict`` as one ``model.safetensors``. Names and shapes are checked
    against the base checkpoint's safetensors headers when it has them; tied aliases are written
    once. ``config.json`` is written last, so a directory that has it is complete.

    Args:
        state_dict: HF checkpoint names -> tensors (any device), e.g. ``model.state_dict()``.
        base_dir: the HF directory the policy was loaded from.
        out_dir: where to write; must be empty or absent unless ``overwrite``.
        overwrite: write into a non-empty ``out_dir``; its old weight files are deleted first.
        dtype: cast floating tensors to "float32", "bfloat16" or "float16"; None keeps them.

    Returns:
        ``out_dir`` as a Path.

    Raises:
        FileNotFoundError: ``base_dir`` has no config.json.
        FileExistsError: ``out_dir`` is not empty and ``overwrite`` is False.
        ValueError: ``out_dir`` is ``base_dir``; a tensor is unknown, missing or of the wrong shape.
    """
    from safetensors.torch import save_file

    base = check_model_dir(base_dir)
    out = pathlib.Path(out_dir)
    if out.exists() and out.resolve() == base.resolve():
        raise ValueError(f"export_hf: out_dir {str(out)!r} is the base directory; pick a new directory")
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"export_hf: out_dir {str(out)!r} is a file; pick a directory")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise FileExistsError(f"export_hf: out_dir {str(out)!r} is not empty; pass overwrite=True or pick a new directory")
    tensors = _export_tensors(state_dict, base, dtype)

    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").unlink(missing_ok=True)  # back only once the directory is complete
    for pattern in _STALE_WEIGHT_GLOBS:
        for stale in out.glob(pattern):
            stale.unlink()
    tmp = out / (WEIGHTS_NAME + ".partial")
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, out / WEIGHTS_NAME)
    for name in TOKENIZER_COPY_FILES:
        if (base / name).is_file():
            shutil.copyfile(base / name, out / name)
    if (base / "generation_config.json").is_file():
        shutil.copyfile(base / "generation_config.json", out / "generation_config.json")
    config = json.loads((base / "config.json").read_text())
    if dtype is not None:
        for key in ("torch_dtype", "dtype"):
            if key in config:
                config[key] = dtype
    tmp_config = out / "config.json.partial"
    tmp_config.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    os.replace(tmp_config, out / "config.json")
    logger.info("export_hf: %d tensors (%.1f MB) from %s -> %s", len(tensors),
                sum(t.numel() * t.element_size() for t in tensors.values()) / 1e6, base, out)
    return out
