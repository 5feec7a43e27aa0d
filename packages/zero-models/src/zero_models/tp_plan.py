"""The plan that makes a GPT tensor-parallel, applied after the model is built (as torchtitan
does): gpt.py itself has no parallel code.

Per block, on a TP group of p ranks (Megatron's partitioning):

    attn.qkv   column-parallel, q/k/v each split, so rank i computes heads [i H/p, (i+1) H/p)
    attn.proj  row-parallel (its all-reduce ends the attention region)
    mlp.fc     column-parallel
    mlp.proj   row-parallel
    wte        vocabulary-parallel; lm_head is its tied weight, giving V/p logits per rank

LayerNorms, wpe and the row-parallel biases stay whole on every rank (their gradients are
the same on every TP rank). Use ``vocab_parallel_cross_entropy`` for the loss.
"""

from __future__ import annotations

from typing import NamedTuple, cast

from torch import nn

from zero_comm import Communicator
from zero_core.estimate.activations import TransformerShape, shape_problem

from .gpt import GPT, Block
from .tp_layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    VocabParallelHead,
)


class Mesh(NamedTuple):
    """A tensor-parallel x data-parallel mesh: TP groups are rows of consecutive ranks."""

    tp: Communicator
    dp: Communicator


def make_mesh(world: Communicator, tp_size: int) -> Mesh:
    """Rows of ``tp_size`` consecutive ranks form TP groups; columns form DP groups."""
    if tp_size < 1 or world.world_size % tp_size:
        raise ValueError(
            f"world size {world.world_size} does not divide by tensor-parallel degree "
            f"{tp_size}; use --tp that divides the number of ranks"
        )
    return Mesh(tp=world.split(color=world.rank // tp_size),
                dp=world.split(color=world.rank % tp_size))  # fmt: skip


def check_tp_degree(config_heads: int, width: int, vocab: int, tp_size: int) -> None:
    """Raise a ValueError naming the size that ``tp_size`` does not divide."""
    problem = shape_problem(TransformerShape(1, width, config_heads, vocab, 1), tp_size)
    if problem:
        raise ValueError(problem)


def tensor_parallel_gpt(model: GPT, tp: Communicator) -> GPT:
    """Replace ``model``'s layers by their TP slices in place; returns ``model``."""
    config = model.config
    check_tp_degree(config.heads, config.width, config.vocab_size, tp.world_size)
    if not config.tie_weights:
        raise ValueError("the tensor-parallel plan expects tied embedding and head weights")
    for module in model.blocks:
        block = cast(Block, module)
        attn, mlp = block.attn, block.mlp
        attn.qkv = ColumnParallelLinear(attn.qkv, tp, groups=3)  # type: ignore[assignment]
        attn.proj = RowParallelLinear(attn.proj, tp)  # type: ignore[assignment]
        attn.heads = config.heads // tp.world_size
        mlp.fc = ColumnParallelLinear(mlp.fc, tp)  # type: ignore[assignment]
        mlp.proj = RowParallelLinear(mlp.proj, tp)  # type: ignore[assignment]
    embedding = VocabParallelEmbedding(model.wte, tp)
    model.wte = embedding  # type: ignore[assignment]
    model.lm_head = VocabParallelHead(embedding.weight, tp)  # type: ignore[assignment]
    return model


def sharded_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters a TP plan split across ranks (everything else is replicated)."""
    sharded = []
    for module in model.modules():
        if isinstance(module, ColumnParallelLinear | VocabParallelEmbedding):
            sharded += list(module.parameters(recurse=False))
        elif isinstance(module, RowParallelLinear):
            sharded.append(module.weight)  # its bias is added after the reduce: replicated
    return sharded
