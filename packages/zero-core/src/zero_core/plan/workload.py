"""What is trained: a dense decoder-only transformer's shape, precision and batch.

From zero-train's options (its GPT presets are mirrored in :data:`GPT_PRESETS`, since
zero_core may not import zero_models; a test in zero-models holds them equal), from a
Hugging Face ``config.json``, or from ``--params/--layers/--width``. The parameter count
is zero_models.gpt's (weights tied, biases included)::

    Ψ = V C + T C + L (12 C^2 + 13 C) + 2 C         (C width, T context, V vocabulary)
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ..estimate.activations import TransformerShape

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


@dataclass(frozen=True)
class GPTShape:
    """zero_models.gpt.GPTConfig's shape fields (mirrored; see the module docstring)."""

    vocab_size: int = 256
    context: int = 128
    layers: int = 4
    heads: int = 4
    width: int = 128


GPT_PRESETS = {
    "test": GPTShape(context=32, layers=2, heads=2, width=32),
    "tiny": GPTShape(context=64, layers=2, heads=4, width=64),
    "small": GPTShape(context=128, layers=4, heads=4, width=128),
    "gpt2": GPTShape(vocab_size=50257, context=1024, layers=12, heads=12, width=768),
    "gpt2-medium": GPTShape(vocab_size=50257, context=1024, layers=24, heads=16, width=1024),
    "gpt2-xl": GPTShape(vocab_size=50257, context=1024, layers=48, heads=25, width=1600),
}


def gpt_params(vocab: int, context: int, layers: int, width: int) -> int:
    """zero_models.gpt.GPTConfig.num_params (tied weights): the module docstring's Ψ."""
    c = width
    return vocab * c + context * c + layers * (12 * c * c + 13 * c) + 2 * c


@dataclass(frozen=True)
class Workload:
    """One training step's work: ``params`` (Ψ), the transformer's shape, ``batch_size``
    sequences per micro-step over all data-parallel ranks (zero-train's --batch-size),
    ``accumulation`` micro-steps per step, the compute ``dtype`` and the dtype gradients
    are reduced in (``reduce_dtype``, None: ``dtype``), and the optimizer's float32 state
    bytes per parameter besides its master (AdamW: 8)."""

    params: float
    layers: int
    width: int
    heads: int
    vocab_size: int
    context: int
    batch_size: int = 16
    accumulation: int = 1
    dtype: str = "fp32"
    reduce_dtype: str | None = None
    optimizer_state_bytes: int = 8
    name: str = ""

    def __post_init__(self) -> None:
        for key in ("layers", "width", "heads", "vocab_size", "context", "batch_size",
                    "accumulation"):  # fmt: skip
            value = getattr(self, key)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"Workload.{key}={value!r} must be an integer >= 1")
        if not 0 < self.params < math.inf:
            raise ValueError(f"Workload.params={self.params!r} must be a number > 0")
        for key in ("dtype", "reduce_dtype"):
            value = getattr(self, key)
            if value is not None and value not in DTYPE_BYTES:
                raise ValueError(f"Workload.{key}={value!r}: one of {sorted(DTYPE_BYTES)}")

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def grad_bytes(self) -> int:
        return DTYPE_BYTES[self.reduce_dtype or self.dtype]

    def tokens_per_rank(self, data_parallel: int) -> int:
        """Tokens one rank computes per micro-step: (batch / N) x context."""
        if self.batch_size % data_parallel:
            raise ValueError(
                f"batch_size={self.batch_size} does not divide over {data_parallel} "
                "data-parallel ranks; give a multiple of the rank count"
            )
        return self.batch_size // data_parallel * self.context

    def shape(self, data_parallel: int) -> TransformerShape:
        """zero_core.estimate.activations' shape at ``data_parallel`` ranks."""
        return TransformerShape(
            self.layers, self.width, self.heads, self.vocab_size,
            self.tokens_per_rank(data_parallel),
        )  # fmt: skip

    def with_(self, **changes: Any) -> Workload:
        return replace(self, **changes)


def workload_from_gpt(
    model: str = "small", *, batch_size: int = 16, accumulation: int = 1, dtype: str = "fp32",
    reduce_dtype: str | None = None, **overrides: int | None,
) -> Workload:  # fmt: skip
    """zero-train's GPT: the preset ``model`` with zero-train's --layers/--heads/--width/
    --context overrides (None: the preset's)."""
    if model not in GPT_PRESETS:
        raise ValueError(f"model {model!r}: one of {sorted(GPT_PRESETS)}")
    shape = replace(GPT_PRESETS[model], **{k: v for k, v in overrides.items() if v is not None})
    return Workload(
        params=gpt_params(shape.vocab_size, shape.context, shape.layers, shape.width),
        layers=shape.layers, width=shape.width, heads=shape.heads,
        vocab_size=shape.vocab_size, context=shape.context, batch_size=batch_size,
        accumulation=accumulation, dtype=dtype, reduce_dtype=reduce_dtype, name=model,
    )  # fmt: skip


def workload_from_params(
    params: float, layers: int, width: int, *, heads: int | None = None,
    vocab_size: int = 50257, context: int = 1024, **rest: Any,
) -> Workload:  # fmt: skip
    """``--params/--layers/--width``: heads default to width / 128 (at least 1)."""
    return Workload(
        params=params, layers=layers, width=width,
        heads=heads or max(1, width // 128), vocab_size=vocab_size, context=context,
        name=f"{params:.3g} params", **rest,
    )  # fmt: skip


_HF_KEYS = {
    "layers": ("num_hidden_layers", "n_layer", "num_layers"),
    "width": ("hidden_size", "n_embd", "d_model"),
    "heads": ("num_attention_heads", "n_head"),
    "vocab_size": ("vocab_size",),
    "context": ("max_position_embeddings", "n_positions", "n_ctx", "seq_length"),
}


def workload_from_hf_config(path: Path, **rest: Any) -> Workload:
    """A Hugging Face ``config.json``: its layers, width, heads, vocabulary and context;
    Ψ counted as a dense GPT-2-style transformer: V C (+ V C untied) + L (4 C^2 + 2 C F +
    13 C) + 2 C, with F = intermediate_size (4 C if absent; 3 C F for gated MLPs) and T C
    learned positions where the config has n_positions (biases and LayerNorms as GPT-2's:
    within a fraction of a percent for models without them).
    ``context`` in ``rest`` (the sequence length trained) overrides the config's."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"Hugging Face config {path}: {exc}") from exc
    found: dict[str, int] = {}
    for field, keys in _HF_KEYS.items():
        for key in keys:
            if isinstance(data.get(key), int):
                found[field] = data[key]
                break
        else:
            raise ValueError(f"Hugging Face config {path}: none of {list(keys)} (the {field})")
    c, v, layers = found["width"], found["vocab_size"], found["layers"]
    ffn = data.get("intermediate_size") or data.get("n_inner") or 4 * c
    gated = data.get("hidden_act") in ("silu", "swiglu") or "llama" in str(data.get("model_type"))
    mlp = (3 if gated else 2) * c * ffn
    untied = not data.get("tie_word_embeddings", True)
    positions = found["context"] * c if "n_positions" in data else 0
    params = v * c * (2 if untied else 1) + positions + layers * (4 * c * c + mlp + 13 * c) + 2 * c
    context = rest.pop("context", None) or found["context"]
    return Workload(
        params=float(params), layers=layers, width=c, heads=found["heads"], vocab_size=v,
        context=context, name=str(data.get("_name_or_path") or Path(path).parent.name), **rest,
    )  # fmt: skip
