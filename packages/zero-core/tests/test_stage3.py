"""Stage 3 beyond the parity suite: prefetching, order changes, divergent ranks, the
working set, user access to partitioned parameters, activation checkpointing."""

from __future__ import annotations

import shutil
import tempfile
from typing import Any

import pytest
import torch
from parity import ParityCase, build_engine, loss_of, micro_batch
from torch import nn
from torch.utils.checkpoint import checkpoint

import zero_core
from zero_comm import CollectiveMismatchError, Communicator, run_simulated
from zero_comm.simulated import SimulatedRankError
from zero_core.component_access import sharded_parameters
from zero_core.estimate.link_traffic import backward_head_buckets


class Branchy(nn.Module):
    """Modules used in an order set by ``order``, one used twice, a parent with its own
    parameter, and an optional checkpointed block."""

    def __init__(self, width: int = 8, use_checkpoint: bool = False) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(1)
        self.a, self.b, self.c = (nn.Linear(width, width) for _ in range(3))
        self.scale = nn.Parameter(torch.ones(width))
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=generator) * 0.4)
        self.order = "abc"
        self.use_checkpoint = use_checkpoint

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for name in self.order:
            layer = getattr(self, name)
            if self.use_checkpoint and name == "b":
                # No RNG to preserve here; preserving it makes every simulated rank (a
                # thread) save and fork the process-wide generator at once: one run of the
                # suite at OMP_NUM_THREADS=1 hung with two ranks in torch.get_rng_state.
                x = torch.tanh(checkpoint(layer, x, use_reentrant=False, preserve_rng_state=False))
            else:
                x = torch.tanh(layer(x))
        return self.b(x) * self.scale  # b is used twice; scale belongs to the root


def branchy_engine(comm: Communicator, stage: int, **config: Any) -> zero_core.ZeroEngine:
    model = Branchy(use_checkpoint=config.pop("use_checkpoint", False))
    return zero_core.initialize(
        model,
        torch.optim.AdamW(model.parameters(), lr=0.05),
        zero_core.ZeroConfig(stage=stage, persistence_threshold=0, **config),
        comm,
    )


def train_branchy(
    comm: Communicator, stage: int, orders: list[str], **config: Any
) -> list[dict[str, torch.Tensor]]:
    engine = branchy_engine(comm, stage, **config)
    states = []
    for step, order in enumerate(orders):
        engine.module.order = order
        generator = torch.Generator().manual_seed(step * 10 + comm.rank)
        x = torch.randn(4, 8, generator=generator)
        engine.backward(engine(x).square().mean())
        engine.step()
        states.append(engine.full_state_dict())
    return states


def assert_equal_states(a: list[dict[str, torch.Tensor]], b: list[dict[str, torch.Tensor]]) -> None:
    for sa, sb in zip(a, b, strict=True):
        for key in sa:
            assert torch.equal(sa[key], sb[key]), key


def test_a_change_of_module_order_is_detected_and_results_stay_exact() -> None:
    """Step 3 runs the modules in another order: the gatherer notices (no silent
    mis-prefetch), and every step still equals stage 0 bit for bit."""
    orders = ["abc", "abc", "cab", "cab"]

    def body(comm: Communicator) -> int:
        reference = train_branchy(comm, 0, orders)
        engine_states = train_branchy(comm, 3, orders)
        assert_equal_states(reference, engine_states)
        engine = branchy_engine(comm, 3)
        for order in orders:
            engine.module.order = order
            engine.backward(engine(torch.ones(2, 8)).sum())
            engine.step()
        return sharded_parameters(engine).gatherer.order_changes

    changes = run_simulated(3, body, defer_outputs=True)
    assert changes[0] >= 1 and len(set(changes)) == 1


def test_activation_checkpointing_recomputes_with_gathered_parameters() -> None:
    def body(comm: Communicator) -> None:
        orders = ["abc"] * 3
        assert_equal_states(
            train_branchy(comm, 0, orders, use_checkpoint=True),
            train_branchy(comm, 3, orders, use_checkpoint=True),
        )

    run_simulated(3, body)


@pytest.mark.parametrize(
    ("orders", "where"),
    [(["abc", "acb"], "'parameters of b'"), (["abc", "ac"], "'parameters of b'")],
    ids=["different-order", "one-rank-skips-a-module"],
)
def test_ranks_that_run_different_modules_get_an_error_naming_module_and_ranks(
    orders: list[str], where: str
) -> None:
    def body(comm: Communicator) -> None:
        engine = branchy_engine(comm, 3)
        engine.module.order = orders[comm.rank]
        engine.backward(engine(torch.ones(2, 8)).sum())

    with pytest.raises(SimulatedRankError) as failure:
        run_simulated(2, body, timeout=20)
    cause = failure.value.__cause__
    assert isinstance(cause, CollectiveMismatchError), cause
    message = str(cause)
    assert "rank 0: all_gather" in message and "rank 1: all_gather" in message, message
    assert where in message, message


