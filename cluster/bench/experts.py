"""`v41 bench experts`: one replica split over worker processes sharing the routed
experts (gloo, this machine) against the same model in one process.

Decode tokens/s at batch 1 and 16 and the prefill of one prompt, for one process and
for each split (``--workers 2,4``), in paired rounds (one process, then each split,
each from fresh caches after the same prompts); ratios are medians of the rounds'
ratios, and the greedy tokens of every split are compared with one process's. On a
machine with fewer cores than workers the split only shows what the exchange costs:
the workers' experts are the same work, moved to processes that share the cores.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--checkpoint", type=Path, default=Path("configs/small"), help="checkpoint directory")
    parser.add_argument("--workers", default="2,4", help="splits to measure, workers per replica")
    parser.add_argument("--decode-steps", type=int, default=24, help="timed decode steps per round at batch 1")
    parser.add_argument("--prompt-tokens", type=int, default=1000, help="prefill prompt length")
    parser.add_argument("--rounds", type=int, default=3, help="paired rounds")


def run(args: argparse.Namespace) -> int:
    import torch

    from actors.expert_workers import LocalExpertWorkers
    from cluster.bench.engine import greedy_decode_rate
    from cluster import UserError
    from model.loader import CheckpointError, load_hasher, load_model
    from model.runtime.engine import Engine

    try:
        splits = [int(w) for w in args.workers.split(",")]
        config, model = load_model(args.checkpoint)
    except (ValueError, CheckpointError, OSError) as error:
        raise UserError(str(error)) from None
    if any(w < 2 or config.text.n_routed_experts % w for w in splits):
        raise UserError(f"--workers: each split must be 2 or more and divide {config.text.n_routed_experts} experts")
    hasher = load_hasher(args.checkpoint, config)
    generator = torch.Generator().manual_seed(1)
    vocab = config.text.vocab_size
    prompts = [torch.randint(16, vocab, (300,), generator=generator).tolist() for _ in range(16)]
    long_prompt = torch.randint(16, vocab, (args.prompt_tokens,), generator=generator).tolist()

    def measure(engine: Engine) -> dict:
        result = {}
        for batch in (1, 16):
            steps = args.decode_steps if batch == 1 else max(4, args.decode_steps // 4)
            result[f"decode{batch}"] = greedy_decode_rate(engine, prompts[:batch], steps)
        begin = time.perf_counter()
        engine.prefill(engine.new_cache(), long_prompt)
        result["prefill"] = (time.perf_counter() - begin, None)
        return result

    rounds: dict[str, list[dict]] = {"one": [], **{f"split{w}": [] for w in splits}}
    with contextlib.ExitStack() as stack:
        engines = {"one": Engine(model, hasher)}
        for workers in splits:
            checkpoint, _ = stack.enter_context(LocalExpertWorkers(args.checkpoint, workers))
            engines[f"split{workers}"] = Engine(checkpoint.backbone, hasher)
        for engine in engines.values():  # warm every path once
            engine.replay(cache := engine.new_cache(), engine.prefill(cache, prompts[0]))
        for _ in range(args.rounds):
            for name, engine in engines.items():
                rounds[name].append(measure(engine))

    def median(name: str, key: str) -> float:
        return statistics.median(r[key][0] for r in rounds[name])

    out: dict = {"checkpoint": str(args.checkpoint), "workers": splits}
    print(f"decode and prefill on {args.checkpoint}: one process against the experts split over N workers "
          f"({args.rounds} paired rounds, medians)")
    print(f"{'replica':>9}  {'tok/s b1':>9}  {'tok/s b16':>9}  {'prefill s':>9}  {'b1 ratio':>8}  {'b16 ratio':>9}  "
          f"{'prefill ratio':>13}  {'same tokens':>11}")
    for name, measured in rounds.items():
        ratios = {key: statistics.median(r[key][0] / o[key][0] for r, o in zip(measured, rounds["one"]))
                  for key in ("decode1", "decode16", "prefill")}
        same = all(r[k][1] == o[k][1] for r, o in zip(measured, rounds["one"]) for k in ("decode1", "decode16"))
        print(f"{name:>9}  {median(name, 'decode1'):>9.1f}  {median(name, 'decode16'):>9.1f}  "
              f"{median(name, 'prefill'):>9.2f}  {ratios['decode1']:>8.2f}  {ratios['decode16']:>9.2f}  "
              f"{ratios['prefill']:>13.2f}  {same!s:>11}")
        out[name] = {"decode_tokens_per_s_batch1": round(median(name, "decode1"), 1),
                     "decode_tokens_per_s_batch16": round(median(name, "decode16"), 1),
                     "prefill_s": round(median(name, "prefill"), 3)}
        if name != "one":
            out[f"{name}_over_one_decode_batch1"] = round(ratios["decode1"], 3)
            out[f"{name}_over_one_decode_batch16"] = round(ratios["decode16"], 3)
            out[f"{name}_over_one_prefill_time"] = round(ratios["prefill"], 3)
            out[f"{name}_same_greedy_tokens"] = same
    if args.json:
        print(json.dumps(out))
    return 0
