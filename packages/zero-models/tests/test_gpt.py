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
