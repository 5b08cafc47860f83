"""The token of the Ray instance `v41 serve` starts, readable by its user alone.

Ray (2.60) starts a new local instance with token authentication and, where there is no
token yet, writes one to ``~/.ray/auth_token`` with the default modes: a folder and a
file any local user may read (0755, 0644). Whoever reads it can submit code to the
cluster, which runs as the service's user. So before Ray starts, ``v41 serve`` writes
the token itself, 0600 in a 0700 folder. A token that exists already is Ray's or the
operator's: it is left as it is, with a warning if other users can read it.
"""

from __future__ import annotations

import os
import secrets
import stat
from pathlib import Path

# Ray's own settings: where set, the operator chose the mode or the token.
_RAY_SETTINGS = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")


def token_path() -> Path:
    """Where Ray looks for its token when nothing says otherwise."""
    return Path.home() / ".ray" / "auth_token"


def ensure_private_token() -> str | None:
    """Write a new token (0600, folder 0700) where Ray will look for one, unless Ray's
    settings name one or one exists; a warning (None: nothing to say) for an existing
    token other users can read."""
    if any(os.environ.get(name) for name in _RAY_SETTINGS):
        return None
    path = token_path()
    try:
        status = path.stat()
    except FileNotFoundError:
        path.parent.mkdir(mode=0o700, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as handle:
            handle.write(secrets.token_hex(32))  # (Ray's own tokens: 256 random bits, hex)
        return None
    if status.st_mode & (stat.S_IRGRP | stat.S_IROTH):
        return (f"{path} (Ray's token) can be read by other users, who can then run code as this one: "
                f"chmod 600 {path}")
    return None
