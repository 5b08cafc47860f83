"""`v41 train-small`: train the shipped small checkpoint from scratch (resumable).

Corpus and tokenizer: :mod:`model.training.corpus` (the standard library's sources, a
byte-level BPE trained on them). Config: :mod:`model.training.small_config`
(``configs/tiny``'s structure at a larger size). Each step trains on the pretraining mix
(:class:`model.training.batches.Batches`, under bounded replays) and on the induction
curriculum's repeat rows (:mod:`model.training.induction`), once optionally on repeat
rows alone (``--induction-phase``). Training math: :mod:`model.training`; the loop:
:mod:`model.training.loop`.

A progress bar (step, loss, tokens/s, ETA) goes to stderr; the training state (model,
optimizers, step, data RNG, log) is saved to ``OUT/train-state/`` every few minutes and
``--resume`` continues from it. At the end the checkpoint is written in the released
format (``model.loader.save_checkpoint``: FP8 dense, FP4 experts, FP8 Engram rows) with
the tokenizer files, ``training.json`` (the log and the numbers of the model card),
``loss.png`` and ``samples.txt``, and the training state is removed.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from cluster import UserError
from cluster.cli.training import add_limits, check_bounded, keep_heap, time_budget
from model import training
from model.config import ModelConfig
from model.engram import EngramLayout, NgramHasher
from model.loader import Checkpoint, build_modules, load_model, save_checkpoint
from model.training.batches import Batches, engram_ids, replay_starts
from model.training.corpus import (
    BOS,
    EOS,
    HELD_OUT_EVERY,
    Corpus,
    load_corpus,
    token_stream,
    tokenizer_config,
    train_tokenizer,
    unigram_baseline,
)
from model.training.held_out import bits_per_byte, evaluate, held_out_rows
from model.training.induction import INDUCTION_ALPHABETS, INDUCTION_PASS, INDUCTION_PROBES, Repeats
from model.training.loop import Counters, Plan, Task, TrainState, lr_factor, train
from model.training.loss_plot import write_loss_png
from model.training.small_config import small_config

MINUTES = 45.0  # the time budget when neither --minutes nor --steps is given
STATE = "train-state"  # the train state's folder under --out
QAT_FROM = 0.7  # share of the schedule after which weights are trained quantisation-aware
SAMPLE_PROMPTS = ("def fibonacci(n):\n", "import os\nimport sys\n\n\ndef main():\n", "class Stack:\n    def __init__(self):\n")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=Path, default=Path("configs/small"), help="checkpoint directory (default configs/small)")
    add_limits(parser, MINUTES, STATE)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--window", type=int, default=64, help="sliding window of every layer (the release's: 128)")
    parser.add_argument("--copy", type=float, default=0.1,
                        help="share of rows that are copy chats (retrieval from up to ~120 tokens back)")
    parser.add_argument("--induction", type=int, default=8,
                        help="random-token repeat rows per step (the induction curriculum; 0: none)")
    parser.add_argument("--induction-every", type=int, default=25,
                        help="steps between repeat-accuracy probes (the alphabet widens when they pass)")
    parser.add_argument("--induction-phase", type=int, default=0,
                        help="at most N steps of repeat rows alone, once (ends when the whole vocabulary's probes "
                             "pass; outside --steps and --minutes; 0: none)")
    parser.add_argument("--induction-at", type=float, default=0.0,
                        help="share of the schedule after which the induction phase runs (0: before the corpus)")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--max-files", type=int, default=None, help="use only the first N corpus files (smoke runs)")
    parser.add_argument("--save-every", type=float, default=5.0, help="minutes between training-state saves")
    parser.add_argument("--eval-every", type=int, default=100, help="steps between held-out evaluations")
    parser.add_argument("--eval-batches", type=int, default=4, help="held-out batches per evaluation")
    parser.add_argument("--no-samples", action="store_true", help="skip the sample continuations at the end")
    parser.add_argument("--keep-state", action="store_true", help="keep OUT/train-state after the final save")


# ---------------------------------------------------------------------- the run


@dataclass
class Text:
    """The run's text: the corpus, its tokenizer, both token streams, the unigram baseline."""
    corpus: Corpus
    tokenizer: object  # tokenizers.Tokenizer
    train_stream: object  # int64 token ids
    held_stream: object
    baseline: float = 0.0


