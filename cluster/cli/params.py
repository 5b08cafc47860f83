"""`v41 params CONFIG_DIR [--parallel experts=N] [--json]`: the model counted on PyTorch's
meta device; with ``--parallel``, what each worker of one split replica holds and what
a token moves between them (model/parallel.py)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", type=Path, help="directory holding config.json (or the file)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--parallel", default=None, metavar="experts=N",
                        help="one replica split over N workers sharing the routed experts: bytes per worker")
    parser.add_argument("--pool", choices=("decoder", "prefill"), default="decoder",
                        help="which pool's replica --parallel splits (default decoder)")
    parser.add_argument("--device-gb", type=float, default=141.0,
                        help="memory of one device, GB (default 141: an H200)")


def _human(n: float) -> str:
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= size:
            return f"{n / size:,.2f}{unit}"
    return f"{n:,.0f}"


def run(args: argparse.Namespace) -> int:
    from cluster import UserError
    from model.accounting import count
    from model.config import ConfigError, ModelConfig
    from model.parallel import ParallelSpec

    try:
        config = ModelConfig.load(args.config)
    except ConfigError as error:
        raise UserError(str(error)) from None
    report = count(config, extra_modules(config))
    split = None
    if args.parallel is not None:
        try:
            split = parallel_report(config, ParallelSpec.parse(args.parallel), args.pool, args.device_gb * 1e9,
                                    report.kv_bytes_per_token)
        except ValueError as error:
            raise UserError(str(error)) from None
    if args.json:
        print(json.dumps({**report.as_dict(), **({"parallel": split} if split else {})}))
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
    if split:
        print(f"\n{args.pool} replica split experts={split['experts']} ({args.device_gb:g} GB devices; "
              "the lead, worker 0, runs attention and holds the caches)")
        print(f"{'worker':>6}  {'holds GB':>9}  {'free GB':>8}")
        for rank, (held, free) in enumerate(zip(split["worker_bytes"], split["free_bytes"])):
            print(f"{rank:>6}  {held / 1e9:>9.2f}  {free / 1e9:>8.2f}")
        print(f"{'all':>6}  {split['pool_bytes'] / 1e9:>9.2f}")
        print(f"long-range cache tokens in the lead's free memory: {split['lead_cache_tokens']:,}")
        traffic = split["bytes_per_token"]
        print(f"moved per token between workers: {traffic['out'] / 1e6:.2f} MB out, {traffic['back'] / 1e6:.2f} MB back "
              f"(BF16 activations, routing spread evenly)")
    return 0


def parallel_report(config, spec, pool: str, device_bytes: float, kv_bytes_per_token: int) -> dict:
    """What ``--parallel`` prints: bytes per worker, room left, traffic per token."""
    from model.parallel_costs import token_traffic, worker_bytes

    held = worker_bytes(config, spec, pool)
    traffic = token_traffic(config, spec, pool)
    free = [int(device_bytes - b) for b in held]
    return {
        "experts": spec.experts, "tensor": spec.tensor, "pool": pool, "device_bytes": int(device_bytes),
        "worker_bytes": held, "pool_bytes": sum(held), "free_bytes": free,
        "fits": all(f > 0 for f in free),
        "lead_cache_tokens": max(0, free[0]) // kv_bytes_per_token,
        "bytes_per_token": {"out": traffic.bytes_out, "back": traffic.bytes_back, "total": traffic.bytes_total},
    }


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
