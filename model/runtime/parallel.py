"""The expert-parallel exchange of one replica (the split: :mod:`model.parallel`).

The lead worker (rank 0) runs the engine. At every MoE layer it routes the layer's
tokens, groups the (token, slot) pairs by expert (:class:`model.moe.ExpertGroups`),
and sends each other worker the pairs of its experts: a header (the layer and how
many pairs each of its experts has), then one message of the pairs' hidden states and
their routing weights (each message costs a rendezvous). While they compute, it runs its own experts and the shared expert; then it
receives each worker's weighted outputs and adds every expert's output back in
expert order, as the one-process :class:`model.moe.MoE` does. Each expert sees the
same rows in the same order as in one process, and the sums are made in the same
order, so a split replica computes the same numbers as one process (the tests
compare them bit for bit, on workers running as many threads as the lead).

The other workers run :func:`serve_experts`: receive a header, compute, send back,
until the lead says stop. All of it goes over ``torch.distributed`` point to point
(gloo here, NCCL on GPUs); the lead's exchanges are serialised by a lock, so the
engine thread and anything else of the lead that runs the model cannot interleave
two layers' messages. A worker that dies breaks the link: the step that was using it
raises :class:`WorkerLost`, and so does every later one; the replica restarts whole.
"""

from __future__ import annotations

import threading
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from ..moe import ExpertGroups, MoE
from ..parallel import ExpertShard
from .weight_layout import store_input_major

_STOP, _MOE = 0, 1


class WorkerLost(RuntimeError):
    """An expert worker of this replica stopped answering: the replica must restart."""


def join(address: str, rank: int, workers: int, timeout_s: float = 60.0) -> dist.ProcessGroup:
    """This replica's process group (``address`` is ``host:port`` of the rendezvous the
    lead, rank 0, listens on), once every worker has joined (at most ``timeout_s``).
    The group is the replica's own, not torch's default one: a process may hold several
    (a test, a benchmark comparing splits)."""
    host, port = address.rsplit(":", 1)
    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore(host, int(port), workers, is_master=rank == 0, timeout=timeout)
    return dist.ProcessGroupGloo(store, rank, workers, timeout)


def _send(group: dist.ProcessGroup, tensor: torch.Tensor, rank: int):
    return group.send([tensor], rank, 0)


def _recv(group: dist.ProcessGroup, tensor: torch.Tensor, rank: int) -> None:
    group.recv([tensor], rank, 0).wait()


class ExpertLink:
    """The lead's end of the exchange (one per replica process)."""

    def __init__(self, shard: ExpertShard, hidden: int, dtype: torch.dtype = torch.float32):
        if shard.rank != 0:
            raise ValueError("the link is the lead worker's (rank 0)")
        self.shard = shard
        self.group: dist.ProcessGroup | None = None  # set by :meth:`connect`
        self.frame = Frame(shard, hidden, dtype)
        self.lock = threading.Lock()
        self.broken: str | None = None

    def connect(self, address: str, timeout_s: float = 60.0) -> None:
        """Open the replica's group as its lead; returns once every worker has joined."""
        self.group = join(address, 0, self.shard.workers, timeout_s)

    def exchange(self, layer: int, flat: torch.Tensor, groups: ExpertGroups,
                 local: nn.ModuleDict) -> list[torch.Tensor | None]:
        """Every expert's weighted output for its pairs (None where it has none): the
        lead's ``local`` experts computed here, the others' received from their workers."""
        shard = self.shard
        outputs: list[torch.Tensor | None] = [None] * shard.n_experts
        with self.lock:
            if self.broken:
                raise WorkerLost(self.broken)
            try:
                sends, remote = [], []
                for rank in range(1, shard.workers):
                    experts = ExpertShard(rank, shard.workers, shard.n_experts).experts
                    span = groups.span(experts)
                    if span.stop == span.start:
                        continue  # nothing for this worker in this layer: it is not told
                    messages = self.frame.pack(_MOE, layer, groups.counts[experts.start:experts.stop],
                                          flat[groups.tokens[span]], groups.weights[span])
                    sends += [(_send(self.group, message, rank), message) for message in messages]
                    remote.append((rank, experts, span))
                for e, (rows, weight) in zip(shard.experts, groups.split(shard.experts)):
                    if len(rows):
                        outputs[e] = local[str(e)](flat[rows], weight)
                for rank, experts, span in remote:
                    received = torch.empty(span.stop - span.start, flat.shape[-1], dtype=flat.dtype)
                    _recv(self.group, received, rank)
                    start = 0
                    for e in experts:
                        count = groups.counts[e]
                        if count:
                            outputs[e] = received[start:start + count]
                            start += count
                for work, _ in sends:
                    work.wait()
            except RuntimeError as error:  # gloo: a peer closed its end, or timed out
                self.broken = f"an expert worker of this replica was lost: {error}"
                raise WorkerLost(self.broken) from error
        return outputs

    def close(self) -> None:
        """Tell every worker to stop (best effort)."""
        with self.lock:
            if not self.broken and self.group is not None:
                try:
                    for rank in range(1, self.shard.workers):
                        _send(self.group, self.frame.pack(_STOP, 0, [0] * self.shard.per_worker)[0], rank).wait()
                except RuntimeError:
                    pass
            self.broken = self.broken or "closed"


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().view(torch.uint8).reshape(-1)


