"""`v41 params CONFIG_DIR [--json]`: the model counted on PyTorch's meta device."""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", type=Path, help="directory holding config.json (or the file)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def _human(n: float) -> str:
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= size:
            return f"{n / size:,.2f}{unit}"
    return f"{n:,.0f}"


def run(args: argparse.Namespace) -> int:
    from cluster.cli import UserError
    from model.accounting import count
    from model.config import ConfigError, ModelConfig

    try:
        config = ModelConfig.load(args.config)
    except ConfigError as error:
        raise UserError(str(error)) from None
    report = count(config, extra_modules(config))
    if args.json:
        print(json.dumps(report.as_dict()))
        return 0
    rows = [(name, n) for name, n in report.categories.items()]
    rows += [
        ("total", report.total),
        ("backbone", report.backbone),
        ("engram", report.engram),
        ("active per output token", report.active_per_output_token),
        ("active per prompt token", report.active_per_prompt_token),
    ]
    width = max(len(name) for name, _ in rows)
    print(f"{'parameters':<{width}}  {'count':>16}  {'':>9}")
    for name, n in rows:
        print(f"{name:<{width}}  {n:>16,}  {_human(n):>9}")
    print(f"{'checkpoint bytes':<{width}}  {report.checkpoint_bytes:>16,}  {report.checkpoint_bytes / 1e9:>7.1f}GB")
    print(f"{'kv bytes per token':<{width}}  {report.kv_bytes_per_token:>16,}")
    return 0


def extra_modules(config) -> dict:
    """The drafter and vision tower, built on meta, when the config has them."""
    import torch

    from model.dspark import DSparkDrafter
    from model.vision import VisionTower

    modules = {}
    with torch.device("meta"):
        if config.text.num_nextn_predict_layers:
            modules["drafter"] = DSparkDrafter(config.text)
        if config.vision is not None:
            modules["vision"] = VisionTower(config.vision, config.text)
    return modules
