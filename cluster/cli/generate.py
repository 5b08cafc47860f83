"""`v41 generate CHECKPOINT_DIR (--prompt TEXT | --ids F.json)`: the engine end to end, in-process.

With ``--prompt`` the text becomes a one-message chat (thinking off) and the answer is
printed; with ``--ids`` every token-id list of the JSON file is a raw prompt, all
generated together with continuous batching. ``--json`` prints one JSON object with
``tokens`` (the generated id lists, one per prompt) and ``text``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", type=Path, help="checkpoint directory")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="a user message, rendered with the chat template")
    source.add_argument("--ids", type=Path, help="JSON file: a list of token-id lists")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--greedy", action="store_true", help="argmax decoding (default: sample)")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--exact-replay", action="store_true",
                        help="replay the whole prompt through the decoder (exact) instead of its last window")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def run(args: argparse.Namespace) -> int:
    from cluster import UserError
    from cluster.inputs import load_or_fail, read_id_lists
    from model.runtime.batcher import generate
    from model.chat import ChatTemplate, Message
    from model.tokenizer import Tokenizer
    from model.runtime.engine import Engine
    from model.runtime.sampling import SamplingParams, SamplingParamsError

    config, model, hasher = load_or_fail(args.checkpoint)
    try:
        tokenizer = Tokenizer.from_dir(args.checkpoint)
        params = SamplingParams(
            temperature=0.0 if args.greedy else args.temperature, top_p=args.top_p, seed=args.seed,
            max_tokens=args.max_new_tokens,
        )
    except (SamplingParamsError, OSError) as error:
        raise UserError(str(error)) from None
    if args.prompt is not None:
        prompts = [ChatTemplate(tokenizer).render([Message("user", args.prompt)])]
    else:
        prompts = read_id_lists(args.ids, config.text.vocab_size)
    engine = Engine(model, hasher, bounded_replay=not args.exact_replay)
    tokens = generate(engine, prompts, params, eos_token_ids=config.text.eos_ids)
    texts = [tokenizer.decode(t, skip_special_tokens=True) for t in tokens]
    if args.json:
        print(json.dumps({"tokens": tokens, "text": texts}))
    else:
        for text in texts:
            print(text)
    return 0
