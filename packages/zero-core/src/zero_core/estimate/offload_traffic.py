"""Bytes one training step moves per rank over the offload links: device <-> host (PCIe)
and host <-> disk (NVMe), from the tiers' placement (zero_core.estimate.model_states).

With S = Ψ/N elements in this rank's shard (stages 1-3), F = f S of them in the
``offload_optimizer`` tier (f = offload_fraction), A micro-steps per step, p the compute
dtype's bytes, g the gradients' (``gradient_dtype``: the compute dtype or ``reduce_dtype``;
offloaded gradients keep it in their tier) and s the optimizer's own state bytes:

    device -> host   gradients      stages 2, 3 with offload_gradients: A g F (each micro-
                                    step's reduced slices, copied as they land); else g F
                                    (the step reads the device shard of its offloaded tiles)
                     parameters     stage 3, parameters offloaded: p (S - F), the shard
                                    the device's optimizer updated, back to its tier
    host -> device   gradients      with clipping, g F: the global norm sums each offloaded
                                    slice's rows on the device (reduce_scattered_gradients)
                     parameters     parameters on the device: p F, the updated compute
                                    shard of the offloaded tiles; stage 3, parameters
                                    offloaded: A p (2S - K/N), each gather's shard (forward
                                    and backward, less the K elements forward keeps
                                    gathered for backward's start: link_traffic's head)
    disk -> host     masters+states optimizer on disk: (4 + s) F, each tile read to step
                     gradients      optimizer on disk, offload_gradients: (A + 1 + c) g F:
                                    each later micro-step reads the sum so far (read-add-
                                    write), the boundary's non-finite check reads every
                                    slice, clipping (c = 1) again for the norm, and the step
                     parameters     parameters on disk: A p (2S - K/N), as their gathers
    host -> disk     masters+states optimizer on disk: (4 + s) F, each tile written back
                     gradients      optimizer on disk, offload_gradients: A g F (every
                                    micro-step's sum written as it lands)
                     parameters     parameters on disk: p S, the updated shard

ZeRO-Offload's check (Ren et al. 2021, sec. 4.1): stage 2 with fp16, A = 1, f = 1 moves
2Ψ/N gradients down and 2Ψ/N parameters up, 4Ψ/N over PCIe per step.
"""

from __future__ import annotations

from typing import NamedTuple

from .model_states import MASTER_BYTES


class LinkTraffic(NamedTuple):
    """Bytes per rank per step over one link, each way, by what moves."""

    gradients: float
    parameters: float
    optimizer_states: float  # float32 masters and the optimizer's states

    @property
    def total(self) -> float:
        return self.gradients + self.parameters + self.optimizer_states


class OffloadTraffic(NamedTuple):
    """One step's bytes per rank over the device <-> host and host <-> disk links."""

    device_to_host: LinkTraffic
    host_to_device: LinkTraffic
    disk_to_host: LinkTraffic
    host_to_disk: LinkTraffic

    def as_dict(self) -> dict[str, dict[str, float]]:
        return {
            name: {**link._asdict(), "total": link.total}
            for name, link in zip(self._fields, self, strict=True)
        }


NOTHING = LinkTraffic(0.0, 0.0, 0.0)


def offload_traffic(
    params: float,
    world_size: int,
    stage: int,
    *,
    param_bytes: float,
    grad_bytes: float,
    state_bytes: float,
    offload_optimizer: str = "none",
    offload_params: str = "none",
    offload_fraction: float = 1.0,
    offload_gradients: bool = False,
    accumulation_steps: int = 1,
    backward_head_numel: float = 0,
    clipping: bool = False,
) -> OffloadTraffic:
    """Bytes per rank per step over each offload link (module docstring);
    ``offload_gradients``: ZeroConfig's field (True there; pass the config's). ``state_bytes``:
    the optimizer's own float32 state bytes per element, s (Adam: 8), the master apart;
    ``backward_head_numel``: stage 3, the full-buffer elements forward keeps gathered for
    backward (link_traffic.backward_head_buckets), read and copied once fewer;
    ``clipping``: ``clip_grad_norm`` is set (the norm reads the offloaded gradients)."""
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage={stage}: ZeRO stages are 0-3")
    if accumulation_steps < 1:
        raise ValueError(f"accumulation_steps={accumulation_steps}: at least 1")
    if stage == 0 or (offload_optimizer == "none" and offload_params == "none"):
        return OffloadTraffic(NOTHING, NOTHING, NOTHING, NOTHING)
    a, n = accumulation_steps, world_size
    shard = params / n
    tiered = shard * offload_fraction if offload_optimizer != "none" else 0.0
    grads_follow = offload_gradients and offload_optimizer != "none" and stage >= 2
    down_grads = (a if grads_follow else 1) * grad_bytes * tiered
    gathers = a * param_bytes * max(0.0, 2 * shard - backward_head_numel / n)
    params_tiered = offload_params != "none"
    down = LinkTraffic(down_grads, param_bytes * (shard - tiered) if params_tiered else 0.0, 0.0)
    up_grads = grad_bytes * tiered if grads_follow and clipping else 0.0
    up = LinkTraffic(up_grads, gathers if params_tiered else param_bytes * tiered, 0.0)
    states = (MASTER_BYTES + state_bytes) * tiered if offload_optimizer == "disk" else 0.0
    grads_on_disk = grads_follow and offload_optimizer == "disk"
    reads = (a + 1 + (1 if clipping else 0)) * grad_bytes * tiered if grads_on_disk else 0.0
    on_disk = offload_params == "disk"
    read = LinkTraffic(reads, gathers if on_disk else 0.0, states)
    written = a * grad_bytes * tiered if grads_on_disk else 0.0
    write = LinkTraffic(written, param_bytes * shard if on_disk else 0.0, states)
    return OffloadTraffic(down, up, read, write)
