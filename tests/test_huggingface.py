"""Hugging Face ``transformers`` models through zero_core: examples/huggingface_causal_lm.py.

A tiny GPT-2 and a tiny Llama, built from a config on the meta device, their values streamed
in through ``initialize(..., init_values=...)``, trained with AdamW in a simulated world:
stages 1, 2 and 3 equal stage 0 bit for bit (``torch.equal``), at 2 and 3 ranks, in float32
and bfloat16. GPT-2 ties its output head to its input embedding; Llama has non-persistent
rotary buffers on the meta device. The engine takes the model's keyword arguments and
returns its ``ModelOutput``.

``transformers`` is an optional test dependency (installed by nox's ``tests`` session).
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

import zero_core
from zero_comm import Communicator, run_simulated

transformers = pytest.importorskip("transformers")

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "huggingface_causal_lm.py"
# Every parameter partitioned (none kept whole for being small), several buckets each.
ZERO_OPTIONS: dict[str, object] = {"persistence_threshold": 0, "bucket_numel": 3000}
STEPS = 3


def test_the_example_names_the_transformers_version_nox_installs() -> None:
    """The example's install hint (and its missing-import message) pins the version the
    tests run: the noxfile's MODEL_ZOO_DEPS."""
    noxfile = (EXAMPLE.parents[1] / "noxfile.py").read_text()
    pinned = re.search(r'MODEL_ZOO_DEPS = \("(transformers==[\d.]+)",\)', noxfile)
    assert pinned is not None, "noxfile.py no longer pins transformers in MODEL_ZOO_DEPS"
    assert EXAMPLE.read_text().count(f"pip install {pinned[1]}") == 2
    assert transformers.__version__ == pinned[1].split("==")[1]