def _text(args: argparse.Namespace, state_dir: Path) -> Text:
    """Load the corpus; train the tokenizer (a resumed run loads the one it trained)."""
    corpus = load_corpus(args.max_files)
    if len(corpus.held_out) == 0:
        raise UserError(f"--max-files {args.max_files} leaves no held-out file (every {HELD_OUT_EVERY}th is held out)")
    print(f"corpus: {len(corpus.train)} train + {len(corpus.held_out)} held-out files, {corpus.n_bytes / 1e6:.1f} MB, "
          f"sha256 {corpus.fingerprint[:16]}", file=sys.stderr)
    if args.resume and (state_dir / "tokenizer.json").exists():
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(str(state_dir / "tokenizer.json"))
    elif args.resume:
        raise UserError(f"--resume: no training state in {state_dir}")
    else:
        tokenizer = train_tokenizer(corpus.train, args.vocab_size)
    return Text(corpus, tokenizer, token_stream(tokenizer, corpus.train), token_stream(tokenizer, corpus.held_out))


def _check(args: argparse.Namespace) -> None:
    check_bounded(args.minutes, args.steps)
    if args.induction_phase and args.induction <= 0:
        raise UserError("--induction-phase needs repeat rows: give --induction N with N > 0")
    if not 0.0 <= args.induction_at < 1.0:
        raise UserError("--induction-at is a share of the schedule: from 0 up to (not including) 1")
    if args.seq_len < 64:
        raise UserError("--seq-len must be at least 64")
    if not 0 < args.window < args.seq_len:
        raise UserError(f"--window must be between 1 and --seq-len - 1 ({args.seq_len - 1})")


def run(args: argparse.Namespace) -> int:
    _check(args)
    keep_heap()
    started = time.time()
    state = TrainState(args.out / STATE)
    text = _text(args, state.directory)
    config = ModelConfig.from_dict(small_config(text.tokenizer, args.window))
    text.baseline = unigram_baseline(text.train_stream, text.held_stream, config.text.vocab_size)
    print(f"tokens: {len(text.train_stream):,} train, {len(text.held_stream):,} held-out; unigram baseline "
          f"{text.baseline:.3f} nats", file=sys.stderr)
    task = SmallTraining(args, text, config, state)
    if args.resume:
        task.counters = state.resume(task)
    else:
        state.directory.mkdir(parents=True, exist_ok=True)
        text.tokenizer.save(str(state.directory / "tokenizer.json"))
    plan = Plan(lambda step, progress: lr_factor(progress), steps=args.steps,
                seconds=time_budget(args.minutes, args.steps, MINUTES), save_every_s=args.save_every * 60,
                tokens_per_step=args.batch * args.seq_len)
    task.model.train()
    train(task, plan, task.counters, save=task.save)
    _finish(task, text, config, args, started)
    return 0


