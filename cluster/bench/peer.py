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
sides' tokens over the tokens generated (both stop at the checkpoint's EOS), the lowest
of the pairs. v41 runs its compiled step unless told ``--eager`` (as `v41 serve`), its
bounded replay unless told ``--exact-replay``. A checkpoint the reference cannot load
as it is (configs/small: FP8/FP4, the composite layout) is run by both sides as a
float copy that v41's loader writes (:func:`float_copy`): the same weights on both.
"""

from __future__ import annotations

import argparse
import importlib
import json
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REFERENCE = "transformers.models.deepseek_v41"
SIDES = ("v41", "reference")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--checkpoint", type=Path, default=Path("tests/golden/A"),
                        help="a checkpoint in the released Hugging Face layout; a quantised one (configs/small) "
                        "is run by both sides as a float copy v41's loader makes")
    parser.add_argument("--lengths", default="300,2000,8000", help="prompt lengths, tokens")
    parser.add_argument("--new-tokens", type=int, default=64, help="greedy tokens per run")
    parser.add_argument("--pairs", type=int, default=3, help="runs of each side per length (interleaved)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--eager", action="store_true",
                        help="v41 on its eager step (default: the compiled step, as `v41 serve` runs it)")
    parser.add_argument("--exact-replay", action="store_true",
                        help="v41 replays whole prompts through the decoder (as `v41 serve --exact-replay`)")
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


def float_copy(checkpoint: Path, out: Path) -> Path:
    """``checkpoint`` in the layout the reference loads without ``accelerate``, written
    to ``out``: its text model (the backbone and the DSpark drafter; no vision tower) in
    float32 as v41's loader dequantises it, the config flat (``deepseek_v41_text``)."""
    from dataclasses import replace

    from model.loader import load_checkpoint, save_checkpoint

    loaded = load_checkpoint(checkpoint, vision=False)
    text_only = replace(loaded.config, vision=None, image_token_id=None, quantization=None)
    # transformers' names: it maps the released ones but the head's (``head.weight``), and
    # would start from a random ``lm_head``.
    save_checkpoint(out, replace(loaded, config=text_only, vision=None), quantize=False, hugging_face_names=True)
    flat = {**loaded.config.text.to_dict(), "architectures": ["DeepseekV41ForCausalLM"],
            "model_type": "deepseek_v41_text", "dtype": "float32"}
    (out / "config.json").write_text(json.dumps(flat, indent=2) + "\n")
    for name in ("tokenizer.json", "tokenizer_config.json"):  # (v41's Engram hasher reads the tokenizer)
        if (checkpoint / name).exists():
            shutil.copyfile(checkpoint / name, out / name)
    return out


def needs_float_copy(checkpoint: Path) -> bool:
    """Whether the reference cannot load ``checkpoint`` as it is: quantised, or not the flat text layout."""
    raw = json.loads((checkpoint / "config.json").read_text())
    return "quantization_config" in raw or raw.get("model_type") != "deepseek_v41_text"


def run_v41(checkpoint: Path, ids: list[int], new_tokens: int, compiled: bool, exact_replay: bool = False) -> dict:
    """v41's engine on ``ids``: prefill + replay to the first token (the whole prompt's
    with ``exact_replay``, else its last windows), then decode."""
    from model.loader import load_hasher, load_model
    from model.runtime.batcher import Batcher
    from model.runtime.engine import Engine
    from model.runtime.sampling import SamplingParams

    config, model = load_model(checkpoint)
    engine = Engine(model, load_hasher(checkpoint, config), bounded_replay=not exact_replay, compiled=compiled)
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


class _FirstToken:
    """A ``generate`` streamer that notes when the first new token comes (its first
    ``put`` is the prompt)."""

    def __init__(self) -> None:
        self.puts: list[float] = []

    def put(self, _value) -> None:
        self.puts.append(time.perf_counter())

    def end(self) -> None:
        pass


def run_reference(checkpoint: Path, ids: list[int], new_tokens: int) -> dict:
    """The reference's eager ``generate`` with its cache, timed within one run: the
    first new token (a streamer notes it), then the rest. (Timing the decode as a whole
    run less a one-token run made it noise at 8,000 tokens: two ~2-minute prefills.)"""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()

    def generate(prompt: list[int], n: int) -> tuple[float, float, list[int]]:
        inputs, first = torch.tensor([prompt]), _FirstToken()
        start = time.perf_counter()
        with torch.no_grad():
            out = model.generate(inputs, attention_mask=torch.ones_like(inputs), max_new_tokens=n, do_sample=False,
                                 use_cache=True, streamer=first)
        end = time.perf_counter()
        return first.puts[1] - start, end - first.puts[1], out[0, len(prompt):].tolist()

    generate(ids[:16], 4)  # warm-up
    loaded = _rss_mb()
    prefill_s, decode_s, tokens = generate(ids, new_tokens)
    return _figures(prefill_s, max(decode_s, 1e-9), tokens, loaded)


