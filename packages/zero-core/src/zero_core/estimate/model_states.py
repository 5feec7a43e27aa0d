"""Model-state memory per rank for each ZeRO stage, from the paper's formulas.

Mixed-precision training with an optimizer that keeps K bytes of state per parameter
(Adam: fp32 master weights, momentum and variance, K = 12) holds, per parameter, 2 bytes of
fp16/bf16 parameters, 2 bytes of gradients and K bytes of optimizer state. With Ψ
parameters on N data-parallel ranks (Rajbhandari et al. 2019, Figure 1):

    stage 0 (DP)          (2 + 2 + K) Ψ
    stage 1 (P_os)        (2 + 2) Ψ + K Ψ / N
    stage 2 (P_os+g)      2 Ψ + (2 + K) Ψ / N
    stage 3 (P_os+g+p)    (2 + 2 + K) Ψ / N

Paper check, Ψ = 7.5e9, N = 64, K = 12: 120, 31.4, 16.6 and 1.9 GB (1 GB = 1e9 bytes).

Tiers (ZeRO-Offload, ZeRO-Infinity; zero_core.offload.tiers). With S the rank's shard of
the model states (Ψ / N at stages 1-3), a fraction f of S in the ``offload_optimizer`` tier,
s = K - 4 the optimizer's own state bytes (K for float32 parameters, which are their own
master without offload) and p, g the parameter and gradient bytes, one rank holds

                     device                         host / disk (the tier)
    parameters       p Ψ  (p Ψ / N at stage 3)      stage 3: p Ψ / N with offload_params
    gradients        g Ψ  (g Ψ / N at stages 2, 3)  stages 2, 3, offload_gradients:
                     (stages 2, 3, offload_grad-      g f S
                     ients: g (1 - f) S + g T')
    masters + states (4 + s)(1 - f) S               (4 + s) f S
                     (s S: float32, no tier at all)
    staging          -                              host: B T (4 + s [+ g]) (optimizer on
                                                    disk [with its gradients; + 2 W T g:
                                                    W = WRITES_IN_FLIGHT pairs of
                                                    write-behind buffers, gradient_tier])
    read ahead       -                              host, during forward and backward:
                                                    p min(S, max(T', 2 R / N)) (params)

Gradients follow the optimizer's tier (``offload_gradients``: ZeroConfig's field, True
there, as in ZeRO-Offload and DeepSpeed; False here unless given, so pass the run's):
at stages 2 and 3 each reduced slice of the offloaded fraction leaves the device as it
lands and is held (accumulated) in its own dtype (``gradient_dtype``: g bytes) in host
memory or in the swap files, beside its tile's master and states. The device then keeps
one reduction's landed slices, at most the largest bucket slice T' (waiting for their
copy out), and the bounded working buffers of zero_core.estimate.working_set. Stage 1
keeps its full gradient buffers (that is stage 1) whatever the tier.

Offloaded masters are never the parameters' storage: with float32 parameters and any
tier, the engine keeps a separate float32 master (4 S bytes more than without offload),
and the 4-byte parameter stays where it was. The disk tier steps its tiles of
T = min(offload_sub_group_numel, a bucket slice, f S) elements through B =
offload_buffer_count host buffers, each holding one tile's master and states. Stage 3
reads disk-tier parameter slices into host buffers ahead of their gathers, which start up
to R = prefetch_numel elements ahead and read up to R more: about 2 R / N elements, at
least a bucket slice T', at most the shard, held only while forward and backward run
(``read_ahead``; not at the step boundary). (Not counted, here or by MemoryReport: one
4 KiB page per I/O thread for the tail of a transfer, and swap_file.STAGING_BYTES per
thread that moves an unaligned tensor: checkpoint saves and loads of disk tiers.)
"""

from __future__ import annotations

import math
from typing import NamedTuple

from ..config.choices import offload_stage_error
from ..config.zero_config import DEFAULT_PREFETCH_NUMEL
from ..offload.gradient_tier import WRITES_IN_FLIGHT

STAGES = (0, 1, 2, 3)
TIERS = ("none", "cpu", "disk")
MASTER_BYTES = 4  # a float32 master weight
# Elements every parameter starts at a multiple of, and every bucket slice is a multiple
# of (zero_core.grad_norm.BLOCK; bucket slices are padded to it).
SLICE_ALIGNMENT = 128
ADAM_STATE_BYTES = 12
# float32 bytes per parameter an optimizer keeps, besides the fp32 master copy.
OPTIMIZER_STATE_BYTES = {
    "adam": 8, "adamw": 8, "sgd": 0, "sgd-momentum": 4, "adagrad": 4, "rmsprop": 4,
}  # fmt: skip


