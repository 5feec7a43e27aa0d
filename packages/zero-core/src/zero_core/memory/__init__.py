"""Memory as measured on this rank (the estimates from formulas are in estimate/).

    report.py       MemoryReport: what a rank holds, by category, counted from its tensors
    tracker.py      MemoryTracker: the peak of each phase of a step
    host_heap.py    giving the C heap's free pages back after the build and each step
    build_heap.py   the build's whole values mapped, not carved from the heap
    proc_status.py  this process's own figures from /proc/self/status

Imports nothing from the rest of zero_core.
"""
