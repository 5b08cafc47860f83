"""`v41 bench engine`: decode step time against context length, CED prefill against full depth.

On a small config whose window and top-k are small against the context (by default
``configs/tiny``: window 32, top-16 entries, 8 candidate blocks of 4):

- **decode step** (batch 1) at contexts from 2K to 32K tokens. The long-range caches
  and windows are filled with random entries in their real byte formats (a decode
  step's cost does not depend on the values, and prefilling 32K tokens would
  dominate the run); each step then runs every layer, scans the indexer keys of the
  Full layers, scores the candidate pool in the Reindex layers, and attends to
  window + top-k places.
- **prefill** of one long prompt: the CED path (encoder half over every token, the
  decoder's memory projected from the encoder output, the decoder replaying the last
  window) against the full-depth path (every layer over every token), alternated
  in one run.

Weights are random (speed does not depend on them). Times are medians.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", type=Path, default=Path("configs/tiny"), help="config directory")
    parser.add_argument("--contexts", default="2048,4096,8192,16384,32768", help="decode contexts, tokens")
    parser.add_argument("--steps", type=int, default=15, help="timed decode steps per context")
    parser.add_argument("--prompt-tokens", type=int, default=4096, help="prefill prompt length")
    parser.add_argument("--repeats", type=int, default=3, help="prefill repetitions per path")


def _time(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def run(args: argparse.Namespace) -> int:
    import torch

    from cluster.cli import UserError
    from model.config import ConfigError, ModelConfig
    from model.runtime.engine import Engine
    from model.engram import EngramLayout, NgramHasher
    from model.loader import CheckpointError, load_tokenizer
    from model.runtime.speculative import synthetic_cache
    from model.transformer import Transformer

    try:
        config = ModelConfig.load(args.config).text
        hasher = None
        if config.engram_layer_ids:
            hasher = NgramHasher.from_tokenizer(EngramLayout.from_config(config), load_tokenizer(args.config))
        contexts = [int(c) for c in args.contexts.split(",")]
    except (ConfigError, CheckpointError, ValueError) as error:
        raise UserError(str(error)) from None
    model = Transformer(config).init_weights(seed=0).eval()
    engine = Engine(model, hasher, bounded_replay=True)
    generator = torch.Generator().manual_seed(0)

    decode: dict[int, float] = {}
    for context in contexts:
        cache = synthetic_cache(engine, context, generator)
        token = [5]
        engine.decode([(cache, token)])  # warm-up
        decode[context] = statistics.median(_time(lambda: engine.decode([(cache, token)])) for _ in range(args.steps))

    prompt = torch.randint(3, config.vocab_size - 1, (args.prompt_tokens,), generator=generator).tolist()
    paths = {"ced": True, "full_depth": False}
    prefill: dict[str, list[float]] = {name: [] for name in paths}

    def one(bounded: bool) -> None:
        cache = engine.new_cache()
        engine.replay(cache, engine.prefill(cache, prompt), exact=not bounded)

    for _ in range(args.repeats):
        for name, bounded in paths.items():
            prefill[name].append(_time(lambda: one(bounded)))
    ced, full = (statistics.median(prefill[name]) for name in paths)

    base = decode[contexts[0]]
    print(f"decode step, batch 1 ({args.config}, window {config.sliding_window}, top-{config.index_topk})")
    print(f"{'context':>8}  {'ms/step':>8}  {'vs first':>8}")
    for context, seconds in decode.items():
        print(f"{context:>8}  {seconds * 1e3:>8.2f}  {seconds / base:>8.3f}")
    print(f"\nprefill of {args.prompt_tokens} tokens")
    print(f"{'path':>10}  {'seconds':>8}  {'ratio':>6}")
    print(f"{'ced':>10}  {ced:>8.2f}  {ced / full:>6.3f}")
    print(f"{'full depth':>10}  {full:>8.2f}  {1.0:>6.3f}")
    result = {
        "config": str(args.config),
        "decode_ms": {str(c): round(s * 1e3, 3) for c, s in decode.items()},
        "prefill_s": {"ced": round(ced, 3), "full_depth": round(full, 3)},
        "prefill_ced_over_full_depth": round(ced / full, 4),
    }
    if 2048 in decode and 32768 in decode:
        result["decode_step_ratio_32k_over_2k"] = round(decode[32768] / decode[2048], 4)
    if args.json:
        print(json.dumps(result))
    return 0
