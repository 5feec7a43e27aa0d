"""Bodies run on every rank of a real world: a DeepSpeed-shaped script through
zero_core.deepspeed, with its communicator made by ``deepspeed.init_distributed()``."""

from __future__ import annotations

from typing import Any


def deepspeed_script(comm: Any, folder: str) -> dict[str, Any]:
    """The tutorial's loop at stage 3: init_distributed, initialize with training data,
    train, save_checkpoint with client_state, load it back. Returns the sample ids this
    rank read, its losses, and what load_checkpoint gave back."""
    import torch
    from torch import nn

    import zero_core.deepspeed as deepspeed

    made = deepspeed.init_distributed(dist_backend="gloo")
    assert deepspeed.init_distributed() is made  # once per process, as DeepSpeed's
    generator = torch.Generator().manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 9), nn.Tanh(), nn.Linear(9, 1))
    data = [(i, torch.randn(5, generator=generator)) for i in range(8)]
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "Adam", "params": {"lr": 0.01}},
        "zero_optimization": {"stage": 3},
    }
    engine, _, loader, _ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), training_data=data, config=config
    )
    seen, losses = [], []
    for ids, x in loader:
        seen += ids.tolist()
        loss = engine(x).square().mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    engine.save_checkpoint(folder, client_state={"seen": seen, "t": torch.ones(2)})
    path, client = engine.load_checkpoint(folder)
    return {"seen": seen, "losses": losses, "path": path, "client_seen": client["seen"],
            "world": made.world_size}  # fmt: skip
