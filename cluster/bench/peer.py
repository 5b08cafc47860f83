"""`v41 bench peer`: v41 against the released reference implementation on the same
checkpoint, greedy, batch 1.

The reference is Hugging Face transformers' ``models/deepseek_v41`` (its eager
``generate`` with its cache), run when it is importable: no transformers release has
it yet, so this is an optional peer (``pip install -e '.[peer]'`` installs transformers'
main branch); without it the bench says why and reports v41's side alone.

For each prompt length (random token ids from a seeded generator, after BOS), pairs of
one run per side, each side in a fresh process (so that each reports its own peak
memory), in alternating order: time to the first token (the prefill, and for v41 the
decoder's replay), decode tokens/s over the rest, the peak RSS and its rise over the
process after loading and a warm-up, and the greedy tokens. Ratios are medians of the
per-pair ratios; ``greedy_agreement`` is the length of the common prefix of the two
sides' tokens over the tokens generated (both stop at the checkpoint's EOS).
"""

from __future__ import annotations

import argparse
import importlib
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

REFERENCE = "transformers.models.deepseek_v41"
SIDES = ("v41", "reference")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--checkpoint", type=Path, default=Path("tests/golden/A"),
                        help="a checkpoint in the released Hugging Face layout")
    parser.add_argument("--lengths", default="300,2000,8000", help="prompt lengths, tokens")
    parser.add_argument("--new-tokens", type=int, default=64, help="greedy tokens per run")
    parser.add_argument("--pairs", type=int, default=3, help="runs of each side per length (interleaved)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--compiled", action="store_true", help="v41 on its compiled step (AOTInductor)")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds one side's run may take")


def reference_missing() -> str | None:
    """None when the reference imports; otherwise why it does not."""
    try:
        import transformers
    except ImportError:
        return "transformers is not installed (pip install -e '.[peer]')"
    try:
        importlib.import_module(REFERENCE)
    except ImportError as error:
        return f"transformers {transformers.__version__} has no deepseek_v41 ({error}; pip install -e '.[peer]')"
    return None


def prompt_ids(config, length: int, seed: int) -> list[int]:
    """BOS, then ``length - 1`` seeded ids of ordinary tokens (no special or image id)
    of a :class:`~model.config.ModelConfig`'s vocabulary."""
    import torch

    text = config.text
    specials = {text.bos_token_id, text.pad_token_id, config.image_token_id, *text.eos_ids}
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, text.vocab_size, (2 * length,), generator=generator).tolist()
    ordinary = [i for i in ids if i not in specials][: length - 1]
    return [text.bos_token_id, *ordinary]


def _rss_mb() -> float:
    """This process's resident set now, MiB (Linux)."""
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * resource.getpagesize() / 2**20


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def run_v41(checkpoint: Path, ids: list[int], new_tokens: int, compiled: bool) -> dict:
    """v41's engine on ``ids``: prefill + replay to the first token, then decode."""
    from model.loader import load_hasher, load_model
    from model.runtime.batcher import Batcher
    from model.runtime.engine import Engine
    from model.runtime.sampling import SamplingParams

    config, model = load_model(checkpoint)
    engine = Engine(model, load_hasher(checkpoint, config), compiled=compiled)
    if engine.compiled is not None:
        engine.warm_compiled()

    def generate(prompt: list[int], n: int) -> tuple[float, float, list[int]]:
        batcher = Batcher(engine, max_batch=1, eos_token_ids=config.text.eos_ids)
        start = time.perf_counter()
        tokens = [batcher.add("0", SamplingParams(temperature=0.0, max_tokens=n), prompt=prompt).token_id]
        first = time.perf_counter()
        while batcher.running:
            tokens += [event.token_id for event in batcher.step()]
        return first - start, time.perf_counter() - first, tokens

    generate(ids[:16], 4)  # warm-up
    loaded = _rss_mb()
    prefill_s, decode_s, tokens = generate(ids, new_tokens)
    return _figures(prefill_s, decode_s, tokens, loaded)


