"""A Hugging Face ``transformers`` causal LM trained with ZeRO, built on the meta device.

    python examples/huggingface_causal_lm.py                             # one process
    zero-launch -n 2 python examples/huggingface_causal_lm.py            # 2 ranks, gloo
    python examples/huggingface_causal_lm.py --model llama --dtype bfloat16 --stage 2

The same model under the Hugging Face ``Trainer`` (``zero_core.huggingface.ZeroTrainer``
in place of ``Trainer``) is examples/huggingface_trainer.py.

It needs ``transformers``, tested at 5.24.0: ``./nox -s dev`` puts it in ``.venv``, or
``pip install transformers==5.24.0`` into your own environment.

The model (GPT-2 or Llama, tiny, from a config: nothing is downloaded) is built under
``torch.device("meta")``, so no rank allocates it. ``initial_values`` makes its values one
parameter at a time and ``zero_core.initialize(..., init_values=...)`` takes them as they
come: at stage 3 each rank keeps only its shard of each, and no rank ever holds the whole
model. The engine takes Hugging Face's keyword arguments and returns its ``ModelOutput``:
``engine(input_ids=x, labels=x).loss`` (the model shifts the labels itself).

Two things of a ``transformers`` model need care on the meta device:

- the tied output head: ``lm_head.weight`` *is* the input embedding's weight (GPT-2's
  ``tie_word_embeddings``), so ``named_parameters()`` names it once, as
  ``transformer.wte.weight``; one value gives both, and the engine keeps the tie;
- non-persistent buffers (Llama's rotary ``inv_freq``, older GPT-2's attention masks) are
  on the meta device too. They are not in a checkpoint, so ``initial_values`` computes
  them as ``from_pretrained`` does: it materialises the buffer's own module on the CPU and
  runs the model's ``_init_weights`` on it (for Llama: the rotary frequencies of the config).

The parameter values follow the library's initialisation scheme (``_init_weights``:
normal(0, ``initializer_range``) weights, zero biases, unit norm weights, GPT-2's residual
projections scaled by 1/sqrt(2 * layers)) but come from a generator seeded per name, not
from torch's global random state: the same seed gives the same bits on every rank, in any
order and at any stage, which is what lets every stage equal stage 0 bit for bit.
"""

from __future__ import annotations

import argparse
import copy
import math
import zlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

try:
    from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig, PreTrainedModel
except ImportError as missing:
    raise SystemExit(
        f"{__file__}: {missing}: pip install transformers==5.24.0 (the version tested), or "
        "./nox -s dev and source .venv/bin/activate"
    ) from None

import zero_comm
import zero_core

# Attention: "eager" (plain matmul + softmax) or "sdpa"; both are deterministic on CPU at
# a fixed intra-op thread count. Dropout is off, so a step depends only on the data.
ATTENTION = "eager"


def tiny_gpt2_config(**overrides: Any) -> GPT2Config:
    options: dict[str, Any] = dict(
        n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=32,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
        bos_token_id=0, eos_token_id=0, attn_implementation=ATTENTION,
    )  # fmt: skip
    return GPT2Config(**{**options, **overrides})


def tiny_llama_config(**overrides: Any) -> LlamaConfig:
    options: dict[str, Any] = dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=128, max_position_embeddings=32,
        attention_dropout=0.0, use_cache=False, bos_token_id=0, eos_token_id=0,
        pad_token_id=None, attn_implementation=ATTENTION,
    )  # fmt: skip
    return LlamaConfig(**{**options, **overrides})


CONFIGS = {"gpt2": tiny_gpt2_config, "llama": tiny_llama_config}


def build_on_meta(config: GPT2Config | LlamaConfig) -> PreTrainedModel:
    """The model with every parameter and buffer on the meta device: no memory."""
    with torch.device("meta"):
        model: PreTrainedModel = AutoModelForCausalLM.from_config(config)
    return model


