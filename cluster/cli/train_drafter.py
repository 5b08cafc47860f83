"""`v41 train-drafter`: train a checkpoint's DSpark drafter on its frozen backbone.

Data. Sequences of two kinds, half of each batch from each: windows of the small
model's corpus (``v41 train-small``'s standard-library sources and tokenizer), and the
backbone's own greedy continuations of corpus prompts (generated here first with the
engine: what the drafter has to guess at serving time). The teacher is the frozen
backbone: its reference forward over each batch gives the next-token distributions and
the attention-input streams of the target layers. Blocks are anchored at random
positions (``--anchors`` per sequence).

Objective (the DSpark paper, section 3.3, :func:`model.dspark.draft_loss`):
0.1 cross-entropy + 0.9 total-variation distance to the teacher + 1.0 confidence BCE
against c* = 1 - TV, each position-weighted by exp(-(k-1)/K). Only the drafter learns
(its embedding and output head are the backbone's, frozen).

Calibration. Greedy continuations of held-out prompts give exact verification labels
(along a greedy trajectory the target's argmax is the next token): every anchor's
greedy draft is accepted up to its first mismatch. Sequential temperature scaling
(:meth:`model.runtime.calibration.Calibration.fit`) runs on the saved (quantised) drafter.

Output: the whole checkpoint re-saved with the trained drafter
(``model.loader.save_checkpoint``) and ``dspark_calibration.json`` (temperatures, ECE
before/after, held-out acceptance length, the training log).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from cluster import UserError
from cluster.cli.training import add_limits, check_bounded, keep_heap, time_budget
from model.config import ConfigError
from model.dspark import draft_loss, target_streams
from model.loader import CheckpointError, load_checkpoint, load_hasher, load_tokenizer, save_checkpoint
from model.runtime.batcher import Speculation, generate
from model.runtime.engine import Engine
from model.runtime.sampling import SamplingParams
from model.runtime.calibration import Calibration
from model.runtime.speculative import SpeculativeDrafter
from model.training.batches import engram_ids
from model.training.corpus import load_corpus, token_stream
from model.training.loop import Counters, Plan, Task, lr_factor, train

MINUTES = 15.0  # the time budget when neither --minutes nor --steps is given


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--checkpoint", type=Path, default=Path("configs/small"), help="checkpoint directory")
    parser.add_argument("--out", type=Path, default=None, help="where to save (default: the checkpoint itself)")
    add_limits(parser, MINUTES)
    parser.add_argument("--batch", type=int, default=8, help="sequences per step")
    parser.add_argument("--seq-len", type=int, default=160)
    parser.add_argument("--anchors", type=int, default=24, help="blocks per sequence")
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--generated", type=int, default=32, help="greedy continuations to train on")
    parser.add_argument("--held-out", type=int, default=16, help="greedy continuations of held-out prompts (calibration)")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--init", type=Path, default=None, help="start from the drafter of this checkpoint")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-files", type=int, default=None, help="use only the first N corpus files (smoke runs)")


def _greedy(engine, prompts: list[list[int]], length: int, speculation=None, batch: int = 32) -> list[list[int]]:
    """Prompts followed by their greedy continuations (speculation, when given, only
    makes this faster: greedy speculative output equals plain greedy output)."""
    params = SamplingParams(temperature=0.0, max_tokens=length)
    out = []
    for i in range(0, len(prompts), batch):
        chunk = prompts[i : i + batch]
        out += [p + c for p, c in zip(chunk, generate(engine, chunk, params, max_batch=batch, speculation=speculation))]
    return out


def _windows(stream, n: int, length: int, generator) -> list[list[int]]:
    starts = torch.randint(0, len(stream) - length - 1, (n,), generator=generator).tolist()
    return [stream[s : s + length].tolist() for s in starts]


def held_out_labels(drafter, model, hasher, sequences: list[list[int]], start: int, block: int = 32):
    """(confidence logits [N, K], accepted prefix [N, K] bool) of the greedy drafts at every
    anchor past ``start`` of greedy sequences (exact labels, see the module doc)."""
    k = drafter.block_size
    logits_all, accepted_all = [], []
    for seq in sequences:
        ids = torch.tensor([seq])
        _, streams = target_streams(model, ids, engram_ids(hasher, ids), drafter.config.dspark_target_layer_ids)
        with torch.no_grad():
            s = ids.shape[1]
            positions = torch.arange(s)[None]
            entries = drafter.context_entries(drafter.project_context(streams), positions)
            for lo in range(start, s - k, block):
                anchors = torch.arange(lo, min(lo + block, s - k))
                n = len(anchors)
                draft = drafter.draft([e.expand(n, -1, -1) for e in entries], positions.expand(n, -1),
                                      ids[0, anchors], anchors, model.embed, model.lm_head)
                proposal = drafter.propose(draft, ids[0, anchors])
                truth = ids[0, anchors[:, None] + 1 + torch.arange(k)]
                accepted_all.append((proposal.tokens == truth).long().cumprod(dim=-1).bool())
                logits_all.append(proposal.confidence_logits)
    return torch.cat(logits_all), torch.cat(accepted_all)


def run(args: argparse.Namespace) -> int:
    check_bounded(args.minutes, args.steps)
    keep_heap()
    out = args.out or args.checkpoint
    try:
        checkpoint = load_checkpoint(args.checkpoint, keep_stored=True)  # the frozen backbone re-saves byte for byte
        tokenizer = load_tokenizer(args.checkpoint)
        hasher = load_hasher(args.checkpoint, checkpoint.config)
    except (CheckpointError, ConfigError, OSError) as error:
        raise UserError(str(error)) from None
    if checkpoint.drafter is None:
        raise UserError(f"{args.checkpoint} has no DSpark drafter (num_nextn_predict_layers = 0)")
    if args.init is not None:
        _load_drafter(args.init, checkpoint.drafter)
    if args.seq_len < args.prompt_len + 2 * checkpoint.drafter.block_size:
        raise UserError("--seq-len must exceed --prompt-len by at least twice the block size")
    for p in checkpoint.backbone.parameters():
        p.requires_grad_(False)
    started = time.time()
    task = DrafterTraining(args, checkpoint, hasher, tokenizer)
    plan = Plan(lambda step, progress: lr_factor(progress), steps=args.steps,
                seconds=time_budget(args.minutes, args.steps, MINUTES))
    task.drafter.train()
    counters = train(task, plan)
    task.drafter.eval()
    save_checkpoint(out, checkpoint)
    _calibrate(out, task, hasher, counters, started)
    return 0


class DrafterTraining(Task):
    """The drafter's steps on its frozen backbone: half greedy continuations, half
    corpus windows, blocks anchored at random positions, the DSpark loss."""

    def __init__(self, args: argparse.Namespace, checkpoint, hasher, tokenizer):
        self.args, self.hasher = args, hasher
        self.model, self.drafter = checkpoint.backbone.eval(), checkpoint.drafter
        self.targets = checkpoint.config.text.dspark_target_layer_ids
        self.generator = torch.Generator().manual_seed(args.seed)
        corpus = load_corpus(args.max_files)
        self.train_stream = token_stream(tokenizer, corpus.train)
        held_stream = token_stream(tokenizer, corpus.held_out)
        self.generated, self.held_out = self._continuations(held_stream)
        params = list(self.drafter.parameters())
        self.optimizers = [torch.optim.AdamW([{"params": params, "base_lr": args.lr}], lr=args.lr, weight_decay=0.01,
                                             betas=(0.9, 0.95))]
        self.log = {"steps": [], "loss": [], "tv": [], "acceptance": []}

    def _continuations(self, held_stream) -> tuple[list[list[int]], list[list[int]]]:
        """Greedy continuations of training prompts (data) and of held-out ones (calibration)."""
        args, k = self.args, self.drafter.block_size
        started = time.time()
        engine = Engine(self.model, self.hasher, bounded_replay=False)
        gen_len = args.seq_len - args.prompt_len
        # A warm-started drafter speeds the generation up (fixed k: no profiling needed).
        speculation = (Speculation(SpeculativeDrafter(self.drafter, engine), "fixed", k=k)
                       if args.init is not None else None)
        print(f"generating {args.generated} + {args.held_out} greedy continuations of {gen_len} tokens ...",
              file=sys.stderr)
        generated = _greedy(engine, _windows(self.train_stream, args.generated, args.prompt_len, self.generator),
                            gen_len, speculation)
        held_out = _greedy(engine, _windows(held_stream, args.held_out, args.prompt_len, self.generator), gen_len,
                           speculation)
        print(f"  {time.time() - started:.0f} s", file=sys.stderr)
        return generated, held_out

    def step(self, progress: float) -> None:
        args, k, generator = self.args, self.drafter.block_size, self.generator
        n_gen = args.batch // 2
        picks = torch.randint(0, len(self.generated), (n_gen,), generator=generator).tolist()
        rows = [self.generated[i] for i in picks] + _windows(self.train_stream, args.batch - n_gen, args.seq_len,
                                                             generator)
        ids = torch.tensor(rows)
        teacher, streams = target_streams(self.model, ids, engram_ids(self.hasher, ids), self.targets)
        anchors = torch.randint(0, args.seq_len - 1 - k, (args.batch, args.anchors), generator=generator)
        logits, confidence = self.drafter.teacher_forced(streams, ids, anchors, self.model.embed, self.model.lm_head)
        batch_rows = torch.arange(args.batch).repeat_interleave(args.anchors)
        window = anchors.reshape(-1, 1) + torch.arange(k)
        rows_of = batch_rows[:, None]
        loss = draft_loss(logits, confidence, teacher[rows_of, window], ids[rows_of, window + 1])
        (optimizer,) = self.optimizers
        optimizer.zero_grad(set_to_none=True)
        loss.total.backward()
        torch.nn.utils.clip_grad_norm_(self.drafter.parameters(), 1.0)
        optimizer.step()
        self.log["loss"].append(round(float(loss.total.detach()), 4))
        self.log["tv"].append(round(float(loss.tv.detach()), 4))
        self.log["acceptance"].append([round(float(a), 3) for a in loss.argmax_match])

    def between(self, counters: Counters) -> None:
        self.log["steps"].append(counters.step)

    def status(self) -> str:
        recent = self.log["loss"][-20:]
        return (f"loss {sum(recent) / len(recent):.3f} | tv {self.log['tv'][-1]:.3f} | argmax match "
                f"{' '.join(f'{a:.2f}' for a in self.log['acceptance'][-1])}")


def _calibrate(out: Path, task: DrafterTraining, hasher, counters: Counters, started: float) -> None:
    """Fit the confidence temperatures on the saved (quantised) drafter's held-out
    drafts and write ``dspark_calibration.json``."""
    args = task.args
    saved = load_checkpoint(out)  # calibrate what users load (quantised weights)
    conf_logits, accepted = held_out_labels(saved.drafter, saved.backbone, hasher, task.held_out, args.prompt_len)
    calibration = Calibration.fit(conf_logits, accepted)
    acceptance_length = 1.0 + float(accepted.float().sum(dim=-1).mean())
    report = {
        **calibration.to_dict(),
        "held_out": {"sequences": len(task.held_out), "blocks": int(accepted.shape[0]),
                     "greedy_acceptance_length": round(acceptance_length, 4),
                     "prefix_acceptance": [round(float(a), 4) for a in accepted.float().mean(0)]},
        "training": {"steps": counters.step, "train_seconds": round(counters.elapsed, 1),
                     "wall_seconds": round(time.time() - started, 1), "batch": args.batch, "seq_len": args.seq_len,
                     "anchors": args.anchors, "lr": args.lr, "generated": args.generated,
                     "loss_weights": {"ce": 0.1, "tv": 0.9, "conf": 1.0}, "log": task.log},
    }
    (Path(out) / "dspark_calibration.json").write_text(json.dumps(report) + "\n")
    print(f"saved {out}: held-out greedy acceptance length {acceptance_length:.3f}, temperatures "
          f"{[round(t, 3) for t in calibration.temperatures]}, ECE {[round(e, 3) for e in calibration.ece_before]} -> "
          f"{[round(e, 3) for e in calibration.ece_after]}", file=sys.stderr)


def _load_drafter(directory: Path, drafter) -> None:
    """Copy the ``mtp.*`` tensors of another checkpoint into ``drafter`` (a warm start)."""
    source = load_checkpoint(directory)
    drafter.load_state_dict(source.drafter.state_dict())
