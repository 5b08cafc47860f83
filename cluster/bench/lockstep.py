"""Decoding modes measured side by side: each mode's batcher takes one step in turn
(:func:`lockstep`), so that a machine that is not steady over a run still compares
them fairly (``v41 bench spec``)."""

from __future__ import annotations

import random
import time
from dataclasses import dataclass


@dataclass
class Run:
    """One mode's share of a lockstep run."""

    outputs: list[list[int]]
    timing: Timing
    tokens: int  # tokens out of ``step`` calls (each request's first comes from its replay)
    metrics: object  # SpecMetrics
    full: Timing  # the steps taken with the batch full (``in_flight`` requests running)
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
    steps are recorded (:class:`~model.runtime.prefix_scheduler.VerifyRecord`)."""
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

    def __add__(self, other: Timing) -> Timing:
        return Timing(self.wall + other.wall, self.cpu + other.cpu, self.modelled + other.modelled)
