"""Sharded checkpoints: each rank writes its shard; any world size and stage reads them.

    sharded_state.py    ShardedState: what one rank holds, as plain data (the engine's side
                        of the contract)
    save_load.py        save and load over a ShardedState
    reader.py           the checkpoint folder: where it is, its index, any range of the shards
    safetensors_file.py safetensors files written as a stream, read by byte range, checksummed
    consolidate.py      zero-consolidate: a sharded checkpoint to one plain state dict

Depends on config/ and flat_layout only; the engine's modules import it, never the reverse.
"""
