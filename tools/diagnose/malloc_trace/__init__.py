"""glibc heap tracing: an LD_PRELOAD shim and the replay that finds the holes it cannot reuse."""
