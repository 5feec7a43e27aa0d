"""What the engine is asked to do, validated before anything is built.

    zero_config.py      ZeroConfig: every option, checked when it is made
    choices.py          the values options take: dtypes, stages, offload tiers
    deepspeed_translation.py  DeepSpeed's keys read as ZeroConfig settings (and notes)
    deepspeed_json.py   a whole DeepSpeed JSON config read into a ZeroConfig and its extras
    fused_step_rule.py  which settings optimizer_in_backward cannot be combined with

Imports nothing from the rest of zero_core: every other module may depend on it.
"""
