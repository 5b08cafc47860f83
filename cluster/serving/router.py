"""The router: the app's HTTP ingress, the OpenAI API, the cache plan, the dispatch.

It renders the chat, computes the prompt's chunk keys, asks the Redis index for the
longest stored prefix and where it lives, and sends the prefill to a replica on that
node (:mod:`cluster.serving.routing`); the prefill replica loads the prefix from its node's
store, encodes the new tokens and returns a handoff; the router passes the handoff's
reference to a decoder replica, which replays, decodes in its continuous batch,
streams tokens back, and writes the conversation to its node's store when the
request ends.
"""

# No `from __future__ import annotations`: FastAPI reads the endpoints' annotations at runtime.

import asyncio
import dataclasses
import hmac
import logging
import math
import time
from collections import OrderedDict, deque
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Annotated

from fastapi import FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from ray import serve
from ray.serve.exceptions import BackPressureError
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException

from actors.replica import ModelIdentity, prompt_gil_handoff
from actors.state import StoringConversation
from actors.store import STORE_TIMEOUT_S, node_store, peer_store
from cluster.serving import conversations_api, responses_api
from cluster.serving import openai_api as api
from actors.config import AppConfig
from cluster.serving.images import ImageLimits, read_image
from cluster.serving.records import Records
from cluster.serving.routing import DecoderLoad, known_replicas
from model.runtime.grammar import GrammarCompiler, GrammarError
from storage.keys import ObjectKey

# A request's trip, mark to mark: (Server-Timing name, from, to).
_STAGES = (
    ("parse", "router_in", "rendered"),  # body, validation, chat template, tokens
    ("plan", "rendered", "planned"),  # the index lookup of the cache plan
    ("dispatch", "planned", "router_sent"),  # Engram lookup started, calls to the pools sent
    ("to_prefill", "router_sent", "prefill_in"),
    ("prefill_wait", "prefill_in", "prefill_read"),  # the prefill replica's queue
    ("prefill", "prefill_read", "prefill_out"),  # store reads + encoder
    ("handoff", "prefill_out", "decode_in"),  # result back, decoder call, object transfer
    ("decode", "decode_in", "decode_out"),  # load, replay, first token
    ("stream", "decode_out", "first_token"),  # first stream item to the router
    ("respond", "first_token", "router_out"),
)


def server_timing(marks: dict[str, float], replica_s: float, prefilled_by: str) -> str:
    """An HTTP ``Server-Timing`` value: each stage of the trip and the replicas' own
    compute, in milliseconds (stages whose marks are missing are left out); the
    prefill stage says where it ran (``desc="pool"`` or ``desc="decoder"``)."""
    parts = []
    for name, a, b in _STAGES:
        if a in marks and b in marks:
            desc = f';desc="{prefilled_by}"' if name == "prefill" and prefilled_by else ""
            parts.append(f"{name};dur={1e3 * (marks[b] - marks[a]):.3f}{desc}")
    return ", ".join(parts + [f"compute;dur={1e3 * replica_s:.3f}"])


def _store_times(marks: dict[str, float]) -> dict[str, str]:
    """When the prompt's stored prefix was looked up (the router's index lookup, or the
    prefill's read of its own store where no index answered) and when the answer's
    conversation counts as stored (Unix seconds: its last token reached the router,
    which from then on holds a turn that continues it until the store has it): the
    two moments that decide which turns find which chunks, for a replay that checks
    the simulator against the cluster."""
    times = {"lookup": marks.get("looked_up", marks.get("prefill_read")), "stored": marks.get("stored")}
    return {f"x-v41-{name}-at": f"{at:.6f}" for name, at in times.items() if at is not None}


def parse_server_timing(header: str) -> tuple[dict[str, float], dict[str, str]]:
    """A ``Server-Timing`` value -> ({name: ms}, {name: desc})."""
    durations, descriptions = {}, {}
    for part in header.split(","):
        name, *params = part.strip().split(";")
        for key, _, value in (param.partition("=") for param in params):
            if key == "dur":
                durations[name] = float(value)
            elif key == "desc":
                descriptions[name] = value.strip('"')
    return durations, descriptions


logger = logging.getLogger("ray.serve")
_NO_REPLICA = "pool: no replica running"  # a /health problem line that makes it 503


def _rebind_after_a_crash() -> None:
    """Let a new router take the port of one that died.

    Ray Serve 2.60's direct ingress binds a replica's HTTP port without SO_REUSEADDR.
    When a router dies with connections open (a crash, SIGKILL, or `v41 serve` stopped
    and started again), the kernel keeps those connections' sockets on the port for up
    to a minute (TIME_WAIT, FIN_WAIT2); the replacement's bind fails, and Serve then
    blocks the port for good: no router comes back. This has the router's server bind
    the way Serve's proxy does (SO_REUSEADDR and SO_REUSEPORT). Serve never gives one
    port to two live replicas, so no two routers share it. Runs where this module is
    imported (the router replica, when Serve loads its class); a Ray without that
    function is left alone."""
    try:
        from ray.serve._private import replica
    except ImportError:
        return
    original = getattr(replica, "start_asgi_http_server", None)
    if original is None or getattr(original, "v41_rebinds", False):
        return

    async def start_asgi_http_server(app, http_options, *, event_loop, enable_so_reuseport=False):
        return await original(app, http_options, event_loop=event_loop, enable_so_reuseport=True)

    start_asgi_http_server.v41_rebinds = True
    replica.start_asgi_http_server = start_asgi_http_server


_rebind_after_a_crash()
fastapi_app = FastAPI(title="v41", docs_url=None, redoc_url=None, openapi_url=None)


@fastapi_app.exception_handler(HTTPException)
async def _http_error(request: Request, error: HTTPException):
    """Unknown paths and wrong methods answer in the OpenAI error shape too."""
    if error.status_code == 404:
        message = f"Invalid URL ({request.method} {request.url.path})"
    elif error.status_code == 405:
        message = f"Method {request.method} not allowed for {request.url.path}"
    else:
        message = str(error.detail)
    body = api.ApiError(error.status_code, message).body()
    return JSONResponse(body, status_code=error.status_code, headers=getattr(error, "headers", None))


@fastapi_app.exception_handler(RequestValidationError)
async def _bad_query(request: Request, error: RequestValidationError):
    """A query parameter of the wrong type (``?limit=x``): a 400 naming it, in the OpenAI shape."""
    first = error.errors()[0]
    param = str(first["loc"][-1]) if first.get("loc") else None
    body = api.ApiError(400, f"{param}: {first['msg']}", param).body()
    return JSONResponse(body, status_code=400)


@fastapi_app.exception_handler(Exception)
async def _server_error(request: Request, error: Exception):
    """A bug answers in the OpenAI error shape too (and is logged), never as a bare 500."""
    logger.error("unhandled error on %s %s", request.method, request.url.path, exc_info=error)
    body = api.ApiError(500, f"internal error: {type(error).__name__}", kind="server_error").body()
    return JSONResponse(body, status_code=500)


