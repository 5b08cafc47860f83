"""Cache-affinity routing of requests to the pools, and the policies it is measured against.

The router knows, from the Redis index, which nodes hold a prompt's stored prefix
(RAM beats SSD), and which decoder replica keeps a returning turn's conversation in
memory (actors/resident.py). Under ``affinity`` it chooses the decoder replica itself
(:class:`DecoderLoad`: the one that keeps the conversation, else one on the cache's
node, unless it has a longer backlog of admissions than another) and passes it as
``preferred_replica``, with the nodes, best first, as ``preferred_nodes`` (to the
prefill pool too). :class:`PrefixAffinityRouter` ranks the preferred replica first,
as chosen; else the replicas on the preferred nodes, in that order, then the rest by
queue length, unless the preferred replicas have more than ``MOVE_SLACK`` requests in
line beyond the least loaded one: then the request goes to the load and its cache
moves (a read from the node that holds it). Serve tries the ranks in order and skips
a replica at its ``max_ongoing_requests``. ``routing`` in the app's config picks the
policy for both pools: ``affinity`` (this), ``pow2`` (Serve's default, power of two
choices) or ``round_robin`` (:class:`RoundRobinRouter`), for `v41 bench agents` to
compare.
"""

from __future__ import annotations

from dataclasses import dataclass

from ray.serve.request_router import FIFOMixin, PendingRequest, RequestRouter, RunningReplica

# How many more requests in line a replica on the cache's node may have than the least
# loaded replica before a request goes to the least loaded one instead. Waiting costs a
# queued request's service time each (a turn's prefill or a place in a batch: hundreds
# of milliseconds here); moving costs reading the prefix from the node that holds it
# (a few milliseconds for a 16K-token prefix on one machine, ~1.3 MB per 16K tokens
# over a network). So the cache wins a tie and a near tie, and load wins beyond that.
MOVE_SLACK = 1


def rank_replicas(replicas: list, preferred_nodes: list[str], queue_len, slack: int = MOVE_SLACK,
                  preferred_replica: str | None = None) -> list[list]:
    """Ranks: one per preferred node that has replicas (in order), then the others
    sorted by queue length; but if the first preferred rank's least loaded replica has
    more than ``slack`` requests in line beyond the least loaded replica of all, every
    replica in one rank by queue length (the request moves to the load).
    ``preferred_replica`` (Serve's unique id: the replica that keeps the conversation,
    which the router chose knowing its backlog) goes first, with no load check.
    ``queue_len(replica)`` may return None (unknown: counted as empty)."""
    def load(replica) -> int:
        return queue_len(replica) or 0

    mine = [r for r in replicas if preferred_replica is not None and r.replica_id.unique_id == preferred_replica]
    if mine:
        return [mine, sorted((r for r in replicas if r is not mine[0]), key=load)]
    ranks, used = [], set()
    for node in preferred_nodes:
        on_node = [r for r in replicas if r.node_id == node and id(r) not in used]
        if on_node:
            ranks.append(on_node)
            used.update(id(r) for r in on_node)
    if ranks and replicas and min(map(load, ranks[0])) - min(map(load, replicas)) > slack:
        return [sorted(replicas, key=load)]
    rest = [r for r in replicas if id(r) not in used]
    if rest:
        ranks.append(sorted(rest, key=lambda r: (queue_len(r) is None, queue_len(r) or 0)))
    return ranks


# How many more requests waiting for their first token a decoder replica may have than
# the least loaded replica before the router sends a request there instead of to its
# cache. Waiting costs each admission ahead of it on the replica's engine thread:
# encoding the turn's new tokens and replaying them (0.55-0.6 s of engine time p50 for
# `v41 bench agents`' turns, 50-500 tokens added at 2-16K deep); moving costs reading the
# cache from the store (~50 ms there). So any longer backlog than the least loaded
# replica's sends the request to the load.
ADMISSION_SLACK = 0

# The decoder replicas that this process's request routers know of, per deployment
# ((app, deployment) -> {replica id: node id}): Serve's own view, kept current by its
# long poll (:meth:`PrefixAffinityRouter.update_replicas`). The ingress reads it to
# choose a replica before it sends a request (:class:`DecoderLoad`).
_REPLICAS: dict[tuple[str, str], dict[str, str]] = {}


def known_replicas(app: str, deployment: str) -> dict[str, str]:
    """{replica id: node id} of a deployment, as this process's request routers know it
    (empty until a handle to it has sent its first request)."""
    return _REPLICAS.get((app, deployment), {})


@dataclass(frozen=True)
class Choice:
    """The decoder replica the ingress chose for a request, its node, and why: ``kept``
    (it keeps the conversation), ``cache`` (on the node holding the cache), ``moved``
    (those had a longer line: the cache moves) or ``anywhere`` (nothing cached that
    a replica's node holds: the least loaded)."""

    replica: str
    node: str
    reason: str


