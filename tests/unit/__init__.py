"""Unit tests: in this process, on CPU, no server and no child process (tests/layers.py)."""
