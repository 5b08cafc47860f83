"""End-to-end tests: the whole app over HTTP, or a command end to end (tests/layers.py)."""
