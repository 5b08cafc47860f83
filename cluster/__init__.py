"""Serving (the Ray Serve app, its router and API adapters), the `v41` command line,
the benches and the retention lab."""


class UserError(Exception):
    """A mistake in how a command was called or in its inputs (not a bug): `v41` prints
    it as one line and exits 2."""
