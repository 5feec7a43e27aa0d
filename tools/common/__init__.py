"""Code several tool families share: where a benchmark's numbers came from."""