def gathers_when_layer_starts(
    comm: Communicator, prefetch_numel: int, gather_coalesce_numel: int = 0
) -> list[int]:
    """all_gather calls already issued when layers[2]'s forward starts, per step."""
    case = ParityCase(widths=(16, 16, 16, 16, 16), persistence_threshold=0,
                      prefetch_numel=prefetch_numel,
                      gather_coalesce_numel=gather_coalesce_numel)  # fmt: skip
    engine = build_engine(case, comm, 3)
    seen: list[int] = []
    layer = engine.module.layers[2]  # type: ignore[index]
    layer.register_forward_pre_hook(lambda *_: seen.append(comm.stats["all_gather"].calls))
    for step in range(3):
        comm.stats.reset()
        x, target = micro_batch(case, step * comm.world_size + comm.rank)
        engine.backward(loss_of(case, engine(x), target))
        engine.step()
    return seen


def test_prefetch_gathers_the_next_modules_ahead_after_the_first_step() -> None:
    """Step 1 records the order and gathers on demand (3 gathers when layer 2 starts);
    later steps have issued all four layers' gathers by then. With prefetch off, never."""
    on = run_simulated(2, lambda comm: gathers_when_layer_starts(comm, 1 << 20))[0]
    off = run_simulated(2, lambda comm: gathers_when_layer_starts(comm, 0))[0]
    assert off == [3, 3, 3]
    assert on == [3, 4, 4]


def test_the_units_a_prefetch_starts_share_one_gather_within_the_coalescing_limit() -> None:
    """Later steps demand layers[0] (one gather), then prefetch layers 1-3 (512 elements
    each, padded): one gather for all three within 1536 elements, two within 1535."""
    coalesced = run_simulated(2, lambda comm: gathers_when_layer_starts(comm, 1 << 20, 1536))
    assert coalesced[0] == [3, 2, 2]
    pairs = run_simulated(2, lambda comm: gathers_when_layer_starts(comm, 1 << 20, 1535))
    assert pairs[0] == [3, 3, 3]


def test_the_working_set_is_bounded_by_the_configuration() -> None:
    """Without prefetching (and no unit kept for backward past its first) at most two
    layers are gathered at once (backward reaches the next layer before the previous
    one's gradients are all in); with prefetching, at most max_live_numel elements beyond
    the running modules. The head kept for backward has the prefetch window's size."""
    widths = (64, 64, 64, 64, 64, 64)
    unit = 4352  # weight 4096 + bias 64 -> 128 (BLOCK), bucket padded to 2 x 128 x 17

    def peak(comm: Communicator, prefetch: int, max_live: int) -> int:
        case = ParityCase(widths=widths, persistence_threshold=0)
        engine = build_engine(case, comm, 3)
        sharded_parameters(engine).gatherer.prefetch_numel = prefetch
        sharded_parameters(engine).gatherer.max_live_numel = max_live
        sharded_parameters(engine).gatherer.backward_head_numel = prefetch
        for step in range(3):
            x, target = micro_batch(case, step * 2 + comm.rank)
            engine.backward(loss_of(case, engine(x), target))
            engine.step()
        return sharded_parameters(engine).gatherer.peak_live_numel

    assert run_simulated(2, lambda comm: peak(comm, 0, 1 << 30))[0] <= 2 * unit
    assert run_simulated(2, lambda comm: peak(comm, 1 << 30, 3 * unit))[0] <= 3 * unit + unit
    everything = run_simulated(2, lambda comm: peak(comm, 1 << 30, 1 << 30))[0]
    assert everything == (len(widths) - 1) * unit  # the bound above is what limited it


UNIT = 4352  # one 64-wide layer's bucket (weight and bias, padded)


def steps_with_head(
    comm: Communicator, keep: bool, head_numel: int = 2 * UNIT
) -> tuple[list[Any], list[int], int, list[int]]:
    """Three steps of six 64-wide layers, a prefetch window of two layers: each step's
    state and all-gathered elements, the gatherer's peak, and the backward head."""
    case = ParityCase(widths=(64,) * 7, persistence_threshold=0, prefetch_numel=2 * UNIT)
    settings = {"keep_backward_head": keep, "backward_head_numel": head_numel}
    engine = build_engine(case, comm, 3, settings)
    states, gathered = [], []
    for step in range(3):
        comm.stats.reset()
        x, target = micro_batch(case, step * comm.world_size + comm.rank)
        engine.backward(loss_of(case, engine(x), target))
        engine.step()
        gathered.append(comm.stats["all_gather"].buffer_elements)
        states.append(engine.full_state_dict())
    gatherer = sharded_parameters(engine).gatherer
    return states, gathered, gatherer.peak_live_numel, gatherer.backward_head_numels()


