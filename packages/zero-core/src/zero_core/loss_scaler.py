"""Loss scaling for float16: scale the loss up so small gradients survive, skip on overflow.

Dynamic scaling (DeepSpeed's and torch.amp's rule): start at ``initial``; after ``window``
consecutive steps without overflow, double; on an overflow, skip the step, and halve (not
below ``minimum``) once ``hysteresis`` overflows have happened since the last growth.
Every rank sees the same overflow flag (the engine reduces it), so scales stay equal.
"""

from __future__ import annotations

from collections.abc import Mapping


class LossScaler:
    """A fixed (``dynamic=False``) or dynamic loss scale."""

    def __init__(
        self,
        initial: float,
        *,
        dynamic: bool = True,
        window: int = 1000,
        hysteresis: int = 2,
        minimum: float = 1.0,
    ) -> None:
        self.scale = float(initial)
        self.dynamic = dynamic
        self.window = window
        self.hysteresis = hysteresis
        self.minimum = minimum
        self._good_steps = 0
        self._overflows_left = hysteresis

    def update(self, overflow: bool) -> None:
        if not self.dynamic:
            return
        if overflow:
            self._good_steps = 0
            self._overflows_left -= 1
            if self._overflows_left <= 0:
                self.scale = max(self.scale / 2, self.minimum)
                self._overflows_left = self.hysteresis
            return
        self._good_steps += 1
        if self._good_steps % self.window == 0:
            self.scale *= 2
            self._overflows_left = self.hysteresis

    def state_dict(self) -> dict[str, float | int]:
        """What a dynamic scale has learnt (empty for a fixed one: its scale is
        configuration, and a resumed run takes it from its own configuration)."""
        if not self.dynamic:
            return {}
        return {"scale": self.scale, "good_steps": self._good_steps,
                "overflows_left": self._overflows_left}  # fmt: skip

    def load_state_dict(self, state: Mapping[str, float | int]) -> None:
        """Continue from :meth:`state_dict`. An empty state (saved by a fixed scale, or by
        a bfloat16 or float32 run, which has none) keeps this scaler as configured; a
        fixed scaler ignores a dynamic one's state."""
        if not state or not self.dynamic:
            return
        missing = {"scale", "good_steps", "overflows_left"} - set(state)
        if missing:
            raise ValueError(f"loss scaler state {dict(state)} lacks {sorted(missing)}")
        self.scale = float(state["scale"])
        self._good_steps = int(state["good_steps"])
        self._overflows_left = int(state["overflows_left"])


class NoLossScaler(LossScaler):
    """bfloat16 and float32: a scale of 1 that never changes."""

    def __init__(self) -> None:
        super().__init__(1.0, dynamic=False)
