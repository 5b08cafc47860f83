"""`v41 forward CHECKPOINT_DIR --ids F.json --out F.safetensors`: reference logits.

Runs the plain full-sequence forward (fp32, every layer over every token) on each
token-id list of ``F.json`` (a JSON list of lists) and saves ``logits_0``,
``logits_1``, ... ([S, V] float32) to a safetensors file.
"""

from __future__ import annotations

import argparse
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", type=Path, help="checkpoint directory (config.json, safetensors)")
    parser.add_argument("--ids", type=Path, required=True, help="JSON file: a list of token-id lists")
    parser.add_argument("--out", type=Path, required=True, help="output .safetensors file")


def run(args: argparse.Namespace) -> int:
    import torch
    from safetensors.torch import save_file

    from cluster.inputs import load_or_fail, read_id_lists

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
