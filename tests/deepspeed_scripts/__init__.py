"""Scripts written for DeepSpeed (as its examples are), and the helpers that port and run
them: port.py (imports only), runs.py (2 ranks, under either framework)."""