class SmallTraining(Task):
    """The pretraining steps (see the module docstring), as :func:`model.training.loop.train` drives them."""

    def __init__(self, args: argparse.Namespace, text: Text, config: ModelConfig, state: TrainState):
        self.args, self.text, self.state, self.counters = args, text, state, Counters()
        self.window = config.text.sliding_window
        self.hasher = NgramHasher.from_tokenizer(EngramLayout.from_config(config.text), text.tokenizer)
        torch.manual_seed(args.seed)
        parts = build_modules(config)
        self.model, self.drafter = parts.backbone, parts.drafter
        self.model.init_weights(args.seed, std=config.text.initializer_range)
        training.init_module(self.drafter, args.seed + 1, std=config.text.initializer_range)
        self.optimizers = training.build_optimizers(self.model, args.lr)
        self.data = Batches(text.train_stream, text.corpus.train, text.tokenizer, args.seq_len, copy=args.copy)
        self.generator = torch.Generator().manual_seed(args.seed)
        self.eval_rows = held_out_rows(text.held_stream, args.seq_len, args.eval_batches * args.batch)
        self.repeats = Repeats(config.text.vocab_size)
        self.log = {"steps": [], "loss": [], "indexer_kl": [], "eval": [], "replays": 0, "repeat_loss": [],
                    "induction": [], "widened": [],
                    "phase": {"steps": 0, "seconds": 0.0, "loss": [], "probes": [], "widened": [],
                              "done": not args.induction_phase}}

    def save(self) -> None:
        self.state.save(self, self.counters)

    def before(self, progress: float) -> None:
        if not self.log["phase"]["done"] and progress >= self.args.induction_at:
            InductionPhase(self).run()

    def step(self, progress: float) -> None:
        args, log = self.args, self.log
        ids = self.data.sample(args.batch, self.generator)
        replay = replay_starts(args.batch, args.seq_len, self.window, self.generator)
        log["replays"] += int((replay.decoder < args.seq_len).sum())
        # Weights are rounded to their storage formats (straight-through) from the decay phase on.
        result = training.train_forward(self.model, ids, engram_ids(self.hasher, ids), replay,
                                        quantize_weights=progress >= QAT_FROM)
        loss = training.lm_loss(result.logits, ids)
        total_loss, loads = loss + result.indexer_loss, result.loads
        if args.induction:
            repeat_loss, repeated = self.repeats.train_loss(self.model, self.hasher, args.induction, self.generator,
                                                            quantize_weights=progress >= QAT_FROM)
            total_loss = total_loss + repeat_loss + repeated.indexer_loss
            loads = {k: loads[k] + repeated.loads[k] for k in loads}
            log["repeat_loss"].append(round(float(repeat_loss.detach()), 4))
        training.backbone_step(self.model, self.optimizers, total_loss, loads)
        log["loss"].append(round(float(loss.detach()), 4))
        log["indexer_kl"].append(round(float(result.indexer_loss.detach()), 4))

    def between(self, counters: Counters) -> None:
        """The repeat probes (the alphabet widens when they pass) and the held-out evaluations."""
        args, log, step = self.args, self.log, counters.step
        log["steps"].append(step)
        if args.induction and step % args.induction_every == 0:
            accuracies = self.repeats.accuracy(self.model, self.hasher, seed=step)
            log["induction"].append([step, self.repeats.alphabet(), accuracies])
            if self.repeats.update(accuracies):
                log["widened"].append([log["induction"][-1][1], step])
                print(f"\nstep {step}: repeats {accuracies} of {log['induction'][-1][1]} tokens; "
                      f"widening to {self.repeats.alphabet()}", file=sys.stderr)
        if step % args.eval_every == 0:
            held = evaluate(self.model, self.hasher, self.eval_rows, args.batch)
            log["eval"].append([step, round(held, 4)])
            print(f"\nstep {step}: held-out loss {held:.3f} (unigram {self.text.baseline:.3f})", file=sys.stderr)

    def status(self) -> str:
        log = self.log
        recent = log["loss"][-20:]
        induction = f" | repeats {log['induction'][-1][2]} of {log['induction'][-1][1]}" if log["induction"] else ""
        return f"loss {sum(recent) / len(recent):.3f} | ix-KL {log['indexer_kl'][-1]:.3f}{induction}"

    def state_dict(self) -> dict:
        return {"model": self.model.state_dict(), "drafter": self.drafter.state_dict(),
                "generator": self.generator.get_state(), "torch_rng": torch.get_rng_state(), "log": self.log,
                "induction_stage": self.repeats.stage,
                "args": {k: str(v) for k, v in vars(self.args).items() if not k.startswith("_")}}

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.drafter.load_state_dict(state["drafter"])
        self.generator.set_state(state["generator"])
        torch.set_rng_state(state["torch_rng"])
        self.log, self.repeats.stage = state["log"], state["induction_stage"]


