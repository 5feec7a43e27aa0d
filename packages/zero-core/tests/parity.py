"""Random models and training runs for the bit-for-bit property: every stage equals stage 0.

A :class:`ParityCase` describes a model (layer widths, optional tied embedding/head, a
frozen layer, two optimizer groups), a precision (and the dtype gradients are reduced in),
an optimizer, accumulation, clipping and
a bucket size. :func:`train` runs it on one communicator and returns the full float32 state
after every applied step. Models and inputs come from explicit generators (never the
global RNG, which the threads of a simulated world share), so every rank and every stage
starts from the same bits.
"""

from __future__ import annotations

import itertools
import tempfile
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

import zero_core
from zero_comm import Communicator
from zero_core.config.zero_config import DTYPES as CONFIG_DTYPES

OPTIMIZERS = {
    "sgd": (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9}),
    "adam": (torch.optim.Adam, {"lr": 1e-2}),
    "adamw": (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1}),
    "adagrad": (torch.optim.Adagrad, {"lr": 0.05}),
    "rmsprop": (torch.optim.RMSprop, {"lr": 1e-3}),
}
DTYPES = {name: CONFIG_DTYPES[name] for name in ("float32", "bfloat16", "float16")}


@dataclass(frozen=True)
class ParityCase:
    widths: tuple[int, ...] = (5, 7, 3)
    vocab: int = 0  # > 0: token inputs, an embedding and an output head over this vocab
    tie: bool = False  # the head reuses the embedding's weight
    freeze_first: bool = False
    two_groups: bool = False
    dtype: str = "float32"
    optimizer: str = "adamw"
    accumulation: int = 1
    clip: float | None = None
    bucket_numel: int = 1 << 20
    persistence_threshold: int = 0  # stage 3: parameters this small stay whole
    prefetch_numel: int = 1 << 20  # stage 3
    steps: int = 2
    seed: int = 0
    offload_optimizer: str = "none"  # stages 1-3: "cpu" or "disk" (stage 0 never offloads)
    offload_params: str = "none"  # stage 3 only
    offload_fraction: float = 1.0
    sub_group_numel: int = 1 << 22
    offload_gradients: bool = True  # stages 2-3 with offload_optimizer: gradients follow it
    coalesce_numel: int | None = None  # None: ZeroConfig's default
    gather_coalesce_numel: int | None = None  # stage 3; None: ZeroConfig's default
    reduce_dtype: str | None = None  # ZeroConfig.reduce_dtype; None: the compute dtype


class ParityModel(nn.Module):
    """An MLP, optionally between a token embedding and an output head (tied or not)."""

    def __init__(self, case: ParityCase) -> None:
        super().__init__()
        widths = case.widths
        self.embedding = nn.Embedding(case.vocab, widths[0]) if case.vocab else None
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in itertools.pairwise(widths))
        self.head = nn.Linear(widths[-1], case.vocab, bias=False) if case.vocab else None
        if self.head is not None and self.embedding is not None and case.tie:
            self.head.weight = self.embedding.weight
        generator = torch.Generator().manual_seed(case.seed)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=generator) * 0.5)
        if case.freeze_first and len(self.layers) > 1:
            for p in self.layers[0].parameters():
                p.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embedding(x) if self.embedding is not None else x
        for i, layer in enumerate(self.layers):
            h = layer(h)
            if i < len(self.layers) - 1:
                h = torch.tanh(h)
        return self.head(h) if self.head is not None else h


def normalised(case: ParityCase) -> ParityCase:
    """Tying needs the head's input width to equal the embedding's."""
    if case.vocab and case.tie and case.widths[-1] != case.widths[0]:
        return ParityCase(**{**case.__dict__, "widths": (*case.widths, case.widths[0])})
    return case


