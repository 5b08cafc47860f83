"""Integration tests: real Redis, Ray actors, child processes, compilers, files (tests/layers.py)."""
