"""``save_checkpoint(client_state=...)``: the script's own state, kept in the checkpoint.

DeepSpeed pickles ``client_state`` beside its model states. The engine's checkpoint keeps
it in its JSON index (``engine.save(path, extra)``), so here it is converted to JSON and
back, exactly: dicts with string keys, lists, tuples, ``None``, bools, ints, floats
(``nan``/``inf`` included), strings, and tensors (a small header plus base64 of their
bytes; they come back on the CPU, as DeepSpeed loads them, without ``requires_grad``).
Anything else (a numpy array, an argparse Namespace, a dict keyed by ints) is refused
before anything is written, naming where it is, rather than saved as something else.
"""

from __future__ import annotations

import base64
from collections.abc import Mapping
from typing import Any

import torch

TENSOR = "__zero_tensor__"  # marks an encoded tensor
TUPLE = "__zero_tuple__"  # marks an encoded tuple
MARKERS = (TENSOR, TUPLE)


def encode(state: Mapping[str, Any]) -> dict[str, Any]:
    """``state`` as JSON values (see the module doc); TypeError naming the first value
    that cannot be kept exactly."""
    if not isinstance(state, Mapping):
        raise TypeError(f"client_state must be a dict, got {type(state).__name__}")
    return _encode_dict(state, "client_state")


def decode(saved: Mapping[str, Any]) -> dict[str, Any]:
    """What :func:`encode` made, back as it was given."""
    decoded = _decode(dict(saved))
    assert isinstance(decoded, dict)
    return decoded


def _encode_dict(value: Mapping[Any, Any], where: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, item in value.items():
        if not isinstance(key, str):
            raise TypeError(
                f"{where} has the key {key!r} ({type(key).__name__}): a checkpoint keeps "
                f"string keys only; use str({key!r}) and convert it back after loading"
            )
        if key in MARKERS:
            raise TypeError(f"{where} uses the reserved key {key!r}: rename it")
        out[key] = _encode(item, f"{where}[{key!r}]")
    return out


def _encode(value: Any, where: str) -> Any:
    if value is None or isinstance(value, bool | int | float | str):
        return value  # nan and inf too: the index is written with json's allow_nan
    if isinstance(value, torch.Tensor):
        flat = value.detach().cpu().contiguous().reshape(-1)
        raw = flat.view(torch.uint8) if flat.numel() else torch.zeros(0, dtype=torch.uint8)
        return {
            TENSOR: str(value.dtype).removeprefix("torch."),
            "shape": list(value.shape),
            "data": base64.b64encode(raw.numpy().tobytes()).decode("ascii"),
        }
    if isinstance(value, tuple):
        return {TUPLE: [_encode(v, f"{where}[{i}]") for i, v in enumerate(value)]}
    if isinstance(value, list):
        return [_encode(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, Mapping):
        return _encode_dict(value, where)
    raise TypeError(
        f"{where} is a {type(value).__module__}.{type(value).__name__}: a checkpoint's "
        "client_state holds dicts, lists, tuples, numbers, strings, None and tensors; "
        "convert it to one of those (e.g. vars(namespace), torch.from_numpy(array))"
    )


def _decode(value: Any) -> Any:
    if isinstance(value, list):
        return [_decode(v) for v in value]
    if not isinstance(value, dict):
        return value
    if TENSOR in value:
        dtype = getattr(torch, value[TENSOR])
        shape = tuple(value["shape"])
        raw = base64.b64decode(value["data"])
        if not raw:
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).reshape(shape)
    if TUPLE in value:
        return tuple(_decode(v) for v in value[TUPLE])
    return {k: _decode(v) for k, v in value.items()}
