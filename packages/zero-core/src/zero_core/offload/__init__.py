"""Model states outside the device (ZeRO-Offload, ZeRO-Infinity): host and disk tiers.

    tiers.py              where each state lives, and the sub-groups it is stepped in
    build.py              the tiers a config asks for: swap folder, space check, masters, shards
    masters.py            OffloadedMasters: master weights and optimizer states, tile by tile
    swapped_tiles.py      the disk tier of masters and optimizer states (and gradients)
    gradient_tier.py      reduced gradient slices in host memory or swap files, as they land
    tiered_parameters.py  stage 3's compute shards in their tier (device, host or disk)
    swap_file.py          a preallocated swap file in checksummed blocks
    partial_blocks.py     blocks written piece by piece, sent to a swap file when whole

Built by builder.py; imports the core's layouts and master weights, never the engine.
"""
