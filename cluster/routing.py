"""Cache-affinity routing of prefill requests.

The router knows, from the Redis index, which nodes hold a prompt's stored prefix
(RAM beats SSD); it passes them, best first, as ``preferred_nodes`` in the request's
keyword arguments. :class:`PrefixAffinityRouter` ranks prefill replicas on those
nodes first, in that order, then the rest by queue length.
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
