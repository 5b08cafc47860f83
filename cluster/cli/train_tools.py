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
from pathlib import Path

import torch

from cluster import UserError
from cluster.bench.tools import evaluate_tools
from cluster.cli.training import add_limits, check_bounded, keep_heap, time_budget
from model import training
from model.chat import ChatTemplate
from model.config import ConfigError, ModelConfig
from model.loader import Checkpoint, CheckpointError, load_checkpoint, load_hasher, load_tokenizer, save_checkpoint
from model.tokenizer import Tokenizer
from model.training import tool_data
from model.training.batches import Batches, engram_ids, pad_rows, replay_starts
from model.training.corpus import HELD_OUT_EVERY, load_corpus, token_stream
from model.training.held_out import evaluate, held_out_rows
from model.training.induction import INDUCTION_ALPHABETS, INDUCTION_PROBES, Repeats
from model.training.loop import Counters, Plan, Task, TrainState, lr_factor, train

MINUTES = 45.0  # the time budget when neither --minutes nor --steps is given
STATE = "tools-state"  # the train state's folder under --out

KEEP_FILES = ("tokenizer.json", "tokenizer_config.json", "dspark_calibration.json", "replay-prompts.json")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--checkpoint", type=Path, default=Path("configs/small"), help="the checkpoint to start from")
    parser.add_argument("--out", type=Path, default=Path("configs/small"), help="where to write the fine-tuned one")
    add_limits(parser, MINUTES, STATE)
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


def run(args: argparse.Namespace) -> int:
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
    state = TrainState(args.out / STATE)
    if args.resume and not state.exists():
        raise UserError(f"--resume: no training state in {state.directory}")
    task = ToolTraining(args, checkpoint, hasher, bpe, tokenizer)
    if args.resume:
        task.counters = state.resume(task)
    plan = Plan(lambda step, progress: lr_factor(progress, warmup=0.05), steps=args.steps,
                seconds=time_budget(args.minutes, args.steps, MINUTES), save_every_s=args.save_every * 60)
    task.model.train()
    train(task, plan, task.counters, save=lambda: state.save(task, task.counters))
    _finish(task, args)
    state.remove()
    print(f"saved {args.out}: {task.counters.step} steps", file=sys.stderr)
    return 0


class ToolTraining(Task):
    """The fine-tune's steps: tool conversations (the loss on the assistant's turns), the
    pretraining mix replayed, repeat rows over the whole vocabulary."""

    def __init__(self, args: argparse.Namespace, checkpoint: Checkpoint, hasher, bpe, tokenizer: Tokenizer):
        self.args, self.checkpoint, self.hasher, self.counters = args, checkpoint, hasher, Counters()
        self.model, self.template, self.pad = checkpoint.backbone, ChatTemplate(tokenizer), tokenizer.special.pad
        corpus = load_corpus(args.max_files)
        if len(corpus.held_out) == 0:
            raise UserError(f"--max-files {args.max_files} leaves no held-out file (every {HELD_OUT_EVERY}th is "
                            "held out)")
        # The pretraining mix (stream windows, chat-formatted completions so that a chat
        # without tools still continues code, as `v41 generate` and the README show) and copy
        # chats (a call copies its arguments from the question, past the sliding window).
        self.replay_rows = Batches(token_stream(bpe, corpus.train), corpus.train, bpe, args.seq_len, chat=args.chat,
                                   copy=args.copy)
        self.eval_rows = held_out_rows(token_stream(bpe, corpus.held_out), args.seq_len, 32)
        self.held_before = evaluate(self.model, hasher, self.eval_rows, 8, reference=True)
        self.repeats = Repeats(checkpoint.config.text.vocab_size, stage=len(INDUCTION_ALPHABETS) - 1)
        # Probes inside the sliding window, and past it (a copy from there goes through the
        # compressed and indexer-selected attention: what a second call needs to copy an
        # operand out of the question).
        self.window = checkpoint.config.text.sliding_window
        self.probes = (*INDUCTION_PROBES, self.window + 6, 2 * self.window)
        self.repeats_before = self.repeats_accuracy(self.model)
        print(f"held-out corpus loss before: {self.held_before:.4f}; repeats {self.repeats_before}", file=sys.stderr)
        torch.manual_seed(args.seed)
        self.optimizers = training.build_optimizers(self.model, args.lr)
        self.generator = torch.Generator().manual_seed(args.seed)
        self.rng = random.Random(f"train-tools:{args.seed}")
        self.log = {"steps": [], "tool_loss": [], "corpus_loss": [], "repeat_loss": []}
        self.seen = 0  # target tokens of the conversations trained on

    def repeats_accuracy(self, model) -> list[float]:
        return self.repeats.accuracy(model, self.hasher, seed=self.args.seed, reference=True, lengths=self.probes)

    def step(self, progress: float) -> None:
        args, log = self.args, self.log
        rendered = [tool_data.render(self.template, tool_data.conversation(self.rng, multi_call=args.multi_call))
                    for _ in range(args.batch)]
        ids, mask = pad_rows([(r.ids, [args.content_weight if c else float(t) for t, c in zip(r.targets, r.content)])
                              for r in rendered], self.pad)
        self.seen += sum(sum(r.targets) for r in rendered)
        result = training.train_forward(self.model, ids, engram_ids(self.hasher, ids))
        tool_loss = training.masked_lm_loss(result.logits, ids, mask)
        loss = tool_loss + result.indexer_loss
        loads = result.loads
        corpus_loss = torch.zeros(())
        if args.replay_batch:
            rows = self.replay_rows.sample(args.replay_batch, self.generator)
            replay = replay_starts(args.replay_batch, args.seq_len + 1, self.window, self.generator)
            result = training.train_forward(self.model, rows, engram_ids(self.hasher, rows), replay)
            corpus_loss = training.lm_loss(result.logits, rows)
            loss = loss + args.replay_weight * corpus_loss + result.indexer_loss
            loads = {k: loads[k] + result.loads[k] for k in loads}
        if args.induction:
            repeat_loss, result = self.repeats.train_loss(self.model, self.hasher, args.induction, self.generator)
            loss = loss + repeat_loss + result.indexer_loss
            loads = {k: loads[k] + result.loads[k] for k in loads}
            log["repeat_loss"].append(round(float(repeat_loss.detach()), 4))
        training.backbone_step(self.model, self.optimizers, loss, loads)
        log["tool_loss"].append(round(float(tool_loss.detach()), 4))
        log["corpus_loss"].append(round(float(corpus_loss.detach()), 4))

    def between(self, counters: Counters) -> None:
        self.log["steps"].append(counters.step)

    def status(self) -> str:
        tool, corpus = self.log["tool_loss"][-20:], self.log["corpus_loss"][-20:]
        return f"tool loss {sum(tool) / len(tool):.3f} | corpus loss {sum(corpus) / len(corpus):.3f}"

    def state_dict(self) -> dict:
        return {"model": self.model.state_dict(), "generator": self.generator.get_state(), "rng": self.rng.getstate(),
                "log": self.log, "held_before": self.held_before, "repeats_before": self.repeats_before,
                "seen": self.seen}

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.generator.set_state(state["generator"])
        self.rng.setstate(state["rng"])
        self.log, self.held_before, self.repeats_before = state["log"], state["held_before"], state["repeats_before"]
        self.seen = state["seen"]


