"""Write-behind: objects reach SSD and Redis on a background thread, never on the caller's.

The queue is bounded in bytes; when it is full a new write is dropped (and counted)
rather than blocking the request, since the object is still in RAM and the next
request can store it again. Queued and in-flight objects stay readable through
``pending`` until their write has finished, so a read never misses an object only
because its write is slow.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from storage.keys import ObjectKey

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class WriteJob:
    """One object for the lower tiers, and which of them to write."""

    key: ObjectKey
    payload: bytes
    to_ssd: bool
    to_redis: bool
    replace: bool = False  # the SSD rewrites a copy it holds (``TieredStore.put``)


class WriteBehind:
    """A bounded queue drained by one thread that hands batches to ``sink``."""

    def __init__(self, sink: Callable[[Sequence[WriteJob]], None], *, max_bytes: int, batch: int = 64) -> None:
        self._sink = sink
        self._max_bytes = max_bytes
        self._batch = batch
        self._cond = threading.Condition()
        self._queued: OrderedDict[ObjectKey, WriteJob] = OrderedDict()
        self._in_flight: dict[ObjectKey, WriteJob] = {}
        self._bytes = 0
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="v41-write-behind", daemon=True)
        self._thread.start()

    def submit(self, job: WriteJob) -> bool:
        """Queue ``job``; False if the queue is full (the write is dropped) or closed."""
        with self._cond:
            if self._closed or self._bytes + len(job.payload) > self._max_bytes:
                return False
            if job.key not in self._queued:
                self._queued[job.key] = job
                self._bytes += len(job.payload)
                self._cond.notify_all()
        return True

    def pending(self, key: ObjectKey) -> bytes | None:
        """The payload of a queued or in-flight write of ``key``, else None."""
        with self._cond:
            job = self._queued.get(key) or self._in_flight.get(key)
        return job.payload if job else None

    def pending_many(self, keys: Sequence[ObjectKey]) -> list[bytes | None]:
        """``pending`` for each key, in order, under one lock round."""
        with self._cond:
            if not self._queued and not self._in_flight:
                return [None] * len(keys)
            jobs = [self._queued.get(key) or self._in_flight.get(key) for key in keys]
        return [job.payload if job else None for job in jobs]

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every write submitted so far has finished; False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._queued and not self._in_flight, timeout)

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queued or self._closed)
                if not self._queued:
                    return  # closed and drained
                jobs = []
                while self._queued and len(jobs) < self._batch:
                    key, job = self._queued.popitem(last=False)
                    self._in_flight[key] = job
                    jobs.append(job)
            try:
                self._sink(jobs)
            except Exception:  # a bug in a sink must not stop every later write
                log.exception("write-behind batch failed")
            with self._cond:
                for job in jobs:
                    del self._in_flight[job.key]
                    self._bytes -= len(job.payload)
                self._cond.notify_all()

    def close(self) -> None:
        """Finish the queued writes, then stop the thread."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join()
