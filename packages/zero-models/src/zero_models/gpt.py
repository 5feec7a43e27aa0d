"""A GPT: a decoder-only transformer (Radford et al. 2019), with no parallel code in it.

    tokens (B, T) -> wte + wpe -> L x Block -> ln_f -> lm_head -> logits (B, T, V)
    Block: x + attn(ln_1(x)), then x + mlp(ln_2(x))         (pre-norm, as GPT-2)

Parameters (biases included, weights tied): V*C + T*C + L*(12*C*C + 13*C) + 2*C, where
C = width, T = context, V = vocabulary; GPT-2 small (V=50257, T=1024, L=12, C=768) is
124.4M. Initialisation follows GPT-2: N(0, 0.02), residual projections N(0, 0.02/sqrt(2L)),
biases 0, from an explicit generator so a seed gives the same model on every process.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 256
    context: int = 128
    layers: int = 4
    heads: int = 4
    width: int = 128
    tie_weights: bool = True

    def __post_init__(self) -> None:
        for name in ("vocab_size", "context", "layers", "heads", "width"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"GPTConfig.{name}={value!r} must be an integer >= 1")
        if self.width % self.heads:
            raise ValueError(
                f"width={self.width} does not divide into heads={self.heads}; choose a width "
                f"that is a multiple of {self.heads}"
            )

    @property
    def num_params(self) -> int:
        """Parameters of the model, counted without building it."""
        c = self.width
        embeddings = self.vocab_size * c + self.context * c
        head = 0 if self.tie_weights else self.vocab_size * c
        return embeddings + self.layers * (12 * c * c + 13 * c) + 2 * c + head

    def with_overrides(self, **overrides: int | None) -> GPTConfig:
        changes: dict[str, Any] = {k: v for k, v in overrides.items() if v is not None}
        return replace(self, **changes)


PRESETS = {
    "test": GPTConfig(context=32, layers=2, heads=2, width=32),
    "tiny": GPTConfig(context=64, layers=2, heads=4, width=64),
    "small": GPTConfig(context=128, layers=4, heads=4, width=128),
    "gpt2": GPTConfig(vocab_size=50257, context=1024, layers=12, heads=12, width=768),
    "gpt2-medium": GPTConfig(vocab_size=50257, context=1024, layers=24, heads=16, width=1024),
    "gpt2-xl": GPTConfig(vocab_size=50257, context=1024, layers=48, heads=25, width=1600),
}


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.heads = config.heads
        self.qkv = nn.Linear(config.width, 3 * config.width)
        self.proj = nn.Linear(config.width, config.width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        # chunk(3) and view(.., heads, -1) rather than C: a tensor-parallel plan may give this
        # module a slice of the heads (see tp_plan), and the code must not care.
        q, k, v = self.qkv(x).chunk(3, dim=2)  # 3 x (B, T, C)
        q, k, v = (z.view(b, t, self.heads, -1).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, nh, T, hs)
        out: torch.Tensor = self.proj(y.transpose(1, 2).reshape(b, t, -1))  # (B, T, C)
        return out


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(config.width, 4 * config.width)
        self.proj = nn.Linear(4 * config.width, config.width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.proj(F.gelu(self.fc(x)))  # (B, T, 4C) -> (B, T, C)
        return out


class Block(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.width)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.width)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        out: torch.Tensor = x + self.mlp(self.ln_2(x))
        return out


class GPT(nn.Module):
    def __init__(self, config: GPTConfig, *, seed: int = 0) -> None:
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.width)
        self.wpe = nn.Embedding(config.context, config.width)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.layers))
        self.ln_f = nn.LayerNorm(config.width)
        self.lm_head = nn.Linear(config.width, config.vocab_size, bias=False)
        if config.tie_weights:
            self.lm_head.weight = self.wte.weight
        if not self.wte.weight.is_meta:  # on the meta device: see initial_values
            self.reset_parameters(seed)

    @torch.no_grad()
    def reset_parameters(self, seed: int) -> None:
        for (_, p), (_, value) in zip(
            self.named_parameters(), self.initial_values(seed), strict=True
        ):
            p.copy_(value)

    def initial_values(self, seed: int) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, float32 CPU value) of every parameter, made one at a time: the values
        ``GPT(config, seed=seed)`` starts from. A model built on the meta device takes
        them through ``zero_core.initialize(..., init_values=model.initial_values(seed))``
        and, at stage 3, never exists whole on any rank."""
        generator = torch.Generator().manual_seed(seed)
        residual_std = 0.02 / math.sqrt(2 * self.config.layers)
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                yield name, torch.zeros(p.shape, device="cpu")
            elif ".ln_" in name or name.startswith("ln_f"):
                yield name, torch.ones(p.shape, device="cpu")
            else:
                std = residual_std if name.endswith("proj.weight") else 0.02
                # scaled in place: one tensor, not two, at the build's peak (same bits)
                yield name, torch.randn(p.shape, generator=generator, device="cpu").mul_(std)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        _, t = tokens.shape
        if t > self.config.context:
            raise ValueError(
                f"sequence of {t} tokens is longer than the context {self.config.context}"
            )
        positions = torch.arange(t, device=tokens.device)
        x = self.wte(tokens) + self.wpe(positions)  # (B, T, C)
        for block in self.blocks:
            x = block(x)
        logits: torch.Tensor = self.lm_head(self.ln_f(x))  # (B, T, V)
        return logits

    @torch.no_grad()
    def generate(
        self, prompt: torch.Tensor, new_tokens: int, *, temperature: float = 0.8, seed: int = 0
    ) -> torch.Tensor:
        """Sample ``new_tokens`` after ``prompt`` (B, T0); returns (B, T0 + new_tokens)."""
        generator = torch.Generator().manual_seed(seed)
        tokens = prompt
        for _ in range(new_tokens):
            logits = self(tokens[:, -self.config.context :])[:, -1, :].float()  # (B, V)
            probs = torch.softmax(logits / temperature, dim=-1)
            tokens = torch.cat([tokens, torch.multinomial(probs, 1, generator=generator)], dim=1)
        return tokens
