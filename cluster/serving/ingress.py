"""The router: the app's HTTP ingress (a Serve deployment), thin over its parts.

It takes every connection, finds the caller's tenant by its API key
(:mod:`cluster.serving.admission`), checks the body's size, and answers every route. A
generation request (chat, completions, Responses) makes this trip: its API's adapter
parses it once into the internal request (:mod:`cluster.serving.adapter`); the
prompt is rendered (:mod:`cluster.serving.prompts`); the planner looks up what of it
is stored and where (:mod:`cluster.serving.planner`); the dispatcher sends it to the
prefill and decoder pools and waits for the first token (:mod:`cluster.serving.dispatcher`);
the adapter renders the answer, read once from the decoder's typed events
(:mod:`cluster.serving.answers`), whole or streamed. The stored responses' and
conversations' routes go to their adapters; ``/health`` to :mod:`cluster.serving.health`.
"""

# No `from __future__ import annotations`: FastAPI reads the endpoints' annotations at runtime.

import asyncio
import dataclasses
import logging
import time
from functools import partial
from pathlib import Path
from typing import Annotated

from fastapi import Query, Request
from fastapi.responses import JSONResponse
from ray import serve
from starlette.background import BackgroundTask

from actors.config import AppConfig
from actors.events import Token
from actors.replica import ModelIdentity, node_id, prompt_gil_handoff
from actors.store import node_store, peer_store
from cluster.serving.adapter import Adapter, Exchange, Model, Totals
from cluster.serving.admission import Access, Place, PlacedStream
from cluster.serving.answers import Answer
from cluster.serving.conversations_adapter import Conversations
from cluster.serving.dispatcher import ClientGone, Dispatcher, generation_failed
from cluster.serving.health import PartsHealth
from cluster.serving.http_app import fastapi_app, json_error
from cluster.serving.images import ImageLimits
from cluster.serving.liveness import NodeLiveness
from cluster.serving.openai_adapter import ChatAdapter, CompletionsAdapter
from cluster.serving.planner import Planner
from cluster.serving.prompts import Prompts
from cluster.serving.records import Records
from cluster.serving.responses_adapter import ResponsesAdapter
from cluster.serving.routing import DecoderLoad, known_replicas
from cluster.serving import tenants
from cluster.serving.tenants import Tenant
from cluster.serving.timing import server_timing, store_times
from cluster.serving.validation import ApiError, parse_json

logger = logging.getLogger("ray.serve")