class InductionPhase(Task):
    """Repeat rows alone at the peak learning rate (after a 50-step ramp), widening the
    alphabet as the main loop does, until the whole vocabulary's probes pass or
    ``--induction-phase`` steps. Resumable (its state, ``log["phase"]``, is in the log).
    Rows are short, so a step costs a fraction of a corpus step, and the heads form
    without the corpus's gradient drowning theirs."""

    def __init__(self, outer: SmallTraining):
        self.outer, self.optimizers, self.phase = outer, outer.optimizers, outer.log["phase"]

    @property
    def done(self) -> bool:
        return self.phase["done"]

    def run(self) -> None:
        args, phase = self.outer.args, self.phase
        plan = Plan(lambda step, progress: min(1.0, (step + 1) / 50), steps=args.induction_phase,
                    save_every_s=args.save_every * 60, label="induction phase")
        self.outer.model.train()
        train(self, plan, Counters(phase["steps"], phase["seconds"]), save=self.outer.save)
        print(f"induction phase: {phase['steps']} steps, {phase['seconds']:.0f} s, alphabet "
              f"{self.outer.repeats.alphabet()}", file=sys.stderr)

    def step(self, progress: float) -> None:
        outer = self.outer
        loss, result = outer.repeats.train_loss(outer.model, outer.hasher, outer.args.induction, outer.generator)
        training.backbone_step(outer.model, self.optimizers, loss + result.indexer_loss, result.loads)
        self.phase["loss"].append(round(float(loss.detach()), 4))

    def between(self, counters: Counters) -> None:
        phase, repeats, args = self.phase, self.outer.repeats, self.outer.args
        phase["steps"], phase["seconds"] = counters.step, counters.elapsed
        if phase["steps"] % args.induction_every == 0:
            accuracies = repeats.accuracy(self.outer.model, self.outer.hasher, seed=1_000_000 + phase["steps"])
            phase["probes"].append([phase["steps"], repeats.alphabet(), accuracies])
            if repeats.final and min(accuracies) >= INDUCTION_PASS:
                phase["done"] = True
            elif repeats.update(accuracies):
                phase["widened"].append([phase["probes"][-1][1], phase["steps"]])
        phase["done"] = phase["done"] or phase["steps"] >= args.induction_phase

    def status(self) -> str:
        phase = self.phase
        probe = f" | repeats {phase['probes'][-1][2]} of {phase['probes'][-1][1]}" if phase["probes"] else ""
        return f"repeat loss {sum(phase['loss'][-20:]) / len(phase['loss'][-20:]):.3f}{probe}"


# ---------------------------------------------------------------------- the checkpoint and its report


def _finish(task: SmallTraining, text: Text, config, args: argparse.Namespace, started: float) -> None:
    """Save the checkpoint in the released format with its tokenizer, evaluate what was
    saved, write ``training.json``, ``loss.png`` and ``samples.txt``; drop the state."""

    out, log, step = args.out, task.log, task.counters.step
    held = evaluate(task.model, task.hasher, task.eval_rows, args.batch)
    if not log["eval"] or log["eval"][-1][0] != step:
        log["eval"].append([step, round(held, 4)])
    out.mkdir(parents=True, exist_ok=True)
    save_checkpoint(out, Checkpoint(config, task.model.eval(), task.drafter.eval()))
    text.tokenizer.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(), indent=2, ensure_ascii=False) + "\n")
    # Held-out loss of what was saved (reloaded from the released format: the numbers users get).
    _, saved = load_model(out)
    saved_held = evaluate(saved, task.hasher, task.eval_rows, args.batch, reference=True)
    # Repeats over the whole vocabulary, by the saved checkpoint (whatever stage training reached).
    full_vocab = task.repeats.accuracy(saved, task.hasher, seed=args.seed, stage=len(INDUCTION_ALPHABETS) - 1,
                                       reference=True)
    report = _report(task, text, args, held, saved_held, full_vocab)
    report["wall_seconds"] = round(time.time() - started, 1)
    (out / "training.json").write_text(json.dumps(report) + "\n")
    write_loss_png(out / "loss.png", log, text.baseline)
    if not args.no_samples:
        (out / "samples.txt").write_text(samples(out))
    if not args.keep_state:
        task.state.remove()
    print(f"saved {out}: {step} steps, held-out loss {held:.3f} ({saved_held:.3f} as saved), unigram "
          f"{text.baseline:.3f}", file=sys.stderr)


