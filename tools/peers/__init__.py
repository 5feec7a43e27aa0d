"""Our ZeRO stages against DDP, ZeroRedundancyOptimizer, FSDP2 and DeepSpeed (nox -s bench)."""
