"""Move a stored prefix from another host, or encode its tokens again: whichever costs less.

A prompt's stored chunks may live only on another node (its conversation was answered
there). Reading them moves their bytes over the network; not reading them means
encoding their tokens again. On one machine, or over a fast link, moving wins by far
(~1.3 MB per 16K tokens against seconds of compute); over a slow enough link it
does not. :class:`MoveCost` decides by what this replica has measured itself:

- each node's read throughput, from the replica's own reads of that node's store
  (bytes over seconds, including the call's latency: what a read really costs);
- the bytes of a stored chunk, from the chunks it has read;
- its engine's encoding time per token, from its own prefills.

Until a node's throughput or the encoding speed is known, it moves (the first read
measures the link). The replica counts its choices (``moved``, ``recomputed``).
"""

from __future__ import annotations

from collections import Counter

SMOOTHING = 0.3  # the weight of the newest measurement in each running average


def _blend(old: float | None, new: float) -> float:
    return new if old is None else (1 - SMOOTHING) * old + SMOOTHING * new


class MoveCost:
    """One replica's measured costs, and its choices (see the module docstring)."""

    def __init__(self) -> None:
        self.throughput: dict[str, float] = {}  # node -> bytes/s of reads from its store
        self.chunk_bytes: float | None = None
        self.encode_s_per_token: float | None = None
        self.choices: Counter = Counter()

    def read(self, node: str, nbytes: int, chunks: int, seconds: float, asked: int = 0) -> None:
        """A read of ``asked`` objects from ``node``'s store took ``seconds`` and brought
        ``chunks`` of them, ``nbytes`` in all. One that brought nothing after a second or
        more (it timed out: the link is that slow) counts as at most the bytes asked."""
        if seconds <= 0:
            return
        if nbytes <= 0:
            if asked and self.chunk_bytes is not None and seconds >= 1.0:
                self.throughput[node] = _blend(self.throughput.get(node), asked * self.chunk_bytes / seconds)
            return
        self.throughput[node] = _blend(self.throughput.get(node), nbytes / seconds)
        self.sized(nbytes, chunks)

    def sized(self, nbytes: int, chunks: int) -> None:
        """``chunks`` stored chunks took ``nbytes`` (read from any store, this node's too)."""
        if nbytes > 0 and chunks > 0:
            self.chunk_bytes = _blend(self.chunk_bytes, nbytes / chunks)

    def encoded(self, tokens: int, seconds: float) -> None:
        """The engine encoded ``tokens`` new tokens in ``seconds``."""
        if tokens > 0 and seconds > 0:
            self.encode_s_per_token = _blend(self.encode_s_per_token, seconds / tokens)

    def estimate(self, node: str, chunks: int, chunk_tokens: int) -> tuple[float, float] | None:
        """(seconds to move ``chunks`` chunks from ``node``, seconds to encode their
        tokens), or None while either is unmeasured."""
        throughput = self.throughput.get(node)
        if throughput is None or self.chunk_bytes is None or self.encode_s_per_token is None:
            return None
        return chunks * self.chunk_bytes / throughput, chunks * chunk_tokens * self.encode_s_per_token

    def worth_moving(self, node: str, chunks: int, chunk_tokens: int) -> bool:
        """Read ``chunks`` chunks from ``node`` (True), or encode them again (False)."""
        costs = self.estimate(node, chunks, chunk_tokens)
        move = costs is None or costs[0] <= costs[1]
        self.choices["moved" if move else "recomputed"] += 1
        return move
