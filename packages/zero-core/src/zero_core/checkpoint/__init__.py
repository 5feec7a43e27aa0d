"""Sharded checkpoints: each rank writes its shard; any world size and stage reads them.

    sharded_state.py    ShardedState: what one rank holds, as plain data (the engine's side
                        of the contract)
    writer.py           save(state, comm, path): the layout, written atomically
    loader.py           load(state, comm, path): any world size and stage, into a state
    format.py           names, format marks and the index checksum, writer's and readers'
    tags.py             DIR/<tag>/ and DIR/latest: a folder of checkpoints, the user's files kept
    reader.py           the checkpoint folder: where it is, its index, any range of the shards
    safetensors_file.py safetensors files written as a stream, read by byte range, checksummed
    consolidate.py      zero-consolidate: a sharded checkpoint to one plain state dict

Depends on flat_layout, config/ and command_line only (and zero_comm); the engine's
modules import it, never the reverse: save and load receive plain data and call nothing
back.
"""
