"""What the engine needs to know when the model itself is split across ranks (tensor
parallelism): the model-parallel group, and which parameters are sharded over it.

Replicated parameters (LayerNorms, position embeddings, row-parallel biases) have the
same gradient on every model-parallel rank, so the global gradient norm counts them on
model-parallel rank 0 only, and counts every rank's slice of the sharded ones:

    norm^2 = sum over mp ranks r (in rank order) of  rows(sharded on r)
             + rows(replicated)                       on r = 0 only

A float16 overflow on any rank of either group skips the step everywhere.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from zero_comm import Communicator


@dataclass(frozen=True)
class ModelParallel:
    comm: Communicator
    sharded: tuple[torch.nn.Parameter, ...]  # the parameters split across ``comm``

    @classmethod
    def of(cls, comm: Communicator, sharded_parameters: list[torch.nn.Parameter]) -> ModelParallel:
        return cls(comm, tuple(sharded_parameters))

    def counts_for_norm(self, split: bool) -> bool:
        """Whether this rank's copy of a parameter enters the global norm, given whether
        the parameter is ``split`` across the model-parallel group (the engine's
        ParamSlot.tensor_parallel)."""
        return split or self.comm.rank == 0