def run_reference(checkpoint: Path, ids: list[int], new_tokens: int) -> dict:
    """The reference's eager ``generate`` with its cache: ``max_new_tokens=1`` for the
    time to the first token, then the whole run; decode is the difference."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()

    def generate(prompt: list[int], n: int) -> tuple[float, list[int]]:
        inputs = torch.tensor([prompt])
        start = time.perf_counter()
        with torch.no_grad():
            out = model.generate(inputs, attention_mask=torch.ones_like(inputs), max_new_tokens=n, do_sample=False,
                                 use_cache=True)
        return time.perf_counter() - start, out[0, len(prompt):].tolist()

    generate(ids[:16], 4)  # warm-up
    loaded = _rss_mb()
    prefill_s, _ = generate(ids, 1)
    total_s, tokens = generate(ids, new_tokens)
    return _figures(prefill_s, max(total_s - prefill_s, 1e-9), tokens, loaded)


def _figures(prefill_s: float, decode_s: float, tokens: list[int], loaded_mb: float) -> dict:
    peak = _peak_rss_mb()
    return {"prefill_s": prefill_s, "decode_tokens_per_s": max(len(tokens) - 1, 0) / decode_s, "tokens": tokens,
            "peak_rss_mb": peak, "rise_rss_mb": max(0.0, peak - loaded_mb)}


def _side(side: str, args: argparse.Namespace, length: int, seed: int) -> dict:
    """One side's run in a fresh process (its own peak memory)."""
    from cluster import UserError

    argv = [sys.executable, "-m", "cluster.bench.peer", side, str(args.checkpoint), str(length),
            str(args.new_tokens), str(seed), str(args.threads), "1" if args.compiled else "0"]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=args.timeout, check=False)
    except subprocess.TimeoutExpired:
        raise UserError(f"the {side} side at {length} tokens took more than {args.timeout:.0f} s") from None
    if done.returncode != 0:
        raise UserError(f"the {side} side at {length} tokens failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _agreement(a: list[int], b: list[int]) -> float:
    common = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return common / max(len(a), len(b), 1)


def run(args: argparse.Namespace) -> int:
    from cluster import UserError
    from model.config import ConfigError, ModelConfig

    try:
        lengths = [int(n) for n in args.lengths.split(",")]
        ModelConfig.load(args.checkpoint)
    except (ValueError, ConfigError) as error:
        raise UserError(str(error)) from None
    if any(n < 17 for n in lengths) or args.new_tokens < 2 or args.pairs < 1:
        raise UserError("--lengths must be at least 17 tokens, --new-tokens at least 2, --pairs at least 1")
    missing = reference_missing()
    rows: dict[int, list[dict[str, dict]]] = {}
    for length in lengths:
        rows[length] = []
        for pair in range(args.pairs):
            order = SIDES if pair % 2 == 0 else SIDES[::-1]
            rows[length].append({side: _side(side, args, length, args.seed + pair)
                                 for side in order if side == "v41" or missing is None})

    print(f"v41 against the reference ({args.checkpoint}, greedy, batch 1, {args.new_tokens} new tokens, "
          f"{args.pairs} pairs, {args.threads} thread(s){', v41 compiled' if args.compiled else ''})")
    if missing:
        print(f"reference: skipped: {missing}. v41's side alone:")
    result: dict = {"checkpoint": str(args.checkpoint), "compiled": args.compiled, "reference_missing": missing,
                    "lengths": {}}
    header = (f"{'tokens':>7}  {'prefill s':>10}  {'decode tok/s':>12}  {'peak MiB':>9}  {'rise MiB':>9}")
    print(header + ("" if missing else f"  {'prefill/ref':>11}  {'decode/ref':>10}  {'rise/ref':>9}  {'agree':>6}"))
    for length, pairs in rows.items():
        ours = [p["v41"] for p in pairs]
        figures = {key: statistics.median(o[key] for o in ours)
                   for key in ("prefill_s", "decode_tokens_per_s", "peak_rss_mb", "rise_rss_mb")}
        line = (f"{length:>7}  {figures['prefill_s']:>10.3f}  {figures['decode_tokens_per_s']:>12.2f}  "
                f"{figures['peak_rss_mb']:>9.0f}  {figures['rise_rss_mb']:>9.0f}")
        entry = {"v41": {k: round(v, 4) for k, v in figures.items()}}
        if missing is None:
            refs = [p["reference"] for p in pairs]
            entry["reference"] = {key: round(statistics.median(r[key] for r in refs), 4) for key in figures}
            matched = list(zip(ours, refs))
            entry["prefill_over_reference"] = statistics.median(o["prefill_s"] / r["prefill_s"] for o, r in matched)
            entry["decode_over_reference"] = statistics.median(o["decode_tokens_per_s"] / r["decode_tokens_per_s"]
                                                               for o, r in matched)
            entry["rise_rss_over_reference"] = statistics.median(o["rise_rss_mb"] / max(r["rise_rss_mb"], 1e-9)
                                                                 for o, r in matched)
            entry["greedy_agreement"] = statistics.median(_agreement(o["tokens"], r["tokens"]) for o, r in matched)
            line += (f"  {entry['prefill_over_reference']:>11.3f}  {entry['decode_over_reference']:>10.3f}  "
                     f"{entry['rise_rss_over_reference']:>9.3f}  {entry['greedy_agreement']:>6.2f}")
        result["lengths"][str(length)] = entry
        print(line)
    first = result["lengths"][str(lengths[0])]
    result["decode_over_reference_batch1"] = (None if missing else round(first["decode_over_reference"], 4))
    if args.json:
        print(json.dumps(result))
    return 0


def _main_side(argv: list[str]) -> None:
    """``python -m cluster.bench.peer SIDE CHECKPOINT LENGTH NEW_TOKENS SEED THREADS COMPILED``:
    one side's run; prints its figures as one JSON line."""
    import torch

    side, checkpoint, length, new_tokens, seed, threads, compiled = argv
    torch.set_num_threads(int(threads))
    from model.config import ModelConfig

    ids = prompt_ids(ModelConfig.load(checkpoint), int(length), int(seed))
    if side == "v41":
        out = run_v41(Path(checkpoint), ids, int(new_tokens), compiled == "1")
    else:
        out = run_reference(Path(checkpoint), ids, int(new_tokens))
    print(json.dumps(out))


if __name__ == "__main__":
    _main_side(sys.argv[1:])