def _generation_failed(error: BaseException) -> api.ApiError:
    """A replica died or failed under a request: a server error, nothing cached."""
    return api.ApiError(503, f"generation failed: {type(error).__name__}", kind="server_error")


class ClientGone(Exception):
    """The client closed the connection while its request waited."""


def _chained(first, stream, kept, storing):
    """``first``, then the rest of ``stream`` up to the last token; ``kept(event)`` for
    the event that says a decoder replica keeps the conversation, and ``storing(what,
    stream)`` for a last token whose conversation is being stored (the stream's next
    event says when it is)."""
    def last(event) -> bool:
        if "resident" in event:
            kept(event)
        if "storing" in event:
            storing(event["storing"], stream)
            return True
        return False

    async def events():
        if last(first):
            yield first
            return
        yield first
        async for event in stream:
            if last(event):
                yield event
                return
            yield event
    return events()


@dataclass(frozen=True)
class KeptAt:
    """Where a conversation is kept: a decoder replica (Serve's id for it) and its node."""

    replica: str
    node: str


def _this_node() -> str:
    import ray

    return ray.get_runtime_context().get_node_id()


def _no_include(include: list[str] | None) -> None:
    if include:
        raise api.ApiError(400, "include: no extra item fields are kept here (leave it out)", "include")


def _answer_key(reasoning: str | None, content: str, calls) -> tuple:
    """What identifies an answer in a returning history: its reasoning, text and calls."""
    return reasoning, content, tuple((call.name, call.arguments) for call in calls)


