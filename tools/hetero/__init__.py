"""Mixed hardware measured: speed-weighted micro-batches and memory-weighted shards."""
