"""Diagnostics: where a step's time and memory go, which bits depend on what, long runs."""
