"""The Engram client: row ids -> one batched request per shard -> rows in token order.

The router (or the prefill pool) calls :meth:`EngramClient.start` the moment a
prompt's Engram row ids are known; it returns an :class:`EngramLookup` at once, whose
requests are already on their way. The process that will run the prefill calls
:meth:`EngramLookup.prepare` (a background thread waits for the answers and
dequantises them as they come) and then :meth:`EngramLookup.rows` right before its
first Engram layer, which returns ``{layer_id: float32 rows [..., n_cols, head_dim]}``, the same numbers as
``block.engram.lookup(ids)`` on in-process tables.

Per lookup and table, duplicate row ids are fetched once (``torch.unique``); since the
unique ids are sorted and shards are contiguous row ranges, each shard's share is a
contiguous slice of them, and the answers concatenated in shard order are the unique
rows in order again.

Faults: every request must be answered within ``timeout_s`` of being sent. A request
that times out is re-sent to the next replica of its shard when there is another one;
one that fails (the actor died, the host lost the file) is re-sent up to ``retries``
times (to the next replica, or to the same actor once Ray has restarted it). When all
attempts are spent the lookup raises :class:`EngramServiceError` naming the shard, its
rows and what each attempt saw. Nothing ever substitutes zeros.

This module knows nothing of Ray: a :class:`ShardTransport` carries the requests
(``actors/engram.py`` has the Ray one; :class:`LocalTransport` runs shards in threads).
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from model import formats

from .engram_tables import ShardPlan, ShardRequest, ShardRows

__all__ = [
    "EngramClient",
    "EngramLookup",
    "EngramRawRows",
    "EngramServiceError",
    "LocalTransport",
    "ShardFailure",
    "ShardTimeout",
    "ShardTransport",
    "dequantize_rows",
]


class EngramServiceError(RuntimeError):
    """A lookup could not be completed: a shard timed out or failed on every attempt."""


class ShardTimeout(Exception):
    """Raised by a transport: the answer did not arrive within the time given."""


class ShardFailure(Exception):
    """Raised by a transport: the request failed (actor died, error on the shard)."""


class ShardTransport(ABC):
    """How requests reach the replicas of each shard.

    ``submit`` must return at once with a handle; ``result`` blocks on a handle for at
    most ``timeout_s`` seconds and returns the :class:`ShardRows`, or raises
    :class:`ShardTimeout` / :class:`ShardFailure`. Handles may be waited on more than
    once and from another process if the transport is picklable (the Ray one is).
    """

    n_shards: int
    n_replicas: int

    @abstractmethod
    def submit(self, shard: int, replica: int, request: ShardRequest) -> Any: ...

    @abstractmethod
    def result(self, handle: Any, timeout_s: float) -> ShardRows: ...


class LocalTransport(ShardTransport):
    """Shards in this process, each request run on a thread pool.

    ``fetchers[shard][replica]`` answers a request (e.g. ``EngramShard(plan, s).fetch``).
    """

    def __init__(self, fetchers: Sequence[Sequence[Callable[[ShardRequest], ShardRows]]]):
        if not fetchers or len({len(r) for r in fetchers}) != 1 or not fetchers[0]:
            raise ValueError("fetchers must be a non-empty [shard][replica] grid")
        self.fetchers = [list(r) for r in fetchers]
        self.n_shards, self.n_replicas = len(fetchers), len(fetchers[0])
        self._pool = ThreadPoolExecutor(max_workers=self.n_shards * self.n_replicas, thread_name_prefix="engram")

    def submit(self, shard: int, replica: int, request: ShardRequest) -> Future:
        return self._pool.submit(self.fetchers[shard][replica], request)

    def result(self, handle: Future, timeout_s: float) -> ShardRows:
        try:
            return handle.result(timeout=timeout_s)
        except FutureTimeout:
            raise ShardTimeout() from None
        except Exception as error:  # the shard raised: report it, never swallow it
            raise ShardFailure(f"{type(error).__name__}: {error}") from error

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def dequantize_rows(weight: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """FP8 rows -> float32, value for value ``formats.ENGRAM_ROW.dequantize``.

    ``weight`` uint8 E4M3 bits ``[U, D]``, ``scale`` uint8 UE8M0 bytes ``[U, D / 32]``.
    Both codes are decoded through 256-entry tables built by :mod:`model.formats`
    itself, then multiplied in float32 exactly as the reference does (about 4x faster
    than decoding through ``float8`` casts on CPU; the tests check they agree).
    """
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    e4m3, ue8m0 = formats.decode_e4m3(codes).numpy(), formats.decode_ue8m0(codes).numpy()
    rows, width = weight.shape
    block = formats.ENGRAM_ROW.block
    values = e4m3[weight].reshape(rows, width // block, block)  # [U, D / 32, 32]
    with np.errstate(over="ignore", invalid="ignore"):  # inf / NaN exactly as the reference
        values *= ue8m0[scale][:, :, None]
    return values.reshape(rows, width)


@dataclass(frozen=True)
class EngramRawRows:
    """One layer's rows as stored.

    ``weight`` ``[..., D]``: uint8 FP8 E4M3 bits for an FP8 table, else the float
    values (float32 / float16 / bfloat16). ``scale`` ``[..., D / 32]`` uint8 UE8M0
    bytes, or ``None`` for a float table. (In token order: ``[..., n_cols, D]``.)
    """

    weight: torch.Tensor
    scale: torch.Tensor | None

    def dequantize(self) -> torch.Tensor:
        """float32 ``[..., D]``: ``ENGRAM_ROW`` for FP8 bytes, a cast otherwise."""
        if self.scale is None:
            return self.weight.float()
        shape = self.weight.shape
        flat = dequantize_rows(self.weight.reshape(-1, shape[-1]).numpy(), self.scale.reshape(-1, self.scale.shape[-1]).numpy())
        return torch.from_numpy(flat).view(shape)

    def take(self, index: torch.Tensor) -> "EngramRawRows":
        """Rows ``index`` (any shape) of these ``[U, ...]`` rows: ``[*index.shape, ...]``."""
        flat = index.reshape(-1)
        weight = self.weight.index_select(0, flat).view(*index.shape, *self.weight.shape[1:])
        scale = None if self.scale is None else self.scale.index_select(0, flat).view(*index.shape, *self.scale.shape[1:])
        return EngramRawRows(weight, scale)


@dataclass
class _Attempt:
    """One request in flight: where it went, its handle, when it must have answered."""

    shard: int
    replica: int
    request: ShardRequest
    handle: Any
    deadline: float
    errors: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class _TableIndex:
    """Dedupe of one table's ids: ``unique`` sorted ``[U]``, ``inverse`` (shape of the
    table's ids ``[..., n_cols]``) into it, ``cuts[s]:cuts[s + 1]`` shard ``s``'s slice."""

    unique: torch.Tensor
    inverse: torch.Tensor
    cuts: tuple[int, ...]


class EngramLookup:
    """Rows of one prompt on their way; made by :meth:`EngramClient.start`.

    ``rows()`` / ``raw()`` block until every shard answered (or raise
    :class:`EngramServiceError`); the answer is kept, so both may be called again.
    The object can be handed to another process with the client's transport
    (e.g. from the router to a prefill actor) when the transport is picklable.
    """

    def __init__(self, client: "EngramClient", index: tuple[_TableIndex, ...], attempts: dict[int, _Attempt]):
        self._client = client
        self._index = index
        self._attempts = attempts
        self._unique: tuple[EngramRawRows, ...] | None = None  # per table, [U, ...]
        self._lock, self._answering = threading.Lock(), threading.Lock()
        self._ready: Future | None = None  # rows() made by prepare() on a background thread

    def __getstate__(self) -> dict:
        # Travels without its thread: the receiver calls prepare() again.
        return {k: v for k, v in self.__dict__.items() if k not in ("_lock", "_answering", "_ready")}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock, self._answering, self._ready = threading.Lock(), threading.Lock(), None

    def prepare(self) -> "EngramLookup":
        """Wait for the answers and dequantise them on a background thread, so that
        :meth:`rows` finds them ready (its errors are raised by :meth:`rows`)."""
        with self._lock:
            if self._ready is None:
                self._ready = Future()
                threading.Thread(target=self._fill, name="engram-rows", daemon=True).start()
        return self

    def _fill(self) -> None:
        try:
            self._ready.set_result(self._make_rows())
        except BaseException as error:  # noqa: BLE001 - handed to whoever calls rows()
            self._ready.set_exception(error)

    @property
    def layer_ids(self) -> tuple[int, ...]:
        return self._client.plan.layer_ids

    @property
    def n_unique_rows(self) -> int:
        """Rows actually requested (after deduplication), all tables together."""
        return sum(int(ix.unique.numel()) for ix in self._index)

    def rows(self) -> dict[int, torch.Tensor]:
        """``{layer_id: float32 [..., n_cols, D]}`` in token order (blocks).

        Each unique row is dequantised once, then spread to its tokens."""
        with self._lock:
            ready = self._ready
        return ready.result() if ready is not None else self._make_rows()

    def _make_rows(self) -> dict[int, torch.Tensor]:
        out = {}
        for layer, unique, ix in zip(self.layer_ids, self._answers(), self._index):
            values = unique.dequantize().numpy()  # [U, D] float32
            rows = np.take(values, ix.inverse.reshape(-1).numpy(), axis=0)  # numpy's row gather is the fast one
            out[layer] = torch.from_numpy(rows).view(*ix.inverse.shape, values.shape[-1])
        return out

    def raw(self) -> dict[int, EngramRawRows]:
        """``{layer_id: EngramRawRows}``: the stored bytes in token order (blocks)."""
        return {layer: u.take(ix.inverse) for layer, u, ix in zip(self.layer_ids, self._answers(), self._index)}

    def _answers(self) -> tuple[EngramRawRows, ...]:
        """The unique rows of every table ``[U_t, ...]``, waiting for them once."""
        with self._answering:
            if self._unique is None:
                answers = {shard: self._client._resolve(attempt) for shard, attempt in self._attempts.items()}
                self._unique = tuple(self._stack(t, answers) for t in range(len(self._index)))
                self._attempts = {}
        return self._unique

    def _stack(self, t: int, answers: dict[int, ShardRows]) -> EngramRawRows:
        """Table ``t``'s answers in shard order, which is the order of its unique ids."""
        table, cuts = self._client.plan.tables[t], self._index[t].cuts
        shards = [s for s in sorted(answers) if cuts[s + 1] > cuts[s]]
        weight = _concat([answers[s].weight[t] for s in shards], table.weight.numpy_dtype, table.head_dim)
        weight = torch.from_numpy(weight)
        if table.weight.dtype == "BF16":
            weight = weight.view(torch.bfloat16)
        if table.scale is None:
            return EngramRawRows(weight, None)
        scale = _concat([answers[s].scale[t] for s in shards], np.dtype(np.uint8), table.scale.shape[1])
        return EngramRawRows(weight, torch.from_numpy(scale))


