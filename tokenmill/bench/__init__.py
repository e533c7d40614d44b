"""Benchmarks: `tokenmill bench ...`."""
