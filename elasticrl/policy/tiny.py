"""A tiny causal transformer language model in pure torch, trained from scratch by the demo.

Pre-LayerNorm blocks, learned positions, tied input/output embeddings: about 100 K parameters at
the default size, fast enough on one CPU core to sample and update hundreds of short sequences a
second. Sequences are left-padded so every prompt ends at the same column and sampling appends one
column at a time; positions count real tokens only, so padding does not shift them.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from elasticrl.config import ModelConfig


class Block(nn.Module):
    def __init__(self, d_model: int, n_heads: int):
        super().__init__()
        self.n_heads = n_heads
        self.ln1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor) -> torch.Tensor:
        # x: [B, T, D]; attn_mask: [B, 1, T, T] bool, True where a query may attend to a key.
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.n_heads, d // self.n_heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)  # [B, H, T, D/H]
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class TinyCausalLM(nn.Module):
    def __init__(self, config: ModelConfig, vocab_size: int):
        super().__init__()
        self.config = config
        self.vocab_size = vocab_size
        self.tok = nn.Embedding(vocab_size, config.d_model)
        self.pos = nn.Embedding(config.max_seq_len, config.d_model)
        self.blocks = nn.ModuleList(Block(config.d_model, config.n_heads) for _ in range(config.n_layers))
        self.ln_f = nn.LayerNorm(config.d_model)
        self.apply(self._init)
        for block in self.blocks:  # scale residual writes by depth (GPT-2)
            nn.init.normal_(block.proj.weight, std=0.02 / math.sqrt(2 * config.n_layers))

    @staticmethod
    def _init(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, tokens: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """Next-token logits.

        tokens: [B, T] ids, left-padded; valid: [B, T] bool, False on padding.
        Returns [B, T, V]: position t predicts token t + 1.
        """
        b, t = tokens.shape
        assert t <= self.config.max_seq_len, f"sequence of {t} tokens exceeds policy.max_seq_len={self.config.max_seq_len}"
        positions = (valid.long().cumsum(dim=1) - 1).clamp(min=0)  # [B, T]
        x = self.tok(tokens) + self.pos(positions)
        causal = torch.ones(t, t, dtype=torch.bool, device=tokens.device).tril()
        # A padded query row would attend to nothing (NaN); let it see itself instead.
        mask = (causal & valid[:, None, :]) | torch.eye(t, dtype=torch.bool, device=tokens.device)
        mask = mask[:, None, :, :]  # [B, 1, T, T]
        for block in self.blocks:
            x = block(x, mask)
        return F.linear(self.ln_f(x), self.tok.weight)  # tied embeddings

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())


def token_logprobs(model: nn.Module, tokens: torch.Tensor, valid: torch.Tensor, *, temperature: float = 1.0) -> torch.Tensor:
    """Log-probability of every token given the ones before it, under ``log_softmax(logits / temperature)``
    (the distribution an engine sampling at ``temperature`` drew from and reported logprobs of).

    Returns [B, T - 1]: entry t is log p(tokens[:, t + 1] | tokens[:, :t + 1]).
    """
    if not temperature > 0:
        raise ValueError(f"token_logprobs: temperature {temperature!r} must be > 0 (the sampling temperature, 1 for none)")
    logits = model(tokens[:, :-1], valid[:, :-1]).float()  # [B, T-1, V]
    if temperature != 1.0:
        logits = logits / temperature
    return torch.log_softmax(logits, dim=-1).gather(-1, tokens[:, 1:, None]).squeeze(-1)
