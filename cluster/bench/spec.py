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
import random
import statistics
import time
from dataclasses import dataclass
from pathlib import Path


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

    from cluster.cli.train_small import load_corpus, token_stream

    stream = token_stream(tokenizer, load_corpus().held_out)
    generator = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(stream) - length, (n,), generator=generator).tolist()
    return [stream[s : s + length].tolist() for s in starts]


@dataclass
class Run:
    """One mode's share of a lockstep run."""

    outputs: list[list[int]]
    timing: "Timing"
    tokens: int  # tokens out of ``step`` calls (each request's first comes from its replay)
    metrics: object  # SpecMetrics
    full: "Timing"  # the steps taken with the batch full (``in_flight`` requests running)
    full_tokens: int
    trace: list | None = None  # VerifyRecords, for the mode named by lockstep's ``trace``


def lockstep(engine, prompts, max_tokens: int, modes: dict, cost=None, seed: int = 0,
             in_flight: int | None = None, trace: str | None = None) -> dict[str, Run]:
    """Decode ``prompts`` (greedy) once per mode, the modes' batchers taking one step
    each in turn, in a new (seeded) random order every turn, so that no mode always
    goes first or always follows the same neighbour.

    Side by side at the scale of one step, because this machine is not steady at the
    scale of a run: six back-to-back runs of the same work at batch 16 took 7.3 to
    11.0 s of CPU time. Whole runs in turn had the scheduler 7% behind k=5 at batch 16
    (0.85-0.99 in five bench runs); in lockstep the two are level, within what a second
    k=5 (the bench's control) differs from the first. ``modes`` maps names to a
    :class:`Speculation` or None (plain). With ``cost`` (a StepCost), each mode's
    steps are also timed by the table.

    ``in_flight``: None starts every prompt together (a closed batch, which drains as
    its requests finish); a number runs at most that many at once, the others waiting
    in order and joining each mode's batch as soon as one of its requests finishes
    (continuous batching, as the decoder serves a queue). ``trace``: a mode whose
    steps are recorded (:class:`~model.runtime.speculative.VerifyRecord`)."""
    from model.runtime.batcher import Batcher
    from model.runtime.sampling import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    width = len(prompts) if in_flight is None else in_flight
    batchers, outputs, waiting = {}, {}, {}
    timings, tokens, full, full_tokens = {}, {}, {}, {}
    for name, speculation in modes.items():
        batchers[name] = Batcher(engine, max_batch=width, speculation=speculation)
        if name == trace:
            batchers[name].trace = []
        outputs[name], waiting[name] = {}, list(range(len(prompts)))[::-1]
        timings[name], tokens[name], full[name], full_tokens[name] = Timing(), 0, Timing(), 0
    names, order = list(modes), random.Random(seed)
    while any(b.running or waiting[n] for n, b in batchers.items()):
        for name in order.sample(names, len(names)):
            batcher = batchers[name]
            while waiting[name] and batcher.can_add():  # a free slot takes the next request
                i = waiting[name].pop()
                outputs[name][str(i)] = [batcher.add(str(i), params, prompt=prompts[i]).token_id]
            if not batcher.running:
                continue
            requests, verified = len(batcher.running), batcher.metrics.verified
            start, start_cpu = time.perf_counter(), time.thread_time()
            events = batcher.step()
            wall, cpu = time.perf_counter() - start, time.thread_time() - start_cpu
            modelled = 0.0
            if cost is not None and modes[name] is not None:  # an anchor per request + the guesses verified
                modelled = cost.seconds_per_step(requests, requests + batcher.metrics.verified - verified)
            timings[name] += Timing(wall, cpu, modelled)
            tokens[name] += len(events)
            if requests == width:
                full[name] += Timing(wall, cpu, modelled)
                full_tokens[name] += len(events)
            for event in events:
                outputs[name][event.request_id].append(event.token_id)
    return {name: Run([outputs[name][str(i)] for i in range(len(prompts))], timings[name], tokens[name],
                      batchers[name].metrics, full[name], full_tokens[name], batchers[name].trace) for name in names}


@dataclass
class Timing:
    """Seconds in ``step`` calls: wall clock; this thread's CPU time (torch runs on one
    thread here), which other processes taking the cores do not inflate; and what the
    profiled step-cost table says the same steps cost (no noise at all: a function of
    how many requests and tokens each step verified)."""

    wall: float = 0.0
    cpu: float = 0.0
    modelled: float = 0.0

    def __add__(self, other: "Timing") -> "Timing":
        return Timing(self.wall + other.wall, self.cpu + other.cpu, self.modelled + other.modelled)


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


