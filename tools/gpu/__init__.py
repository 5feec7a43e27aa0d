"""The GPU check and what it measures on one CUDA GPU: MFU, step phases, fragmentation."""