def initial_values(model: PreTrainedModel, seed: int) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, float32 CPU value) of every parameter, then of every buffer left on the meta
    device, made one at a time (the largest is one parameter)."""
    config = model.config
    std = getattr(config, "initializer_range", 0.02)
    # GPT-2's scheme (GPT2PreTrainedModel._init_weights): the projections into the
    # residual stream are scaled down by the number of residual layers.
    residual_std = std / math.sqrt(2 * config.num_hidden_layers)
    norms = {
        name
        for name, module in model.named_modules()
        if isinstance(module, nn.LayerNorm) or "Norm" in type(module).__name__
    }
    gpt2 = config.model_type == "gpt2"
    for name, p in model.named_parameters():  # a tied weight once, under its first name
        owner, _, leaf = name.rpartition(".")
        if owner in norms:
            yield name, torch.ones(p.shape) if leaf == "weight" else torch.zeros(p.shape)
        elif leaf == "bias":
            yield name, torch.zeros(p.shape)
        else:
            generator = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
            scale = residual_std if gpt2 and owner.endswith("c_proj") else std
            yield name, torch.randn(p.shape, generator=generator) * scale
    yield from meta_buffer_values(model)


def meta_buffer_values(model: PreTrainedModel) -> Iterator[tuple[str, torch.Tensor]]:
    """Values for the buffers on the meta device, as ``from_pretrained`` makes them: a
    CPU copy of the buffer's module (a small leaf, such as a rotary embedding) is
    initialised by the model's ``_init_weights``. The copy is filled with NaN first, so a
    buffer that ``_init_weights`` does not compute is an error, not garbage."""
    for prefix, module in model.named_modules():
        names = [n for n, b in module.named_buffers(recurse=False) if b.is_meta]
        if not names:
            continue
        real = copy.deepcopy(module).to_empty(device="cpu")
        with torch.no_grad():
            for tensor in (*real.parameters(), *real.buffers()):
                tensor.fill_(math.nan if tensor.is_floating_point() else 0)
            model._init_weights(real)
        for name in names:
            value = real.get_buffer(name)
            if not value.is_floating_point() or value.isnan().any():
                raise ValueError(
                    f"{type(model).__name__}._init_weights does not compute the buffer "
                    f"{prefix}.{name}: build the model so that it is not on the meta device"
                )
            yield f"{prefix}.{name}" if prefix else name, value


def batch(
    step: int, rank: int, world_size: int, vocab: int, *, rows: int = 4, length: int = 16
) -> torch.Tensor:
    """Rank ``rank``'s micro-batch of step ``step``: counting sequences (each token is the
    previous plus one, modulo the vocabulary) from seeded random starts, so the loss falls
    fast. Every rank gets other rows of one global batch."""
    generator = torch.Generator().manual_seed(step * world_size + rank)
    starts = torch.randint(0, vocab, (rows, 1), generator=generator)
    return (starts + torch.arange(length)) % vocab


def train(
    comm: zero_comm.Communicator,
    config: GPT2Config | LlamaConfig,
    *,
    stage: int,
    dtype: str = "float32",
    steps: int = 5,
    seed: int = 0,
    zero_options: dict[str, Any] | None = None,
    activation_checkpointing: bool = False,
) -> tuple[zero_core.ZeroEngine, list[float]]:
    """Train ``steps`` AdamW steps; return the engine and this rank's loss at each step
    (the loss of its own micro-batch: ranks differ). With ``activation_checkpointing``
    each layer's activations are recomputed in backward (the library's own switch,
    non-reentrant ``torch.utils.checkpoint``)."""
    model = build_on_meta(config)
    if activation_checkpointing:
        model.activation_checkpointing_enable()
    engine = zero_core.initialize(
        model,
        torch.optim.AdamW,
        zero_core.ZeroConfig(stage=stage, param_dtype=dtype, **(zero_options or {})),
        comm,
        optimizer_kwargs={"lr": 3e-3, "weight_decay": 0.1},
        init_values=initial_values(model, seed),
    )
    losses = []
    for step in range(steps):
        tokens = batch(step, comm.rank, comm.world_size, config.vocab_size)
        output = engine(input_ids=tokens, labels=tokens)  # a CausalLMOutput
        engine.backward(output.loss)
        engine.step()
        losses.append(output.loss.item())
    return engine, losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(CONFIGS), default="gpt2")
    parser.add_argument("--stage", type=int, choices=[0, 1, 2, 3], default=3)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--activation-checkpointing", action="store_true")
    args = parser.parse_args()
    comm = zero_comm.init(deterministic=True)
    engine, losses = train(
        comm, CONFIGS[args.model](), stage=args.stage, dtype=args.dtype, steps=args.steps,
        seed=args.seed, activation_checkpointing=args.activation_checkpointing,
    )  # fmt: skip
    state = engine.full_state_dict(rank=0)  # collective: every rank calls it
    if comm.rank == 0:
        print(f"{args.model}, stage {args.stage}, {comm.world_size} ranks, {args.dtype}")
        for step in range(0, len(losses), max(1, len(losses) // 10)):
            print(f"step {step + 1:4d}  loss {losses[step]:.4f}")
        print(f"final loss {losses[-1]:.4f}; {sum(v.numel() for v in state.values()):,} values")


if __name__ == "__main__":
    main()