def _figures(prefill_s: float, decode_s: float, tokens: list[int], loaded_mb: float) -> dict:
    peak = _peak_rss_mb()
    return {"prefill_s": prefill_s, "decode_tokens_per_s": max(len(tokens) - 1, 0) / decode_s, "tokens": tokens,
            "peak_rss_mb": peak, "rise_rss_mb": max(0.0, peak - loaded_mb)}


def _side(side: str, args: argparse.Namespace, length: int, seed: int) -> dict:
    """One side's run in a fresh process (its own peak memory)."""
    from cluster import UserError

    argv = [sys.executable, "-m", "cluster.bench.peer", side, str(args.run_checkpoint), str(length),
            str(args.new_tokens), str(seed), str(args.threads), "1" if args.compiled else "0",
            "1" if args.exact_replay else "0"]
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
    from model.runtime.aot import compiler_problem

    try:
        lengths = [int(n) for n in args.lengths.split(",")]
        ModelConfig.load(args.checkpoint)
    except (ValueError, ConfigError) as error:
        raise UserError(str(error)) from None
    if any(n < 17 for n in lengths) or args.new_tokens < 2 or args.pairs < 1:
        raise UserError("--lengths must be at least 17 tokens, --new-tokens at least 2, --pairs at least 1")
    missing = reference_missing()
    problem = None if args.eager else compiler_problem()
    args = argparse.Namespace(**vars(args), compiled=not args.eager and problem is None)
    with tempfile.TemporaryDirectory(prefix="v41-bench-peer-") as scratch:
        # The reference loads float weights in the flat text layout: both sides run this copy.
        copy = missing is None and needs_float_copy(args.checkpoint)
        args.run_checkpoint = float_copy(args.checkpoint, Path(scratch)) if copy else args.checkpoint
        rows = {length: [{side: _side(side, args, length, args.seed + pair)
                          for side in (SIDES if pair % 2 == 0 else SIDES[::-1]) if side == "v41" or missing is None}
                         for pair in range(args.pairs)]
                for length in lengths}
    step = "compiled" if args.compiled else "eager"
    print(f"v41 against the reference ({args.checkpoint}{', a float copy' if copy else ''}, greedy, batch 1, "
          f"{args.new_tokens} new tokens, {args.pairs} pairs, {args.threads} thread(s), v41's {step} step"
          f"{', exact replay' if args.exact_replay else ''})")
    if problem:
        print(f"v41: {problem}: its eager step instead")
    if missing:
        print(f"reference: skipped: {missing}. v41's side alone:")
    result = {"checkpoint": str(args.checkpoint), "float_copy": copy, "step": step,
              "exact_replay": args.exact_replay, "reference_missing": missing, "lengths": _report(rows, missing)}
    result["decode_over_reference_batch1"] = (None if missing else
                                              round(result["lengths"][str(lengths[0])]["decode_over_reference"], 4))
    if args.json:
        print(json.dumps(result))
    return 0


def _report(rows: dict[int, list[dict[str, dict]]], missing: str | None) -> dict[str, dict]:
    """Per length: each side's medians and the medians of the per-pair ratios, printed as a table."""
    header = (f"{'tokens':>7}  {'prefill s':>10}  {'decode tok/s':>12}  {'peak MiB':>9}  {'rise MiB':>9}")
    print(header + ("" if missing else f"  {'prefill/ref':>11}  {'decode/ref':>10}  {'rise/ref':>9}  {'agree':>6}"))
    entries = {}
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
            entry["greedy_agreement"] = min(_agreement(o["tokens"], r["tokens"]) for o, r in matched)
            line += (f"  {entry['prefill_over_reference']:>11.3f}  {entry['decode_over_reference']:>10.3f}  "
                     f"{entry['rise_rss_over_reference']:>9.3f}  {entry['greedy_agreement']:>6.2f}")
        entries[str(length)] = entry
        print(line)
    return entries


def _main_side(argv: list[str]) -> None:
    """``python -m cluster.bench.peer SIDE CHECKPOINT LENGTH NEW_TOKENS SEED THREADS COMPILED EXACT``:
    one side's run; prints its figures as one JSON line."""
    import torch

    side, checkpoint, length, new_tokens, seed, threads, compiled, exact_replay = argv
    torch.set_num_threads(int(threads))
    from model.config import ModelConfig

    ids = prompt_ids(ModelConfig.load(checkpoint), int(length), int(seed))
    if side == "v41":
        out = run_v41(Path(checkpoint), ids, int(new_tokens), compiled == "1", exact_replay == "1")
    else:
        out = run_reference(Path(checkpoint), ids, int(new_tokens))
    print(json.dumps(out))


if __name__ == "__main__":
    _main_side(sys.argv[1:])