def state_bytes_per_param(param_bytes: int, optimizer: str = "adamw") -> int:
    """The paper's K for ``optimizer`` with parameters of ``param_bytes`` bytes: its float32
    states, plus a 4-byte float32 master, except for float32 parameters, which are their
    own master at every stage. Adam in bf16: 4 + 8 = 12; in float32: 8."""
    return OPTIMIZER_STATE_BYTES[optimizer] + (0 if param_bytes == 4 else 4)


class ModelStateBytes(NamedTuple):
    """Bytes one rank holds, by category."""

    parameters: float
    gradients: float
    optimizer_states: float

    @property
    def total(self) -> float:
        return self.parameters + self.gradients + self.optimizer_states


def model_state_bytes(
    params: float,
    world_size: int,
    stage: int,
    *,
    optimizer_state_bytes: float = ADAM_STATE_BYTES,
    param_bytes: float = 2,
    grad_bytes: float = 2,
) -> ModelStateBytes:
    """Per-rank model-state bytes of ``params`` parameters at ``stage`` on ``world_size`` ranks."""
    if stage not in STAGES:
        raise ValueError(f"stage must be one of {STAGES}, got {stage}")
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    if params < 0:
        raise ValueError(f"params must be >= 0, got {params}")
    n = world_size
    return ModelStateBytes(
        parameters=params * param_bytes / (n if stage >= 3 else 1),
        gradients=params * grad_bytes / (n if stage >= 2 else 1),
        optimizer_states=params * optimizer_state_bytes / (n if stage >= 1 else 1),
    )


class TieredStateBytes(NamedTuple):
    """Bytes one rank holds, by tier: the device's by category (as MemoryReport counts
    them), the offloaded model states in host memory and in swap files, and the host
    memory of the disk tiers' buffers (``staging``: the optimizer's pipeline, held for
    good; ``read_ahead``: the disk parameters' reads, while forward and backward run;
    neither is model states)."""

    parameters: float
    gradients: float
    master_weights: float  # separate float32 masters on the device (aliased: 0)
    optimizer_states: float  # on the device
    host: float
    disk: float
    staging: float
    read_ahead: float = 0.0  # host, while forward and backward run (disk parameters)
    tier_gradients: float = 0.0  # offloaded gradients, in ``host`` or ``disk``

    @property
    def device(self) -> float:
        return self.parameters + self.gradients + self.master_weights + self.optimizer_states

    @property
    def host_resident(self) -> float:
        """Host bytes in use at the step boundary: offloaded model states and the staging
        buffers (what MemoryReport.host counts then); add ``read_ahead`` for the peak."""
        return self.host + self.staging

    @property
    def model_states(self) -> float:
        """Model states in every tier (staging buffers apart)."""
        return self.device + self.host + self.disk


