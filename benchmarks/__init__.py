"""Benchmarks that print JSON; run as ``python -m benchmarks.<name>``."""
