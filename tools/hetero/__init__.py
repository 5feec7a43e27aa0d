"""Mixed hardware measured: speed-weighted micro-batches against the even split and the ideal."""