def load_example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("huggingface_causal_lm", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


example = load_example()
# What GPT2LMHeadModel returns.
CausalLMOutput = transformers.modeling_outputs.CausalLMOutputWithCrossAttentions
transformers.logging.set_verbosity_error()  # "loss_type=None ... unrecognized", per model


def final_state(
    comm: Communicator, model: str, stage: int, dtype: str, checkpointing: bool
) -> tuple[dict[str, torch.Tensor], list[float]]:
    engine, losses = example.train(
        comm, example.CONFIGS[model](), stage=stage, dtype=dtype, steps=STEPS,
        zero_options=ZERO_OPTIONS, activation_checkpointing=checkpointing,
    )  # fmt: skip
    assert engine.module.training  # from_config's mode; the library checkpoints only then
    assert engine.module.is_activation_checkpointing == checkpointing
    return engine.full_state_dict(), losses


CASES = [
    *(
        # N = 3 (a sum of three terms has more than one order) in the default run; N = 2
        # in `nox -s slow`, for the time of the default run.
        pytest.param(
            model,
            world_size,
            dtype,
            False,
            id=f"{model}-{world_size}-{dtype}",
            marks=[pytest.mark.slow] if world_size == 2 else [],
        )
        for model in ("gpt2", "llama")
        for world_size in (2, 3)
        for dtype in ("float32", "bfloat16")
    ),
    # The library's activation checkpointing (non-reentrant torch.utils.checkpoint):
    # stage 3 gathers the layers' parameters again for the recomputation.
    pytest.param("llama", 3, "bfloat16", True, id="llama-3-bfloat16-checkpointing"),
]


@pytest.mark.parametrize(("model", "world_size", "dtype", "checkpointing"), CASES)
def test_stages_1_2_and_3_equal_stage_0_bit_for_bit(
    model: str, world_size: int, dtype: str, checkpointing: bool
) -> None:
    def body(comm: Communicator) -> None:
        reference, reference_losses = final_state(comm, model, 0, dtype, checkpointing)
        initial = dict(example.initial_values(example.build_on_meta(example.CONFIGS[model]()), 0))
        same = [k for k in initial if k in reference and torch.equal(initial[k], reference[k])]
        assert not same, f"training did not move {same}"
        for stage in (1, 2, 3):
            state, losses = final_state(comm, model, stage, dtype, checkpointing)
            assert losses == reference_losses, f"stage {stage}: losses {losses}"
            assert state.keys() == reference.keys()
            for key, value in reference.items():
                assert torch.equal(state[key], value), (
                    f"stage {stage}, {key} differs by up to "
                    f"{(state[key] - value).abs().max().item():.3g}"
                )

    run_simulated(world_size, body)


def test_streamed_values_arrive_whole_and_the_tied_head_stays_tied() -> None:
    """At stage 3 on 2 ranks: the state right after initialize is initial_values' (both
    names of the tied weight), no trainable parameter is held whole by the model, and
    after training the head still is the embedding."""
    config = example.tiny_gpt2_config()

    def body(comm: Communicator) -> None:
        model = example.build_on_meta(config)
        values = dict(example.initial_values(model, 7))
        assert "lm_head.weight" not in values  # the tie: one value, under its first name
        engine = zero_core.initialize(
            model, torch.optim.AdamW, zero_core.ZeroConfig(stage=3, **ZERO_OPTIONS),
            comm, optimizer_kwargs={"lr": 1e-2}, init_values=example.initial_values(model, 7),
        )  # fmt: skip
        assert model.lm_head.weight is model.transformer.wte.weight
        for name, p in model.named_parameters():
            # a NaN placeholder of the logical shape: one element, broadcast
            assert p.untyped_storage().nbytes() <= p.element_size(), f"{name} is held whole"
        state = engine.full_state_dict()
        assert state.keys() == {*values, "lm_head.weight"}
        for name, value in values.items():
            assert torch.equal(state[name], value), name
        assert torch.equal(state["lm_head.weight"], values["transformer.wte.weight"])
        tokens = example.batch(0, comm.rank, comm.world_size, config.vocab_size)
        engine.backward(engine(input_ids=tokens, labels=tokens).loss)
        engine.step()
        state = engine.full_state_dict()
        assert not torch.equal(state["lm_head.weight"], values["transformer.wte.weight"])
        assert torch.equal(state["lm_head.weight"], state["transformer.wte.weight"])

    run_simulated(2, body)


def test_meta_buffers_get_the_values_of_a_model_built_on_the_cpu() -> None:
    """Llama's rotary inv_freq (non-persistent, on the meta device) is computed as a CPU
    construction computes it, and reaches the engine's model, cast to the compute dtype."""
    config = example.tiny_llama_config()
    cpu_model = transformers.AutoModelForCausalLM.from_config(config)
    expected = dict(cpu_model.named_buffers())
    meta_model = example.build_on_meta(config)
    given = dict(example.meta_buffer_values(meta_model))
    rotary = {"model.rotary_emb.inv_freq", "model.rotary_emb.original_inv_freq"}
    assert given.keys() == expected.keys() == rotary
    for name, value in expected.items():
        assert torch.equal(given[name], value), name

    def body(comm: Communicator) -> None:
        model = example.build_on_meta(config)
        zero_core.initialize(
            model, torch.optim.AdamW, zero_core.ZeroConfig(stage=3, param_dtype="bf16"),
            comm, init_values=example.initial_values(model, 0),
        )  # fmt: skip
        for name, buffer in model.named_buffers():
            assert torch.equal(buffer, expected[name].to(torch.bfloat16)), name

    run_simulated(2, body)


def test_a_buffer_that_init_weights_does_not_compute_is_an_error() -> None:
    model = example.build_on_meta(example.tiny_gpt2_config())
    model.transformer.register_buffer("mask", torch.ones(4, device="meta"), persistent=False)
    with pytest.raises(ValueError, match=r"does not compute the buffer transformer\.mask"):
        list(example.meta_buffer_values(model))


@pytest.mark.parametrize("stage", [0, 3])
def test_forward_takes_keyword_arguments_and_returns_the_model_output(stage: int) -> None:
    """engine(input_ids=..., labels=...) is the model's call: a CausalLMOutput with .loss
    (float32: the model upcasts the logits for it) and bfloat16 logits. Floating inputs
    (inputs_embeds) are cast to the compute dtype; integer ones (the attention mask, the
    labels) are passed through."""
    config = example.tiny_gpt2_config()

    def body(comm: Communicator) -> None:
        engine, _ = example.train(comm, config, stage=stage, dtype="bfloat16", steps=1)
        tokens = example.batch(5, comm.rank, comm.world_size, config.vocab_size)
        mask = torch.ones_like(tokens)
        generator = torch.Generator().manual_seed(comm.rank)
        embeds = torch.randn(*tokens.shape, config.n_embd, generator=generator)
        with torch.no_grad():
            output = engine(input_ids=tokens, attention_mask=mask, labels=tokens)
            assert isinstance(output, CausalLMOutput)
            assert isinstance(output, transformers.utils.ModelOutput)
            assert output.loss.dtype == torch.float32 and output.loss.ndim == 0
            assert output.logits.dtype == torch.bfloat16
            assert output.logits.shape == (*tokens.shape, config.vocab_size)
            cast = engine(inputs_embeds=embeds, attention_mask=mask, labels=tokens)
            given = engine(inputs_embeds=embeds.bfloat16(), attention_mask=mask, labels=tokens)
            assert torch.equal(cast.logits, given.logits)
            assert torch.equal(cast.loss, given.loss)
        # and a keyword-argument call trains:
        output = engine(input_ids=tokens, attention_mask=mask, labels=tokens)
        engine.backward(output.loss)
        engine.step()

    run_simulated(2, body)
