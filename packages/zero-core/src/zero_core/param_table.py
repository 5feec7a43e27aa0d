"""One slot per trainable parameter: the single place a parameter is looked up by identity.

Every other module holds :class:`ParamSlot` objects and reads what it needs from them, so
per-parameter state has one owner instead of a dict keyed by ``id(p)`` per feature:

    ParamSlot  name            "blocks.0.attn.qkv.weight" (its first name; ties: aliases)
               index           position among trainable parameters (optimizer-group order)
               group, group_index   its optimizer group, and its position in that group
               bucket, flat    its bucket in the group's layout, its flat_range there
               pieces          the parts of it in this rank's local shard (group_layout)
               unit            stage 3: the fetch unit gathering it (None elsewhere)
               param_view      the compute-dtype tensor its .data is (while gathered)
               grad_view       stages 0 and 1: the flat-buffer view its .grad is

The layout fills in ``bucket``, ``flat`` and ``pieces``; the components fill in the views.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

from .flat_layout import Range
from .group_layout import GroupLayout, LocalPiece

NOWHERE = Range(0, 0)  # a slot's flat range before the layout places it


class ParamNames:
    """Every distinct parameter of a module, by identity: its first name (in
    ``named_parameters()`` order), its position, and the other names of a tied one."""

    def __init__(self, module: nn.Module) -> None:
        self._first: dict[int, tuple[str, int]] = {}
        self.aliases: dict[str, str] = {}  # a tied parameter's later name -> its first
        for name, p in module.named_parameters(remove_duplicate=False):
            known = self._first.get(id(p))
            if known is None:
                self._first[id(p)] = (name, len(self._first))
            else:
                self.aliases[name] = known[0]

    def name(self, param: torch.Tensor) -> str | None:
        """The first name of ``param`` in the module; None if it is not a parameter of it."""
        known = self._first.get(id(param))
        return None if known is None else known[0]

    def position(self, param: torch.Tensor) -> int:
        """Where ``param`` comes in ``module.parameters()``."""
        return self._first[id(param)][1]


@dataclass(eq=False)
class ParamSlot:
    """One trainable parameter and everything the engine keeps about it."""

    param: nn.Parameter
    name: str
    index: int
    group: int
    group_index: int
    model_index: int  # position in module.parameters() (errors name the first in this order)
    tensor_parallel: bool = False  # split across the model-parallel group
    bucket: int = 0
    flat: Range = NOWHERE
    pieces: tuple[LocalPiece, ...] = ()
    unit: int | None = None
    param_view: torch.Tensor | None = None
    grad_view: torch.Tensor | None = None
    shape: tuple[int, ...] = field(default=())

    def __post_init__(self) -> None:
        self.shape = tuple(self.param.shape)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


class ParamTable:
    """The slots of a module's trainable parameters, in optimizer-group order, and the one
    parameter -> slot lookup."""

    def __init__(
        self,
        module: nn.Module,
        group_params: tuple[tuple[nn.Parameter, ...], ...],
        tensor_parallel: tuple[nn.Parameter, ...] = (),
    ) -> None:
        self.names = ParamNames(module)
        slots: list[ParamSlot] = []
        self.by_group: list[list[ParamSlot]] = []
        for g, params in enumerate(group_params):
            self.by_group.append([])
            for i, p in enumerate(params):
                name = self.names.name(p)
                assert name is not None, "optimizer_spec checked every parameter is the model's"
                slot = ParamSlot(p, name, len(slots), g, i, self.names.position(p))
                slots.append(slot)
                self.by_group[g].append(slot)
        self.slots = tuple(slots)
        self._slot_of: dict[int, ParamSlot] = {id(slot.param): slot for slot in slots}
        for p in tensor_parallel:
            if id(p) in self._slot_of:
                self._slot_of[id(p)].tensor_parallel = True

    def __iter__(self) -> Iterator[ParamSlot]:
        return iter(self.slots)

    def __len__(self) -> int:
        return len(self.slots)

    def get(self, tensor: torch.Tensor) -> ParamSlot | None:
        """The slot of ``tensor`` if it is a trainable parameter of the model, else None."""
        return self._slot_of.get(id(tensor))

    def slot(self, param: torch.Tensor) -> ParamSlot:
        """The slot of trainable parameter ``param``."""
        found = self._slot_of.get(id(param))
        if found is None:
            name = self.names.name(param) or f"of shape {tuple(param.shape)}"
            raise ValueError(
                f"parameter {name} is not one of the engine's trainable parameters (frozen, "
                "or not in the model that zero_core.initialize was given)"
            )
        return found

    def place(self, layouts: list[GroupLayout], rank: int) -> None:
        """Record each slot's bucket, flat range and pieces in rank ``rank``'s shard."""
        for group, layout in zip(self.by_group, layouts, strict=True):
            for slot, (k, flat) in zip(group, layout.param_places(), strict=True):
                slot.bucket, slot.flat = k, flat
            pieces: list[list[LocalPiece]] = [[] for _ in group]
            for piece in layout.local_pieces(rank):
                pieces[piece.param_index].append(piece)
            for slot, mine in zip(group, pieces, strict=True):
                slot.pieces = tuple(mine)

    def in_bucket(self, group: int, bucket: int) -> list[ParamSlot]:
        """The slots of bucket ``bucket`` of ``group``, in flat order."""
        return [slot for slot in self.by_group[group] if slot.bucket == bucket]
