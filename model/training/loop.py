"""The training loop every training command runs: schedule, step, train state, progress.

A command describes its training as a :class:`Task` (one step: its data, forward, loss
and update; what evaluations run between steps; what its progress bar shows; what a
resumed run needs back) and how long it runs and how fast it learns as a :class:`Plan`.
:func:`train` then takes steps until the plan's step count or time budget is reached
(or the task says it is done): before each step it sets every optimizer's learning
rate to the schedule's factor of the group's ``base_lr``; after each it updates the
:class:`Counters`, lets the task evaluate, redraws the progress bar on stderr and, every
``Plan.save_every_s``, saves the train state (:class:`TrainState`, a run resumes from it).

Time is the steps' own: ``Counters.elapsed`` counts data, forward, backward and update,
not the evaluations between steps, the saves or a detour before a step (``v41
train-small``'s induction phase), so the time budget and the schedule follow the
training itself. The commands own everything else: their data, models, losses, final
checkpoint and report.
"""

from __future__ import annotations

import math
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

# (steps taken, progress in [0, 1)) -> the learning-rate factor of the next step.
Schedule = Callable[[int, float], float]
RATE_WINDOW_S = 60.0  # the progress bar's rate is over about this much recent training time


def lr_factor(progress: float, warmup: float = 0.03, decay_from: float = 0.7, floor: float = 0.1) -> float:
    """Warmup-stable-decay: linear warmup, constant, linear decay to ``floor`` (progress in [0, 1])."""
    if progress < warmup:
        return max(progress / warmup, 0.02)
    if progress < decay_from:
        return 1.0
    return 1.0 - (1.0 - floor) * min(1.0, (progress - decay_from) / (1.0 - decay_from))


def set_lr(optimizers: list[torch.optim.Optimizer], factor: float) -> None:
    """Every parameter group's learning rate: ``factor`` times its ``base_lr``."""
    for opt in optimizers:
        for group in opt.param_groups:
            group["lr"] = group["base_lr"] * factor


@dataclass
class Counters:
    """How far a run got: steps taken and the seconds spent in them."""

    step: int = 0
    elapsed: float = 0.0


@dataclass(frozen=True)
class Plan:
    """When a run stops and how fast it learns meanwhile.

    The run stops at ``steps`` steps or ``seconds`` of steps, whichever comes first
    (None / ``math.inf``: no such bound; ``seconds`` 0: no step at all). Progress is the
    larger share of the two, and the schedule reads it."""

    schedule: Schedule
    steps: int | None = None
    seconds: float = math.inf
    save_every_s: float = math.inf  # between train-state saves (when the run saves)
    tokens_per_step: int | None = None  # the bar shows tokens/s (None: seconds per step)
    label: str = "step"  # the bar's first word

    def progress(self, counters: Counters) -> float:
        by_steps = counters.step / self.steps if self.steps else 0.0
        by_time = counters.elapsed / self.seconds if self.seconds > 0 else 1.0
        return max(by_steps, by_time)


class Task:
    """A command's training as the loop drives it (override :meth:`step`; the rest is
    optional). ``optimizers`` are what the schedule sets and the train state saves;
    ``done`` set by the task ends the run before the plan's limits."""

    optimizers: list[torch.optim.Optimizer]
    done: bool = False

    def before(self, progress: float) -> None:
        """Before each step, outside its time (a detour such as a curriculum phase)."""

    def step(self, progress: float) -> None:
        """One update: draw the data, forward, loss, backward, optimizer steps; log it."""
        raise NotImplementedError

    def between(self, counters: Counters) -> None:
        """After each step (``counters`` include it), outside its time: evaluations."""

    def status(self) -> str:
        """The progress bar's middle: the task's recent losses."""
        return ""

    def state_dict(self) -> dict:
        """What resuming needs besides the counters and the optimizers (models, RNGs, log)."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Take back what :meth:`state_dict` gave."""


class TrainState:
    """``directory/state.pt``: a run's state (the task's, the optimizers', the
    counters'), written atomically; a run resumes from it."""

    def __init__(self, directory: Path):
        self.directory = Path(directory)
        self.path = self.directory / "state.pt"

    def exists(self) -> bool:
        return self.path.exists()

    def save(self, task: Task, counters: Counters) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".pt.tmp")
        torch.save({**task.state_dict(), "optimizers": [o.state_dict() for o in task.optimizers],
                    "step": counters.step, "elapsed": counters.elapsed}, tmp)
        tmp.replace(self.path)

    def resume(self, task: Task) -> Counters:
        """Load the saved state into ``task``; the counters it had reached."""
        state = torch.load(self.path, weights_only=False)
        for optimizer, saved in zip(task.optimizers, state["optimizers"]):
            optimizer.load_state_dict(saved)
        task.load_state_dict(state)
        counters = Counters(state["step"], state["elapsed"])
        print(f"resumed at step {counters.step} ({format_time(counters.elapsed)} trained)", file=sys.stderr)
        return counters

    def remove(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)


def train(task: Task, plan: Plan, counters: Counters | None = None,
          save: Callable[[], None] | None = None) -> Counters:
    """Steps of ``task`` until ``plan`` ends the run (or the task is done), from
    ``counters`` (a resumed run's) or the start; ``save`` (the train state's writer)
    runs every ``plan.save_every_s`` and once at the end. Returns the counters."""
    counters = Counters() if counters is None else counters
    bar = _Bar(plan, counters)
    last_save = time.time()
    while not task.done:
        progress = plan.progress(counters)
        if progress >= 1.0:
            break
        task.before(progress)
        tick = time.time()
        set_lr(task.optimizers, plan.schedule(counters.step, progress))
        task.step(progress)
        counters.step += 1
        counters.elapsed += time.time() - tick
        task.between(counters)
        bar.show(counters, task.status())
        if save is not None and time.time() - last_save > plan.save_every_s:
            save()
            last_save = time.time()
    print(file=sys.stderr)
    if save is not None:
        save()
    return counters


class _Bar:
    """``label step/total | status | rate | ETA`` on one stderr line, redrawn each step;
    the rate over the last ``RATE_WINDOW_S`` of training time."""

    def __init__(self, plan: Plan, counters: Counters):
        self.plan = plan
        self.start = Counters(counters.step, counters.elapsed)

    def show(self, counters: Counters, status: str) -> None:
        plan, start = self.plan, self.start
        per_step = (counters.elapsed - start.elapsed) / max(1, counters.step - start.step)
        if counters.elapsed - start.elapsed > RATE_WINDOW_S:
            self.start = Counters(counters.step, counters.elapsed)
        rate = (f"{plan.tokens_per_step / max(per_step, 1e-9):,.0f} tok/s" if plan.tokens_per_step
                else f"{per_step:.1f} s/step")
        left = plan.seconds - counters.elapsed
        if plan.steps:
            left = min(left, (plan.steps - counters.step) * per_step)
        total = plan.steps or "?"
        middle = f" | {status}" if status else ""
        print(f"\r{plan.label} {counters.step}/{total}{middle} | {rate} | ETA {format_time(left)}   ", end="",
              file=sys.stderr, flush=True)


def format_time(seconds: float) -> str:
    """``h:mm:ss`` (``?`` for no bound)."""
    if not math.isfinite(seconds):
        return "?"
    seconds = max(0, int(seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"
