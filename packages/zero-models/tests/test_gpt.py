"""The GPT: parameter counts, tying, deterministic initialisation, shapes, errors."""

from __future__ import annotations

import pytest
import torch

from zero_models.gpt import GPT, PRESETS, GPTConfig


@pytest.mark.parametrize("name", ["test", "tiny", "small"])
def test_num_params_counts_what_the_model_holds(name: str) -> None:
    config = PRESETS[name]
    model = GPT(config)
    assert sum(p.numel() for p in model.parameters()) == config.num_params
    untied = GPTConfig(**{**config.__dict__, "tie_weights": False})
    assert sum(p.numel() for p in GPT(untied).parameters()) == untied.num_params


def test_presets_match_the_published_sizes() -> None:
    assert PRESETS["gpt2"].num_params == 124_439_808  # GPT-2 small, tied
    assert 1.55e9 < PRESETS["gpt2-xl"].num_params < 1.56e9


def test_weights_are_tied_and_initialisation_depends_only_on_the_seed() -> None:
    a, b, c = GPT(PRESETS["test"], seed=1), GPT(PRESETS["test"], seed=1), GPT(PRESETS["test"])
    assert a.lm_head.weight is a.wte.weight
    pairs = zip(a.state_dict().values(), b.state_dict().values(), strict=True)
    assert all(torch.equal(x, y) for x, y in pairs)
    assert not torch.equal(a.wte.weight, c.wte.weight)


def test_forward_and_generate_shapes() -> None:
    model = GPT(PRESETS["test"])
    tokens = torch.randint(0, 256, (3, 10))
    assert model(tokens).shape == (3, 10, 256)
    assert model.generate(tokens[:, :4], 40).shape == (3, 44)  # past the context of 32
    with pytest.raises(ValueError, match="longer than the context"):
        model(torch.zeros(1, 33, dtype=torch.int64))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [({"width": 30, "heads": 4}, "does not divide into heads=4"), ({"layers": 0}, "layers=0")],
)
def test_bad_sizes_are_named(overrides: dict[str, int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        GPTConfig(**overrides)


def test_built_on_meta_and_partitioned_equals_built_whole() -> None:
    """GPT on the meta device + initial_values(seed), at stage 3 on 3 ranks (every weight
    partitioned, each value sharded as it is made), holds exactly the values of
    GPT(config, seed) built whole; and trains to the same bits as stage 0."""
    import zero_core
    from zero_comm import Communicator, run_simulated

    config = PRESETS["test"]
    tokens = torch.randint(0, config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))

    def engine_for(comm: Communicator, stage: int, meta: bool) -> zero_core.ZeroEngine:
        if meta:
            with torch.device("meta"):
                model = GPT(config, seed=5)
            values = model.initial_values(5)
        else:
            model, values = GPT(config, seed=5), None
        return zero_core.initialize(
            model, torch.optim.AdamW(model.parameters(), lr=1e-2),
            zero_core.ZeroConfig(stage=stage, persistence_threshold=0), comm,
            init_values=values,
        )  # fmt: skip

    def states(engine: zero_core.ZeroEngine) -> list[dict[str, torch.Tensor]]:
        out = [engine.full_state_dict()]
        for _ in range(2):
            logits = engine(tokens)
            loss = torch.nn.functional.cross_entropy(
                logits.view(-1, logits.shape[-1]), tokens.roll(1, 1).reshape(-1)
            )
            engine.backward(loss)
            engine.step()
            out.append(engine.full_state_dict())
        return out

    def body(comm: Communicator) -> None:
        whole = GPT(config, seed=5).state_dict()
        reference = states(engine_for(comm, 0, meta=False))
        partitioned = states(engine_for(comm, 3, meta=True))
        assert all(torch.equal(partitioned[0][k], whole[k].float()) for k in whole)
        for a, b in zip(reference, partitioned, strict=True):
            assert all(torch.equal(a[k], b[k]) for k in a)

    run_simulated(3, body)
