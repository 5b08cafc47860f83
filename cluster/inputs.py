"""What the command-line programs read from their user: a checkpoint, lists of token ids.
A bad one is a :class:`cluster.UserError` (one line, exit 2), never a traceback."""

from __future__ import annotations

import json
from pathlib import Path


def read_id_lists(path: Path, vocab_size: int) -> list[list[int]]:
    """Parse and validate a JSON list of non-empty token-id lists."""
    from cluster import UserError

    try:
        lists = json.loads(path.read_text())
    except FileNotFoundError:
        raise UserError(f"no such file: {path}") from None
    except json.JSONDecodeError as error:
        raise UserError(f"{path} is not JSON: {error}") from None
    if not isinstance(lists, list) or not lists or not all(isinstance(x, list) and x for x in lists):
        raise UserError(f"{path} must hold a non-empty list of non-empty token-id lists")
    for ids in lists:
        if not all(isinstance(t, int) and 0 <= t < vocab_size for t in ids):
            raise UserError(f"{path}: token ids must be integers in [0, {vocab_size})")
    return lists


def load_or_fail(checkpoint: Path):
    """(config, backbone, hasher) of a checkpoint; a bad one is a UserError."""
    from cluster import UserError
    from model.config import ConfigError
    from model.loader import CheckpointError, load_hasher, load_model

    try:
        config, model = load_model(checkpoint)
        return config, model, load_hasher(checkpoint, config)
    except (ConfigError, CheckpointError, OSError) as error:
        raise UserError(str(error)) from None