def micro_batch(case: ParityCase, index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Micro-batch number ``index`` (global across ranks and steps): (input, target)."""
    generator = torch.Generator().manual_seed(case.seed * 7919 + index + 1)
    if case.vocab:
        tokens = torch.randint(0, case.vocab, (3, 4), generator=generator)
        return tokens, torch.roll(tokens, 1, dims=1)
    return torch.randn(4, case.widths[0], generator=generator), torch.zeros(0)


def loss_of(case: ParityCase, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    if case.vocab:
        return nn.functional.cross_entropy(
            output.float().reshape(-1, case.vocab), target.reshape(-1)
        )
    return output.float().square().mean()


def build_engine(
    case: ParityCase, comm: Communicator, stage: int, settings: dict[str, Any] | None = None
) -> zero_core.ZeroEngine:
    """``settings``: more ZeroConfig fields (e.g. ``shard_group_size``). The model is made
    on the CPU, then moved to the communicator's device."""
    model = ParityModel(case).to(comm.device)
    optimizer_class, options = OPTIMIZERS[case.optimizer]
    trainable = [p for p in model.parameters() if p.requires_grad]
    if case.two_groups and len(trainable) > 1:
        half = len(trainable) // 2
        groups: list[dict[str, Any]] = [
            {"params": trainable[:half]},
            {"params": trainable[half:], "lr": options["lr"] * 0.5},
        ]
        if "weight_decay" in options:
            groups[1]["weight_decay"] = 0.0
    else:
        groups = [{"params": trainable}]
    config = zero_core.ZeroConfig(
        stage=stage,
        param_dtype=DTYPES[case.dtype],
        bucket_numel=case.bucket_numel,
        gradient_accumulation_steps=case.accumulation,
        clip_grad_norm=case.clip,
        persistence_threshold=case.persistence_threshold,
        prefetch_numel=case.prefetch_numel,
        **({} if case.reduce_dtype is None else {"reduce_dtype": case.reduce_dtype}),
        **({} if case.coalesce_numel is None else {"coalesce_numel": case.coalesce_numel}),
        **(
            {}
            if case.gather_coalesce_numel is None
            else {"gather_coalesce_numel": case.gather_coalesce_numel}
        ),
        **offload_settings(case, stage),
        **(settings or {}),
    )
    return zero_core.initialize(model, optimizer_class(groups, **options), config, comm)


def offload_settings(case: ParityCase, stage: int) -> dict[str, Any]:
    """The case's offload tiers where the stage has them (none at stage 0, parameters
    at stage 3 only), with swap files under the temporary folder."""
    out: dict[str, Any] = {}
    if stage >= 1 and case.offload_optimizer != "none":
        out["offload_optimizer"] = case.offload_optimizer
        out["offload_fraction"] = case.offload_fraction
        out["offload_sub_group_numel"] = case.sub_group_numel
        out["offload_gradients"] = case.offload_gradients
    if stage == 3 and case.offload_params != "none":
        out["offload_params"] = case.offload_params
    if "disk" in out.values():
        out["offload_dir"] = tempfile.gettempdir()
    return out


def train(
    case: ParityCase,
    comm: Communicator,
    stage: int,
    *,
    settings: dict[str, Any] | None = None,
) -> list[dict[str, torch.Tensor]]:
    """Train ``case.steps`` updates; return the full fp32 state after each applied step.

    Rank r's micro-batch number m of step s is global index
    (s * accumulation + m) * world_size + r.
    """
    case = normalised(case)
    engine = build_engine(case, comm, stage, settings)
    states = run_steps(engine, case, comm, range(case.steps))
    engine.close()
    return states


def run_steps(
    engine: zero_core.ZeroEngine, case: ParityCase, comm: Communicator, steps: range
) -> list[dict[str, torch.Tensor]]:
    """Train ``engine`` (built from ``case``) over ``steps``, the micro-batches of those
    steps moved to the communicator's device; the full fp32 state after each applied step."""
    states = []
    for step in steps:
        for micro in range(case.accumulation):
            x, target = micro_batch(
                case, (step * case.accumulation + micro) * comm.world_size + comm.rank
            )
            x, target = x.to(comm.device), target.to(comm.device)
            loss = loss_of(case, engine(x.to(DTYPES[case.dtype]) if not case.vocab else x), target)
            engine.backward(loss)
            if engine.step():
                states.append(engine.full_state_dict())
    return states


def assert_same_states(
    expected: list[dict[str, torch.Tensor]], actual: list[dict[str, torch.Tensor]], what: str
) -> None:
    assert len(expected) == len(actual), f"{what}: {len(actual)} steps applied, not {len(expected)}"
    for step, (a, b) in enumerate(zip(expected, actual, strict=True)):
        assert a.keys() == b.keys(), f"{what}: keys differ"
        for key in a:
            assert torch.equal(a[key], b[key]), (
                f"{what}: step {step}, {key} differs by up to "
                f"{(a[key] - b[key]).abs().max().item():.3g}"
            )


def stages_equal_stage0(
    comm: Communicator, case: ParityCase, stages: tuple[int, ...] = (1, 2, 3)
) -> None:
    reference = train(case, comm, 0)
    for stage in stages:
        assert_same_states(reference, train(case, comm, stage), f"stage {stage}")


def parity_cases() -> Any:
    """A hypothesis strategy of ParityCase (hypothesis is a test dependency)."""
    from hypothesis import strategies as st

    widths = st.lists(st.sampled_from([1, 2, 3, 5, 7, 15, 33, 130]), min_size=2, max_size=4)

    @st.composite
    def cases(draw: Any) -> ParityCase:
        vocab = draw(st.sampled_from([0, 0, 11]))
        return ParityCase(
            widths=tuple(draw(widths)),
            vocab=vocab,
            tie=vocab > 0 and draw(st.booleans()),
            freeze_first=draw(st.booleans()),
            two_groups=draw(st.booleans()),
            dtype=draw(st.sampled_from(["float32", "bfloat16", "float16"])),
            optimizer=draw(st.sampled_from(["sgd", "adam", "adamw", "adam", "adagrad", "rmsprop"])),
            accumulation=draw(st.sampled_from([1, 1, 2, 3])),
            clip=draw(st.sampled_from([None, None, 0.05, 1e3])),
            bucket_numel=draw(st.sampled_from([1, 64, 300, 5000, 1 << 20])),
            persistence_threshold=draw(st.sampled_from([0, 0, 20, 200])),
            prefetch_numel=draw(st.sampled_from([0, 100, 1 << 20])),
            coalesce_numel=draw(st.sampled_from([None, 0, 128, 600, 1 << 20])),
            gather_coalesce_numel=draw(st.sampled_from([None, 0, 64, 600, 1 << 20])),
            reduce_dtype=draw(st.sampled_from([None, None, "float32"])),
            steps=2,
            seed=draw(st.integers(0, 10_000)),
        )

    return cases()


def tiers_equal_stage0(comm: Communicator, case: ParityCase) -> None:
    """Stages 1-3 with ``case``'s offload tiers equal stage 0 without offload."""
    plain = ParityCase(**{**case.__dict__, "offload_optimizer": "none", "offload_params": "none"})
    reference = train(plain, comm, 0)
    for stage in (1, 2, 3):
        assert_same_states(reference, train(case, comm, stage), f"stage {stage}, {case}")


def offloaded_parity_cases() -> Any:
    """ParityCase with offload tiers drawn too: optimizer states and masters on host or
    disk, parameters (stage 3) on host or disk, a fraction and a sub-group size, and
    whether the gradients follow the optimizer's tier (accumulation, clipping and the
    reduce dtype are drawn by parity_cases)."""
    from hypothesis import strategies as st

    @st.composite
    def cases(draw: Any) -> ParityCase:
        case = draw(parity_cases())
        optimizer = draw(st.sampled_from(["cpu", "disk", "none"]))
        params = draw(st.sampled_from(["cpu", "disk", "none"]))
        if optimizer == params == "none":
            optimizer = "disk"
        if optimizer == "disk" and case.optimizer == "adagrad":
            optimizer = "cpu"  # Adagrad makes its state at construction: refused on disk
        tiers = {
            "offload_optimizer": optimizer,
            "offload_params": params,
            "offload_fraction": draw(st.sampled_from([1.0, 1.0, 0.5, 0.0])),
            "sub_group_numel": draw(st.sampled_from([64, 1000, 1 << 22])),
            "offload_gradients": draw(st.sampled_from([True, True, False])),
        }
        return normalised(ParityCase(**{**case.__dict__, **tiers}))

    return cases()