class Frame:
    """The lead's message to a worker, of a fixed size both ends know: a header (op,
    layer, the pair count of each of the worker's experts; 64 bytes aligned) and room
    for ``inline`` pairs (hidden state, then routing weight). A call with more pairs
    sends them in a second message of their exact size. One message per call where
    it fits matters: over TCP a second small message right behind the first waits
    for its acknowledgement (on the 2-core VM the small model's decode step at batch 1
    took 27 ms split over 2 workers with two messages per call, 23.5 ms with one frame,
    17 ms in one process)."""

    def __init__(self, shard: ExpertShard, hidden: int, dtype: torch.dtype, inline: int = 64):
        self.hidden, self.dtype, self.inline = hidden, dtype, inline
        self.header_bytes = -(-8 * (2 + shard.per_worker) // 64) * 64
        self.row_bytes = hidden * dtype.itemsize + 4
        self.size = self.header_bytes + inline * self.row_bytes

    def pack(self, op: int, layer: int, counts: list[int], x: torch.Tensor | None = None,
             weights: torch.Tensor | None = None) -> list[torch.Tensor]:
        pairs = sum(counts)
        message = torch.zeros(self.size, dtype=torch.uint8)
        header = torch.tensor([op, layer, *counts], dtype=torch.int64)
        message[:header.numel() * 8] = _bytes(header)
        if not pairs:
            return [message]
        rows = torch.cat((_bytes(x), _bytes(weights)))
        if pairs > self.inline:
            return [message, rows]
        message[self.header_bytes:self.header_bytes + rows.numel()] = rows
        return [message]

    def header(self, message: torch.Tensor) -> tuple[int, int, list[int]]:
        values = message[:self.header_bytes].view(torch.int64).tolist()
        return values[0], values[1], values[2:]

    def rows(self, message: torch.Tensor, pairs: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden states [pairs, hidden], weights [pairs]) of a frame, or of the
        second message when there was one."""
        start = self.header_bytes if pairs <= self.inline else 0
        split = start + pairs * self.hidden * self.dtype.itemsize
        return (message[start:split].view(self.dtype).reshape(pairs, self.hidden),
                message[split:split + pairs * 4].view(torch.float32))


class ExpertParallelMoE(nn.Module):
    """:class:`model.moe.MoE` of one layer on the lead worker: the router, the shared
    expert and the lead's share of the routed experts; the rest through the link."""

    def __init__(self, moe: MoE, layer: int, link: ExpertLink):
        super().__init__()
        self.gate, self.shared_experts, self.experts = moe.gate, moe.shared_experts, moe.experts
        self.layer, self.link = layer, link

    def forward(self, x: torch.Tensor, image_mask: torch.Tensor | None = None) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        weights, indices = self.gate(flat, image_mask)
        groups = ExpertGroups.of(weights, indices, self.link.shard.n_experts)
        outputs = self.link.exchange(self.layer, flat, groups, self.experts)
        return groups.combine(self.shared_experts(flat), outputs).to(x.dtype).reshape(shape)


def attach(model: nn.Module, link: ExpertLink) -> nn.Module:
    """Route every MoE layer of a backbone loaded with the lead's shard
    (``load_checkpoint(..., shard=...)``) through ``link``."""
    for block in model.layers:
        ffn = getattr(block, "ffn", None)
        if isinstance(ffn, MoE):
            block.ffn = ExpertParallelMoE(ffn, block.plan.index, link)
    return model


def serve_experts(group: dist.ProcessGroup, experts: dict[int, nn.ModuleDict], shard: ExpertShard, hidden: int,
                  dtype: torch.dtype) -> int:
    """A non-lead worker's loop: answer the lead's MoE calls with ``experts`` (``{layer:
    {str(expert): Expert}}``, this worker's share) until it says stop. Returns how many
    calls it answered. The experts are kept input-major, as the lead's engine keeps its
    own (:mod:`model.runtime.weight_layout`): every worker multiplies as one process would."""
    for table in experts.values():
        store_input_major(table)
    frame = Frame(shard, hidden, dtype)
    answered = 0
    with torch.no_grad():
        while True:
            message = torch.empty(frame.size, dtype=torch.uint8)
            _recv(group, message, 0)
            op, layer, counts = frame.header(message)
            if op == _STOP:
                return answered
            table = experts[layer]
            pairs = sum(counts)
            if pairs > frame.inline:
                message = torch.empty(pairs * frame.row_bytes, dtype=torch.uint8)
                _recv(group, message, 0)
            x, weights = frame.rows(message, pairs)
            outputs, start = [], 0
            for e, count in zip(shard.experts, counts):
                if count:
                    outputs.append(table[str(e)](x[start:start + count], weights[start:start + count, None]))
                    start += count
            _send(group, torch.cat(outputs), 0).wait()
            answered += 1
