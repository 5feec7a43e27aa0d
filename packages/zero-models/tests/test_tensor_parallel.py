"""Tensor parallelism against the plain model, for TP degrees 1 to 4 (simulated ranks).

Tolerances: a row-parallel layer sums p partial products across ranks where the plain
model does one matmul, so float32 results differ by rounding, ~1e-6 relative per layer;
over 2 blocks and the loss, 1e-5 relative (and 1e-6 absolute near zero) holds with room.
Where no cross-rank sum is involved (embedding lookup), results are compared exactly.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from torch.nn import functional as F

from zero_comm import Communicator, run_simulated
from zero_models.gpt import GPT, GPTConfig
from zero_models.tp_layers import vocab_parallel_cross_entropy
from zero_models.tp_mappings import gather_last_dim
from zero_models.tp_plan import make_mesh, tensor_parallel_gpt

CONFIG = GPTConfig(vocab_size=264, context=16, layers=2, heads=12, width=48)
TOKENS = torch.randint(0, 264, (2, 16), generator=torch.Generator().manual_seed(0))
TARGETS = torch.roll(TOKENS, -1, dims=1)


def reference() -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    model = GPT(CONFIG, seed=3)
    logits = model(TOKENS)
    loss = F.cross_entropy(logits.view(-1, CONFIG.vocab_size), TARGETS.view(-1))
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return logits.detach(), loss.detach(), grads


def shard_of(name: str, full: torch.Tensor, rank: int, p: int) -> torch.Tensor:
    """The slice of a full (TP = 1) tensor that rank ``rank`` of ``p`` holds."""
    if name in ("wte.weight", "lm_head.weight"):
        rows = full.shape[0] // p
        return full[rank * rows : (rank + 1) * rows]
    if name.endswith(("attn.qkv.weight", "attn.qkv.bias")):
        thirds = full.chunk(3, dim=0)
        return torch.cat([t.chunk(p, dim=0)[rank] for t in thirds])
    if name.endswith(("mlp.fc.weight", "mlp.fc.bias")):
        return full.chunk(p, dim=0)[rank]
    if name.endswith(("attn.proj.weight", "mlp.proj.weight")):
        return full.chunk(p, dim=1)[rank]
    return full


@pytest.mark.parametrize("p", [1, 2, 3, 4])
def test_tp_matches_the_plain_model(p: int) -> None:
    full_logits, full_loss, full_grads = reference()

    def body(comm: Communicator) -> None:
        model = tensor_parallel_gpt(GPT(CONFIG, seed=3), comm)
        plain = GPT(CONFIG, seed=3)
        for name, param in model.named_parameters():  # TP init = slices of TP = 1 init
            assert torch.equal(param, shard_of(name, dict(plain.named_parameters())[name],
                                                  comm.rank, p)), name  # fmt: skip
        assert torch.equal(model.wte(TOKENS), plain.wte(TOKENS))  # exact: no sum involved
        h = plain.blocks[0].ln_1(plain.wte(TOKENS) + plain.wpe(torch.arange(16)))
        column = model.blocks[0].attn.qkv(h)  # this rank's heads of q, k, v: no sum either
        whole = plain.blocks[0].attn.qkv(h)
        assert torch.equal(column, shard_of("attn.qkv.bias", whole.transpose(0, -1), comm.rank, p)
                           .transpose(0, -1))  # fmt: skip
        logits = model(TOKENS)
        loss = vocab_parallel_cross_entropy(logits, TARGETS, comm)
        loss.backward()
        gathered = gather_last_dim(logits.detach(), comm)
        torch.testing.assert_close(gathered, full_logits, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(loss.detach(), full_loss, rtol=1e-5, atol=1e-6)
        for name, param in model.named_parameters():
            expected = shard_of(name, full_grads[name], comm.rank, p)
            torch.testing.assert_close(param.grad, expected, rtol=1e-4, atol=1e-6, msg=name)

    run_simulated(p, body)


def test_sizes_that_do_not_divide_are_named() -> None:
    def body(comm: Communicator) -> None:
        with pytest.raises(
            ValueError, match="heads=12 does not divide over tensor-parallel degree 5"
        ):
            tensor_parallel_gpt(GPT(CONFIG), comm)

    run_simulated(5, body)

    def mesh(comm: Communicator) -> None:
        with pytest.raises(ValueError, match="world size 3 does not divide by tensor-parallel"):
            make_mesh(comm, 2)

    run_simulated(3, mesh)


def test_a_mesh_splits_rows_and_columns() -> None:
    def body(comm: Communicator) -> tuple[int, int, int, int]:
        mesh = make_mesh(comm, 2)
        return mesh.tp.rank, mesh.tp.world_size, mesh.dp.rank, mesh.dp.world_size

    assert run_simulated(4, body) == [(0, 2, 0, 2), (1, 2, 0, 2), (0, 2, 1, 2), (1, 2, 1, 2)]


def test_the_plain_model_is_untouched_by_building_a_plan() -> None:
    model = GPT(CONFIG, seed=3)
    before = copy.deepcopy(model.state_dict())
    run_simulated(1, lambda comm: tensor_parallel_gpt(copy.deepcopy(model), comm))
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def train_on_mesh(comm: Communicator, tp_size: int, stage: int) -> list[float]:
    """Three AdamW steps with clipping on a tp x dp mesh; the global batch is the same
    whatever the mesh (each data-parallel rank takes its rows)."""
    import zero_core
    from zero_models.data import BatchSampler
    from zero_models.tp_plan import sharded_parameters

    mesh = make_mesh(comm, tp_size)
    model = tensor_parallel_gpt(GPT(CONFIG, seed=3), mesh.tp)
    sharded = sharded_parameters(model)
    engine = zero_core.initialize(
        model,
        torch.optim.AdamW(model.parameters(), lr=1e-3),
        zero_core.ZeroConfig(stage=stage, clip_grad_norm=0.5, persistence_threshold=0),
        mesh.dp,
        model_parallel=zero_core.ModelParallel.of(mesh.tp, sharded),
    )
    tokens = torch.arange(5000) % 264
    sampler = BatchSampler(tokens, context=16, global_batch=4, dp_rank=mesh.dp.rank,
                           dp_size=mesh.dp.world_size, seed=1)  # fmt: skip
    losses = []
    for step in range(3):
        x, y = sampler.batch(step)
        loss = vocab_parallel_cross_entropy(engine(x), y, mesh.tp)
        engine.backward(loss)
        engine.step()
        mean = loss.detach().reshape(1).clone()
        mesh.dp.all_reduce(mean)
        losses.append(mean.item() / mesh.dp.world_size)
    assert engine.last_grad_norm is not None
    return [*losses, engine.last_grad_norm]


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_tp2_x_dp2_trains_like_tp1_x_dp4(stage: int) -> None:
    """Same global batch, same seed: losses and the clipping norm agree within 1e-5
    relative. They cannot be bit-identical: TP sums partial matmuls across ranks (float32
    rounding, ~1e-6 relative per layer, see the module docstring), and Adam's update is
    normalised, so such differences stay at that scale over three steps."""
    plain = run_simulated(4, lambda comm: train_on_mesh(comm, 1, stage))[0]
    split = run_simulated(4, lambda comm: train_on_mesh(comm, 2, stage))[0]
    torch.testing.assert_close(torch.tensor(split), torch.tensor(plain), rtol=1e-5, atol=1e-6)


def nan_in_one_column(comm: Communicator) -> str:
    """tp 2 x dp 2, stage 3 with the optimizer step in backward; a hook turns one
    column-parallel weight's gradient into NaN on tensor-parallel rank 0 only, so only
    that column's data-parallel group holds a NaN in its reduced slices."""
    import zero_core
    from zero_models.tp_plan import sharded_parameters

    mesh = make_mesh(comm, 2)
    model = tensor_parallel_gpt(GPT(CONFIG, seed=3), mesh.tp)
    engine = zero_core.initialize(
        model,
        torch.optim.AdamW(model.parameters(), lr=1e-3),
        zero_core.ZeroConfig(stage=3, optimizer_in_backward=True, nonfinite="raise"),
        mesh.dp,
        model_parallel=zero_core.ModelParallel.of(mesh.tp, sharded_parameters(model)),
    )
    if mesh.tp.rank == 0:
        weight = dict(model.named_parameters())["blocks.0.mlp.fc.weight"]
        weight.register_hook(lambda grad: torch.full_like(grad, float("nan")))
    x = TOKENS[mesh.dp.rank : mesh.dp.rank + 1]
    y = TARGETS[mesh.dp.rank : mesh.dp.rank + 1]
    with pytest.raises(FloatingPointError) as raised:
        engine.backward(vocab_parallel_cross_entropy(engine(x), y, mesh.tp))
    engine.close()
    return f"tp{mesh.tp.rank} {raised.value}"


