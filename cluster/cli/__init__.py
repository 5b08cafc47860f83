"""The `v41` command line: one entry point, one module per command.

Each command lives in its own module exposing ``add_arguments(parser)`` and
``run(args) -> int``; this file only wires them up. Only the module of the command
being run is imported (the list in `v41 --help` comes from ``COMMANDS``), so
`v41 --help` imports neither torch nor Ray. A user mistake raises ``UserError``: it
prints as one line and exits 2, never as a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from cluster import UserError

# name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("cluster.cli.serve", "the whole cluster on this machine (embedded Redis, RAM and SSD tiers)"),
    "params": ("cluster.cli.params", "count the model built on the meta device"),
    "forward": ("cluster.cli.forward", "reference full-sequence logits for token-id lists"),
    "generate": ("cluster.cli.generate", "generate with the engine (prefill, replay, batched decode)"),
    "cache-sim": ("cluster.cli.cache_sim", "the retention lab: workloads through the real store policy on a virtual clock"),
    "bench": ("cluster.bench", "side-by-side measurements, printed as a table"),
    "train-small": ("cluster.cli.train_small", "train the shipped small checkpoint (progress bar, resumable)"),
    "train-tools": ("cluster.cli.train_tools", "fine-tune a checkpoint to call tools (synthetic set, corpus replay)"),
    "train-vision": ("cluster.cli.train_vision", "trains a vision tower on a frozen checkpoint to read code from images"),
    "train-drafter": ("cluster.cli.train_drafter", "train a checkpoint's DSpark drafter on its frozen backbone, calibrate it"),
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser; ``command`` names the one command whose arguments are added (its
    module imported), None for all of them."""
    parser = argparse.ArgumentParser(prog="v41", description="DeepSeek V4.1-Flash on Ray")
    parser.add_argument(
        "--threads", type=int, default=1,
        help="torch intra-op threads (default 1: the small models' matmuls are too small to share, "
        "and spinning OpenMP threads collapse when other processes hold the cores)",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module_name, help_text) in COMMANDS.items():
        parser_of = sub.add_parser(name, help=help_text, description=help_text)
        if command is None or command == name:
            module = importlib.import_module(module_name)
            module.add_arguments(parser_of)
            parser_of.set_defaults(_module=module)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    chosen = next((arg for arg in argv if arg in COMMANDS), "")
    args = build_parser(chosen).parse_args(argv)
    if args.threads < 1:
        print("v41: error: --threads must be at least 1", file=sys.stderr)
        return 2
    import torch

    torch.set_num_threads(args.threads)
    try:
        return int(args._module.run(args) or 0)
    except UserError as error:
        print(f"v41 {args.command}: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