def run(args: argparse.Namespace) -> int:
    from cluster import UserError
    from model.runtime.batcher import Speculation
    from model.config import ConfigError
    from model.runtime.engine import Engine
    from model.loader import CheckpointError, load_checkpoint, load_hasher, load_tokenizer
    from model.runtime.speculative import Calibration, SpecMetrics, SpeculativeDrafter, StepCost, replay_schedules

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
    k_max = drafter.block_size
    if any(not 1 <= k <= k_max for k in fixed):
        raise UserError(f"--fixed lengths must be in 1..{k_max}")
    if args.waves < 1 or args.repeats < 1:
        raise UserError("--waves and --repeats must be at least 1")

    start = time.perf_counter()
    cost = StepCost.profile(engine, drafter, requests=sorted({1, *batches}), max_tokens=k_max + 1)
    profile_s = time.perf_counter() - start
    scheduled = Speculation(drafter, "scheduled", cost=cost)
    prompts = _prompts(tokenizer, max(args.prompts, max(batches) * args.waves), args.prompt_tokens, args.seed)

    # Single stream: one request at a time, plain and speculative in lockstep per prompt.
    plain_s = spec_s = 0.0
    plain_n = spec_n = 0
    equal = True
    single = SpecMetrics()
    for prompt in prompts[: args.prompts]:
        runs = lockstep(engine, [prompt], args.max_tokens, {"plain": None, "speculative": scheduled}, seed=args.seed)
        plain, spec = runs["plain"], runs["speculative"]
        plain_s, plain_n = plain_s + plain.timing.wall, plain_n + plain.tokens
        spec_s, spec_n = spec_s + spec.timing.wall, spec_n + spec.tokens
        equal &= plain.outputs == spec.outputs
        for name in ("passes", "request_steps", "emitted", "accepted", "verified"):
            setattr(single, name, getattr(single, name) + getattr(spec.metrics, name))
        for length, count in spec.metrics.verify_lengths.items():
            single.verify_lengths[length] = single.verify_lengths.get(length, 0) + count
    plain_tps, spec_tps = plain_n / plain_s, spec_n / spec_s

    # Batch throughput: every mode at every batch size, as a closed batch (all start
    # together) and under continuous batching (a queue, the batch refilled).
    # The control: the largest fixed k a second time. Identical work, so its ratio to the
    # first shows how finely this machine can tell two modes apart.
    control = f"k={max(fixed)} again"
    modes = {"plain": None, **{f"k={k}": Speculation(drafter, "fixed", k=k) for k in fixed}, "scheduler": scheduled,
             control: Speculation(drafter, "fixed", k=max(fixed))}
    closed = _batch_table(engine, prompts, modes, fixed, batches, args, cost, continuous=False)
    served = _batch_table(engine, prompts, modes, fixed, batches, args, cost, continuous=True)
    table, cpu_table, modelled_table, paired, lengths = (closed.wall, closed.cpu, closed.modelled, closed.paired,
                                                         closed.lengths)
    batch_equal = closed.equal and served.equal

    print(f"DSpark speculative decoding ({args.checkpoint}, greedy, {args.max_tokens} tokens per request; "
          f"step-cost profile {profile_s:.1f} s)")
    print(f"\nsingle stream ({args.prompts} prompts)")
    print(f"{'':>12}  {'tokens/s':>9}")
    print(f"{'plain':>12}  {plain_tps:>9.2f}")
    print(f"{'speculative':>12}  {spec_tps:>9.2f}   x{spec_tps / plain_tps:.2f}; outputs equal: {equal}")
    print(f"acceptance length {single.acceptance_length:.3f} tokens per pass; guesses accepted "
          f"{single.accepted}/{single.verified}; verify lengths {single.to_dict()['verify_lengths']}")
    names = list(modes)
    print(f"\nbatch throughput, closed batch (all start together; the batch drains as they finish), decode tokens/s "
          f"({args.batch_tokens} tokens per request, {args.repeats} rounds)")
    ratios: dict[str, dict[int, float]] = {}
    for label, rows in (("wall clock", table), ("CPU time of the engine thread", cpu_table),
                        ("by the profiled step-cost table (the steps each mode took, timed by the table Algorithm 1 "
                         "reads)", modelled_table)):
        print(f"{label}:")
        ratios[label] = _print_rows(rows, names, fixed)
    best_ratio, cpu_ratio, modelled_ratio = ratios.values()
    print("scheduler / best fixed k, median over rounds of the paired CPU-time ratio: "
          + ", ".join(f"batch {b}: {paired[b]:.3f}" for b in batches))
    print(f"control, {control} / k={max(fixed)} (the same work; 1 up to noise), wall clock: "
          + ", ".join(f"batch {b}: {table[b][control] / table[b][f'k={max(fixed)}']:.3f}" for b in batches))
    print("scheduled verify lengths: " + "; ".join(f"batch {b}: {lengths[b]}" for b in batches))
    replayed = {}
    if max(fixed) == k_max:  # every guess verified: any shorter choice's outcome is known
        replayed = {b: replay_schedules(closed.records[b] + served.records[b], cost, fixed) for b in batches}
        print(f"the choices alone: each replayed on the draft states of the k={k_max} steps above (both tables), timed "
              "by the step-cost table (no noise, no trajectory), / best fixed k: "
              + ", ".join(f"batch {b}: scheduler {_over_best(r, fixed):.3f}, "
                          f"oracle {_over_best(r, fixed, 'oracle'):.3f}" for b, r in replayed.items()))
    print(f"\ncontinuous batching, decode tokens/s while the batch is full ({args.waves} requests per slot queued, "
          f"{args.batch_tokens} tokens each, {args.repeats} rounds), wall clock:")
    served_ratio = _print_rows(served.wall, names, fixed)
    print("scheduler / best fixed k, paired over rounds (CPU time): "
          + ", ".join(f"batch {b}: {served.paired[b]:.3f}" for b in batches)
          + "; by the step-cost table: "
          + ", ".join(f"batch {b}: {_over_best(rows, fixed):.3f}" for b, rows in served.modelled.items()))
    print("scheduled verify lengths: " + "; ".join(f"batch {b}: {served.lengths[b]}" for b in batches))
    print(f"every mode's outputs equal plain decoding's: {batch_equal}")
    result = {
        "checkpoint": str(args.checkpoint),
        "calibrated": calibration is not None,
        "compiled": engine.compiled is not None,
        "single_stream_tokens_per_s": {"plain": round(plain_tps, 3), "speculative": round(spec_tps, 3)},
        "single_stream_speedup": round(spec_tps / plain_tps, 4),
        "greedy_outputs_equal": equal,
        "batch_outputs_equal": batch_equal,
        "acceptance_length": round(single.acceptance_length, 4),
        "tokens_per_pass": round(single.tokens_per_pass, 4),
        "single_stream_verify_lengths": single.to_dict()["verify_lengths"],
        "batch_tokens_per_s": {str(b): {n: round(v, 3) for n, v in table[b].items()} for b in batches},
        "batch_tokens_per_cpu_s": {str(b): {n: round(v, 3) for n, v in cpu_table[b].items()} for b in batches},
        "scheduler_over_best_fixed_k": {str(b): round(r, 4) for b, r in best_ratio.items()},
        "scheduler_over_best_fixed_k_cpu": {str(b): round(r, 4) for b, r in cpu_ratio.items()},
        "scheduler_over_best_fixed_k_paired_cpu": {str(b): round(r, 4) for b, r in paired.items()},
        "scheduler_over_best_fixed_k_modelled": {str(b): round(r, 4) for b, r in modelled_ratio.items()},
        "scheduled_verify_lengths": {str(b): lengths[b] for b in batches},
        "control_over_same_k": {str(b): round(table[b][control] / table[b][f"k={max(fixed)}"], 4) for b in batches},
        "continuous_tokens_per_s": {str(b): {n: round(v, 3) for n, v in served.wall[b].items()} for b in batches},
        "continuous_scheduler_over_best_fixed_k": {str(b): round(r, 4) for b, r in served_ratio.items()},
        "continuous_scheduler_over_best_fixed_k_paired_cpu": {str(b): round(r, 4) for b, r in served.paired.items()},
        "continuous_scheduled_verify_lengths": {str(b): served.lengths[b] for b in batches},
        "replayed_tokens_per_s": {str(b): {n: round(v, 3) for n, v in r.items()} for b, r in replayed.items()},
        "replayed_scheduler_over_best_fixed_k": {str(b): round(_over_best(r, fixed), 4) for b, r in replayed.items()},
        "step_cost_s": cost.to_dict(),
    }
    if 16 in best_ratio:
        result["scheduler_over_best_fixed_k_batch16"] = round(best_ratio[16], 4)
        result["scheduler_over_best_fixed_k_batch16_cpu"] = round(cpu_ratio[16], 4)
        result["continuous_scheduler_over_best_fixed_k_batch16"] = round(served_ratio[16], 4)
    if args.json:
        print(json.dumps(result))
    return 0
