"""Benchmarks of the package's cost per training step; ``benchmark.py`` is the command line (see README.md)."""