def _report(task: SmallTraining, text: Text, args: argparse.Namespace, held: float, saved_held: float,
            full_vocab: list[float]) -> dict:
    """``training.json``: the corpus, the run, the held-out numbers, the induction curriculum, the log."""
    corpus, log, phase, counters = text.corpus, task.log, task.log["phase"], task.counters
    return {
        "corpus": {"source": f"Python {sys.version.split()[0]} standard library (.py, no tests)", "root": corpus.root,
                   "files": len(corpus.train) + len(corpus.held_out), "held_out_files": len(corpus.held_out),
                   "bytes": corpus.n_bytes, "sha256": corpus.fingerprint,
                   "train_tokens": int(len(text.train_stream)), "held_out_tokens": int(len(text.held_stream))},
        "steps": counters.step, "train_seconds": round(counters.elapsed, 1),
        "tokens_seen": counters.step * args.batch * args.seq_len, "batch": args.batch, "seq_len": args.seq_len,
        "lr": args.lr, "held_out_loss": round(held, 4), "held_out_loss_saved_checkpoint": round(saved_held, 4),
        "held_out_eval_tokens": int(task.eval_rows.numel() - task.eval_rows.shape[0]),
        # Comparable across tokenizers: nats per token x tokens / bytes, in bits.
        "held_out_bits_per_byte": round(bits_per_byte(saved_held, task.eval_rows, text.tokenizer), 4),
        "unigram_baseline": round(text.baseline, 4), "replayed_sequences": log["replays"],
        "induction": {"rows_per_step": args.induction, "alphabet": task.repeats.alphabet(),
                      "widened": log["widened"],
                      "phase": {"at": args.induction_at, "steps": phase["steps"],
                                "seconds": round(phase["seconds"], 1), "widened": phase["widened"]},
                      "repeat_accuracy": dict(zip(map(str, INDUCTION_PROBES), full_vocab))},
        "log": log,
    }


def samples(directory: Path, max_new_tokens: int = 96) -> str:
    """Greedy continuations of :data:`SAMPLE_PROMPTS` by the engine on the saved checkpoint."""
    from model.runtime.batcher import generate
    from model.runtime.engine import Engine
    from model.loader import load_hasher, load_model, load_tokenizer
    from model.runtime.sampling import SamplingParams

    config, model = load_model(directory)
    tokenizer = load_tokenizer(directory)
    engine = Engine(model, load_hasher(directory, config))
    prompts = [[BOS, *tokenizer.encode(p, add_special_tokens=False).ids] for p in SAMPLE_PROMPTS]
    outs = generate(engine, prompts, SamplingParams(temperature=0.0, max_tokens=max_new_tokens), eos_token_ids=(EOS,))
    parts = []
    for prompt, out in zip(SAMPLE_PROMPTS, outs):
        parts.append(f"=== prompt ===\n{prompt}=== greedy continuation ({len(out)} tokens) ===\n"
                     f"{tokenizer.decode(out, skip_special_tokens=True)}\n")
    return "\n".join(parts)
