"""Predictions from formulas: memory per rank and link traffic per step, before a run.

    model_states.py  model-state bytes per rank of each stage (the paper's formulas)
    activations.py   activation bytes of a GPT-2-style step from its shape
    link_traffic.py  bytes a step sends over intra- and inter-node links
    working_set.py   the device's bounded working memory (buckets in flight, gathered units)
    offload_traffic.py  bytes a step moves between device and host, and host and disk
    command.py       zero-estimate, the command line over them (table.py prints it)

Sits above the engine: nothing outside estimate/ imports it but the package's front door
and zero_core.plan (zero-plan's cost model, which counts bytes with it).
"""
