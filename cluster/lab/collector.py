"""Python's cyclic garbage collector paused while the simulator's loop runs."""

from __future__ import annotations

import contextlib
import gc


@contextlib.contextmanager
def collector_paused():
    """Python's cyclic GC off while the loop runs. The loop makes no reference cycles
    (``test_the_loop_leaves_nothing_for_the_cyclic_collector``), and the store's
    entries live for hours of virtual time: automatic full collections walked tens of
    millions of live objects again and again (1.19x the run's time at 50,000 sessions),
    and collecting the young generations every 100,000 requests still cost 3%.

    On the way out, what the run made joins the oldest generation unscanned
    (``gc.freeze`` then ``gc.unfreeze``): re-enabling the collector would otherwise walk
    all of it at the next allocation (2.4 s of a 72 s run at 50,000 sessions). Skipped
    where the process keeps frozen objects of its own, which ``unfreeze`` would release."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            if gc.get_freeze_count() == 0:
                gc.freeze()
                gc.unfreeze()
            gc.enable()
