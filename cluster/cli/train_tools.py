"""`v41 train-tools`: fine-tune a checkpoint to call tools (resumable).

Starts from ``--checkpoint`` (default ``configs/small``) and trains its backbone on the
synthetic tool-use set of :mod:`model.training.tool_data` (conversations in the released
format; the loss is on the assistant turns only: calls, answers, end tokens), mixed
with replay of its pretraining data (random windows of the standard library and, one in
ten, a chat-formatted completion, as in pretraining; bounded replays as in pretraining) so that the held-out corpus loss does not get worse.
Weights are trained quantisation-aware throughout (the checkpoint is stored in FP8/FP4).
The drafter and the vision tower are copied unchanged (both read the backbone: train
them again on the result, `v41 train-drafter --init`, `v41 train-vision --init`).

At the end: the checkpoint is written to ``--out`` with the source's tokenizer and
DSpark calibration, and ``tool_training.json`` records the held-out corpus loss before
and after, the tool-use evaluation (``v41 bench tools``) and the per-step log.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import time
from pathlib import Path

from cluster.cli.training import check_bounded, keep_heap, minutes_argument, time_budget

MINUTES = 45.0  # the time budget when neither --minutes nor --steps is given

KEEP_FILES = ("tokenizer.json", "tokenizer_config.json", "dspark_calibration.json", "replay-prompts.json")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--checkpoint", type=Path, default=Path("configs/small"), help="the checkpoint to start from")
    parser.add_argument("--out", type=Path, default=Path("configs/small"), help="where to write the fine-tuned one")
    parser.add_argument("--minutes", **minutes_argument(MINUTES))
    parser.add_argument("--steps", type=int, default=None, help="stop after N steps (the schedule follows N when given)")
    parser.add_argument("--resume", action="store_true", help="continue from OUT/tools-state")
    parser.add_argument("--batch", type=int, default=2, help="tool conversations per step")
    parser.add_argument("--replay-batch", type=int, default=4, help="corpus windows per step")
    parser.add_argument("--replay-weight", type=float, default=0.5, help="weight of the corpus loss")
    parser.add_argument("--seq-len", type=int, default=256, help="corpus window length")
    parser.add_argument("--chat", type=float, default=0.3,
                        help="share of replay rows that are chat-formatted completions (a chat without tools)")
    parser.add_argument("--copy", type=float, default=0.3,
                        help="share of replay rows that are copy chats (retrieval past the window)")
    parser.add_argument("--induction", type=int, default=4,
                        help="random-token repeat rows per step over the whole vocabulary (keeps the copying "
                             "that `train-small`'s induction curriculum taught; 0: none)")
    parser.add_argument("--multi-call", type=float, default=0.0,
                        help="share of tool episodes drawn as multi-call (a chain or parallel calls) before the "
                             "default mix, which has 17%% of them")
    parser.add_argument("--window", type=int, default=None,
                        help="fine-tune (and save) at this sliding window (default: the checkpoint's; "
                             "the release's: 128)")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--content-weight", type=float, default=1.0,
                        help="loss weight of argument values and answer text (the format's tokens: 1)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-files", type=int, default=None, help="use only the first N corpus files (smoke runs)")
    parser.add_argument("--save-every", type=float, default=5.0, help="minutes between training-state saves")
    parser.add_argument("--eval", type=int, default=60, help="held-out conversations per split in the final evaluation")


def _pad(rows: list, pad: int):
    """(ids, per-position loss weights) padded to the longest row."""
    import torch

    length = max(len(ids) for ids, _ in rows)
    ids = torch.full((len(rows), length), pad, dtype=torch.long)
    weights = torch.zeros((len(rows), length))
    for i, (row, row_weights) in enumerate(rows):
        ids[i, : len(row)] = torch.as_tensor(row)
        weights[i, : len(row)] = torch.as_tensor(row_weights)
    return ids, weights


def run(args: argparse.Namespace) -> int:
    import torch

    from model.training import tool_data
    from cluster.bench.tools import evaluate_tools
    from cluster import UserError
    from cluster.cli.train_small import (
        HELD_OUT_EVERY,
        INDUCTION_ALPHABETS,
        INDUCTION_PROBES,
        Batches,
        Repeats,
        _engram_ids,
        _format_time,
        _held_out_rows,
        _replay_starts,
        evaluate,
        load_corpus,
        token_stream,
    )
    from model import training
    from model.chat import ChatTemplate, Tokenizer
    from model.config import ConfigError, ModelConfig
    from model.loader import Checkpoint, CheckpointError, load_checkpoint, load_hasher, load_tokenizer, save_checkpoint

    check_bounded(args.minutes, args.steps)
    keep_heap()
    if not 0.0 <= args.multi_call <= 1.0:
        raise UserError(f"--multi-call must be a share in [0, 1], not {args.multi_call}")
    try:
        config = ModelConfig.load(args.checkpoint)
        if args.window is not None:
            config = config.with_window(args.window)
        checkpoint = load_checkpoint(args.checkpoint, config=config)
        hasher = load_hasher(args.checkpoint, checkpoint.config)
        bpe = load_tokenizer(args.checkpoint)
        tokenizer = Tokenizer.from_dir(args.checkpoint)
    except (CheckpointError, ConfigError, OSError, ValueError) as error:
        raise UserError(str(error)) from None
    out: Path = args.out
    state_dir = out / "tools-state"
    model, drafter = checkpoint.backbone, checkpoint.drafter
    template = ChatTemplate(tokenizer)
    corpus = load_corpus(args.max_files)
    if len(corpus.held_out) == 0:
        raise UserError(f"--max-files {args.max_files} leaves no held-out file (every {HELD_OUT_EVERY}th is held out)")
    train_stream = token_stream(bpe, corpus.train)
    # The pretraining mix (stream windows, chat-formatted completions so that a chat
    # without tools still continues code, as `v41 generate` and the README show) and copy
    # chats (a call copies its arguments from the question, past the sliding window).
    replay_rows = Batches(train_stream, corpus.train, bpe, args.seq_len, chat=args.chat, copy=args.copy)
    eval_rows = _held_out_rows(token_stream(bpe, corpus.held_out), args.seq_len, 32)
    held_before = evaluate(model, hasher, eval_rows, 8, reference=True)
    repeats = Repeats(checkpoint.config.text.vocab_size, stage=len(INDUCTION_ALPHABETS) - 1)
    # Probes inside the sliding window, and past it (a copy from there goes through the
    # compressed and indexer-selected attention: what a second call needs to copy an
    # operand out of the question).
    window = checkpoint.config.text.sliding_window
    probes = (*INDUCTION_PROBES, window + 6, 2 * window)
    repeats_before = repeats.accuracy(model, hasher, seed=args.seed, reference=True, lengths=probes)
    print(f"held-out corpus loss before: {held_before:.4f}; repeats {repeats_before}", file=sys.stderr)

    torch.manual_seed(args.seed)
    optimizers = training.build_optimizers(model, args.lr)
    generator = torch.Generator().manual_seed(args.seed)
    rng = random.Random(f"train-tools:{args.seed}")
    log = {"steps": [], "tool_loss": [], "corpus_loss": [], "repeat_loss": []}
    step, elapsed, seen = 0, 0.0, 0
    if args.resume:
        if not (state_dir / "state.pt").exists():
            raise UserError(f"--resume: no training state in {state_dir}")
        state = torch.load(state_dir / "state.pt", weights_only=False)
        model.load_state_dict(state["model"])
        for opt, opt_state in zip(optimizers, state["optimizers"]):
            opt.load_state_dict(opt_state)
        generator.set_state(state["generator"])
        rng.setstate(state["rng"])
        step, elapsed, log, held_before = state["step"], state["elapsed"], state["log"], state["held_before"]
        repeats_before = state["repeats_before"]
        seen = state["seen"]
        print(f"resumed at step {step} ({_format_time(elapsed)} trained)", file=sys.stderr)
    state_dir.mkdir(parents=True, exist_ok=True)

    def save_state():
        tmp = state_dir / "state.pt.tmp"
        torch.save({"model": model.state_dict(), "optimizers": [o.state_dict() for o in optimizers],
                    "generator": generator.get_state(), "rng": rng.getstate(), "step": step, "elapsed": elapsed,
                    "log": log, "held_before": held_before, "repeats_before": repeats_before, "seen": seen}, tmp)
        tmp.replace(state_dir / "state.pt")

    budget = time_budget(args.minutes, args.steps, MINUTES)
    pad = tokenizer.special.pad
    last_save = time.time()
    model.train()
    while True:
        progress = max(step / args.steps if args.steps else 0.0, elapsed / budget)
        if progress >= 1.0:
            break
        tick = time.time()
        training.set_lr(optimizers, training.lr_factor(progress, warmup=0.05))
        rendered = [tool_data.render(template, tool_data.conversation(rng, multi_call=args.multi_call))
                    for _ in range(args.batch)]
        ids, mask = _pad([(r.ids, [args.content_weight if c else float(t) for t, c in zip(r.targets, r.content)])
                          for r in rendered], pad)
        seen += sum(sum(r.targets) for r in rendered)
        result = training.train_forward(model, ids, _engram_ids(hasher, ids))
        tool_loss = training.masked_lm_loss(result.logits, ids, mask)
        loss = tool_loss + result.indexer_loss
        loads = result.loads
        corpus_loss = torch.zeros(())
        if args.replay_batch:
            rows = replay_rows.sample(args.replay_batch, generator)
            replay = _replay_starts(args.replay_batch, args.seq_len + 1, window, generator)
            result = training.train_forward(model, rows, _engram_ids(hasher, rows), replay)
            corpus_loss = training.lm_loss(result.logits, rows)
            loss = loss + args.replay_weight * corpus_loss + result.indexer_loss
            loads = {k: loads[k] + result.loads[k] for k in loads}
        if args.induction:
            repeat_loss, result = repeats.train_loss(model, hasher, args.induction, generator)
            loss = loss + repeat_loss + result.indexer_loss
            loads = {k: loads[k] + result.loads[k] for k in loads}
            log["repeat_loss"].append(round(float(repeat_loss.detach()), 4))
        training.backbone_step(model, optimizers, loss, loads)
        step += 1
        elapsed += time.time() - tick
        log["steps"].append(step)
        log["tool_loss"].append(round(float(tool_loss.detach()), 4))
        log["corpus_loss"].append(round(float(corpus_loss.detach()), 4))
        recent = log["tool_loss"][-20:]
        total = args.steps if args.steps else "?"
        print(f"\rstep {step}/{total} | tool loss {sum(recent) / len(recent):.3f} | corpus loss "
              f"{sum(log['corpus_loss'][-20:]) / len(recent):.3f} | {elapsed / step:.1f} s/step | "
              f"ETA {_format_time(budget - elapsed if not args.steps else (args.steps - step) * elapsed / step)}   ",
              end="", file=sys.stderr, flush=True)
        if time.time() - last_save > args.save_every * 60:
            save_state()
            last_save = time.time()
    print(file=sys.stderr)
    save_state()

    out.mkdir(parents=True, exist_ok=True)
    model.eval()
    save_checkpoint(out, Checkpoint(checkpoint.config, model, drafter, checkpoint.vision))
    if out.resolve() != args.checkpoint.resolve():
        for name in KEEP_FILES:
            if (args.checkpoint / name).exists():
                shutil.copyfile(args.checkpoint / name, out / name)
    saved = load_checkpoint(out)
    held_after = evaluate(saved.backbone, hasher, eval_rows, 8, reference=True)
    repeats_after = repeats.accuracy(saved.backbone, hasher, seed=args.seed, reference=True, lengths=probes)
    print(f"held-out corpus loss: {held_before:.4f} before, {held_after:.4f} after; "
          f"repeats {repeats_before} before, {repeats_after} after", file=sys.stderr)
    evaluation = evaluate_tools(out, args.eval) if args.eval else None
    report = {
        "source": str(args.checkpoint), "steps": step, "train_seconds": round(elapsed, 1),
        "conversations": step * args.batch, "target_tokens": seen, "batch": args.batch,
        "replay_batch": args.replay_batch, "replay_weight": args.replay_weight, "chat": args.chat, "copy": args.copy, "seq_len": args.seq_len, "lr": args.lr,
        "content_weight": args.content_weight, "multi_call": args.multi_call,
        "window": checkpoint.config.text.sliding_window,
        "held_out_corpus_loss": {"before": round(held_before, 4), "after": round(held_after, 4)},
        "induction": args.induction,
        "repeat_accuracy": {"lengths": list(probes), "before": repeats_before, "after": repeats_after},
        "evaluation": evaluation, "log": log,
    }
    earlier = args.checkpoint / "tool_training.json"
    if earlier.exists():  # the checkpoint was fine-tuned before: keep its runs' reports
        previous = json.loads(earlier.read_text())
        report["previous_runs"] = previous.pop("previous_runs", []) + [previous]
    (out / "tool_training.json").write_text(json.dumps(report) + "\n")
    shutil.rmtree(state_dir, ignore_errors=True)
    print(f"saved {out}: {step} steps", file=sys.stderr)
    return 0
