"""Several all-gathers in one collective: :func:`all_gather_coalesced`.

A collective has a fixed cost (a round of messages, a wake-up of the backend's thread)
whatever its size. Stage 3 gathers a model of many small modules one module at a time, so
it pays that cost per module; gathering the units a prefetch starts together pays it once.

Layout, for inputs a (n_a elements) and b (n_b) on N = 2 ranks::

    send      rank r:  | a_r b_r |                       n_a + n_b elements
    received           | a_0 b_0 | a_1 b_1 |             N * (n_a + n_b)
    outputs            a: | a_0 a_1 |   b: | b_0 b_1 |   copied out at wait()

Each output gets exactly what ``comm.all_gather(output, input)`` would give it, bit for
bit. With a ``quantizer`` (qwZ) every input is encoded by itself and every part decoded by
itself, so each output gets exactly what :func:`zero_comm.quantized_all_gather` would give:
the coalescing moves no block boundary. The stats count one all-gather of the sum of the
sizes (of the encoded sizes with a quantizer), the same bytes as the separate calls.
The send buffer (n_a + n_b elements, or their encoding) is a copy, so the inputs may be
reused as soon as the call returns; the received buffer, N times that, lives from the call
to the first ``wait()``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .block_quantize import QUANTIZABLE_DTYPES, BlockQuantizer
from .communicator import Communicator
from .quantized import QuantizedHandle, _nothing, _refuse, _warn_once


def all_gather_coalesced(
    comm: Communicator,
    outputs: Sequence[torch.Tensor],
    inputs: Sequence[torch.Tensor],
    quantizer: BlockQuantizer | None = None,
    *,
    allow_fallback: bool = False,
    label: str = "",
) -> QuantizedHandle:
    """Launch ``comm.all_gather(outputs[k], inputs[k])`` for every k as one collective.

    ``inputs``: contiguous tensors of one dtype and device, any sizes (n_k elements each,
    the same n_k on every rank), free to be reused once the call returns; ``outputs[k]``:
    N * n_k elements of that dtype, written at the wait. With a
    ``quantizer`` each output is as :func:`zero_comm.quantized_all_gather` leaves it
    (``allow_fallback`` as there). The outputs hold the result once the returned handle's
    ``wait()`` returns (waiting twice is harmless).
    """
    what = "all_gather_coalesced"
    comm._check_open(what)
    if len(outputs) != len(inputs) or not inputs:
        raise ValueError(
            comm._err(
                f"{what}: {len(outputs)} outputs for {len(inputs)} inputs; pass one output per "
                "input, at least one"
            )
        )
    size = comm.world_size
    for output, shard in zip(outputs, inputs, strict=True):
        comm._check_pair(what, output, shard, size, 1)
    kinds = {(shard.dtype, shard.device) for shard in inputs}
    if len(kinds) > 1:
        raise TypeError(
            comm._err(
                f"{what}: the inputs must share one dtype and device, got "
                f"{sorted(map(str, kinds))}; gather the others in a call of their own"
            )
        )
    if quantizer is not None and inputs[0].dtype not in QUANTIZABLE_DTYPES:
        reason = f"{inputs[0].dtype} is not quantized (float32, bfloat16 and float16 are)"
        if not allow_fallback:
            _refuse(comm, what, reason, "cast the inputs to one of them")
        # Under quantized_all_gather's name: stage 3 gathers a unit alone or coalesced, and
        # one dtype's fallback is one thing to tell, whichever way its units went.
        _warn_once("quantized_all_gather", reason)
        quantizer = None
    if size == 1:  # nothing moves, so nothing is quantized
        for output, shard in zip(outputs, inputs, strict=True):
            output.view(-1).copy_(shard.view(-1))
        return QuantizedHandle(None, _nothing)
    numels = [shard.numel() for shard in inputs]
    if quantizer is None:
        parts = [shard.view(-1) for shard in inputs]
    else:
        parts = [quantizer.encode(shard) for shard in inputs]
    send = torch.cat(parts)
    received = torch.empty(size * send.numel(), dtype=send.dtype, device=send.device)
    handle = comm.all_gather(received, send, async_op=True, label=label)
    widths = [part.numel() for part in parts]

    def copy_out() -> None:
        rows = received.view(size, -1)
        start = 0
        for output, numel, width in zip(outputs, numels, widths, strict=True):
            columns = rows[:, start : start + width]
            start += width
            if quantizer is None:
                output.view(size, numel).copy_(columns)
            else:
                quantizer.decode(
                    columns.contiguous().view(-1), numel, parts=size, out=output.view(-1)
                )

    return QuantizedHandle(handle, copy_out)
