"""Offload measured: the largest model under a memory cap, swap I/O, the CPU optimizer step."""
