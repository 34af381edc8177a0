"""Benchmarks and device checks for a checkout, run as modules from the repository root: `python -m benchmarks.NAME`."""
