"""`v41 bench spec`: DSpark speculative decoding against plain decoding, and the scheduler
against fixed verify lengths.

On a checkpoint with a trained drafter (by default ``configs/small`` with its
``dspark_calibration.json``), greedy, prompts cut from the held-out files of the small
model's corpus:

- **single stream**: decode tokens/s of one request at a time, speculative (the
  scheduler) against plain, in lockstep; the speculative tokens are checked equal to
  the plain ones; acceptance length (tokens per request per backbone pass) and tokens
  per pass.
- **batch throughput** at batch 1, 4, 16: decode tokens/s of the scheduler against
  fixed k = 1..5 and against plain decoding, over ``--repeats`` rounds; in each round
  every mode decodes the same prompts in lockstep (one step of each mode in turn, see
  :func:`lockstep`). Twice: as a **closed batch** (the requests start together and the
  batch drains as they finish) and under **continuous batching** (``--waves`` requests
  per slot queue and a finished request's slot takes the next, as the decoder serves;
  counted while the batch is full). The two differ for the scheduler: it lets the
  requests whose guesses are accepted run ahead, so a closed batch ends on its slow
  requests at a small batch, which a queue refills.

Decode tokens/s counts the tokens of ``step`` calls over the time spent in them (the
first token of each request comes from its replay, the same in every mode), by the
wall clock, by the engine thread's CPU time (torch on one thread; on this VM it is no
steadier than the wall clock) and by the profiled step-cost table; the scheduler is
also compared round by round with the best fixed k (median of the per-round CPU-time
ratios). The scheduler's step-cost table is profiled first, as the decoder does when
it starts.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

from cluster.bench.lockstep import Timing, lockstep


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--checkpoint", type=Path, default=Path("configs/small"), help="checkpoint directory")
    parser.add_argument("--prompts", type=int, default=8, help="single-stream prompts")
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens generated per request")
    parser.add_argument("--batches", default="1,4,16", help="batch sizes of the throughput table")
    parser.add_argument("--fixed", default="1,2,3,4,5", help="fixed verify lengths to compare")
    parser.add_argument("--batch-tokens", type=int, default=32, help="tokens per request in the batch table")
    parser.add_argument("--repeats", type=int, default=2, help="rounds over all modes in the batch table (interleaved)")
    parser.add_argument("--waves", type=int, default=4,
                        help="continuous batching: requests queued per batch slot (batch x waves requests a round)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--compiled", action="store_true",
                        help="run the compiled layer step (AOTInductor, as compiled_step serves it)")


def _prompts(tokenizer, n: int, length: int, seed: int) -> list[list[int]]:
    """Windows of the held-out stdlib files (deterministic)."""
    import torch

    from model.training.corpus import load_corpus, token_stream

    stream = token_stream(tokenizer, load_corpus().held_out)
    generator = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(stream) - length, (n,), generator=generator).tolist()
    return [stream[s : s + length].tolist() for s in starts]


@dataclass
class BatchTable:
    """Decode tokens/s of every mode at every batch size, over the rounds of
    :func:`lockstep`: by the wall clock, the engine thread's CPU time and the step-cost
    table; the scheduler over the best fixed k, median over rounds of the per-round
    ratio (CPU time); the scheduler's verify lengths; whether every mode decoded what
    plain decoding did."""

    wall: dict[int, dict[str, float]]
    cpu: dict[int, dict[str, float]]
    modelled: dict[int, dict[str, float]]  # speculative modes only (plain does not draft)
    paired: dict[int, float]
    lengths: dict[int, dict[str, int]]
    equal: bool
    records: dict[int, list]  # the largest fixed k's steps (VerifyRecords)


def _batch_table(engine, prompts, modes: dict, fixed: list[int], batches: list[int], args, cost,
                 continuous: bool) -> BatchTable:
    """A closed batch: ``batch`` prompts start together and the batch drains as they
    finish (every step counted). Continuous: ``batch * args.waves`` prompts queue for
    ``batch`` slots, each finished request's slot taken by the next; only the steps
    with the batch full count (a server under load; the final drain is the closed
    batch's case)."""
    wall, cpu, modelled, paired, lengths, equal, records = {}, {}, {}, {}, {}, True, {}
    for batch in batches:
        records[batch] = []
        rounds: list[dict[str, tuple[int, Timing]]] = []
        lengths[batch] = {}
        for round_ in range(args.repeats):
            runs = lockstep(engine, prompts[: batch * args.waves] if continuous else prompts[:batch],
                            args.batch_tokens, modes, cost, seed=args.seed + round_,
                            in_flight=batch if continuous else None, trace=f"k={max(fixed)}")
            records[batch] += runs[f"k={max(fixed)}"].trace
            rounds.append({name: (run.full_tokens, run.full) if continuous else (run.tokens, run.timing)
                           for name, run in runs.items()})
            equal &= all(run.outputs == runs["plain"].outputs for run in runs.values())
            for k, v in runs["scheduler"].metrics.verify_lengths.items():
                lengths[batch][str(k)] = lengths[batch].get(str(k), 0) + v
        tokens = {name: sum(r[name][0] for r in rounds) for name in modes}
        total = {name: sum((r[name][1] for r in rounds), Timing()) for name in modes}
        wall[batch] = {name: tokens[name] / total[name].wall for name in modes}
        cpu[batch] = {name: tokens[name] / total[name].cpu for name in modes}
        modelled[batch] = {name: tokens[name] / total[name].modelled for name in modes if name != "plain"}
        best = max((f"k={k}" for k in fixed), key=lambda name: cpu[batch][name])
        paired[batch] = statistics.median((r["scheduler"][0] / r["scheduler"][1].cpu) / (r[best][0] / r[best][1].cpu)
                                          for r in rounds)
        lengths[batch] = dict(sorted(lengths[batch].items(), key=lambda item: int(item[0])))
    return BatchTable(wall, cpu, modelled, paired, lengths, equal, records)


def _over_best(row: dict[str, float], fixed: list[int], name: str = "scheduler") -> float:
    """``row[name]`` over the best fixed k's figure in the same row."""
    return row[name] / max(row[f"k={k}"] for k in fixed)


def _print_rows(rows: dict[int, dict[str, float]], names: list[str], fixed: list[int]) -> dict[int, float]:
    """A table of tokens/s by batch (the modes of ``names`` that ``rows`` has) with the
    scheduler over the best fixed k; returns those ratios."""
    shown = [n for n in names if n in next(iter(rows.values()))]
    ratios = {b: _over_best(row, fixed) for b, row in rows.items()}
    print(f"{'batch':>5}  " + "  ".join(f"{n:>9}" for n in shown) + f"  {'sched/best k':>12}")
    for batch, row in rows.items():
        print(f"{batch:>5}  " + "  ".join(f"{row[n]:>9.2f}" for n in shown) + f"  {ratios[batch]:>12.3f}")
    return ratios


@dataclass
class Setup:
    """The bench's engine and drafter on the checkpoint, and the batch sizes and fixed
    verify lengths it compares."""

    engine: object  # model.runtime.engine.Engine
    drafter: object  # model.runtime.speculative.SpeculativeDrafter
    calibrated: bool
    tokenizer: object
    batches: list[int]
    fixed: list[int]


def _setup(args: argparse.Namespace) -> Setup:
    from cluster import UserError
    from model.config import ConfigError
    from model.loader import CheckpointError, load_checkpoint, load_hasher, load_tokenizer
    from model.runtime.calibration import Calibration
    from model.runtime.engine import Engine
    from model.runtime.speculative import SpeculativeDrafter

    try:
        checkpoint = load_checkpoint(args.checkpoint)
        tokenizer = load_tokenizer(args.checkpoint)
        hasher = load_hasher(args.checkpoint, checkpoint.config)
        batches = [int(b) for b in args.batches.split(",")]
        fixed = [int(k) for k in args.fixed.split(",")]
    except (CheckpointError, ConfigError, OSError, ValueError) as error:
        raise UserError(str(error)) from None
    if checkpoint.drafter is None:
        raise UserError(f"{args.checkpoint} has no DSpark drafter")
    calibration_path = args.checkpoint / "dspark_calibration.json"
    calibration = Calibration.from_dict(json.loads(calibration_path.read_text())) if calibration_path.exists() else None
    engine = Engine(checkpoint.backbone, hasher, compiled=args.compiled)
    if engine.compiled is not None:
        engine.warm_compiled()
    drafter = SpeculativeDrafter(checkpoint.drafter, engine, calibration)
    drafter.warm_compiled()
    if any(not 1 <= k <= drafter.block_size for k in fixed):
        raise UserError(f"--fixed lengths must be in 1..{drafter.block_size}")
    if args.waves < 1 or args.repeats < 1:
        raise UserError("--waves and --repeats must be at least 1")
    return Setup(engine, drafter, calibration is not None, tokenizer, batches, fixed)


@dataclass
class SingleStream:
    """One request at a time, plain and speculative in lockstep per prompt."""

    plain_tps: float
    spec_tps: float
    equal: bool  # the speculative tokens were the plain ones
    metrics: object  # SpecMetrics, summed over the prompts


def _single_stream(engine, prompts: list[list[int]], max_tokens: int, scheduled, seed: int) -> SingleStream:
    from model.runtime.speculative import SpecMetrics

    plain_s = spec_s = 0.0
    plain_n = spec_n = 0
    equal = True
    single = SpecMetrics()
    for prompt in prompts:
        runs = lockstep(engine, [prompt], max_tokens, {"plain": None, "speculative": scheduled}, seed=seed)
        plain, spec = runs["plain"], runs["speculative"]
        plain_s, plain_n = plain_s + plain.timing.wall, plain_n + plain.tokens
        spec_s, spec_n = spec_s + spec.timing.wall, spec_n + spec.tokens
        equal &= plain.outputs == spec.outputs
        for name in ("passes", "request_steps", "emitted", "accepted", "verified"):
            setattr(single, name, getattr(single, name) + getattr(spec.metrics, name))
        for length, count in spec.metrics.verify_lengths.items():
            single.verify_lengths[length] = single.verify_lengths.get(length, 0) + count
    return SingleStream(plain_n / plain_s, spec_n / spec_s, equal, single)


def run(args: argparse.Namespace) -> int:
    from model.runtime.batcher import Speculation
    from model.runtime.prefix_scheduler import StepCost, replay_schedules

    setup = _setup(args)
    engine, drafter, batches, fixed = setup.engine, setup.drafter, setup.batches, setup.fixed
    start = time.perf_counter()
    cost = StepCost.profile(engine, drafter, requests=sorted({1, *batches}), max_tokens=drafter.block_size + 1)
    profile_s = time.perf_counter() - start
    scheduled = Speculation(drafter, "scheduled", cost=cost)
    prompts = _prompts(setup.tokenizer, max(args.prompts, max(batches) * args.waves), args.prompt_tokens, args.seed)
    single = _single_stream(engine, prompts[: args.prompts], args.max_tokens, scheduled, args.seed)

    # Batch throughput: every mode at every batch size, as a closed batch (all start
    # together) and under continuous batching (a queue, the batch refilled).
    # The control: the largest fixed k a second time. Identical work, so its ratio to the
    # first shows how finely this machine can tell two modes apart.
    modes = {"plain": None, **{f"k={k}": Speculation(drafter, "fixed", k=k) for k in fixed}, "scheduler": scheduled,
             _control(fixed): Speculation(drafter, "fixed", k=max(fixed))}
    closed = _batch_table(engine, prompts, modes, fixed, batches, args, cost, continuous=False)
    served = _batch_table(engine, prompts, modes, fixed, batches, args, cost, continuous=True)
    replayed = {}
    if max(fixed) == drafter.block_size:  # every guess verified: any shorter choice's outcome is known
        replayed = {b: replay_schedules(closed.records[b] + served.records[b], cost, fixed) for b in batches}
    print(f"DSpark speculative decoding ({args.checkpoint}, greedy, {args.max_tokens} tokens per request; "
          f"step-cost profile {profile_s:.1f} s)")
    ratios = _print_tables(args, setup, single, list(modes), closed, served, replayed)
    if args.json:
        print(json.dumps(_result(args, setup, single, closed, served, ratios, replayed, cost.to_dict())))
    return 0

def _control(fixed: list[int]) -> str:
    return f"k={max(fixed)} again"


def _print_tables(args: argparse.Namespace, setup: Setup, single: SingleStream, names: list[str], closed: BatchTable,
                  served: BatchTable, replayed: dict) -> dict[str, dict[int, float]]:
    """The single-stream numbers, the closed-batch tables (wall, CPU, modelled), the
    replayed choices, the continuous-batching table; the scheduler / best fixed k ratios
    of each table by its name."""
    batches, fixed, control, metrics = setup.batches, setup.fixed, _control(setup.fixed), single.metrics
    print(f"\nsingle stream ({args.prompts} prompts)")
    print(f"{'':>12}  {'tokens/s':>9}")
    print(f"{'plain':>12}  {single.plain_tps:>9.2f}")
    print(f"{'speculative':>12}  {single.spec_tps:>9.2f}   x{single.spec_tps / single.plain_tps:.2f}; outputs equal: "
          f"{single.equal}")
    print(f"acceptance length {metrics.acceptance_length:.3f} tokens per pass; guesses accepted "
          f"{metrics.accepted}/{metrics.verified}; verify lengths {metrics.to_dict()['verify_lengths']}")
    print(f"\nbatch throughput, closed batch (all start together; the batch drains as they finish), decode tokens/s "
          f"({args.batch_tokens} tokens per request, {args.repeats} rounds)")
    ratios: dict[str, dict[int, float]] = {}
    for key, label, rows in (("wall", "wall clock", closed.wall), ("cpu", "CPU time of the engine thread", closed.cpu),
                             ("modelled", "by the profiled step-cost table (the steps each mode took, timed by the "
                              "table Algorithm 1 reads)", closed.modelled)):
        print(f"{label}:")
        ratios[key] = _print_rows(rows, names, fixed)
    print("scheduler / best fixed k, median over rounds of the paired CPU-time ratio: "
          + ", ".join(f"batch {b}: {closed.paired[b]:.3f}" for b in batches))
    print(f"control, {control} / k={max(fixed)} (the same work; 1 up to noise), wall clock: "
          + ", ".join(f"batch {b}: {closed.wall[b][control] / closed.wall[b][f'k={max(fixed)}']:.3f}" for b in batches))
    print("scheduled verify lengths: " + "; ".join(f"batch {b}: {closed.lengths[b]}" for b in batches))
    if replayed:
        print(f"the choices alone: each replayed on the draft states of the k={max(fixed)} steps above (both tables), "
              "timed by the step-cost table (no noise, no trajectory), / best fixed k: "
              + ", ".join(f"batch {b}: scheduler {_over_best(r, fixed):.3f}, "
                          f"oracle {_over_best(r, fixed, 'oracle'):.3f}" for b, r in replayed.items()))
    print(f"\ncontinuous batching, decode tokens/s while the batch is full ({args.waves} requests per slot queued, "
          f"{args.batch_tokens} tokens each, {args.repeats} rounds), wall clock:")
    ratios["served"] = _print_rows(served.wall, names, fixed)
    print("scheduler / best fixed k, paired over rounds (CPU time): "
          + ", ".join(f"batch {b}: {served.paired[b]:.3f}" for b in batches)
          + "; by the step-cost table: "
          + ", ".join(f"batch {b}: {_over_best(rows, fixed):.3f}" for b, rows in served.modelled.items()))
    print("scheduled verify lengths: " + "; ".join(f"batch {b}: {served.lengths[b]}" for b in batches))
    print(f"every mode's outputs equal plain decoding's: {closed.equal and served.equal}")
    return ratios


def _result(args: argparse.Namespace, setup: Setup, single: SingleStream, closed: BatchTable, served: BatchTable,
            ratios: dict[str, dict[int, float]], replayed: dict, step_cost: dict) -> dict:
    """The bench's JSON line."""
    batches, fixed, control, metrics = setup.batches, setup.fixed, _control(setup.fixed), single.metrics

    def rounded(values: dict, digits: int = 4) -> dict:
        return {str(b): round(r, digits) for b, r in values.items()}

    result = {
        "checkpoint": str(args.checkpoint),
        "calibrated": setup.calibrated,
        "compiled": setup.engine.compiled is not None,
        "single_stream_tokens_per_s": {"plain": round(single.plain_tps, 3), "speculative": round(single.spec_tps, 3)},
        "single_stream_speedup": round(single.spec_tps / single.plain_tps, 4),
        "greedy_outputs_equal": single.equal,
        "batch_outputs_equal": closed.equal and served.equal,
        "acceptance_length": round(metrics.acceptance_length, 4),
        "tokens_per_pass": round(metrics.tokens_per_pass, 4),
        "single_stream_verify_lengths": metrics.to_dict()["verify_lengths"],
        "batch_tokens_per_s": {str(b): rounded(closed.wall[b], 3) for b in batches},
        "batch_tokens_per_cpu_s": {str(b): rounded(closed.cpu[b], 3) for b in batches},
        "scheduler_over_best_fixed_k": rounded(ratios["wall"]),
        "scheduler_over_best_fixed_k_cpu": rounded(ratios["cpu"]),
        "scheduler_over_best_fixed_k_paired_cpu": rounded(closed.paired),
        "scheduler_over_best_fixed_k_modelled": rounded(ratios["modelled"]),
        "scheduled_verify_lengths": {str(b): closed.lengths[b] for b in batches},
        "control_over_same_k": {str(b): round(closed.wall[b][control] / closed.wall[b][f"k={max(fixed)}"], 4)
                                for b in batches},
        "continuous_tokens_per_s": {str(b): rounded(served.wall[b], 3) for b in batches},
        "continuous_scheduler_over_best_fixed_k": rounded(ratios["served"]),
        "continuous_scheduler_over_best_fixed_k_paired_cpu": rounded(served.paired),
        "continuous_scheduled_verify_lengths": {str(b): served.lengths[b] for b in batches},
        "replayed_tokens_per_s": {str(b): rounded(r, 3) for b, r in replayed.items()},
        "replayed_scheduler_over_best_fixed_k": {str(b): round(_over_best(r, fixed), 4) for b, r in replayed.items()},
        "step_cost_s": step_cost,
    }
    if 16 in ratios["wall"]:
        result["scheduler_over_best_fixed_k_batch16"] = round(ratios["wall"][16], 4)
        result["scheduler_over_best_fixed_k_batch16_cpu"] = round(ratios["cpu"][16], 4)
        result["continuous_scheduler_over_best_fixed_k_batch16"] = round(ratios["served"][16], 4)
    return result
