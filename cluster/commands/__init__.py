"""The ``v41`` subcommands (one module each)."""

from __future__ import annotations

import math


def minutes_argument(default: float) -> dict:
    """``--minutes`` for a training command, with :func:`time_budget`'s default."""
    return {"type": float, "default": None,
            "help": f"training time budget (the LR schedule follows it; default {default:g}, none with --steps)"}


def time_budget(minutes: float | None, steps: int | None, default: float) -> float:
    """Seconds a training run may take. ``--minutes`` when given (0: no limit); else
    none when ``--steps`` bounds the run, and ``default`` minutes when nothing does. A
    run given only ``--steps`` used to stop at the default minutes too, short of its steps."""
    if minutes is None:
        minutes = 0.0 if steps else default
    return minutes * 60 if minutes > 0 else math.inf


def check_bounded(minutes: float | None, steps: int | None) -> None:
    """A run must end: ``--minutes 0`` (no time limit) needs ``--steps``."""
    if steps is None and minutes is not None and minutes <= 0:
        from cluster.cli import UserError

        raise UserError("give --steps or a positive --minutes")
