"""ZeRO-R's residual-state parts: activation checkpointing with P_a, P_a+cpu and M_D.

    activation_checkpoint.py  ActivationCheckpointing: partitioned, offloaded checkpoints
    activation_arena.py       M_D: one pre-allocated buffer cut into checkpoint slots

Imports nothing from the rest of zero_core.
"""