# The router takes every connection. A request waiting for a place in a decoder batch
# waits at the router's handle to the decoder pool (Serve's queue, FIFO across the
# replicas); beyond ``max_queued_requests`` waiting, it is answered 429.
@serve.deployment(max_ongoing_requests=4096)
@serve.ingress(fastapi_app)
class Router:
    """The OpenAI-compatible ingress: tokenise, plan the cache, route, stream."""

    def __init__(self, config: AppConfig, prefill, decoder):
        from actors.metrics import RouterMetrics
        from model.chat import ChatTemplate

        prompt_gil_handoff()
        self.config = config
        # How each call travels. The prefill's answer goes to the decoder by reference:
        # the handoff moves between the replicas through the object store, not through
        # the router. A short prompt's call carries only the plan and goes by gRPC
        # (~3.5 ms less per request than a Ray actor call on two cores).
        self.prefill = prefill.options(_by_reference=True)
        self.decoder = decoder.options(stream=True, _by_reference=True)
        self.decoder_direct = decoder.options(stream=True, _by_reference=False)
        self.decoder_prefetch = decoder.options(_by_reference=False)
        model = ModelIdentity(config)
        self.model_config, self.tokenizer = model.model_config, model.tokenizer
        # It remembers the ids of the long messages it tokenised, up to 4M tokens (~50 MB
        # with their texts): a returning turn re-renders its whole history.
        self.template = ChatTemplate(self.tokenizer, memo_tokens=4 << 20)
        self.naming = model.naming
        self.metrics = RouterMetrics()
        self.index, self.link = None, None
        if config.redis_url:
            from storage.index import RedisIndex
            from storage.redis_link import RedisLink

            self.link = RedisLink(config.redis_url, namespace="v41", timeout_s=0.5, retry_s=1.0)
            self.index = RedisIndex(self.link, key_ttl_s=config.chunk_retention_hours * 3600)
        # A model that reads images: its image token, and what a request's images may be.
        self.vision = self.model_config.vision
        self.image_token_id = self.model_config.image_token_id if self.vision is not None else None
        self.image_limits = ImageLimits(config.max_images_per_request, config.max_image_bytes,
                                        config.max_image_pixels, config.max_request_image_pixels, config.image_dir)
        self.api_key = config.resolved_api_key()
        self.finished: deque[float] = deque(maxlen=4096)  # when requests ended (time.monotonic), for Retry-After
        self.waiting = 0  # dispatched requests without their first token yet
        self._health: tuple[float, list[str]] | None = None
        self._pools_ready = False  # every pool has had a replica running (then "starting" is over)
        # Under affinity it chooses the decoder replica (admissions pending per replica).
        self.load = DecoderLoad(lambda: known_replicas(decoder.app_name, decoder.deployment_name)) \
            if config.routing == "affinity" else None
        # Recent answers' exact token ids by their text, so that the next turn of a
        # conversation re-renders them verbatim and its prefix stays cached.
        self.answers: OrderedDict[tuple, tuple[int, ...]] = OrderedDict()
        # The conversations decoder replicas keep for their next turn (actors/resident.py),
        # by name, and which replica keeps each: the last 65,536 answers'.
        self.resident: OrderedDict[ObjectKey, KeptAt] = OrderedDict()
        # Conversations a decoder replica is storing (their last token is out), by the
        # name of their window state: a turn that continues one, or shares a chunk it
        # stores, waits for its store.
        self.storing: dict[ObjectKey, tuple[StoringConversation, asyncio.Future]] = {}
        self._store_waits: set[asyncio.Task] = set()
        self.think_end = self.tokenizer.special.think_end
        self.dsml = self.tokenizer.special.dsml  # a special token: its text is put back for the parser
        self.grammars: GrammarCompiler | None = None  # built at the first constrained request
        # Stored responses and conversations (this node's store actor, reached at the first
        # use; the responses this router wrote lately, up to 64 MiB of JSON, in memory).
        self.records = Records(partial(node_store, config.store_settings(), self.naming.fingerprint.digest),
                               peer_store, _this_node, self.index, self.link)
        self.engram, self.hasher = None, None
        if config.engram_shards:
            import ray

            from actors.engram import EngramServiceConfig, shared_engram_service
            from model.loader import load_hasher

            self.hasher = load_hasher(config.model, self.model_config)
            holder = shared_engram_service(EngramServiceConfig(
                checkpoint=str(Path(config.model).resolve()), n_shards=config.engram_shards,
                replicas=config.engram_replicas, resource=config.engram_resource, num_cpus=config.engram_cpus))
            self.engram = ray.get(holder.client.remote())

    # ------------------------------------------------------------------ plumbing
    def _authorize(self, request: Request) -> None:
        if self.api_key is None:
            return
        header = request.headers.get("authorization", "")
        if not hmac.compare_digest(header.encode(), f"Bearer {self.api_key}".encode()):
            raise api.ApiError(401, "invalid API key", kind="authentication_error", code="invalid_api_key")

    async def _plan(self, tokens: list[int], images: tuple = ()):
        """Which leading chunks of the prompt are stored, where, and which window state
        after them the index knows of (one Redis round trip, two after a gap); and
        every window state the prompt could resume from after those chunks, known or
        not, as ``(length, key)`` (none without an index). ``images``: the prompt's
        :class:`actors.state.PromptImage` (their digests name the chunks that hold them).
        A conversation the prompt continues, or shares a chunk with, whose store is still
        running is waited for (the wait is part of the ``plan`` stage)."""
        from actors.state import CachePlan, media_of
        from storage.policy import TierName

        media = media_of(images)
        keys = self.naming.chunks(tokens, media=media)
        named = tuple(keys)
        if self.storing:
            await self._stored(tokens, named, media)
        if self.index is None:  # one node: its store knows
            return CachePlan(tuple(tokens), len(keys), chunk_keys=named, images=images), []
        size = self.naming.chunk_tokens
        usable = max(0, min(len(keys), (len(tokens) - 1) // size))  # the prefill encodes the last token
        windows = self.naming.window_candidates(tokens[:-1], usable * size, named, media)
        now = time.time()
        located = self.index.locate(keys + [key for _, key in windows], now)
        if located is None:  # Redis away: as on one node, the prefill's own store decides
            return CachePlan(tuple(tokens), len(keys), chunk_keys=named, images=images), windows
        found_windows = located[len(keys):]
        depth = 0
        while depth < len(keys) and located[depth]:
            depth += 1
        if depth < usable:  # a gap: the windows after the stored run instead
            windows = self.naming.window_candidates(tokens[:-1], depth * size, named, media)
            found_windows = self.index.locate([key for _, key in windows], now)
            if found_windows is None:
                return CachePlan(tuple(tokens), len(keys), chunk_keys=named, images=images), windows
        known = tuple((window, locations) for window, locations in zip(windows, found_windows) if locations)
        best = [known[0][1]] if known else []
        if depth:
            best.append(located[depth - 1])
        order = sorted((loc for locations in best for loc in locations),
                       key=lambda loc: (loc.tier is not TierName.RAM, loc.tier is not TierName.SSD))
        nodes = tuple(dict.fromkeys(loc.node_id for loc in order if loc.node_id != "*"))
        return CachePlan(tuple(tokens), depth, nodes, tuple(window for window, _ in known), named, images), windows

    def _resumable(self, request: api.GenerationRequest, tokens: list[int],
                   windows: list[tuple[int, ObjectKey]], images: tuple) -> tuple[ObjectKey, KeptAt] | None:
        """The conversation a decoder replica keeps that the prompt continues, as (its
        name, where), if it adds at most ``resume_tokens`` to it: one answer (each of
        ``n`` would need its own copy), no images (the vision tower is the prefill
        pool's). Forgotten here once sent: the request takes it."""
        if request.n != 1 or images or not self.config.resume_tokens:
            return None
        for length, key in windows:  # longest first
            kept = self.resident.pop(key, None)
            if kept is not None:
                return (key, kept) if len(tokens) - length <= self.config.resume_tokens else None
        return None

    async def _stored(self, tokens: list[int], named: tuple[ObjectKey, ...], media: tuple) -> None:
        """Wait (up to the store's timeout) for the stores still running of the
        conversations this prompt continues or shares a new chunk with: an agent's
        next turn, sent the moment the answer was out, then finds every chunk of its
        history, and any turn planned after a last token reached the router finds what
        that answer stores."""
        import numpy as np

        ids, chunks = np.asarray(tokens, dtype="<i8"), set(named)
        running = [done for conversation, done in self.storing.values()
                   if not chunks.isdisjoint(conversation.keys[:-1])
                   or (conversation.length < len(ids)
                       and self.naming.window(ids[: conversation.length], named, media) == conversation.window)]
        if running:
            started = time.perf_counter()
            await asyncio.wait(running, timeout=STORE_TIMEOUT_S)
            self.metrics.store_wait.observe(time.perf_counter() - started)

    def _storing(self, conversation: StoringConversation, stream) -> None:
        """A decoder replica is storing ``conversation`` (its last token is out): held as
        running until the rest of ``stream`` says it is stored, or ends."""
        done = asyncio.get_running_loop().create_future()
        self.storing[conversation.window] = (conversation, done)

        async def until_stored() -> None:
            try:
                async for event in stream:
                    if "stored_at" in event:
                        break
            except Exception as error:  # noqa: BLE001 (the replica died: the next turn reads what was stored)
                logger.info("a decoder replica's stream ended before its store reported: %s", type(error).__name__)
            finally:
                if self.storing.get(conversation.window, (None, None))[1] is done:
                    del self.storing[conversation.window]
                done.set_result(None)

        task = asyncio.ensure_future(until_stored())
        self._store_waits.add(task)
        task.add_done_callback(self._store_waits.discard)

    def _kept(self, event: dict) -> None:
        """A decoder replica keeps the conversation an answer ended (its last event)."""
        self.resident[event["resident"]] = KeptAt(event["replica"], event["node"])
        self.resident.move_to_end(event["resident"])
        while len(self.resident) > 65536:
            self.resident.popitem(last=False)

    def _read_image(self, url: str, earlier: tuple):
        """(the positions its span takes, the decoded image) of an ``image_url``;
        ``earlier``: the request's images before it (they share a budget of pixels)."""
        from model.vision import plan_image

        image = read_image(url, self.image_limits, sum(image.height * image.width for image in earlier))
        return plan_image(image.height, image.width, self.vision).num_tokens, image

    def _prompt_images(self, request: api.GenerationRequest, tokens: list[int]) -> tuple:
        """Where each of the request's images sits in the rendered prompt (its image
        tokens, in order); every image token of the prompt belongs to one."""
        from actors.state import PromptImage

        if self.image_token_id is None:
            return ()
        images, position = [], 0
        for length, image in request.images:
            start = tokens.index(self.image_token_id, position)
            images.append(PromptImage(start, length, image.pixels, image.digest))
            position = start + length
        spans = sum(length for length, _ in request.images)
        if tokens.count(self.image_token_id) != spans or any(
                tokens[i.start:i.start + i.length] != [self.image_token_id] * i.length for i in images):
            param = "prompt" if request.prompt is not None else "messages"
            raise api.ApiError(400, f"{param}: the image token (id {self.image_token_id}) stands only for the images "
                               "of image_url parts", param)
        return tuple(images)

    def _render(self, request: api.GenerationRequest) -> list[int]:
        self._bound_prompt(request)
        if request.prompt is not None:
            if isinstance(request.prompt, tuple):
                return list(request.prompt)
            return [self.tokenizer.special.bos] + self.tokenizer.encode(request.prompt)
        messages = []
        for message in request.messages:
            known = self.answers.get(_answer_key(message.reasoning, message.content, message.tool_calls)) \
                if message.role == "assistant" else None
            messages.append(dataclasses.replace(message, token_ids=known) if known else message)
        try:
            return self.template.render(messages, thinking=request.thinking, effort=request.effort,
                                        tools=request.tools)
        except ValueError as error:
            raise api.ApiError(400, str(error), "messages") from None

    def _bound_prompt(self, request: api.GenerationRequest) -> None:
        """A 400 before tokenising a prompt whose text is certainly longer than the
        context: no token spells more than ``max_token_bytes`` bytes (nor characters), so
        a text of C characters is at least C / max_token_bytes tokens."""
        if isinstance(request.prompt, tuple):
            return
        chars = len(request.prompt) if request.prompt is not None else \
            sum(len(message.content) + len(message.reasoning or "") for message in request.messages)
        least = chars // self.tokenizer.max_token_bytes
        if least + request.params.max_tokens > self.config.max_model_len:
            param = "prompt" if request.prompt is not None else "messages"
            raise api.ApiError(400, f"this request needs at least {least + request.params.max_tokens} tokens; the "
                               f"context is {self.config.max_model_len}", param, code="context_length_exceeded")

    def _constrained(self, request: api.GenerationRequest) -> api.GenerationRequest:
        """The request with the grammar its answer must follow (``GenerationRequest.grammar``),
        checked here so that a schema the engine cannot compile is a 400."""
        chosen = request.grammar(self.dsml, self.think_end)
        if chosen is None:
            return request
        grammar, after, param = chosen
        if self.grammars is None:
            self.grammars = GrammarCompiler(self.tokenizer.json, self.tokenizer.vocab_size, self.tokenizer.special.eos)
        try:
            self.grammars.check(grammar)
        except GrammarError as error:
            raise api.ApiError(400, f"{param}: the schema cannot be enforced: {error}", param) from None
        params = dataclasses.replace(request.params, grammar=grammar, grammar_after=after)
        return dataclasses.replace(request, params=params)

    def _remember(self, answer: api.ChatAnswer, tokens: list[int]) -> None:
        self.answers[_answer_key(answer.reasoning, answer.content, answer.calls)] = tuple(tokens)
        while len(self.answers) > 4096:
            self.answers.popitem(last=False)

    async def _events(self, request: api.GenerationRequest, tokens: list[int], rid: str, marks: dict[str, float]):
        if len(tokens) + request.params.max_tokens > self.config.max_model_len:
            raise api.ApiError(400, f"this request needs {len(tokens) + request.params.max_tokens} tokens; the "
                               f"context is {self.config.max_model_len}", "messages", code="context_length_exceeded")
        images = self._prompt_images(request, tokens)
        marks["rendered"] = time.time()
        plan, windows = await self._plan(tokens, images)
        marks["planned"] = time.time()
        if plan.windows is not None:  # the index decided what is stored (else the prefill's store does)
            marks["looked_up"] = marks["planned"]
        lookup = None
        if self.engram is not None:  # start fetching the rows now: they arrive while layer 0 runs
            import torch

            ids = torch.tensor([tokens])
            text = None if self.image_token_id is None else ids != self.image_token_id  # no n-gram across an image
            lookup = self.engram.start(self.hasher.hash_ids(ids, token_mask=text)[0][0])
        # A conversation a decoder replica keeps in memory, that this prompt continues.
        resume = self._resumable(request, tokens, windows, images)
        cache_nodes = list(plan.nodes)
        if resume is not None:
            cache_nodes = [resume[1].node] + [node for node in cache_nodes if node != resume[1].node]
        # The decoder replica: the one that keeps the conversation, or one where the cache
        # is, unless another has a shorter backlog of admissions (then the cache moves).
        # The prefill pool prefers the same node.
        kept = resume[1].replica if resume is not None else None
        chosen = self.load.choose(cache_nodes, kept) if self.load is not None else None
        replica, nodes = kept, cache_nodes
        if chosen is not None:
            replica = chosen.replica
            nodes = [chosen.node] + [node for node in cache_nodes if node != chosen.node]
            self.load.started(replica)
            self.metrics.routed.inc(tags={"choice": chosen.reason})
        marks["replica"] = replica
        if resume is not None:
            # The replica that keeps it encodes only what the conversation added, from its
            # cache; another (moved for load) reads the conversation from the store.
            decoder = self.decoder_direct if lookup is None else self.decoder
            return [(decoder.prefill_and_generate.remote(plan, request.params, rid, engram=lookup,
                                                         preferred_nodes=nodes, resident=resume[0],
                                                         preferred_replica=replica), None)]
        samples = request.samples()
        if request.n == 1 and plan.cached_chunks == 0 and plan.windows == () and not images and \
                len(tokens) <= self.config.local_prefill_tokens:
            # Nothing stored and a short prompt: the decoder encodes it itself, sparing
            # two hops and a handoff (its batch waits about one step for it).
            # (An Engram lookup holds object refs: those travel by reference.)
            decoder = self.decoder_direct if lookup is None else self.decoder
            return [(decoder.prefill_and_generate.remote(plan, request.params, rid, engram=lookup,
                                                         preferred_nodes=nodes, preferred_replica=replica), None)]
        stored = self.naming.loadable_chunks(plan)
        if stored and plan.chunk_keys:  # the decoder reads the stored prefix while the prefill runs
            self.decoder_prefetch.prefetch.remote(plan.chunk_keys[:stored], preferred_nodes=nodes,
                                                  preferred_replica=replica)
        # One prefill, whatever n: each answer's decoder admits its own copy of the handoff.
        handoff = self.prefill.prefill.remote(plan, preferred_nodes=nodes, engram=lookup)

        def without_the_pool(params, sample_id):  # the prefill pool failed: the decoder encodes the prompt
            if images:  # (not one with images: the vision tower is the prefill pool's)
                return None
            return lambda: self.decoder_direct.prefill_and_generate.remote(plan, params, sample_id)

        ids = [rid] if request.n == 1 else [f"{rid}-{i}" for i in range(request.n)]
        return [(self.decoder.generate.remote(handoff, params, sample_id, preferred_nodes=nodes,
                                              preferred_replica=replica),
                 without_the_pool(params, sample_id)) for params, sample_id in zip(samples, ids)]

    # ------------------------------------------------------------------ endpoints
    @fastapi_app.get("/health")
    async def health(self):
        """``{"status": "ok"}``; ``"degraded"`` with the problems while a part the cache
        depends on (Redis, a node's store) is down (it serves either way); ``"starting"``
        (HTTP 503) while the prefill or decoder pool has no replica running yet (a first
        start with ``compiled_step`` builds the step's packages for minutes: requests
        sent then wait for it), and 503 ``"degraded"`` while one has none running later."""
        problems = await self._problems()
        if any(_NO_REPLICA in problem for problem in problems):
            status = "degraded" if self._pools_ready else "starting"
            return JSONResponse({"status": status, "problems": problems}, status_code=503)
        return JSONResponse({"status": "degraded" if problems else "ok", "problems": problems})

    async def check_health(self) -> None:
        """Serve's periodic health check: refreshes the parts' gauges (``v41_redis_up``,
        ``v41_stores_down``) even when nobody polls /health. A degraded part does not
        make the router unhealthy (restarting it would not bring Redis back)."""
        try:
            await self._problems()
        except Exception:  # noqa: BLE001 (the check itself failing is not the router failing)
            logger.warning("health probe of the parts failed", exc_info=True)

    async def _problems(self) -> list[str]:
        now = time.monotonic()
        # A second-old answer serves, unless it had a pool without a replica: a starting
        # pool's first replica must show at once (`v41 serve` says ready as it runs).
        if self._health is not None and now - self._health[0] < 1.0 and self._pools_ready:
            return self._health[1]
        from actors.health import store_problems

        checks = [store_problems(), asyncio.to_thread(self._pool_problems)]
        if self.link is not None:
            checks.append(asyncio.to_thread(self._redis_problem))
        found = [problem for problems in await asyncio.gather(*checks) for problem in problems]
        self._health = (time.monotonic(), found)
        self._pools_ready |= not any(_NO_REPLICA in problem for problem in found)
        self.metrics.parts(redis_up=not any(p.startswith("redis") for p in found),
                           stores_down=sum(p.startswith("store") for p in found))
        return found

    def _pool_problems(self) -> list[str]:
        """One line per pool (prefill, decoder) without a replica running, from Serve's
        controller; none when the controller does not answer (not the pools' problem)."""
        from ray import serve

        try:
            deployments = serve.status().applications[self.decoder.app_name].deployments
        except Exception:  # noqa: BLE001 (a busy or restarting controller)
            return []
        problems = []
        for pool, handle in (("prefill", self.prefill), ("decoder", self.decoder)):
            overview = deployments.get(handle.deployment_name)
            if overview is None:
                continue
            states = {str(getattr(state, "value", state)): n for state, n in overview.replica_states.items()}
            if not states.get("RUNNING"):
                detail = ", ".join(f"{n} {state.lower()}" for state, n in sorted(states.items()) if n) or "none"
                problems.append(f"{pool} {_NO_REPLICA} ({detail}); requests wait for it")
        return problems

    def _redis_problem(self) -> list[str]:
        try:
            self.link.client.ping()
            return []
        except Exception as error:  # noqa: BLE001 (any failure means the same)
            return [f"redis: not answering ({type(error).__name__}); serving without the cluster index"]

    @fastapi_app.get("/v1/models")
    async def models(self, request: Request):
        try:
            self._authorize(request)
        except api.ApiError as error:
            return JSONResponse(error.body(), status_code=error.status)
        return {"object": "list", "data": [{"id": self.config.model_name, "object": "model", "created": 0,
                                            "owned_by": "v41"}]}

    @fastapi_app.get("/v1/models/{model_id:path}")
    async def model(self, model_id: str, request: Request):
        try:
            self._authorize(request)
            if model_id != self.config.model_name:
                raise api.ApiError(404, f"The model `{model_id}` does not exist", "model", code="model_not_found")
        except api.ApiError as error:
            return JSONResponse(error.body(), status_code=error.status)
        return {"id": self.config.model_name, "object": "model", "created": 0, "owned_by": "v41"}

    @fastapi_app.post("/v1/chat/completions")
    async def chat(self, request: Request):
        return await self._serve(request, "chat")

    @fastapi_app.post("/v1/completions")
    async def completions(self, request: Request):
        return await self._serve(request, "completions")

    @fastapi_app.post("/v1/responses")
    async def responses(self, request: Request):
        return await self._serve(request, "responses")

    @fastapi_app.get("/v1/responses/{rid}")
    async def stored_response(self, rid: str, request: Request):
        async def call():
            return (await self._stored_response(rid))["response"]

        return await self._records_call(request, call)

    @fastapi_app.get("/v1/responses/{rid}/input_items")
    async def stored_input_items(self, rid: str, request: Request, after: str | None = None, limit: int = 20,
                                 order: str = "desc"):
        async def call():
            return responses_api.input_items_page(await self._stored_response(rid), after, limit, order)

        return await self._records_call(request, call)

    @fastapi_app.delete("/v1/responses/{rid}")
    async def delete_response(self, rid: str, request: Request):
        async def call():
            await self._stored_response(rid)
            await self.records.forget_response(rid)
            return {"id": rid, "object": "response", "deleted": True}

        return await self._records_call(request, call)

    async def _body(self, request: Request) -> bytes:
        """The request body, refused with 413 as soon as it is known to be over the
        limit (before reading it when its Content-Length says so)."""
        limit = self.config.max_request_bytes
        declared = request.headers.get("content-length")
        if declared is not None:
            if not declared.isdigit():
                raise api.ApiError(400, "invalid Content-Length header")
            if int(declared) > limit:
                raise api.ApiError(413, f"request body is {int(declared)} bytes; the limit is {limit}",
                                   code="request_too_large")
        parts, size = [], 0
        async for part in request.stream():
            size += len(part)
            if size > limit:
                raise api.ApiError(413, f"request body is over the limit of {limit} bytes", code="request_too_large")
            parts.append(part)
        return b"".join(parts)

    def _parse(self, endpoint: str, data: dict, history: list[dict]):
        """(the generation request, the Responses request it came from or None);
        ``history``: the items of the response a Responses request continues."""
        if endpoint == "completions":
            return api.parse_completion(data, self.config.model_name, self.config.max_tokens_default,
                                        self.model_config.text.vocab_size), None
        common = (data, self.config.model_name, self.config.max_tokens_default, self.model_config.text.vocab_size,
                  self._read_image if self.vision is not None else None, self.config.max_images_per_request)
        if endpoint == "chat":
            return api.parse_chat(*common), None
        parsed = responses_api.parse_responses(*common, keeps=self.config.store_responses, history=history)
        return parsed.generation, parsed

    def _prepare(self, endpoint: str, data: dict, history: list[dict]):
        """(the generation request with its grammar, the Responses request it came from
        or None, the prompt's ids): a request's CPU-heavy part, run off the event loop."""
        parsed, responses = self._parse(endpoint, data, history)
        try:
            parsed = self._constrained(parsed)
            return parsed, responses, self._render(parsed)
        except api.ApiError as error:
            raise (error if responses is None else responses.renamed(error)) from None

    async def _serve(self, request: Request, endpoint: str):
        """One request of ``endpoint`` (chat, completions or responses)."""
        chat, start, arrived = endpoint != "completions", time.perf_counter(), time.time()
        marks = {"router_in": arrived, "replica": None}  # the trip's marks; "replica": where it was sent
        responses = None
        try:
            self._authorize(request)
            body = await self._body(request)
            # Parsing is off the event loop, so other clients' tokens keep flowing while a
            # request's JSON is read, its images decoded, its grammar compiled, its prompt
            # tokenised.
            data = await asyncio.to_thread(api.parse_json, body)
            history = await self._continued(data) if endpoint == "responses" else []
            parsed, responses, tokens = await asyncio.to_thread(self._prepare, endpoint, data, history)
            rid = responses_api.response_id() if responses is not None else api.new_id("chatcmpl" if chat else "cmpl")
            dispatched = await self._events(parsed, tokens, rid, marks)
            marks["router_sent"] = time.time()
            started = await self._started(dispatched, request)
        except api.ApiError as error:
            if responses is not None:
                error = responses.renamed(error)
            self._answered(marks)
            self.metrics.record(endpoint, str(error.status))
            return JSONResponse(error.body(), status_code=error.status, headers=error.headers)
        except ClientGone:
            self._answered(marks)
            self.metrics.record(endpoint, "499")
            return JSONResponse(api.ApiError(499, "client closed the request").body(), status_code=499)
        except Exception as error:  # a replica died or failed before the first token
            self._answered(marks)
            logger.exception("request failed before its first token")
            self.metrics.record(endpoint, "503")
            return JSONResponse(_generation_failed(error).body(), status_code=503)
        first = started[0][0]
        self._answered(marks)  # (its first token: no longer waiting for an admission)
        queued_ms = self._admitted(first, marks)
        streams = [_chained(head, stream, self._kept, self._storing) for head, stream in started]
        if parsed.stream:
            # Its Server-Timing covers the trip to the first token (the headers go out with it).
            to_first = {**marks, **first.get("timeline", {}), "first_token": time.time()}
            events = self._response_events(streams[0], parsed, responses, rid, start) if responses is not None else \
                self._sse(streams, parsed, rid, chat, start)
            return StreamingResponse(events, media_type="text/event-stream",
                                     headers={"x-v41-queue-ms": f"{queued_ms:.3f}",
                                              "x-v41-moved-bytes": str(first.get("moved_bytes", 0)),
                                              "x-v41-prefilled-by": first.get("prefilled_by", ""),
                                              "server-timing": server_timing(to_first, first.get("replica_s", 0.0),
                                                                             first.get("prefilled_by", ""))})
        try:
            results = await asyncio.gather(*(self._collect(events, parsed, start) for events in streams))
        except Exception as error:  # the decoder died or failed: a clear error, nothing cached
            self.metrics.record(endpoint, "503")
            return JSONResponse(_generation_failed(error).body(), status_code=503)
        result = results[0]
        generated = sum(len(r["tokens"]) for r in results)
        # Counted once the response is out (Ray metrics cost ~0.1 ms a request).
        counted = BackgroundTask(self._count, endpoint, "200", len(tokens), result["cached"],
                                 generated, result["ttft"], time.perf_counter() - start)
        if responses is not None:
            builder = responses.builder(rid, self.config.model_name)
            builder.push(result["deltas"])
            body = builder.finish(result["finish"], responses_api.usage(
                len(tokens), generated, result["cached"], result["reasoning_tokens"]))[-1]["response"]
            try:
                await self._answered_response(responses, body)
            except api.ApiError as error:  # its conversation could not take it
                self.metrics.record(endpoint, str(error.status))
                return JSONResponse(error.body(), status_code=error.status, headers=error.headers)
        elif chat:
            body = api.chat_response(rid, self.config.model_name, [
                api.chat_choice(i, r["content"], r["reasoning"], r["finish"], r["calls"], r["logprobs"])
                for i, r in enumerate(results)], api.usage(len(tokens), generated, result["cached"]))
        else:
            body = api.completion_response(rid, self.config.model_name, [
                api.completion_choice(i, r["content"], r["finish"], r["logprobs"]) for i, r in enumerate(results)],
                api.usage(len(tokens), generated, result["cached"]))
        # Time the replicas spent computing the first token (prefill, replay, sample), and
        # where the rest of the request's time went (Server-Timing, milliseconds).
        marks.update(result["timeline"], router_out=time.time())
        # How many times the prompt was encoded for these answers (1 whatever n).
        prefills = len({(r["timeline"].get("prefill_in"), r["timeline"].get("prefill_out")) for r in results})
        return JSONResponse(body, background=counted,
                            headers={"x-v41-replica-ms": f"{1e3 * result['replica_s']:.3f}",
                                     "x-v41-prefills": str(prefills),
                                     "x-v41-queue-ms": f"{queued_ms:.3f}",
                                     "x-v41-moved-bytes": str(first.get("moved_bytes", 0)),
                                     "x-v41-prefilled-by": result["prefilled_by"],
                                     **_store_times(marks),
                                     "server-timing": server_timing(marks, result["replica_s"], result["prefilled_by"])})

    async def _started(self, dispatched: list, request: Request) -> list[tuple[dict, object]]:
        """(first event, stream) of each answer, once every one has its first token; an
        answer whose prefill pool failed is encoded by the decoder instead. If one
        fails, the others are cancelled."""
        async def start(stream, fallback):
            try:
                return await self._first(stream, request), stream
            except (api.ApiError, ClientGone):
                raise
            except Exception as error:  # noqa: BLE001 (a prefill replica died, or the pool failed)
                if fallback is None:
                    raise
                logger.warning("the prefill pool failed (%s): the decoder encodes the prompt", type(error).__name__)
                stream = fallback()
                return await self._first(stream, request), stream

        tasks = [asyncio.ensure_future(start(stream, fallback)) for stream, fallback in dispatched]
        try:
            return list(await asyncio.gather(*tasks))
        except BaseException:
            for task, (stream, _) in zip(tasks, dispatched):
                task.cancel()
                stream.cancel()
            raise

    async def _first(self, stream, request: Request):
        """The stream's first event (the first token), awaited before the response
        starts so that a full queue is a 429 and a failure a 503, not a broken stream.
        While the request waits for a place in a batch, a client that goes away takes
        it out of the queue."""
        self.waiting += 1
        self.metrics.waiting.set(self.waiting)
        first = asyncio.ensure_future(stream.__anext__())
        try:
            while True:
                done, _ = await asyncio.wait((first,), timeout=0.5)
                if done:
                    return first.result()
                if await request.is_disconnected():
                    first.cancel()
                    stream.cancel()
                    raise ClientGone()
        except BackPressureError as error:
            queued = getattr(error, "args", (0,))[0] or 0
            raise api.ApiError(429, "the server is at capacity: every decoder batch is full and the queue is "
                                    f"full ({queued} requests waiting); retry later", kind="rate_limit_error",
                               code="queue_full", headers={"retry-after": str(self._retry_after(queued))}) from None
        finally:
            self.waiting -= 1
            self.metrics.waiting.set(self.waiting)

    def _answered(self, marks: dict) -> None:
        """A request dispatched to ``marks["replica"]`` has its first token, or failed (once)."""
        if self.load is not None:
            self.load.answered(marks.pop("replica", None))

    def _admitted(self, first: dict, marks: dict[str, float]) -> float:
        """Milliseconds the request waited for a place in a batch, once ready for one
        (after its prefill when the pool encoded it); recorded as a metric."""
        timeline = first.get("timeline", {})
        ready = timeline.get("prefill_out") if first.get("prefilled_by") == "pool" else marks.get("router_sent")
        admitted = timeline.get("admitted")
        waited = max(0.0, admitted - ready) if admitted is not None and ready is not None else 0.0
        self.metrics.queue_wait.observe(waited)
        return 1e3 * waited

    def _retry_after(self, queued: int) -> int:
        """Seconds until the queue has likely drained: its length over the rate requests
        finished in the last 30 s (1 to 60)."""
        now = time.monotonic()
        recent = sum(1 for ended in self.finished if now - ended < 30.0)
        if not recent:
            return 5
        return max(1, min(60, math.ceil(queued * 30.0 / recent)))

    async def _count(self, *args) -> None:
        """``metrics.record`` as a coroutine: Starlette would run a plain function in a
        worker thread, one more thread for the event loop to share the GIL with."""
        self.finished.append(time.monotonic())
        self.metrics.record(*args)

    async def _collect(self, stream, request: api.GenerationRequest, start: float) -> dict:
        tokens, cached, finish, replica_s = [], 0, "stop", 0.0
        ttft, timeline, prefilled_by = None, {}, ""
        answer = api.ChatAnswer(request, self.think_end, self.dsml, self.tokenizer.token_bytes)
        completion = api.CompletionLogprobs(self.tokenizer.token_bytes) \
            if request.prompt is not None and request.params.logprobs is not None else None
        entries, deltas = [], []
        async for event in stream:
            if "cached_tokens" in event:
                cached, replica_s, prefilled_by = event["cached_tokens"], event["replica_s"], event["prefilled_by"]
                timeline = {**event["timeline"], "first_token": time.time()}
                ttft = time.perf_counter() - start
            if "storing" in event:  # the last token: a turn that continues it waits for its store
                timeline["stored"] = time.time()
            tokens.append(event["token_id"])
            deltas += answer.push(event["token_id"], event["text"], event.get("logprob"),
                                  event.get("top_logprobs", ()))
            if completion is not None and event.get("logprob") is not None:
                entries.append(completion.entry(event["token_id"], event["text"], event["logprob"],
                                                event["top_logprobs"]))
            if event["finish_reason"]:
                finish = event["finish_reason"]
                break  # the request's last token: do not wait for the stream to close
        deltas += answer.finish()
        if request.messages:
            self._remember(answer, tokens)
        logprobs = completion.merge(entries) if completion is not None else answer.logprobs
        return {"tokens": tokens, "content": answer.content, "reasoning": answer.reasoning, "calls": answer.calls,
                "deltas": deltas, "reasoning_tokens": answer.reasoning_tokens,
                "logprobs": logprobs, "cached": cached, "finish": answer.finish_reason(finish),
                "replica_s": replica_s, "ttft": ttft, "timeline": timeline, "prefilled_by": prefilled_by}

    async def _sse(self, streams: list, request: api.GenerationRequest, rid: str, chat: bool, start: float):
        """The answers' chunks as they come (several answers interleave, each with its
        index), then the usage if asked, then ``[DONE]``."""
        endpoint, totals = ("chat" if chat else "completions"), {"prompt": 0, "cached": 0, "tokens": 0, "ttft": None}
        chunks: asyncio.Queue = asyncio.Queue()

        async def pump(index: int, stream) -> None:
            try:
                async for chunk in self._answer_chunks(index, stream, request, rid, chat, start, totals):
                    await chunks.put(chunk)
            except Exception as error:  # noqa: BLE001 (passed on to the client below)
                await chunks.put(error)
            finally:
                await chunks.put(None)

        pumps = [asyncio.ensure_future(pump(i, stream)) for i, stream in enumerate(streams)]
        try:
            running, failed = len(pumps), None
            while running:
                item = await chunks.get()
                if item is None:
                    running -= 1
                elif isinstance(item, Exception):
                    failed = failed or item
                elif failed is None:
                    yield api.sse(item)
            if failed is not None:  # mid-stream failure: tell the client, end the stream
                self.metrics.record(endpoint, "503")
                yield api.sse(_generation_failed(failed).body())
            else:
                if request.include_usage:
                    usage = api.usage(totals["prompt"], totals["tokens"], totals["cached"])
                    model = self.config.model_name
                    yield api.sse(api.chat_chunk(rid, model, None, None, usage) if chat else
                                  api.completion_chunk(rid, model, None, None, usage))
                await self._count(endpoint, "200", totals["prompt"], totals["cached"], totals["tokens"],
                                  totals["ttft"], time.perf_counter() - start)
            yield api.sse("[DONE]")
        finally:
            for task in pumps:
                task.cancel()

    async def _answer_chunks(self, index: int, stream, request: api.GenerationRequest, rid: str, chat: bool,
                             start: float, totals: dict):
        """One answer's chunks (choice ``index``); its tokens counted in ``totals``."""
        model = self.config.model_name
        events = self._tokens(stream, totals, start, prompt=index == 0)
        if chat:
            # No content yet: an answer that is only calls keeps content null, as unstreamed.
            yield api.chat_chunk(rid, model, {"role": "assistant"}, None, index=index)
            answer = api.ChatAnswer(request, self.think_end, self.dsml, self.tokenizer.token_bytes)
            async for deltas, finish in self._chat_deltas(events, answer):
                for chunk in api.chat_chunks(rid, model, deltas, finish, index):
                    yield chunk
            return
        completion = api.CompletionLogprobs(self.tokenizer.token_bytes) if request.params.logprobs is not None else None
        async for event in events:
            logprob = event.get("logprob")
            logprobs = completion.entry(event["token_id"], event["text"], logprob, event.get("top_logprobs", ())) \
                if completion is not None and logprob is not None else None
            yield api.completion_chunk(rid, model, event["text"], event["finish_reason"], logprobs=logprobs,
                                       index=index)

    @staticmethod
    async def _tokens(stream, totals: dict, start: float, prompt: bool = True):
        """An answer's token events, up to its last (not waiting for the stream to close),
        counted in ``totals`` (and, with ``prompt``, the prompt's tokens and the TTFT)."""
        async for event in stream:
            if prompt and "cached_tokens" in event:
                totals.update(cached=event["cached_tokens"], prompt=event["prompt_tokens"],
                              ttft=time.perf_counter() - start)
            totals["tokens"] += 1
            yield event
            if event["finish_reason"]:
                break

    async def _chat_deltas(self, events, answer: api.ChatAnswer):
        """A chat answer token by token: ``(deltas, finish)``, ``finish`` its finish
        reason at the last token (else None); then its ids are remembered for the next turn."""
        tokens = []
        async for event in events:
            tokens.append(event["token_id"])
            deltas = answer.push(event["token_id"], event["text"], event.get("logprob"), event.get("top_logprobs", ()))
            finish = event["finish_reason"]
            yield (deltas + answer.finish(), answer.finish_reason(finish)) if finish else (deltas, None)
        self._remember(answer, tokens)

    async def _response_events(self, stream, request: api.GenerationRequest,
                               responses: responses_api.ParsedResponses, rid: str, start: float):
        """A Responses stream: the response's events as the answer's tokens come
        (``response.failed`` if the decoder fails under it)."""
        builder = responses.builder(rid, self.config.model_name)
        answer = api.ChatAnswer(request, self.think_end, self.dsml, self.tokenizer.token_bytes)
        totals, finish = {"prompt": 0, "cached": 0, "tokens": 0, "ttft": None}, "stop"
        for item in builder.start():
            yield responses_api.sse(item)
        try:
            async for deltas, done in self._chat_deltas(self._tokens(stream, totals, start), answer):
                for item in builder.push(deltas):
                    yield responses_api.sse(item)
                finish = done or finish
        except Exception as error:  # noqa: BLE001 (passed on to the client)
            self.metrics.record("responses", "503")
            failed = builder.failed(_generation_failed(error))
            await self._answered_response(responses, failed["response"], joins=False)
            yield responses_api.sse(failed)
            return
        prompt, cached, generated = totals["prompt"], totals["cached"], totals["tokens"]
        # Counted and kept before the last event: a client may close the stream once it
        # has it, and send the next turn naming it.
        await self._count("responses", "200", prompt, cached, generated, totals["ttft"], time.perf_counter() - start)
        events = builder.finish(finish, responses_api.usage(prompt, generated, cached, answer.reasoning_tokens))
        try:
            await self._answered_response(responses, events[-1]["response"])
        except api.ApiError as error:  # its conversation could not take it: the response failed
            events[-1] = builder.failed(error)
        for item in events:
            yield responses_api.sse(item)

    # ------------------------------------------------------------------ stored responses
    async def _continued(self, data: dict) -> list[dict]:
        """The items a Responses request continues: those of the response it names as
        ``previous_response_id``, or of the ``conversation`` it names (none when it names
        neither, or the server keeps none: parsing refuses that)."""
        if not isinstance(data, dict) or not self.config.store_responses:
            return []
        previous = data.get("previous_response_id")
        if isinstance(previous, str) and previous:
            return responses_api.history(await self._stored_response(previous, "previous_response_id"))
        cid = responses_api.conversation_named(data)
        return [] if cid is None else (await self._conversation(cid, "conversation"))["items"]

    async def _stored_response(self, rid: str, param: str | None = None) -> dict:
        """A stored response's record; a 404 (or, for ``param``, a 400 naming it) if no node has it."""
        found = await self.records.response(rid) if self.config.store_responses else None
        if found is None:
            if param is not None:
                raise api.ApiError(400, f"{param}: no stored response has id {rid!r} (it was not stored, was "
                                        "deleted, or its retention ran out)", param,
                                   code="previous_response_not_found")
            raise api.ApiError(404, f"No response found with id {rid!r}", code="not_found")
        return found

    async def _answered_response(self, responses: responses_api.ParsedResponses, response: dict,
                                 joins: bool = True) -> None:
        """Keep a finished response (when asked to), and add its input and output to the
        conversation it names (unless it failed: ``joins``), before the client has the
        whole answer; a conversation that cannot take it is an :class:`ApiError`."""
        if responses.store:
            await self.records.keep_response(response["id"], responses_api.record(responses, response))
        if joins and responses.conversation is not None:
            joined = [*responses.new_items, *response["output"]]
            await self._change_conversation(responses.conversation,
                                            lambda record: conversations_api.with_items(record, joined, "input"))

    # ------------------------------------------------------------------ conversations
    async def _conversation(self, cid: str, param: str | None = None) -> dict:
        found = await self.records.conversation(cid)
        if found is None:
            raise conversations_api.not_found(cid, param)
        return found

    async def _change_conversation(self, cid: str, change) -> dict:
        """Apply ``change`` (a record to its next version) to a conversation; a 404 if there is none."""
        record = await self.records.change_conversation(cid, change)
        if record is None:
            raise conversations_api.not_found(cid)
        return record

    async def _records_call(self, request: Request, call, conversations: bool = False):
        """One call of the stored-records routes (responses, conversations): ``call()``'s
        body, or its error in the OpenAI shape. Conversations are refused when this
        server keeps none; a stored response is then simply not found."""
        try:
            self._authorize(request)
            if conversations and not self.config.store_responses:
                raise api.ApiError(400, "this server keeps no conversations (store_responses is off)",
                                   code="conversations_disabled")
            return await call()
        except api.ApiError as error:
            return JSONResponse(error.body(), status_code=error.status, headers=error.headers)

    async def _conversations_call(self, request: Request, call):
        return await self._records_call(request, call, conversations=True)

    async def _json_body(self, request: Request) -> dict:
        data = api.parse_json(await self._body(request))
        if not isinstance(data, dict):
            raise api.ApiError(400, "the request body must be a JSON object")
        return data

    @fastapi_app.post("/v1/conversations")
    async def create_conversation(self, request: Request):
        async def call():
            record = conversations_api.created(await self._json_body(request))
            await self.records.write_conversation(record)
            return record["conversation"]

        return await self._conversations_call(request, call)

    @fastapi_app.get("/v1/conversations/{cid}")
    async def get_conversation(self, cid: str, request: Request):
        async def call():
            return (await self._conversation(cid))["conversation"]

        return await self._conversations_call(request, call)

    @fastapi_app.post("/v1/conversations/{cid}")
    async def update_conversation(self, cid: str, request: Request):
        async def call():
            data = await self._json_body(request)
            return (await self._change_conversation(
                cid, lambda record: conversations_api.updated(record, data)))["conversation"]

        return await self._conversations_call(request, call)

    @fastapi_app.delete("/v1/conversations/{cid}")
    async def delete_conversation(self, cid: str, request: Request):
        async def call():
            if not await self.records.forget_conversation(cid):
                raise conversations_api.not_found(cid)
            return conversations_api.deleted(cid)

        return await self._conversations_call(request, call)

    @fastapi_app.post("/v1/conversations/{cid}/items")
    async def add_conversation_items(self, cid: str, request: Request, include: Annotated[list[str] | None, Query()] = None):
        async def call():
            _no_include(include)
            items = conversations_api.new_items(await self._json_body(request))
            await self._change_conversation(cid, lambda record: conversations_api.with_items(record, items))
            return conversations_api.added(items)

        return await self._conversations_call(request, call)

    @fastapi_app.get("/v1/conversations/{cid}/items")
    async def conversation_items(self, cid: str, request: Request, after: str | None = None, limit: int = 20,
                                 order: str = "desc", include: Annotated[list[str] | None, Query()] = None):
        async def call():
            _no_include(include)
            return conversations_api.page(await self._conversation(cid), after, limit, order)

        return await self._conversations_call(request, call)

    @fastapi_app.get("/v1/conversations/{cid}/items/{item_id}")
    async def conversation_item(self, cid: str, item_id: str, request: Request,
                                include: Annotated[list[str] | None, Query()] = None):
        async def call():
            _no_include(include)
            return conversations_api.item(await self._conversation(cid), item_id)

        return await self._conversations_call(request, call)

    @fastapi_app.delete("/v1/conversations/{cid}/items/{item_id}")
    async def delete_conversation_item(self, cid: str, item_id: str, request: Request):
        async def call():
            return (await self._change_conversation(
                cid, lambda record: conversations_api.without_item(record, item_id)))["conversation"]

        return await self._conversations_call(request, call)

