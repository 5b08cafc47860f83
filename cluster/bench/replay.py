"""`v41 bench replay CHECKPOINT_DIR`: the drift the two bounded replays cause.

For each prompt (token-id lists from ``--ids``, or the checkpoint's own random
prompts) the exact path is compared with:

- **decoder**: Decoder SWA Bounded Replay (the decoder half replays only the last
  window of the prompt) against replaying the whole prompt;
- **encoder**: Encoder SWA Bounded Replay (a returning conversation whose windows
  expired: the encoder reruns its last window of tokens only) against live windows,
  on a follow-up turn of ``--follow`` tokens; **encoder_xM** reruns M windows
  (``--encoder-windows``, the serve option ``encoder_replay_windows``), and
  **encoder_exact** as many as the exact rebuild needs (one per layer), which
  checks the comparison itself: it agrees to float rounding.

Reported per replay: max |logit difference| and KL(exact || bounded) at the first
generated token, and greedy agreement over ``--tokens`` generated tokens (the share
of positions where the two greedy continuations agree, and the length of the
common prefix). Each encoder row also reports what the rerun costs: its tokens and
its time (``restore_ms``, the mean over the prompts).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", type=Path, help="checkpoint directory")
    parser.add_argument("--ids", type=Path, help="JSON file: prompts as token-id lists")
    parser.add_argument("--prompts", type=int, default=4, help="random prompts when --ids is not given")
    parser.add_argument("--prompt-tokens", type=int, default=600)
    parser.add_argument("--follow", type=int, default=24, help="tokens of the follow-up turn")
    parser.add_argument("--tokens", type=int, default=64, help="greedy tokens compared")
    parser.add_argument("--encoder-windows", type=_windows, default=(1, 2, 4, None), metavar="M,M,...",
                        help="windows of tokens each encoder replay reruns; 'exact': one per layer "
                             "(default: 1,2,4,exact)")


def _windows(text: str) -> tuple[int | None, ...]:
    try:
        values = tuple(None if part.strip() == "exact" else int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of window counts: {text!r}") from None
    if not values or any(v is not None and v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"window counts are at least 1: {text!r}")
    return values


def _row_name(windows: int | None) -> str:
    return "encoder" if windows == 1 else "encoder_exact" if windows is None else f"encoder_x{windows}"


def _greedy(engine, cache, logits, n):
    out = []
    for _ in range(n):
        out.append(int(logits.argmax()))
        logits = engine.decode([(cache, [out[-1]])])[0][-1]
    return out


def _compare(exact_logits, bounded_logits, exact_tokens, bounded_tokens) -> dict:
    import torch

    log_p = torch.log_softmax(exact_logits, -1)
    log_q = torch.log_softmax(bounded_logits, -1)
    prefix = next((i for i, (a, b) in enumerate(zip(exact_tokens, bounded_tokens)) if a != b), len(exact_tokens))
    return {
        "max_logit_diff": float((exact_logits - bounded_logits).abs().max()),
        "kl": float((log_p.exp() * (log_p - log_q)).sum()),
        "agreement": sum(a == b for a, b in zip(exact_tokens, bounded_tokens)) / len(exact_tokens),
        "common_prefix": prefix,
    }


def run(args: argparse.Namespace) -> int:
    import time

    import torch

    from cluster.inputs import load_or_fail, read_id_lists
    from model.runtime.engine import Engine

    config, model, hasher = load_or_fail(args.checkpoint)
    vocab = config.text.vocab_size
    generator = torch.Generator().manual_seed(0)
    if args.ids is not None:
        prompts = read_id_lists(args.ids, vocab)
    else:
        prompts = [torch.randint(3, vocab - 1, (args.prompt_tokens,), generator=generator).tolist()
                   for _ in range(args.prompts)]
    exact, bounded = Engine(model, hasher, bounded_replay=False), Engine(model, hasher, bounded_replay=True)
    # Encoder replays of each length, followed by the exact decoder replay: the
    # encoder's drift alone.
    restorers = {_row_name(w): Engine(model, hasher, bounded_replay=False, restore_windows=w)
                 for w in args.encoder_windows}
    rows = {"decoder": [], **{name: [] for name in restorers}}
    for prompt in prompts:
        # Decoder SWA Bounded Replay.
        runs = []
        for engine in (exact, bounded):
            cache = engine.new_cache()
            logits = engine.replay(cache, engine.prefill(cache, prompt))
            runs.append((logits, _greedy(engine, cache, logits, args.tokens)))
        rows["decoder"].append(_compare(runs[0][0], runs[1][0], runs[0][1], runs[1][1]))
        # Encoder SWA Bounded Replay: same conversation, windows live vs expired.
        follow = torch.randint(3, vocab - 1, (args.follow,), generator=generator).tolist()
        cache = exact.new_cache()
        exact.replay(cache, exact.prefill(cache, prompt))
        logits = exact.replay(cache, exact.prefill(cache, follow))
        live = (logits, _greedy(exact, cache, logits, args.tokens))
        for name, engine in restorers.items():
            cache = engine.new_cache()
            engine.replay(cache, engine.prefill(cache, prompt))
            cache.windows = [None] * len(cache.windows)
            cache.pending = {k: v[:0] for k, v in cache.pending.items()}
            started = time.perf_counter()
            restored = engine.restore(cache, prompt)
            restore_ms = (time.perf_counter() - started) * 1e3
            logits = engine.replay(cache, restored.then(engine.prefill(cache, follow)))
            result = _compare(live[0], logits, live[1], _greedy(engine, cache, logits, args.tokens))
            rows[name].append({**result, "rerun_tokens": len(restored.positions), "restore_ms": restore_ms})

    summary = {}
    print(f"bounded replay drift against the exact path: {args.checkpoint}, {len(prompts)} prompts, "
          f"{args.tokens} greedy tokens")
    print(f"{'replay':>13}  {'max |dlogit|':>12}  {'KL':>9}  {'agreement':>9}  {'common prefix':>13}  "
          f"{'rerun tokens':>12}  {'restore ms':>10}  per prompt (prefix)")
    for name, results in rows.items():
        mean = {k: sum(r[k] for r in results) / len(results) for k in results[0]}
        worst = max(r["max_logit_diff"] for r in results)
        summary[name] = {**mean, "max_logit_diff_worst": worst, "per_prompt": results}
        prefixes = " ".join(str(r["common_prefix"]) for r in results)
        cost = (f"{mean['rerun_tokens']:>12.0f}  {mean['restore_ms']:>10.1f}" if "restore_ms" in mean
                else f"{'':>12}  {'':>10}")
        print(f"{name:>13}  {worst:>12.4f}  {mean['kl']:>9.2e}  {mean['agreement']:>9.1%}  {mean['common_prefix']:>13.1f}"
              f"  {cost}  {prefixes}")
    if args.json:
        print(json.dumps(summary))
    return 0
