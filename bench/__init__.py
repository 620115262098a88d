"""Benchmarks: each `python -m bench.<name>` prints one JSON object per line (see docs/benchmarks.md)."""