def test_forward_keeps_the_backward_head_for_backward_with_the_same_bits_and_peak() -> None:
    """From the second step on (the first records backward's order), the last layer and
    the two the window holds after it stay gathered from forward to backward: each step
    gathers them once, not twice; the updates are bit for bit those of releasing them,
    and the gathered peak is the same (backward's start gathers exactly those)."""
    on = run_simulated(2, lambda comm: steps_with_head(comm, True))[0]
    off = run_simulated(2, lambda comm: steps_with_head(comm, False))[0]
    assert_equal_states(on[0], off[0])
    head = on[3]
    assert head == [UNIT] * 3 and off[3] == []
    assert on[1][0] == off[1][0]  # no backward record yet
    assert off[1][1:] == [off[1][0]] * 2
    assert on[1][1:] == [off[1][0] - sum(head)] * 2
    assert on[2] == off[2]


@pytest.mark.parametrize("layers", [0, 1, 4, 6])
def test_the_head_is_bounded_by_its_own_window_not_the_prefetch_window(layers: int) -> None:
    """backward_head_numel of 0-6 layers (the prefetch window is 2): the head is the
    first unit and that many more (5 of the 6 layers at most); the same bits, each step
    gathers the head's elements fewer, and the gathered peak grows by what the head holds
    beyond backward's own start (first unit and 2 ahead), no more."""
    on = run_simulated(2, lambda comm: steps_with_head(comm, True, layers * UNIT))[0]
    off = run_simulated(2, lambda comm: steps_with_head(comm, False))[0]
    assert_equal_states(on[0], off[0])
    head = on[3]
    assert head == [UNIT] * min(1 + layers, 6)
    assert head == backward_head_buckets([UNIT] * 6, layers * UNIT)  # zero-estimate's model
    assert on[1][1:] == [off[1][0] - sum(head)] * 2
    assert on[2] == off[2] + max(0, len(head) - 3) * UNIT


def test_the_head_starts_at_backwards_first_unit_that_is_not_persistent() -> None:
    """The last layer (64 -> 2, 130 elements) stays whole under the persistence threshold,
    so backward's record starts with it; with backward_head_numel 0 the head is the next
    layer, the first that backward gathers (it was empty while the rule counted the
    persistent one as backward's first)."""

    def head(comm: Communicator) -> list[int]:
        case = ParityCase(widths=(64,) * 5 + (2,), persistence_threshold=200)
        engine = build_engine(case, comm, 3, {"backward_head_numel": 0})
        for step in range(2):
            x, target = micro_batch(case, step * comm.world_size + comm.rank)
            engine.backward(loss_of(case, engine(x), target))
            engine.step()
        return sharded_parameters(engine).gatherer.backward_head_numels()

    assert run_simulated(2, head)[0] == [64 * 64]  # a weight; biases are whole (persistent)


