"""`v41 bench NAME`: side-by-side measurements printed as a table.

Each benchmark module exposes ``add_arguments(parser)`` and ``run(args) -> int`` and
prints a table; with ``--json`` it prints one JSON object on its last line. Speed is
only ever reported as ratios measured in one run, never asserted in tests.
"""

from __future__ import annotations

import argparse
import importlib

# name -> (module, one-line help)
BENCHES: dict[str, tuple[str, str]] = {
    "engine": ("cluster.bench.engine", "decode step time against context, CED prefill against full depth"),
    "replay": ("cluster.bench.replay", "drift of the bounded replays against the exact path"),
    "serve": ("cluster.bench.serve", "TTFT and tokens/s through HTTP, returning turn against cold, Serve overhead"),
    "store": ("cluster.bench.store", "tiered store GET/PUT throughput against the raw tiers"),
    "engram": ("cluster.bench.engram", "Engram service lookups and prefill with prefetch against in-process tables"),
    "spec": ("cluster.bench.spec", "DSpark speculative decoding against plain, the scheduler against fixed k"),
    "agents": ("cluster.bench.agents", "agent sessions on several raylets, routing policies side by side"),
    "load": ("cluster.bench.load", "many streaming clients in a closed loop: answered, failed, queue wait, TTFT"),
    "grammar": ("cluster.bench.grammar", "constrained decoding's cost per decode step at batch 16, plain and DSpark"),
    "experts": ("cluster.bench.experts", "one replica split over worker processes sharing the experts, against one process"),
    "vision": ("cluster.bench.vision", "an image's cost in the prefill pool (decode, preprocess, tower), returning turn TTFT"),
    "peer": ("cluster.bench.peer", "v41 against the released reference (transformers' deepseek_v41) when importable"),
    "tools": ("cluster.bench.tools", "tool calling on held-out conversations: well-formed, right function, free and constrained"),
    "all": ("cluster.bench.suite", "every table of docs/ in one run, beside the machine's raw limits"),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="bench", required=True, metavar="NAME")
    for name, (module_name, help_text) in BENCHES.items():
        bench = sub.add_parser(name, help=help_text, description=help_text)
        module = importlib.import_module(module_name)
        module.add_arguments(bench)
        bench.add_argument("--json", action="store_true", help="print one JSON object on the last line")
        bench.set_defaults(_bench=module)


def run(args: argparse.Namespace) -> int:
    return args._bench.run(args)
