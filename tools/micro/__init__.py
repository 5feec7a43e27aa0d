"""Benchmarks of one mechanism each (a collective, a stage's step, a checkpoint), one launch."""
