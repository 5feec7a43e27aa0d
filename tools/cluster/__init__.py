"""The emulated cluster (network namespaces as hosts, a shaped link) and what runs on it."""
