"""Cache-affinity routing of requests to the pools, and the policies it is measured against.

The router knows, from the Redis index, which nodes hold a prompt's stored prefix
(RAM beats SSD); it passes them, best first, as ``preferred_nodes`` in the request's
keyword arguments, to the prefill pool and to the decoder pool. :class:`PrefixAffinityRouter`
ranks replicas on those nodes first, in that order, then the rest by queue length.
Serve tries the ranks in order and skips a replica at its ``max_ongoing_requests``:
a busy preferred replica costs a move of the cache (a read from the node that holds
it), not a wait. ``routing`` in the app's config picks the policy for both pools:
``affinity`` (this), ``pow2`` (Serve's default, power of two choices) or
``round_robin`` (:class:`RoundRobinRouter`), for `v41 bench agents` to compare.
"""

from __future__ import annotations

from ray.serve.request_router import FIFOMixin, PendingRequest, RequestRouter, RunningReplica


def rank_replicas(replicas: list, preferred_nodes: list[str], queue_len) -> list[list]:
    """Ranks: one per preferred node that has replicas (in order), then the others
    sorted by queue length. ``queue_len(replica)`` may return None (unknown: last)."""
    ranks, used = [], set()
    for node in preferred_nodes:
        on_node = [r for r in replicas if r.node_id == node and id(r) not in used]
        if on_node:
            ranks.append(on_node)
            used.update(id(r) for r in on_node)
    rest = [r for r in replicas if id(r) not in used]
    if rest:
        ranks.append(sorted(rest, key=lambda r: (queue_len(r) is None, queue_len(r) or 0)))
    return ranks


class PrefixAffinityRouter(FIFOMixin, RequestRouter):
    """Prefer replicas on the nodes that hold the request's cached prefix."""

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        preferred = []
        if pending_request is not None:
            preferred = list(pending_request.kwargs.get("preferred_nodes") or [])
        return rank_replicas(candidate_replicas, preferred, lambda r: r.routing_stats.get("queue_len"))


class RoundRobinRouter(FIFOMixin, RequestRouter):
    """Each request to the next replica in turn (a baseline: blind to caches and load)."""

    _turn = 0

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        ordered = sorted(candidate_replicas, key=lambda r: r.replica_id.unique_id)
        self._turn = (self._turn + 1) % len(ordered)
        return [[ordered[self._turn]], ordered[self._turn + 1:] + ordered[: self._turn]]


ROUTERS = {
    "affinity": "cluster.routing:PrefixAffinityRouter",
    "pow2": "ray.serve._private.request_router:PowerOfTwoChoicesRequestRouter",
    "round_robin": "cluster.routing:RoundRobinRouter",
}