def test_a_nan_in_one_tensor_parallel_column_stops_every_rank_of_the_step_in_backward() -> None:
    """The step in backward checks its slices after backward; a NaN that only one
    column's data-parallel group saw must still raise on the other column's ranks (they
    hold the other half of the same layers), which name where it was."""
    for message in run_simulated(4, nan_in_one_column):
        assert "non-finite gradient at step 0" in message, message
        if message.startswith("tp0"):
            assert "in the reduced gradient slices held by data-parallel rank(s)" in message
            assert "blocks.0.mlp.fc.weight" in message, message
        else:
            assert "on a rank of another data-parallel group (tensor parallelism)" in message


def test_a_tensor_parallel_engine_refuses_to_save(tmp_path: Path) -> None:
    """Each data-parallel group of a tp x dp mesh would write its slices into one folder
    under the same file names (a 2 x 2 zero-train run died on a renamed file; luckier
    timing would leave a checkpoint mixed from both): save() refuses, on every rank,
    and writes nothing."""
    import zero_core
    from zero_models.tp_plan import sharded_parameters

    def body(comm: Communicator) -> str:
        mesh = make_mesh(comm, 2)
        model = tensor_parallel_gpt(GPT(CONFIG, seed=3), mesh.tp)
        engine = zero_core.initialize(
            model, torch.optim.AdamW(model.parameters(), lr=1e-3), zero_core.ZeroConfig(stage=3),
            mesh.dp, model_parallel=zero_core.ModelParallel.of(mesh.tp, sharded_parameters(model)),
        )  # fmt: skip
        with pytest.raises(zero_core.CheckpointError) as refused:
            engine.save(tmp_path / "ckpt")
        engine.close()
        return str(refused.value)

    for message in run_simulated(4, body):
        assert "save() of a tensor-parallel engine (2 model-parallel ranks)" in message
    assert not list(tmp_path.iterdir())
