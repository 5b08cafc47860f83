"""`v41 bench grammar`: what constrained decoding costs a decode step.

On the shipped small checkpoint, greedy, ``--batch`` requests (prompts cut from the
held-out corpus) decode ``--steps`` steps under a JSON schema (an array of at least
10,000 strings: no request ends early) and without one, one step of each in turn (lockstep), in
plain decoding and with DSpark (fixed k = 3, when the checkpoint has a drafter).
Reported: the median step time of each, their ratio, the time the grammar itself took
per token (mask and advance, timed inside the step), and the tokens each emitted (with
DSpark, a guess outside the grammar is rejected: fewer tokens per step).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

SCHEMA = {"type": "array", "items": {"type": "string"}, "minItems": 10000}  # no early end


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--checkpoint", type=Path, default=Path("configs/small"), help="checkpoint directory")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=24, help="decode steps timed per mode")
    parser.add_argument("--prompt-tokens", type=int, default=64)


class _Timed:
    """Wraps a Constraint's methods with a shared clock."""

    def __init__(self, constraint, clock: list[float]):
        self._constraint, self._clock = constraint, clock

    def __getattr__(self, name):
        method = getattr(self._constraint, name)
        if name not in ("mask", "advance", "masks_along", "try_advance", "rewind"):
            return method

        def timed(*args):
            start = time.perf_counter()
            try:
                return method(*args)
            finally:
                self._clock[0] += time.perf_counter() - start
        return timed


def _lockstep(engine, tokenizer, prompts, steps, speculation):
    """Median step seconds (free, constrained), grammar seconds per token, tokens."""
    from model.runtime.batcher import Batcher
    from model.runtime.grammar import json_grammar
    from model.runtime.sampling import SamplingParams

    clock = [0.0]
    batchers, times = {}, {"free": [], "constrained": []}
    for mode in times:
        grammar = json_grammar(SCHEMA) if mode == "constrained" else None
        params = SamplingParams(temperature=0.0, max_tokens=steps * 8 + 8, grammar=grammar)
        batcher = Batcher(engine, tokenizer, (tokenizer.special.eos,), max_batch=len(prompts), speculation=speculation)
        for i, prompt in enumerate(prompts):
            batcher.add(str(i), params, prompt=prompt)
        for running in batcher.running.values():
            if running.constraint is not None:
                running.constraint = _Timed(running.constraint, clock)
        batchers[mode] = batcher
    clock[0] = 0.0
    tokens = {"free": 0, "constrained": 0}
    for _ in range(steps):
        for mode, batcher in batchers.items():
            start = time.perf_counter()
            tokens[mode] += len(batcher.step())
            times[mode].append(time.perf_counter() - start)
    return (statistics.median(times["free"]), statistics.median(times["constrained"]),
            clock[0] / max(1, tokens["constrained"]), tokens)


def run(args: argparse.Namespace) -> int:
    import torch

    from cluster.bench.spec import _prompts
    from cluster import UserError
    from model.tokenizer import Tokenizer
    from model.config import ConfigError
    from model.loader import CheckpointError, load_checkpoint, load_hasher, load_tokenizer
    from model.runtime.batcher import Speculation
    from model.runtime.engine import Engine
    from model.runtime.speculative import SpeculativeDrafter

    try:
        checkpoint = load_checkpoint(args.checkpoint)
        tokenizer = load_tokenizer(args.checkpoint)
        hasher = load_hasher(args.checkpoint, checkpoint.config)
    except (CheckpointError, ConfigError, OSError, ValueError) as error:
        raise UserError(str(error)) from None
    torch.set_num_threads(1)
    engine = Engine(checkpoint.backbone, hasher)
    prompts = _prompts(tokenizer, args.batch, args.prompt_tokens, 0)
    tokenizer = Tokenizer.from_dir(args.checkpoint)
    modes = {"plain": None}
    if checkpoint.drafter is not None:
        modes["DSpark k=3"] = Speculation(SpeculativeDrafter(checkpoint.drafter, engine), "fixed", k=3)
    rows = {}
    for name, speculation in modes.items():
        free, constrained, per_token, tokens = _lockstep(engine, tokenizer, prompts, args.steps, speculation)
        rows[name] = {"step_ms": round(1e3 * free, 2), "constrained_step_ms": round(1e3 * constrained, 2),
                      "ratio": round(constrained / free, 3), "grammar_us_per_token": round(1e6 * per_token, 1),
                      "tokens": tokens}
    print(f"v41 bench grammar: {args.checkpoint}, batch {args.batch}, {args.steps} steps per mode, greedy, "
          f"JSON schema {json.dumps(SCHEMA)}")
    print(f"{'decoding':<12} {'step ms':>9} {'constrained ms':>15} {'ratio':>7} {'grammar us/token':>17} "
          f"{'tokens free / constrained':>26}")
    for name, row in rows.items():
        tokens = f"{row['tokens']['free']} / {row['tokens']['constrained']}"
        print(f"{name:<12} {row['step_ms']:>9.2f} {row['constrained_step_ms']:>15.2f} {row['ratio']:>7.3f} "
              f"{row['grammar_us_per_token']:>17.1f} {tokens:>26}")
    if args.json:
        print(json.dumps({"batch": args.batch, "steps": args.steps, "modes": rows}))
    return 0