def tiered_state_bytes(
    params: float,
    world_size: int,
    stage: int,
    *,
    optimizer_state_bytes: float = ADAM_STATE_BYTES,
    param_bytes: float = 2,
    grad_bytes: float = 2,
    offload_optimizer: str = "none",
    offload_params: str = "none",
    offload_fraction: float = 1.0,
    sub_group_numel: int = 2**22,
    buffer_count: int = 4,
    bucket_numel: int = 2**22,
    largest_param_numel: float = 0,
    prefetch_numel: int = DEFAULT_PREFETCH_NUMEL,
    optimizer_in_backward: bool = False,
    offload_gradients: bool = False,
) -> TieredStateBytes:
    """Per-rank bytes of ``params`` parameters at ``stage`` on ``world_size`` ranks, placed
    in the tiers of ``offload_optimizer`` and ``offload_params`` (ZeroConfig's fields of
    the same names; see the module docstring).

    ``optimizer_state_bytes`` is the paper's K, as for :func:`model_state_bytes`: it holds
    a 4-byte float32 master unless ``param_bytes`` is 4 (float32 parameters are their own
    master). ``sub_group_numel``, ``buffer_count``, ``bucket_numel`` and ``prefetch_numel``
    size the disk tiers' staging buffers; ``largest_param_numel`` matters only where one
    parameter is larger than ``bucket_numel`` (it gets a bucket of its own, with larger
    slices and tiles).
    ``optimizer_in_backward`` (ZeroConfig's field; stage 3 only, no offload tiers): the
    gradients are one bucket slice, :func:`in_backward_gradient_bytes`, not g Psi / N.
    ``offload_gradients``: ZeroConfig's field (True there; pass the config's): at stages 2
    and 3 the gradient shard of the offloaded fraction follows ``offload_optimizer``.
    Without offload this is :func:`model_state_bytes` with the master apart."""
    plain = model_state_bytes(
        params, world_size, stage, optimizer_state_bytes=optimizer_state_bytes,
        param_bytes=param_bytes, grad_bytes=grad_bytes,
    )  # fmt: skip
    for name, tier in (
        ("offload_optimizer", offload_optimizer),
        ("offload_params", offload_params),
    ):
        if tier not in TIERS:
            raise ValueError(f"{name} must be one of {TIERS}, got {tier!r}")
    wrong_stage = offload_stage_error(stage, offload_optimizer, offload_params)
    if wrong_stage:
        raise ValueError(wrong_stage)
    if not 0 <= offload_fraction <= 1:
        raise ValueError(f"offload_fraction must be in [0, 1], got {offload_fraction}")
    if sub_group_numel < 1 or buffer_count < 1 or bucket_numel < 1 or prefetch_numel < 0:
        raise ValueError(
            "sub_group_numel, buffer_count and bucket_numel must be >= 1 and prefetch_numel "
            f">= 0, got {sub_group_numel}, {buffer_count}, {bucket_numel} and {prefetch_numel}"
        )
    own_master = param_bytes == 4  # float32 parameters: the master is the parameter
    states = optimizer_state_bytes - (0 if own_master else MASTER_BYTES)  # s, master apart
    master = MASTER_BYTES
    if states < 0 and offload_optimizer == "none":  # a K with no master in it: kept whole
        states, master = optimizer_state_bytes, 0
    elif states < 0:
        raise ValueError(
            f"optimizer_state_bytes={optimizer_state_bytes} holds a {MASTER_BYTES}-byte master "
            f"with {param_bytes}-byte parameters, so it must be at least {MASTER_BYTES}"
        )
    offloads = offload_optimizer != "none" or offload_params != "none"
    separate = not own_master or offloads  # with any tier, masters are never aliased
    shard = params / (world_size if stage >= 1 else 1)  # S: elements of the rank's master
    tiered = shard * offload_fraction if offload_optimizer != "none" else 0.0
    resident = shard - tiered
    moved = {"cpu": 0.0, "disk": 0.0}
    if offload_optimizer != "none":
        moved[offload_optimizer] += (MASTER_BYTES + states) * tiered
    parameters = plain.parameters
    if offload_params != "none":
        moved[offload_params] += parameters
        parameters = 0.0
    slice_numel = _largest_slice(stage, world_size, bucket_numel, largest_param_numel)
    gradients = plain.gradients
    tier_gradients = 0.0
    grads_follow = offload_gradients and offload_optimizer != "none" and stage >= 2
    if grads_follow:  # the gradient shard's offloaded fraction: the masters' elements
        tier_gradients = grad_bytes * tiered
        moved[offload_optimizer] += tier_gradients
        # On the device: the resident part, and the slices of one reduction landed there
        # before their copy out (offload.gradient_tier: landed_bytes).
        gradients = grad_bytes * (resident + min(tiered, slice_numel))
    staging = 0.0
    if offload_optimizer == "disk" and tiered > 0:
        tile = min(sub_group_numel, slice_numel, tiered)  # the largest tile
        buffers = min(buffer_count, math.ceil(tiered / tile))
        per_element = MASTER_BYTES + states + (grad_bytes if grads_follow else 0)
        staging += buffers * tile * per_element
        if grads_follow:  # the gradient writes behind the backward: pairs of tile buffers
            staging += WRITES_IN_FLIGHT * 2 * tile * grad_bytes
    read_ahead = 0.0
    if offload_params == "disk":
        ahead = max(slice_numel, 2 * prefetch_numel / world_size)
        read_ahead = param_bytes * min(shard, ahead)
    if optimizer_in_backward and stage == 3:
        gradients = in_backward_gradient_bytes(
            params, world_size, grad_bytes, bucket_numel, largest_param_numel
        )
    return TieredStateBytes(
        parameters=parameters,
        gradients=gradients,
        master_weights=master * resident if separate else 0.0,
        optimizer_states=states * resident,
        host=moved["cpu"],
        disk=moved["disk"],
        staging=staging,
        read_ahead=read_ahead,
        tier_gradients=tier_gradients,
    )


def _largest_slice(stage: int, world_size: int, bucket_numel: int, largest_param: float) -> int:
    """Elements of the largest bucket slice a rank owns: a bucket holds up to
    ``bucket_numel`` elements (or one larger parameter), padded to N x SLICE_ALIGNMENT."""
    n = world_size if stage >= 1 else 1
    biggest = max(bucket_numel, math.ceil(largest_param))
    return math.ceil(biggest / (n * SLICE_ALIGNMENT)) * SLICE_ALIGNMENT


def in_backward_gradient_bytes(
    params: float, world_size: int, grad_bytes: float, bucket_numel: int, largest_param: float
) -> float:
    """Stage 3 with ``ZeroConfig.optimizer_in_backward``: the gradient bytes a rank holds
    at once, one bucket slice (never more than its Ψ / N) and, where the gradients are
    narrower than float32, that slice's float32 copy; it stands for the gradients' g Ψ / N."""
    slice_numel = min(params / world_size, _largest_slice(3, world_size, bucket_numel,
                                                          largest_param))  # fmt: skip
    return slice_numel * (grad_bytes + (4 if grad_bytes != 4 else 0))
