"""DeepSpeed config keys at values that change nothing are accepted and listed once in
``no_effect``; what cannot be honoured is refused all in one message (issue 46, "Also
found": ``prescale_gradients: false``, ``fp16.fp16_master_weights_and_grads: false`` and
``zero_optimization.cpu_offload: false`` each cost a relaunch before).

The tables of config.deepspeed_inert are the spec: every accepted value of every key
leaves the ZeroConfig as it is without the key; hypothesis draws sets of them over
configs of each precision, and sets of refused keys whose one error names every one."""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import zero_core
from zero_core.config.deepspeed_inert import (
    DISABLED_SECTIONS,
    INERT_KEYS,
    INERT_SECTION_KEYS,
    Inert,
)

BASES: list[dict[str, Any]] = [
    {"zero_optimization": {"stage": 2}},
    {"zero_optimization": {"stage": 3}, "bf16": {"enabled": True}},
    {"zero_optimization": {"stage": 1}, "fp16": {"enabled": True, "initial_scale_power": 8}},
]


def entries() -> list[tuple[str, str | None, Any]]:
    """(section or key, sub-key or None, value) for every accepted value in the tables."""
    out: list[tuple[str, str | None, Any]] = []
    for key, inert in INERT_KEYS.items():
        out += [(key, None, value) for value in inert.accepted]
    for section, table in INERT_SECTION_KEYS.items():
        for sub, inert in table.items():
            out += [(section, sub, value) for value in inert.accepted]
    out += [(section, "enabled", False) for section in DISABLED_SECTIONS]
    return out


def refused_value(inert: Inert) -> Any:
    """A value of the key's kind that is not among its accepted ones (None if none is)."""
    first = inert.accepted[0]
    if isinstance(first, bool):
        return None if set(inert.accepted) == {True, False} else not first
    if first is None:
        return "fp32"
    if isinstance(first, str):
        return "sometimes"
    if isinstance(first, dict):
        return {"pipeline_stage": True}
    return first + 7


def refusals() -> list[tuple[str, str | None, Any]]:
    out: list[tuple[str, str | None, Any]] = []
    for key, inert in INERT_KEYS.items():
        if refused_value(inert) is not None:
            out.append((key, None, refused_value(inert)))
    for section, table in INERT_SECTION_KEYS.items():
        for sub, inert in table.items():
            if refused_value(inert) is not None and sub not in (
                "cpu_offload",
                "cpu_offload_param",
                "cpu_offload_use_pin_memory",
            ):
                out.append((section, sub, refused_value(inert)))
    out += [(section, "enabled", True) for section in DISABLED_SECTIONS]
    return out


def with_entries(base: dict[str, Any], chosen: list[tuple[str, str | None, Any]]) -> dict[str, Any]:
    config = copy.deepcopy(base)
    for key, sub, value in chosen:
        if sub is None:
            config[key] = value
        else:
            config.setdefault(key, {})[sub] = value
    return config


def path(key: str, sub: str | None) -> str:
    whole_section = sub is None or (sub == "enabled" and key in DISABLED_SECTIONS)
    return key if whole_section else f"{key}.{sub}"


@given(
    base=st.sampled_from(BASES),
    chosen=st.lists(st.sampled_from(entries()), min_size=1, max_size=8,
                    unique_by=lambda e: (e[0], e[1])),
)  # fmt: skip
def test_keys_at_values_that_change_nothing_are_accepted_and_listed(
    base: dict[str, Any], chosen: list[tuple[str, str | None, Any]]
) -> None:
    plain = zero_core.read_deepspeed(base, world_size=2)
    setup = zero_core.read_deepspeed(with_entries(base, chosen), world_size=2)
    assert setup.zero == plain.zero
    for key, sub, _ in chosen:
        assert any(note.startswith(path(key, sub)) for note in setup.no_effect), (key, sub)


@pytest.mark.parametrize(("key", "sub", "value"), entries(), ids=lambda v: str(v))
def test_each_accepted_value_alone(key: str, sub: str | None, value: Any) -> None:
    """Every row once (hypothesis above mixes them): the three the issue names included."""
    base = BASES[0]
    assert (
        zero_core.read_deepspeed(with_entries(base, [(key, sub, value)]), world_size=2).zero
        == zero_core.read_deepspeed(base, world_size=2).zero
    )


@given(chosen=st.lists(st.sampled_from(refusals()), min_size=2, max_size=6,
                       unique_by=lambda e: (e[0], e[1])))  # fmt: skip
def test_every_refused_key_is_named_in_one_message(
    chosen: list[tuple[str, str | None, Any]],
) -> None:
    with pytest.raises(ValueError) as info:
        zero_core.read_deepspeed(with_entries(BASES[0], chosen), world_size=2)
    message = str(info.value)
    assert f"{len(chosen)} keys cannot be honoured" in message, message
    for key, sub, value in chosen:
        assert f"{path(key, sub)}" in message and repr(value) in message, (key, sub, message)


def test_the_issues_three_keys_are_accepted_and_listed() -> None:
    config = {"prescale_gradients": False, "fp16": {"fp16_master_weights_and_grads": False},
              "zero_optimization": {"stage": 2, "cpu_offload": False}}  # fmt: skip
    setup = zero_core.read_deepspeed(config, world_size=2)
    assert setup.zero == zero_core.read_deepspeed(BASES[0], world_size=2).zero
    assert len(setup.no_effect) == 3, setup.no_effect


def test_deprecated_cpu_offload_true_is_read_as_offload_optimizer_on_the_cpu() -> None:
    old = {"zero_optimization": {"stage": 2, "cpu_offload": True}}
    new = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
    setup = zero_core.read_deepspeed(old, world_size=2)
    assert setup.zero == zero_core.read_deepspeed(new, world_size=2).zero
    assert setup.zero.offload_optimizer == "cpu"
    assert any("read as offload_optimizer" in note for note in setup.no_effect)


def test_prescale_gradients_true_says_why() -> None:
    with pytest.raises(ValueError, match=r"prescale_gradients=True is not supported: .* once"):
        zero_core.read_deepspeed({"prescale_gradients": True}, world_size=2)


@pytest.mark.parametrize(
    ("precision", "value", "reduce_dtype"),
    [({}, "fp32", None), ({"bf16": {"enabled": True}}, "bf16", None), ({}, None, None),
     ({"bf16": {"enabled": True}}, "fp32", torch.float32),
     ({"fp16": {"enabled": True}}, "fp32", torch.float32),
     ({"fp16": {"enabled": True}}, "bf16", "refused"), ({}, "int8", "refused")],
)  # fmt: skip
def test_communication_data_type_is_read_as_reduce_dtype(
    precision: dict[str, Any], value: str | None, reduce_dtype: Any
) -> None:
    """The compute dtype changes nothing; float32 from 16-bit compute is reduce_dtype;
    anything else is refused, naming the choices."""
    config = {**precision, "communication_data_type": value}
    plain = zero_core.read_deepspeed(precision, world_size=2).zero
    if reduce_dtype == "refused":
        with pytest.raises(ValueError, match=r"communication_data_type|reduce_dtype"):
            zero_core.read_deepspeed(config, world_size=2)
        return
    setup = zero_core.read_deepspeed(config, world_size=2)
    assert setup.zero.reduce_dtype is reduce_dtype
    assert dataclasses.replace(setup.zero, reduce_dtype=None) == plain


def test_bfloat16_is_still_read_as_bf16() -> None:
    setup = zero_core.read_deepspeed({"bfloat16": {"enabled": True}}, world_size=2)
    assert str(setup.zero.param_dtype) == "torch.bfloat16"