# The router takes every connection. A request waiting for a place in a decoder batch
# waits at the router's handle to the decoder pool (Serve's queue, FIFO across the
# replicas); beyond ``max_queued_requests`` waiting, it is answered 429.
@serve.deployment(max_ongoing_requests=4096)
@serve.ingress(fastapi_app)
class Router:
    """The OpenAI-compatible ingress: authorize, parse, render, plan, dispatch, answer."""

    def __init__(self, config: AppConfig, prefill, decoder):
        from actors.metrics import RouterMetrics

        prompt_gil_handoff()
        self.config = config
        model = ModelIdentity(config)
        self.metrics = RouterMetrics()
        index, link = self._index(config)
        model_config = model.model_config
        vision = model_config.vision
        self.prompts = Prompts(model.tokenizer, vision, model_config.image_token_id if vision is not None else None,
                               ImageLimits(config.max_images_per_request, config.max_image_bytes,
                                           config.max_image_pixels, config.max_request_image_pixels, config.image_dir),
                               config.max_model_len)
        # Lost hosts, known in seconds: not read from, not chosen, their streams ended.
        liveness = NodeLiveness()
        if index is not None:
            liveness.on_dead = index.forget_nodes
        self.planner = Planner(model.naming, index, self.metrics, config.resume_tokens, liveness.usable)
        # Under affinity it chooses the decoder replica (admissions pending per replica).
        load = DecoderLoad(lambda: liveness.live_replicas(known_replicas(decoder.app_name, decoder.deployment_name))) \
            if config.routing == "affinity" else None
        self.dispatcher = Dispatcher(config, prefill, decoder, model.naming, self.metrics, load,
                                     *self._engram(config, model_config), image_token_id=self.prompts.image_token_id,
                                     liveness=liveness)
        self.health_of = PartsHealth((("prefill", self.dispatcher.prefill), ("decoder", self.dispatcher.decoder)),
                                     link, self.metrics, liveness.problems)
        self.access = Access(config, self.dispatcher.estimate_retry_after)
        # Stored responses and conversations (this node's store actor, reached at the first
        # use; the responses this router wrote lately, up to 64 MiB of JSON, in memory).
        self.records = Records(partial(node_store, config.store_settings(), model.naming.fingerprint.digest),
                               peer_store, node_id, index, link, forgotten=self.planner.forget)
        self.conversations = Conversations(self.records)
        parsing = Model(config.model_name, config.max_answer_tokens, model_config.text.vocab_size,
                        self.prompts.image_reader, config.max_images_per_request)
        self.chat_api = ChatAdapter(parsing, self._count, self._record)
        self.completions_api = CompletionsAdapter(parsing, self._count, self._record)
        self.responses_api = ResponsesAdapter(parsing, self._count, self._record, self.records,
                                              self.conversations, config.store_responses)

    @staticmethod
    def _index(config: AppConfig):
        """(the Redis location index, its link), or (None, None) without Redis."""
        if not config.redis_url:
            return None, None
        from storage.index import RedisIndex
        from storage.redis_link import RedisLink

        link = RedisLink(config.redis_url, namespace="v41", timeout_s=0.5, retry_s=1.0)
        return RedisIndex(link, key_ttl_s=config.chunk_retention_hours * 3600), link

    @staticmethod
    def _engram(config: AppConfig, model_config):
        """(the Engram service's client, the model's n-gram hasher), or (None, None) without Engram."""
        if not config.engram_shards:
            return None, None
        import ray

        from actors.engram import EngramServiceConfig, shared_engram_service
        from model.loader import load_hasher

        hasher = load_hasher(config.model, model_config)
        holder = shared_engram_service(EngramServiceConfig(
            checkpoint=str(Path(config.model).resolve()), n_shards=config.engram_shards,
            replicas=config.engram_replicas, resource=config.engram_resource, num_cpus=config.engram_cpus))
        return ray.get(holder.client.remote()), hasher

    # ------------------------------------------------------------------ plumbing
    async def _body(self, request: Request) -> bytes:
        """The request body, refused with 413 as soon as it is known to be over the
        limit (before reading it when its Content-Length says so)."""
        limit = self.config.max_request_bytes
        declared = request.headers.get("content-length")
        if declared is not None:
            if not declared.isdigit():
                raise ApiError(400, "invalid Content-Length header")
            if int(declared) > limit:
                raise ApiError(413, f"request body is {int(declared)} bytes; the limit is {limit}",
                               code="request_too_large")
        parts, size = [], 0
        async for part in request.stream():
            size += len(part)
            if size > limit:
                raise ApiError(413, f"request body is over the limit of {limit} bytes", code="request_too_large")
            parts.append(part)
        return b"".join(parts)

    async def _json_body(self, request: Request) -> dict:
        data = parse_json(await self._body(request))
        if not isinstance(data, dict):
            raise ApiError(400, "the request body must be a JSON object")
        return data

    async def _call(self, request: Request, call, conversations: bool = False):
        """One call of a route that answers JSON (models, stored responses, conversations):
        ``call()``'s body, or its error in the OpenAI shape. Conversations are refused when
        this server keeps none; a stored response is then simply not found."""
        try:
            self.access.authorize(request)
            if conversations and not self.config.store_responses:
                raise ApiError(400, "this server keeps no conversations (store_responses is off)",
                               code="conversations_disabled")
            return await call()
        except ApiError as error:
            return json_error(error)

    def _record(self, *args) -> None:
        """``metrics.record`` of the request's tenant (:data:`~cluster.serving.tenants.OWNER`)."""
        self.metrics.record(*args, tenant=tenants.OWNER.get())  # (the module: Serve pickles this class by value)

    async def _count(self, *args) -> None:
        """``_record`` as a coroutine: Starlette would run a plain function in a worker
        thread, one more thread for the event loop to share the GIL with."""
        self.dispatcher.finished.append(time.monotonic())
        self._record(*args)

    # ------------------------------------------------------------------ generation
    def _prepare(self, adapter: Adapter, data: dict, history: list[dict]):
        """(the request with its grammar, what its API parsed beside it, the prompt's
        ids): a request's CPU-heavy part, run off the event loop."""
        request, parsed = adapter.parse(data, history)
        request, tokens = self.prompts.prepare(request)
        return request, parsed, tokens

    async def _dispatch(self, client: Request, adapter: Adapter, marks: dict, start: float, tenant: Tenant):
        """Parse, render, plan and send a request of ``tenant``: (its exchange, each
        answer's (first token, stream))."""
        body = await self._body(client)
        # Parsing is off the event loop, so other clients' tokens keep flowing while a
        # request's JSON is read, its images decoded, its grammar compiled, its prompt
        # tokenised.
        data = await asyncio.to_thread(parse_json, body)
        history = await adapter.history(data)
        request, parsed, tokens = await asyncio.to_thread(self._prepare, adapter, data, history)
        request = self.prompts.fit(request, tokens)
        retention = tenant.retention(request.cache_retention)
        request = dataclasses.replace(request, cache_retention=retention,
                                      cache_group=tenant.group(request.cache_group))
        images = self.prompts.images(request, tokens)
        marks["rendered"] = time.time()
        scope = tenant.scope_for(retention)
        plan, windows = await self.planner.plan(tokens, images, scope)
        shared = (plan.chunk_keys or ())[: scope.shared_tokens // self.config.chunk_tokens] if scope.salt else ()
        exchange = Exchange(request, parsed, adapter.new_id(), len(tokens), start, plan.chunk_keys or (),
                            frozenset(shared))
        marks["planned"] = time.time()
        if plan.windows is not None:  # the index decided what is stored (else the prefill's store does)
            marks["looked_up"] = marks["planned"]
        # A conversation a decoder replica keeps in memory, that this prompt continues.
        resume = self.planner.take_resident(tokens, windows, request.n == 1 and not images)
        sent = self.dispatcher.send(request, tokens, images, plan, resume, exchange.rid, marks)
        marks["router_sent"] = time.time()
        return exchange, await self.dispatcher.start(sent, client, marks)

    async def _serve(self, client: Request, adapter: Adapter):
        """One request of a generation API, holding a place of its tenant's until its answer ends."""
        start, endpoint = time.perf_counter(), adapter.endpoint
        marks = {"router_in": time.time(), "replica": None}  # the trip's marks; "replica": where it was sent
        try:
            tenant = self.access.authorize(client)
            place = self.access.enter(tenant)
        except ApiError as error:
            return self._refuse(endpoint, marks, error)
        try:
            response = await self._serve_as(client, adapter, tenant, marks, start, place)
        except BaseException:
            place.leave()
            raise
        if not isinstance(response, PlacedStream):  # (a stream gives its place back once sent)
            place.leave()
        return response

    async def _serve_as(self, client: Request, adapter: Adapter, tenant: Tenant, marks: dict, start: float,
                        place: Place):
        endpoint = adapter.endpoint
        try:
            exchange, started = await self._dispatch(client, adapter, marks, start, tenant)
        except ApiError as error:
            return self._refuse(endpoint, marks, error)
        except ClientGone:
            return self._refuse(endpoint, marks, ApiError(499, "client closed the request"))
        except Exception as error:  # a replica died or failed before the first token
            logger.exception("request failed before its first token")
            return self._refuse(endpoint, marks, generation_failed(error))
        first = started[0][0]
        self.dispatcher.release(marks)  # (its first token: no longer waiting for an admission)
        queued_ms = self.dispatcher.measure_queue_wait(first, marks)
        answers = [Answer(head, stream, exchange.request,
                          self.prompts.new_answer(exchange.request) if exchange.request.prompt is None else None,
                          self.prompts.tokenizer.token_bytes, self._finish_answer, start) for head, stream in started]
        headers = {"x-v41-queue-ms": f"{queued_ms:.3f}", "x-v41-moved-bytes": str(first.admission.moved_bytes),
                   "x-v41-prefilled-by": first.admission.prefilled_by, "x-v41-decoder-node": first.admission.node,
                   "x-v41-recomputed-tokens": str(first.admission.recomputed_tokens),
                   "v41-cache-retention": exchange.request.cache_retention.value}
        if exchange.request.stream:
            # Its Server-Timing covers the trip to the first token (the headers go out with it).
            to_first = {**marks, **first.admission.timeline, "first_token": time.time()}
            headers["server-timing"] = server_timing(to_first, first.admission.replica_s, first.admission.prefilled_by)
            return PlacedStream(place, adapter.stream(exchange, answers), media_type="text/event-stream",
                                headers=self.access.shown(headers, tenant))
        return await self._answer_whole(adapter, exchange, answers, marks, headers, tenant)

    def _refuse(self, endpoint: str, marks: dict, error: ApiError) -> JSONResponse:
        """A request answered with ``error`` before its first token."""
        self.dispatcher.release(marks)
        self._record(endpoint, str(error.status))
        return json_error(error)

    def _finish_answer(self, answer: Answer, last: Token) -> None:
        """An answer's last token is here: the planner follows its conversation, and a
        chat answer's ids are remembered for the turn that sends it back."""
        self.planner.track_ending(last, answer.stream)
        if answer.request.messages:
            self.prompts.remember(answer.chat, answer.tokens)

    async def _answer_whole(self, adapter: Adapter, exchange: Exchange, answers: list[Answer], marks: dict,
                            headers: dict, tenant: Tenant) -> JSONResponse:
        """The answers read whole, as one body."""
        try:
            await asyncio.gather(*(answer.read() for answer in answers))
        except Exception as error:  # the decoder died or failed: a clear error, nothing cached
            self._record(adapter.endpoint, "503")
            return json_error(generation_failed(error))
        try:
            body = await adapter.body(exchange, answers)
        except ApiError as error:  # (a Responses answer its conversation could not take)
            self._record(adapter.endpoint, str(error.status))
            return json_error(error)
        first, totals = answers[0], Totals.of(answers, exchange.prompt_tokens)
        # Counted once the response is out (Ray metrics cost ~0.1 ms a request).
        counted = BackgroundTask(self._count, adapter.endpoint, "200", totals.prompt, totals.cached,
                                 totals.generated, totals.ttft, time.perf_counter() - exchange.start)
        # Time the replicas spent computing the first token (prefill, replay, sample), and
        # where the rest of the request's time went (Server-Timing, milliseconds).
        marks.update(first.timeline, router_out=time.time())
        # How many times the prompt was encoded for these answers (1 whatever n).
        prefills = len({(a.timeline.get("prefill_in"), a.timeline.get("prefill_out")) for a in answers})
        admission = first.admission
        return JSONResponse(body, background=counted, headers=self.access.shown({
            "x-v41-replica-ms": f"{1e3 * admission.replica_s:.3f}", "x-v41-prefills": str(prefills), **headers,
            **store_times(marks), "server-timing": server_timing(marks, admission.replica_s, admission.prefilled_by)},
            tenant))

    # ------------------------------------------------------------------ endpoints
    @fastapi_app.post("/v1/chat/completions")
    async def chat(self, request: Request):
        return await self._serve(request, self.chat_api)

    @fastapi_app.post("/v1/completions")
    async def completions(self, request: Request):
        return await self._serve(request, self.completions_api)

    @fastapi_app.post("/v1/responses")
    async def responses(self, request: Request):
        return await self._serve(request, self.responses_api)

    @fastapi_app.get("/health")
    async def health(self):
        """See :meth:`cluster.serving.health.PartsHealth.report`."""
        status, body = self.health_of.report(await self.health_of.problems())
        return JSONResponse(body, status_code=status)

    async def check_health(self) -> None:
        """Serve's periodic health check: refreshes the parts' gauges (``v41_redis_up``,
        ``v41_stores_down``) even when nobody polls /health. A degraded part does not
        make the router unhealthy (restarting it would not bring Redis back)."""
        try:
            await self.health_of.problems()
        except Exception:  # noqa: BLE001 (the check itself failing is not the router failing)
            logger.warning("health probe of the parts failed", exc_info=True)

    @fastapi_app.get("/v1/models")
    async def models(self, request: Request):
        async def call():
            return {"object": "list", "data": [self._model_object()]}

        return await self._call(request, call)

    @fastapi_app.get("/v1/models/{model_id:path}")
    async def model(self, model_id: str, request: Request):
        async def call():
            if model_id != self.config.model_name:
                raise ApiError(404, f"The model `{model_id}` does not exist", "model", code="model_not_found")
            return self._model_object()

        return await self._call(request, call)

    def _model_object(self) -> dict:
        return {"id": self.config.model_name, "object": "model", "created": 0, "owned_by": "v41"}

    @fastapi_app.get("/v1/responses/{rid}")
    async def stored_response(self, rid: str, request: Request):
        return await self._call(request, lambda: self._response_of(rid))

    async def _response_of(self, rid: str) -> dict:
        return (await self.responses_api.stored(rid))["response"]

    @fastapi_app.get("/v1/responses/{rid}/input_items")
    async def stored_input_items(self, rid: str, request: Request, after: str | None = None, limit: int = 20,
                                 order: str = "desc"):
        return await self._call(request, lambda: self.responses_api.input_items(rid, after, limit, order))

    @fastapi_app.delete("/v1/responses/{rid}")
    async def delete_response(self, rid: str, request: Request):
        return await self._call(request, lambda: self.responses_api.delete(rid))

    @fastapi_app.post("/v1/conversations")
    async def create_conversation(self, request: Request):
        async def call():
            return await self.conversations.create(await self._json_body(request))

        return await self._call(request, call, conversations=True)

    @fastapi_app.get("/v1/conversations/{cid}")
    async def get_conversation(self, cid: str, request: Request):
        return await self._call(request, lambda: self.conversations.retrieve(cid), conversations=True)

    @fastapi_app.post("/v1/conversations/{cid}")
    async def update_conversation(self, cid: str, request: Request):
        async def call():
            return await self.conversations.update(cid, await self._json_body(request))

        return await self._call(request, call, conversations=True)

    @fastapi_app.delete("/v1/conversations/{cid}")
    async def delete_conversation(self, cid: str, request: Request):
        return await self._call(request, lambda: self.conversations.delete(cid), conversations=True)

    @fastapi_app.post("/v1/conversations/{cid}/items")
    async def add_conversation_items(self, cid: str, request: Request,
                                     include: Annotated[list[str] | None, Query()] = None):
        async def call():
            return await self.conversations.add_items(cid, await self._json_body(request), include)

        return await self._call(request, call, conversations=True)

    @fastapi_app.get("/v1/conversations/{cid}/items")
    async def conversation_items(self, cid: str, request: Request, after: str | None = None, limit: int = 20,
                                 order: str = "desc", include: Annotated[list[str] | None, Query()] = None):
        return await self._call(request, lambda: self.conversations.items(cid, after, limit, order, include),
                                        conversations=True)

    @fastapi_app.get("/v1/conversations/{cid}/items/{item_id}")
    async def conversation_item(self, cid: str, item_id: str, request: Request,
                                include: Annotated[list[str] | None, Query()] = None):
        return await self._call(request, lambda: self.conversations.item(cid, item_id, include),
                                        conversations=True)

    @fastapi_app.delete("/v1/conversations/{cid}/items/{item_id}")
    async def delete_conversation_item(self, cid: str, item_id: str, request: Request):
        return await self._call(request, lambda: self.conversations.delete_item(cid, item_id),
                                        conversations=True)
