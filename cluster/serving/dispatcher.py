"""Sending a planned request to the pools, and waiting for its first token.

The dispatcher chooses the decoder replica (the one that keeps the conversation, or one
where the cache is, unless another has a shorter backlog: :mod:`cluster.serving.routing`),
sends the prefill to the prefill pool and the handoff's reference to the decoder pool
(or the whole prompt to the decoder, when it is short and nothing of it is stored, or
when the decoder keeps the conversation), and waits for each answer's first token: a
full queue is then a 429 with ``Retry-After``, a failure a 503, not a broken stream. A
prefill pool that fails leaves the prompt to the decoder.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from ray.serve.exceptions import BackPressureError

from actors.events import HostLost, Kept, Token, TokenStream
from actors.metrics import tenant_label
from actors.state import CachePlan
from cluster.serving.request import GenerationRequest
from cluster.serving.tenants import OWNER
from cluster.serving.validation import ApiError

logger = logging.getLogger("ray.serve")


class ClientGone(Exception):
    """The client closed the connection while its request waited."""


def generation_failed(error: BaseException) -> ApiError:
    """A replica died or failed under a request, or its host was lost: a server error,
    nothing cached."""
    if isinstance(error, HostLost):
        return ApiError(503, f"generation failed: {error}; retry", kind="server_error", code="host_lost",
                        headers={"retry-after": "1"})
    return ApiError(503, f"generation failed: {type(error).__name__}", kind="server_error")


@dataclass(frozen=True)
class Sent:
    """One answer's call to the decoder pool: its stream, and how to call again without
    the prefill pool if that fails (None: no way)."""

    stream: object
    without_the_pool: Callable[[], object] | None = None


class Dispatcher:
    """The router's calls to the pools. ``prefill``, ``decoder``: Serve handles;
    ``load``: the decoder replicas' admission backlog (:class:`cluster.serving.routing.DecoderLoad`,
    None: Serve's request router chooses); ``engram``, ``hasher``: the Engram service's
    client and the model's n-gram hasher (None without Engram)."""

    def __init__(self, config, prefill, decoder, naming, metrics, load=None, engram=None, hasher=None,
                 image_token_id: int | None = None, liveness=None):
        self.config, self.naming, self.metrics, self.load = config, naming, metrics, load
        self.liveness = liveness  # (cluster.serving.liveness.NodeLiveness: streams from a lost host end)
        self.engram, self.hasher, self.image_token_id = engram, hasher, image_token_id
        # How each call travels. The prefill's answer goes to the decoder by reference:
        # the handoff moves between the replicas through the object store, not through
        # the router. A short prompt's call carries only the plan and goes by gRPC
        # (~3.5 ms less per request than a Ray actor call on two cores).
        self.prefill = prefill.options(_by_reference=True)
        self.decoder = decoder.options(stream=True, _by_reference=True)
        self.decoder_direct = decoder.options(stream=True, _by_reference=False)
        self.decoder_prefetch = decoder.options(_by_reference=False)
        self.finished: deque[float] = deque(maxlen=4096)  # when requests ended (time.monotonic), for Retry-After
        self.waiting = 0  # dispatched requests without their first token yet

    def send(self, request: GenerationRequest, tokens: list[int], images: tuple, plan: CachePlan,
             resume: tuple | None, rid: str, marks: dict) -> list[Sent]:
        """Send each of the request's answers (``resume``: (name, :class:`Kept`) of the
        conversation a decoder replica keeps that the prompt continues, or None);
        ``marks["replica"]`` says which replica was chosen."""
        lookup = self._engram_lookup(tokens)
        replica, nodes = self._choose(plan, resume, marks, request.cache_group)
        if self.liveness is not None:
            self.liveness.start()
        decoder = self.decoder_direct if lookup is None else self.decoder  # (Engram refs travel by reference)
        if resume is not None:
            # The replica that keeps it encodes only what the conversation added, from its
            # cache; another (moved for load) reads the conversation from the store.
            return [Sent(TokenStream(decoder.prefill_and_generate.remote(
                plan, request.params, rid, engram=lookup, preferred_nodes=nodes, resident=resume[0],
                preferred_replica=replica)))]
        if request.n == 1 and plan.cached_chunks == 0 and plan.windows == () and not images and \
                len(tokens) <= self.config.local_prefill_tokens:
            # Nothing stored and a short prompt: the decoder encodes it itself, sparing
            # two hops and a handoff (its batch waits about one step for it).
            return [Sent(TokenStream(decoder.prefill_and_generate.remote(
                plan, request.params, rid, engram=lookup, preferred_nodes=nodes, preferred_replica=replica)))]
        stored = self.naming.loadable_chunks(plan)
        if stored and plan.chunk_keys:  # the decoder reads the stored prefix while the prefill runs
            self.decoder_prefetch.prefetch.remote(plan.chunk_keys[:stored], preferred_nodes=nodes,
                                                  preferred_replica=replica)
        # One prefill, whatever n: each answer's decoder admits its own copy of the handoff.
        handoff = self.prefill.prefill.remote(plan, preferred_nodes=nodes, engram=lookup)

        def without_the_pool(params, sample_id):  # the prefill pool failed: the decoder encodes the prompt
            if images:  # (not one with images: the vision tower is the prefill pool's)
                return None
            return lambda: TokenStream(self.decoder_direct.prefill_and_generate.remote(plan, params, sample_id))

        ids = [rid] if request.n == 1 else [f"{rid}-{i}" for i in range(request.n)]
        return [Sent(TokenStream(self.decoder.generate.remote(handoff, params, sample_id, preferred_nodes=nodes,
                                                              preferred_replica=replica)),
                     without_the_pool(params, sample_id))
                for params, sample_id in zip(request.samples(), ids)]

    def _engram_lookup(self, tokens: list[int]):
        """Start fetching the prompt's Engram rows (they arrive while layer 0 runs); None without Engram."""
        if self.engram is None:
            return None
        import torch

        ids = torch.tensor([tokens])
        text = None if self.image_token_id is None else ids != self.image_token_id  # no n-gram across an image
        return self.engram.start(self.hasher.hash_ids(ids, token_mask=text)[0][0])

    def _choose(self, plan: CachePlan, resume: tuple[object, Kept] | None, marks: dict,
                group: bytes | None = None) -> tuple[str | None, list]:
        """(the decoder replica, the nodes in order of preference): the replica that keeps
        the conversation, or one where the cache is, unless another has a shorter backlog
        of admissions (then the cache moves); with nothing cached, ``group``'s (a
        ``prompt_cache_key``'s). The prefill pool prefers the same node."""
        cache_nodes = list(plan.nodes)
        kept = resume[1] if resume is not None else None
        if kept is not None:
            cache_nodes = [kept.node] + [node for node in cache_nodes if node != kept.node]
        replica, nodes = (kept.replica if kept is not None else None), cache_nodes
        chosen = self.load.choose(cache_nodes, replica, group) if self.load is not None else None
        if chosen is not None:
            replica = chosen.replica
            nodes = [chosen.node] + [node for node in cache_nodes if node != chosen.node]
            self.load.started(replica)
            self.metrics.routed.inc(tags={"choice": chosen.reason})
        marks["replica"], marks["node"] = replica, (chosen.node if chosen is not None else None)
        return replica, nodes

    async def start(self, sent: list[Sent], client, marks: dict) -> list[tuple[Token, object]]:
        """(first token, stream) of each answer, once every one has its first token; an
        answer whose prefill pool failed is encoded by the decoder instead. If one
        fails, the others are cancelled. ``client``: the HTTP request (is it still there?);
        ``marks["node"]``: the node of the replica chosen (None: Serve chooses)."""
        async def start(call: Sent):
            try:
                return await self.first_token(call.stream, client, node), call.stream
            except (ApiError, ClientGone, HostLost):  # (a lost decoder host: the pool did not fail)
                raise
            except Exception as error:  # noqa: BLE001 (a prefill replica died, or the pool failed)
                if call.without_the_pool is None:
                    raise
                logger.warning("the prefill pool failed (%s): the decoder encodes the prompt", type(error).__name__)
                stream = call.without_the_pool()
                return await self.first_token(stream, client), stream

        node = marks.get("node")
        tasks = [asyncio.ensure_future(start(call)) for call in sent]
        try:
            return list(await asyncio.gather(*tasks))
        except BaseException:
            for task, call in zip(tasks, sent):
                task.cancel()
                call.stream.cancel()
            raise

    async def first_token(self, stream, client, node: str | None = None) -> Token:
        """The stream's first event (the first token), awaited before the response
        starts so that a full queue is a 429 and a failure a 503, not a broken stream.
        While the request waits for a place in a batch, a client that goes away takes
        it out of the queue. The stream ends if the host of its replica (``node``, where
        known; the first token's node after it) is lost."""
        if self.liveness is not None:
            self.liveness.watch(node, stream)
        self.waiting += 1
        self.metrics.waiting.set(self.waiting)
        first = asyncio.ensure_future(stream.__anext__())
        try:
            while True:
                done, _ = await asyncio.wait((first,), timeout=0.5)
                if done:
                    token = first.result()
                    if self.liveness is not None and token.admission.node != node:
                        self.liveness.watch(token.admission.node, stream)
                    return token
                if await client.is_disconnected():
                    first.cancel()
                    stream.cancel()
                    raise ClientGone()
        except BackPressureError as error:
            queued = getattr(error, "args", (0,))[0] or 0
            retry = self.estimate_retry_after(queued)
            raise ApiError(429, "the server is at capacity: every decoder batch is full and the queue is "
                                f"full ({queued} requests waiting); retry later", kind="rate_limit_error",
                           code="queue_full", headers={"retry-after": str(retry)}) from None
        finally:
            self.waiting -= 1
            self.metrics.waiting.set(self.waiting)

    def release(self, marks: dict) -> None:
        """A request dispatched to ``marks["replica"]`` has its first token, or failed (once)."""
        if self.load is not None:
            self.load.answered(marks.pop("replica", None))

    def measure_queue_wait(self, first: Token, marks: dict[str, float]) -> float:
        """Milliseconds the request waited for a place in a batch, once ready for one
        (after its prefill when the pool encoded it); recorded as a metric."""
        admission = first.admission
        timeline = admission.timeline
        ready = timeline.get("prefill_out") if admission.prefilled_by == "pool" else marks.get("router_sent")
        admitted = timeline.get("admitted")
        waited = max(0.0, admitted - ready) if admitted is not None and ready is not None else 0.0
        self.metrics.queue_wait.observe(waited, tags={"tenant": tenant_label(OWNER.get())})
        return 1e3 * waited

    def estimate_retry_after(self, queued: int) -> int:
        """Seconds until the queue has likely drained: its length over the rate requests
        finished in the last 30 s (1 to 60)."""
        now = time.monotonic()
        recent = sum(1 for ended in self.finished if now - ended < 30.0)
        if not recent:
            return 5
        return max(1, min(60, math.ceil(queued * 30.0 / recent)))
