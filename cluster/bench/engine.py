"""`v41 bench engine`: decode step time against context length, CED prefill against full depth,
the compiled layer step against the eager one.

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
- **compiled against eager** on trained weights (``--checkpoint``, configs/small):
  decode tokens/s at batch 1 and 16, and prefill of 300 / 2,000 / 8,000 tokens (the
  compiled engine encodes in chunks its compiled step takes), paired rounds.

Weights are random (speed does not depend on them) except in the compiled comparison.
Times are medians.
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
    parser.add_argument("--checkpoint", type=Path, default=Path("configs/small"),
                        help="the compiled-vs-eager decode runs on these trained weights")
    parser.add_argument("--decode-steps", type=int, default=24,
                        help="timed decode steps per round at each batch (compiled vs eager)")
    parser.add_argument("--rounds", type=int, default=3, help="paired rounds of compiled and eager decode")
    parser.add_argument("--no-compiled", action="store_true", help="skip the compiled-vs-eager comparison")
    parser.add_argument("--profile", action="store_true",
                        help="only count the aten calls of an eager decode step of --checkpoint, by part")


def _time(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def run(args: argparse.Namespace) -> int:
    if args.profile:
        return _profile(args)
    import torch

    from cluster import UserError
    from model.config import ConfigError, ModelConfig
    from model.runtime.engine import Engine
    from model.engram import EngramLayout, NgramHasher
    from model.loader import CheckpointError, load_tokenizer
    from model.runtime.prefix_scheduler import synthetic_cache
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
    if not args.no_compiled:
        result.update(_compiled_vs_eager(args))
    if args.json:
        print(json.dumps(result))
    return 0


def greedy_decode_rate(engine, prompts: list[list[int]], steps: int) -> tuple[float, list[list[int]]]:
    """Greedy decode of one sequence per prompt, from fresh caches after each prompt's
    prefill and replay: (tokens/s over ``steps`` timed batched steps, every sequence's
    tokens)."""
    caches = [engine.new_cache() for _ in prompts]
    tokens = [[int(engine.replay(c, engine.prefill(c, p)).argmax())] for c, p in zip(caches, prompts)]
    begin = time.perf_counter()
    for _ in range(steps):
        for row, logits in zip(tokens, engine.decode([(c, [row[-1]]) for c, row in zip(caches, tokens)])):
            row.append(int(logits[-1].argmax()))
    return len(prompts) * steps / (time.perf_counter() - begin), tokens


def _compiled_vs_eager(args: argparse.Namespace) -> dict:
    """Decode tokens/s of the compiled layer step against the eager one on trained
    weights, at batch 1 and 16: rounds alternate the two (paired), each from fresh
    caches after a 300-token prompt; the ratio is the median of the rounds' ratios.
    Then the prefill of seeded prompts of 300 / 2,000 / 8,000 tokens the same way (the
    ratio: eager seconds over compiled seconds)."""
    import torch

    from model.engram import EngramLayout, NgramHasher
    from model.loader import load_model, load_tokenizer
    from model.runtime.engine import Engine

    config, model = load_model(args.checkpoint)
    model.eval()
    hasher = None
    if config.text.engram_layer_ids:
        hasher = NgramHasher.from_tokenizer(EngramLayout.from_config(config.text), load_tokenizer(args.checkpoint))
    eager = Engine(model, hasher)
    started = time.perf_counter()
    fast = Engine(model, hasher, compiled=True)
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(16, config.text.vocab_size, (300,), generator=generator).tolist() for _ in range(16)]

    def tokens_per_s(engine: Engine, batch: int, steps: int) -> tuple[float, list[list[int]]]:
        return greedy_decode_rate(engine, prompts[:batch], steps)

    for batch in (1, 2, 16):  # compile the step's shapes (the first decode of each count), then warm both
        tokens_per_s(fast, batch, 2)
    compile_s = time.perf_counter() - started
    built = [seconds for function in fast.compiled.functions.values() for seconds in function.built.values()]
    tokens_per_s(eager, 16, 2)
    rows, out = {}, {"compiled_checkpoint": str(args.checkpoint), "compile_s": round(compile_s, 1),
                     "packages_built": len(built)}
    for batch in (1, 16):
        pairs = []
        for _ in range(args.rounds):
            eager_rate, eager_tokens = tokens_per_s(eager, batch, args.decode_steps)
            fast_rate, fast_tokens = tokens_per_s(fast, batch, args.decode_steps)
            pairs.append((eager_rate, fast_rate, eager_tokens == fast_tokens))
        ratio = statistics.median(f / e for e, f, _ in pairs)
        rows[batch] = (statistics.median(e for e, _, _ in pairs), statistics.median(f for _, f, _ in pairs), ratio,
                       all(same for _, _, same in pairs))
        out[f"fast_over_eager_decode_batch{batch}"] = round(ratio, 3)
        out[f"decode_tokens_per_s_batch{batch}"] = {"eager": round(rows[batch][0], 1),
                                                     "compiled": round(rows[batch][1], 1)}
        out[f"same_greedy_tokens_batch{batch}"] = rows[batch][3]
    print(f"\ndecode on {args.checkpoint} (300-token prompts; compiled by AOTInductor: {compile_s:.0f} s to "
          f"warm, {len(built)} packages built in it, the rest loaded from {fast.compiled.cache_dir})")
    print(f"{'batch':>6}  {'eager tok/s':>11}  {'compiled tok/s':>14}  {'ratio':>6}  {'same tokens':>11}")
    for batch, (eager_rate, fast_rate, ratio, same) in rows.items():
        print(f"{batch:>6}  {eager_rate:>11.1f}  {fast_rate:>14.1f}  {ratio:>6.2f}  {same!s:>11}")
    # Prefill: the compiled engine encodes in chunks its compiled step takes; the eager
    # one in chunks of prefill_chunk (1,024) through the eager blocks.
    print(f"\nprefill (encoder half), seconds, paired rounds\n{'tokens':>6}  {'eager s':>8}  {'compiled s':>10}  "
          f"{'eager/compiled':>14}")
    for length in (300, 2000, 8000):
        prompt = torch.randint(16, config.text.vocab_size, (length,), generator=generator).tolist()
        pairs = [(_prefill_s(eager, prompt), _prefill_s(fast, prompt)) for _ in range(args.rounds)]
        ratio = statistics.median(e / f for e, f in pairs)  # the speed-up, as the decode ratios
        eager_s, fast_s = statistics.median(e for e, _ in pairs), statistics.median(f for _, f in pairs)
        out[f"prefill_s_{length}"] = {"eager": round(eager_s, 4), "compiled": round(fast_s, 4)}
        out[f"fast_over_eager_prefill_{length}"] = round(ratio, 3)
        print(f"{length:>6}  {eager_s:>8.3f}  {fast_s:>10.3f}  {ratio:>14.2f}")
    return out


def _prefill_s(engine, prompt: list[int]) -> float:
    cache = engine.new_cache()
    return _time(lambda: engine.prefill(cache, prompt))


def _profile(args: argparse.Namespace) -> int:
    """Aten calls (nested ones included) of one eager decode step of ``--checkpoint``
    at batch 1 after a 300-token prompt, and of each part of a block called alone."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from model import mhc
    from model.engram import EngramLayout, NgramHasher
    from model.loader import load_model, load_tokenizer
    from model.runtime.engine import Engine

    config, model = load_model(args.checkpoint)
    model.eval()
    text = config.text
    hasher = None
    if text.engram_layer_ids:
        hasher = NgramHasher.from_tokenizer(EngramLayout.from_config(text), load_tokenizer(args.checkpoint))
    engine = Engine(model, hasher)
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(16, text.vocab_size, (300,), generator=generator).tolist()
    cache = engine.new_cache()
    token = int(engine.replay(cache, engine.prefill(cache, prompt)).argmax())

    def calls(fn) -> int:
        with torch.no_grad(), profile(activities=[ProfilerActivity.CPU]) as prof:
            fn()
        return sum(event.count for event in prof.key_averages() if event.key.startswith("aten::"))

    block, hc, width = model.layers[0], text.hc_mult, text.hidden_size
    streams, pre = torch.randn(1, hc, width, generator=generator), torch.rand(1, hc, generator=generator)
    step = calls(lambda: engine.decode([(cache, [token])]))
    per_call = {
        "sinkhorn": calls(lambda: mhc.sinkhorn(torch.randn(1, hc, hc), text.hc_sinkhorn_iters, text.hc_eps)),
        "mhc_mixes": calls(lambda: block.mixes(streams, "attn")),
        "moe": calls(lambda: block.ffn(torch.randn(1, width))),
        "collapse_norm": calls(lambda: block.attn_norm(mhc.collapse(streams, pre))),
        "expand": calls(lambda: mhc.expand(torch.randn(1, width), streams, pre, torch.rand(1, hc, hc))),
    }
    layers = text.num_hidden_layers
    per_step = {"sinkhorn": 2 * layers, "mhc_mixes": 2 * layers, "moe": layers, "collapse_norm": 2 * layers,
                "expand": 2 * layers}
    print(f"aten calls of one eager decode step ({args.checkpoint}, batch 1, 300-token prompt): {step}")
    print(f"{'part':>14}  {'per call':>8}  {'calls':>5}  {'share':>6}")
    for part, count in per_call.items():
        print(f"{part:>14}  {count:>8}  {per_step[part]:>5}  {count * per_step[part] / step:>6.1%}")
    print("(mhc_mixes includes sinkhorn)")
    if args.json:
        print(json.dumps({"checkpoint": str(args.checkpoint), "aten_calls_per_step": step,
                          "aten_calls_per_call": per_call, "calls_per_step": per_step}))
    return 0