class DecoderLoad:
    """The router's own count, per decoder replica, of its requests dispatched there that
    have no first token yet (exact and current for one router; Serve's queue lengths lag
    and count every running request): the backlog of admissions a request would wait
    behind. With it, the replica a request should go to: the one that keeps its
    conversation, else the least loaded one on the first node that holds its cache,
    unless that one has more than ``slack`` such requests beyond the least loaded
    replica of all (then the request goes there, and reads its cache from the store).
    A request with nothing cached anywhere that names a group (a tenant's
    ``prompt_cache_key``) prefers the group's replica, the same for every request of
    the group, under the same slack: requests that share a long prefix meet where the
    first of them leaves it. ``replicas()`` gives the pool as {replica id: node id}."""

    def __init__(self, replicas, slack: int = ADMISSION_SLACK) -> None:
        self.replicas = replicas
        self.slack = slack
        self.pending: dict[str, int] = {}  # replica -> requests without a first token
        self._turn = 0  # ties between the least loaded replicas go to each in turn

    def choose(self, cache_nodes: list[str], kept: str | None = None, group: bytes | None = None) -> Choice | None:
        """The replica for a request whose cache is on ``cache_nodes`` (best first) or
        kept by replica ``kept``, or of ``group`` (a digest); None while the pool is unknown."""
        replicas = self.replicas()
        if not replicas:
            return None
        ordered = sorted(replicas)
        self._turn = (self._turn + 1) % len(ordered)
        ordered = ordered[self._turn:] + ordered[:self._turn]

        def load(replica: str) -> int:
            return self.pending.get(replica, 0)

        least = min(ordered, key=load)
        preferred, reason = (kept, "kept") if kept in replicas else (None, "cache")
        for node in cache_nodes if preferred is None else ():
            here = [replica for replica in ordered if replicas[replica] == node]
            if here:
                preferred = min(here, key=load)
                break
        if preferred is None and group is not None:
            preferred, reason = sorted(replicas)[int.from_bytes(group[:8], "little") % len(replicas)], "group"
        if preferred is None:
            return Choice(least, replicas[least], "anywhere")
        if load(preferred) - load(least) <= self.slack:
            return Choice(preferred, replicas[preferred], reason)
        return Choice(least, replicas[least], "moved")

    def started(self, replica: str | None) -> None:
        """A request was sent to ``replica``."""
        if replica is not None:
            self.pending[replica] = self.pending.get(replica, 0) + 1

    def answered(self, replica: str | None) -> None:
        """A request sent to ``replica`` has its first token, or ended without one (once)."""
        if replica is not None and self.pending.get(replica, 0) > 0:
            self.pending[replica] -= 1


def _back_off_when_full(pending_request: PendingRequest | None) -> None:
    """Let Serve sleep (exponential backoff, 25 ms to 0.5 s) before it asks again when
    every replica is at its ``max_ongoing_requests``. Serve sets this flag only in its
    locality mixin; a router without it probes the full replicas again at once, in a
    loop: with 64 clients on one decoder replica that halved throughput (`v41 bench
    load`: 47 vs 100 tokens/s)."""
    if pending_request is not None:
        pending_request.routing_context.should_backoff = True


class PrefixAffinityRouter(FIFOMixin, RequestRouter):
    """Prefer the replica the ingress chose, else replicas on the nodes that hold the
    request's cached prefix. It publishes the pool it knows (:func:`known_replicas`)."""

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        self._publish()

    def on_replica_actor_died(self, replica_id) -> None:
        super().on_replica_actor_died(replica_id)
        self._publish()

    def _publish(self) -> None:
        # Serve ships this class to the caller by value (cloudpickle): its globals are a
        # copy, so the registry is reached through the module the ingress imported.
        import cluster.serving.routing  # noqa: PLW0406 (the real module, not this copy of its globals)

        cluster.serving.routing._REPLICAS[(self._deployment_id.app_name, self._deployment_id.name)] = {
            replica.replica_id.unique_id: replica.node_id for replica in self.curr_replicas.values()}

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        _back_off_when_full(pending_request)
        preferred, replica = [], None
        if pending_request is not None:
            preferred = list(pending_request.kwargs.get("preferred_nodes") or [])
            replica = pending_request.kwargs.get("preferred_replica")
        # Serve's own count of each replica's ongoing requests (probed, and kept current
        # as it sends requests).
        return rank_replicas(candidate_replicas, preferred,
                             lambda r: self.replica_queue_len_cache.get(r.replica_id), preferred_replica=replica)


class RoundRobinRouter(FIFOMixin, RequestRouter):
    """Each request to the next replica in turn (a baseline: blind to caches and load)."""

    _turn = 0

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        _back_off_when_full(pending_request)
        if not candidate_replicas:
            return []
        ordered = sorted(candidate_replicas, key=lambda r: r.replica_id.unique_id)
        self._turn = (self._turn + 1) % len(ordered)
        return [[ordered[self._turn]], ordered[self._turn + 1:] + ordered[: self._turn]]


ROUTERS = {
    "affinity": "cluster.serving.routing:PrefixAffinityRouter",
    "pow2": "ray.serve._private.request_router:PowerOfTwoChoicesRequestRouter",
    "round_robin": "cluster.serving.routing:RoundRobinRouter",
}

# When every replica is full, Serve asks again after 25 ms, doubling up to 0.5 s. A place
# in a decoder batch frees every step (tens of milliseconds), so a request slept through
# up to ten of them; this retries every 10-50 ms (a probe is one small actor call).
BACKOFF = {"initial_backoff_s": 0.01, "backoff_multiplier": 2, "max_backoff_s": 0.05}


def request_router_config(routing: str):
    """Serve's request router settings for a pool under the ``routing`` policy."""
    from ray.serve.config import RequestRouterConfig

    return RequestRouterConfig(request_router_class=ROUTERS[routing], **BACKOFF)

