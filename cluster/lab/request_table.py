"""One row per simulated request, written to Parquet (``v41 cache-sim run --requests-table``,
and ``validate``, which compares each turn with the live cluster's).

Compiled with the simulator (``cluster.lab.native``): a row is added per request.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from cluster.lab.workload import Request


class RequestTable:
    """Each request's outcome, written to a Parquet file in row groups (pyarrow):
    arrival, session, prompt and answer tokens, tokens found in RAM and on SSD, whether
    its window state was found, whether the encoder replayed, tokens prefilled."""

    COLUMNS = ("time_s", "session", "input_tokens", "output_tokens", "hit_tokens_ram", "hit_tokens_ssd",
               "window_hit", "replay", "prefill_tokens")

    def __init__(self, path: Path, rows_per_group: int = 1 << 20) -> None:
        self.path, self.rows_per_group = Path(path), rows_per_group
        self._columns: dict[str, list] = {name: [] for name in self.COLUMNS}
        self._writer: Any = None  # a pyarrow.parquet.ParquetWriter once the first group is written
        self.rows = 0

    def add(self, request: Request, hit_ram: int, hit_ssd: int, window_hit: bool, replay: bool, prefill: int) -> None:
        c = self._columns
        for name, value in zip(self.COLUMNS, (request.time_s, request.session, request.input_tokens,
                                              request.output_tokens, hit_ram, hit_ssd, window_hit, replay, prefill)):
            c[name].append(value)
        self.rows += 1
        if len(c["time_s"]) >= self.rows_per_group:
            self._flush()

    def _flush(self) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        batch = pa.table(self._columns)
        if self._writer is None:
            self._writer = pq.ParquetWriter(self.path, batch.schema)
        self._writer.write_table(batch)
        self._columns = {name: [] for name in self.COLUMNS}

    def close(self) -> None:
        if self._columns["time_s"] or self._writer is None:
            self._flush()
        self._writer.close()
