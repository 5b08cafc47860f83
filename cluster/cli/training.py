"""What the training commands share on the command line: how long a run may take
(``--minutes``, ``--steps``, ``--resume``) and the process's heap."""

from __future__ import annotations

import argparse
import ctypes
import math


def add_limits(parser: argparse.ArgumentParser, minutes: float, state: str | None = None) -> None:
    """``--minutes`` (``minutes`` by default: see :func:`time_budget`) and ``--steps``; with
    ``state`` (the train state's folder under ``--out``), ``--resume``."""
    parser.add_argument("--minutes", type=float, default=None,
                        help=f"training time budget (the LR schedule follows it; default {minutes:g}, none with "
                             "--steps)")
    parser.add_argument("--steps", type=int, default=None, help="stop after N steps (the schedule follows N when given)")
    if state is not None:
        parser.add_argument("--resume", action="store_true", help=f"continue from OUT/{state}")


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
        from cluster import UserError

        raise UserError("give --steps or a positive --minutes")


def keep_heap() -> bool:
    """Keep freed memory in this process's heap instead of handing it back to the kernel
    (glibc; elsewhere nothing changes). Returns whether it took effect.

    glibc serves each allocation past its mmap threshold (at most 32 MiB) with a fresh
    mapping and unmaps it on free, so a training step that builds and drops such tensors
    (the gathered windows of a 1,000-token conversation: batch x tokens x window x head
    dim) faults in every page again, every step. With mappings off and trimming high the
    heap grows to the step's peak once and is reused. `train-tools` on 2 cores of an AMD
    EPYC VM, the same 16 steps and losses: 7.3-7.7 s a step without, 6.3 s with; at a
    128-token window 16.2 s (60% of it in the kernel) without, 7.7 s with.
    """
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    m_trim_threshold, m_top_pad, m_mmap_max = -1, -2, -4
    return all(mallopt(option, value) == 1 for option, value in
               ((m_mmap_max, 0), (m_trim_threshold, 2**31 - 1), (m_top_pad, 64 << 20)))