def test_a_shard_write_releases_the_units_kept_for_backward() -> None:
    """A forward keeps the head; a checkpoint load between it and backward writes the
    shards, so what the user then reads gathered is the loaded values, not forward's."""

    def body(comm: Communicator, folder: str) -> None:
        case = ParityCase(widths=(16,) * 4, persistence_threshold=0)
        engine = build_engine(case, comm, 3)
        for step in range(2):
            x, target = micro_batch(case, step * comm.world_size + comm.rank)
            engine.backward(loss_of(case, engine(x), target))
            engine.step()
            if step == 0:
                engine.save(folder)
                saved = engine.full_state_dict()
        engine(micro_batch(case, comm.rank)[0])  # keeps the head, no backward follows
        assert sharded_parameters(engine).gatherer.backward_head_numels()
        engine.load(folder)
        with engine.gathered_parameters():
            for name, param in engine.module.named_parameters():
                assert torch.equal(param.detach(), saved[name]), name

    folder = tempfile.mkdtemp()
    try:
        run_simulated(2, lambda comm: body(comm, folder))
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def test_partitioned_parameters_keep_their_logical_shape() -> None:
    def body(comm: Communicator) -> None:
        weight = branchy_engine(comm, 3).module.a.weight  # type: ignore[union-attr]
        assert weight.shape == (8, 8) and weight.numel() == 64
        assert torch.isnan(weight).all()  # released: a placeholder, not stale values

    run_simulated(2, body)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gathered_parameters_read_and_modify_at_every_stage(stage: int, dtype: torch.dtype) -> None:
    """Read inside the block; modify with a modifier rank; only the named parameter's
    master values change (in bfloat16 the others keep their float32 bits)."""

    def body(comm: Communicator) -> None:
        engine = branchy_engine(comm, stage, param_dtype=dtype)
        model = engine.module
        weight = model.a.weight  # type: ignore[union-attr]
        before = engine.full_state_dict()
        with engine.gathered_parameters([weight]):
            assert torch.equal(weight.float(), before["a.weight"].to(dtype).float())
        with engine.gathered_parameters([weight], modify=True, modifier_rank=1):
            weight.data.fill_(float(comm.rank + 1))  # rank 1's values win
        after = engine.full_state_dict()
        assert torch.equal(after["a.weight"], torch.full((8, 8), 2.0))
        with engine.gathered_parameters([weight], modifier_rank=0):  # DeepSpeed's habit
            weight.data.fill_(float(comm.rank + 5))  # without modify=True: kept all the same
        assert torch.equal(engine.full_state_dict()["a.weight"], torch.full((8, 8), 5.0))
        with engine.gathered_parameters([weight], modify=True, modifier_rank=1):
            weight.data.fill_(float(comm.rank + 1))
        assert all(torch.equal(after[k], before[k]) for k in before if k != "a.weight")
        with engine.gathered_parameters():  # every parameter, e.g. to print or save
            assert torch.equal(model.a.bias.float(), before["a.bias"].to(dtype).float())  # type: ignore[union-attr]
        engine.backward(engine(torch.ones(2, 8, dtype=dtype)).float().sum())
        engine.step()  # the written-back values train on
        assert not torch.equal(engine.full_state_dict()["a.weight"], torch.full((8, 8), 2.0))

    run_simulated(3, body)


def test_a_model_bigger_than_its_shards_is_built_from_the_meta_device() -> None:
    """A model built on the meta device gets its values from init_values, one tensor at
    a time, and equals the same model built whole (every stage)."""

    def body(comm: Communicator) -> None:
        whole = Branchy()
        values = {name: p.detach().clone() for name, p in whole.named_parameters()}
        for stage in (0, 2, 3):
            with torch.device("meta"):
                model = Branchy()
            engine = zero_core.initialize(
                model, torch.optim.SGD(model.parameters(), lr=0.1),
                zero_core.ZeroConfig(stage=stage, persistence_threshold=0), comm,
                init_values=iter(values.items()),
            )  # fmt: skip
            state = engine.full_state_dict()
            assert all(torch.equal(state[k], v) for k, v in values.items()), stage

    run_simulated(2, body)


def test_init_values_errors_name_the_tensor() -> None:
    def body(comm: Communicator) -> None:
        with torch.device("meta"):
            model = Branchy()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        config = zero_core.ZeroConfig(stage=3)
        with pytest.raises(ValueError, match="parameter scale is on the meta device"):
            zero_core.initialize(model, optimizer, config, comm)
        with pytest.raises(ValueError, match=r"init_values\['a.weight'\] has shape \(2,\)"):
            zero_core.initialize(model, optimizer, config, comm,
                                 init_values=[("a.weight", torch.zeros(2))])  # fmt: skip
        with pytest.raises(ValueError, match="'nope', which is not a parameter"):
            zero_core.initialize(model, optimizer, config, comm,
                                 init_values=[("nope", torch.zeros(2))])  # fmt: skip
        with pytest.raises(ValueError, match=r"gave them no value: scale, a\.weight"):
            zero_core.initialize(model, optimizer, config, comm, init_values=[])

    run_simulated(1, body)


def test_memory_report_counts_persistent_parameters_whole() -> None:
    """Parameters of at most persistence_threshold elements stay gathered: the report's
    parameters are the (2-byte) compute shards plus those, whole, and nothing else once
    a step is over."""
    case = ParityCase(widths=(37, 300, 129, 5), dtype="bfloat16", optimizer="adam",
                      persistence_threshold=200)  # fmt: skip

    def body(comm: Communicator) -> tuple[int, int, int]:
        engine = build_engine(case, comm, 3)
        x, target = micro_batch(case, comm.rank)
        engine.backward(loss_of(case, engine(x.to(torch.bfloat16)), target))
        engine.step()
        shard = sum(layout.shard_numel for layout in engine.layouts)  # type: ignore[attr-defined]
        plan = sharded_parameters(engine).plan
        persistent = sharded_parameters(engine).gatherer.units[plan.persistent]
        assert sorted(slot.numel for slot in persistent.slots) == [5, 129]
        return engine.memory_report().parameters, shard, persistent.numel

    for parameters, shard, persistent in run_simulated(3, body):
        assert parameters == 2 * shard + 2 * persistent