def _concat(parts: list[np.ndarray], dtype: np.dtype, cols: int) -> np.ndarray:
    """Stack the shards' answers into one writable array ``[U, cols]``."""
    if not parts:
        return np.empty((0, cols), dtype=dtype)
    return np.concatenate(parts, axis=0)


class EngramClient:
    """Routes Engram lookups to the shards of a :class:`ShardPlan`.

    ``timeout_s``: how long each request may take from being sent to its answer.
    ``retries``: extra attempts per shard after a failure (a timeout is retried only
    on another replica). ``hasher``: the model's :class:`model.engram.NgramHasher`,
    needed only by :meth:`start_tokens`. ``clock``: wall-clock seconds (deadlines
    travel with a lookup to other processes, so not a monotonic clock).
    """

    def __init__(
        self,
        plan: ShardPlan,
        transport: ShardTransport,
        timeout_s: float = 5.0,
        retries: int = 1,
        hasher: Any = None,
        clock: Callable[[], float] = time.time,
    ):
        if transport.n_shards != plan.n_shards:
            raise ValueError(f"the transport reaches {transport.n_shards} shards, the plan has {plan.n_shards}")
        if timeout_s <= 0 or retries < 0:
            raise ValueError(f"need timeout_s > 0 and retries >= 0, got {timeout_s}, {retries}")
        self.plan = plan
        self.transport = transport
        self.timeout_s = float(timeout_s)
        self.retries = int(retries)
        self.hasher = hasher
        self.clock = clock
        self._bounds = [torch.tensor(b, dtype=torch.long) for b in plan.bounds]
        self._turn = 0  # round-robin over replicas, one step per lookup

    def start(self, engram_ids: torch.Tensor) -> EngramLookup:
        """Send the requests for ``engram_ids`` ``[..., n_layers, n_cols]`` (int64 row
        ids per Engram layer, in ``plan.layer_ids`` order, as
        :meth:`model.engram.NgramHasher.hash_ids` returns) and return at once."""
        if engram_ids.is_floating_point() or engram_ids.dim() < 2 or engram_ids.shape[-2] != len(self.plan.tables):
            raise ValueError(
                f"engram_ids must be integer [..., {len(self.plan.tables)}, n_cols], got "
                f"{engram_ids.dtype} {tuple(engram_ids.shape)}"
            )
        ids = engram_ids.detach().to("cpu", torch.long)
        index = tuple(self._dedupe(ids[..., t, :], t) for t in range(len(self.plan.tables)))
        replica0 = self._turn % self.transport.n_replicas
        self._turn += 1
        attempts = {}
        for shard in range(self.plan.n_shards):
            local = tuple(
                (ix.unique[ix.cuts[shard] : ix.cuts[shard + 1]] - self._bounds[t][shard]).numpy()
                for t, ix in enumerate(index)
            )
            request = ShardRequest(local)
            if request.n_rows:
                attempts[shard] = self._send(shard, (replica0 + shard) % self.transport.n_replicas, request)
        return EngramLookup(self, index, attempts)

    def start_tokens(self, token_ids: torch.Tensor, context: Any = None, token_mask: torch.Tensor | None = None):
        """Hash ``token_ids`` ``[S]`` or ``[B, S]`` with the model's hasher, then
        :meth:`start`. Returns ``(lookup, context after)`` (see ``NgramHasher.hash_ids``)."""
        if self.hasher is None:
            raise ValueError("this EngramClient has no hasher; pass one, or call start() with row ids")
        engram_ids, context = self.hasher.hash_ids(token_ids, context, token_mask)
        return self.start(engram_ids), context

    def lookup(self, engram_ids: torch.Tensor) -> dict[int, torch.Tensor]:
        """``start(engram_ids).rows()``: blocking, for callers with nothing to overlap."""
        return self.start(engram_ids).rows()

    # ------------------------------------------------------------------ internals
    def _dedupe(self, ids: torch.Tensor, t: int) -> _TableIndex:
        unique, inverse = torch.unique(ids.reshape(-1), sorted=True, return_inverse=True)
        rows = self.plan.tables[t].rows
        if unique.numel() and (int(unique[0]) < 0 or int(unique[-1]) >= rows):
            raise ValueError(
                f"Engram layer {self.plan.tables[t].layer_id}: row ids must lie in [0, {rows}), got "
                f"[{int(unique[0])}, {int(unique[-1])}] (hasher and checkpoint disagree?)"
            )
        cuts = torch.searchsorted(unique, self._bounds[t]).tolist()
        return _TableIndex(unique, inverse.view(ids.shape), tuple(cuts))

    def _send(self, shard: int, replica: int, request: ShardRequest, errors: list[str] | None = None) -> _Attempt:
        handle = self.transport.submit(shard, replica, request)
        return _Attempt(shard, replica, request, handle, self.clock() + self.timeout_s, errors or [])

    def _resolve(self, attempt: _Attempt) -> ShardRows:
        """The answer of one shard, re-sending as the policy allows."""
        n_replicas = self.transport.n_replicas
        for tries_left in range(self.retries, -1, -1):
            try:
                return self.transport.result(attempt.handle, max(0.0, attempt.deadline - self.clock()))
            except ShardTimeout:
                attempt.errors.append(f"replica {attempt.replica}: no answer within {self.timeout_s:g} s")
                if n_replicas == 1:  # re-asking the same silent actor only doubles the wait
                    break
            except ShardFailure as error:
                attempt.errors.append(f"replica {attempt.replica}: {error}")
            if tries_left:
                next_replica = (attempt.replica + 1) % n_replicas
                attempt = self._send(attempt.shard, next_replica, attempt.request, attempt.errors)
        ranges = ", ".join(
            f"layer {t.layer_id} rows [{a}, {b})" for t, (a, b) in zip(self.plan.tables, self.plan.rows(attempt.shard))
        )
        raise EngramServiceError(
            f"Engram shard {attempt.shard} of {self.plan.n_shards} ({ranges}) failed: " + "; ".join(attempt.errors)
        )
