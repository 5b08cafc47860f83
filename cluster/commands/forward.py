"""`v41 forward CHECKPOINT_DIR --ids F.json --out F.safetensors`: reference logits.

Runs the plain full-sequence forward (fp32, every layer over every token) on each
token-id list of ``F.json`` (a JSON list of lists) and saves ``logits_0``,
``logits_1``, ... ([S, V] float32) to a safetensors file.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", type=Path, help="checkpoint directory (config.json, safetensors)")
    parser.add_argument("--ids", type=Path, required=True, help="JSON file: a list of token-id lists")
    parser.add_argument("--out", type=Path, required=True, help="output .safetensors file")


def read_id_lists(path: Path, vocab_size: int) -> list[list[int]]:
    """Parse and validate a JSON list of non-empty token-id lists."""
    from cluster.cli import UserError

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
    from cluster.cli import UserError
    from model.config import ConfigError
    from model.loader import CheckpointError, load_hasher, load_model

    try:
        config, model = load_model(checkpoint)
        return config, model, load_hasher(checkpoint, config)
    except (ConfigError, CheckpointError, OSError) as error:
        raise UserError(str(error)) from None


def run(args: argparse.Namespace) -> int:
    import torch
    from safetensors.torch import save_file

    config, model, hasher = load_or_fail(args.checkpoint)
    lists = read_id_lists(args.ids, config.text.vocab_size)
    out = {}
    for i, ids in enumerate(lists):
        tokens = torch.tensor([ids])
        engram_ids = hasher.hash_ids(tokens)[0] if hasher is not None else None
        out[f"logits_{i}"] = model(tokens, engram_ids)[0].contiguous()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    save_file(out, args.out)
    print(f"wrote {len(out)} logits tensors to {args.out}")
    return 0