def _finish(task: ToolTraining, args: argparse.Namespace) -> None:
    """Save the checkpoint (with the source's tokenizer and calibration files), evaluate
    what was saved, write ``tool_training.json`` (keeping the source's earlier runs)."""
    out, checkpoint = args.out, task.checkpoint
    out.mkdir(parents=True, exist_ok=True)
    task.model.eval()
    save_checkpoint(out, Checkpoint(checkpoint.config, task.model, checkpoint.drafter, checkpoint.vision))
    if out.resolve() != args.checkpoint.resolve():
        for name in KEEP_FILES:
            if (args.checkpoint / name).exists():
                shutil.copyfile(args.checkpoint / name, out / name)
    saved = load_checkpoint(out)
    held_after = evaluate(saved.backbone, task.hasher, task.eval_rows, 8, reference=True)
    repeats_after = task.repeats_accuracy(saved.backbone)
    print(f"held-out corpus loss: {task.held_before:.4f} before, {held_after:.4f} after; "
          f"repeats {task.repeats_before} before, {repeats_after} after", file=sys.stderr)
    evaluation = evaluate_tools(out, args.eval) if args.eval else None
    step = task.counters.step
    report = {
        "source": str(args.checkpoint), "steps": step, "train_seconds": round(task.counters.elapsed, 1),
        "conversations": step * args.batch, "target_tokens": task.seen, "batch": args.batch,
        "replay_batch": args.replay_batch, "replay_weight": args.replay_weight, "chat": args.chat,
        "copy": args.copy, "seq_len": args.seq_len, "lr": args.lr,
        "content_weight": args.content_weight, "multi_call": args.multi_call, "window": task.window,
        "held_out_corpus_loss": {"before": round(task.held_before, 4), "after": round(held_after, 4)},
        "induction": args.induction,
        "repeat_accuracy": {"lengths": list(task.probes), "before": task.repeats_before, "after": repeats_after},
        "evaluation": evaluation, "log": task.log,
    }
    earlier = args.checkpoint / "tool_training.json"
    if earlier.exists():  # the checkpoint was fine-tuned before: keep its runs' reports
        previous = json.loads(earlier.read_text())
        report["previous_runs"] = previous.pop("previous_runs", []) + [previous]
    (out / "tool_training.json").write_text(json.dumps(report) + "\n")
