"""zero_core under PyTorch Lightning: ``ZeroStrategy`` (needs ``zero-core[lightning]``).

    import lightning, zero_core.lightning
    trainer = lightning.Trainer(devices=2, strategy=zero_core.lightning.ZeroStrategy(stage=3))
    trainer = lightning.Trainer(devices=2, strategy="zero_stage_3")   # the same, by name

docs/use-from-your-framework.md says what it supports.
"""

from lightning.pytorch.strategies import StrategyRegistry

from .precision import ZeroPrecision
from .strategy import ZeroStrategy

ZeroStrategy.register_strategies(StrategyRegistry)

__all__ = ["ZeroPrecision", "ZeroStrategy"]
