"""The Ray Serve application: router (ingress), prefill pool, decoder pool.

``build_app(args)`` validates its arguments into an :class:`AppConfig` and wires the
deployments with ``.bind()``; ``serve run cluster.app:build_app`` and the YAML
configs in ``configs/`` use it (``cluster.app:app`` is the local default).

Request path: the router renders the chat, computes the prompt's chunk keys, asks the
Redis index for the longest stored prefix and where it lives, and sends the prefill
to a replica on that node (:mod:`cluster.routing`). The prefill replica loads the
prefix from its node's store actor, encodes the new tokens and returns a handoff;
the router passes the handoff's reference to a decoder replica, which replays,
decodes in its continuous batch, streams tokens back, and writes the conversation to
its node's store when the request ends.
"""

# No `from __future__ import annotations`: FastAPI reads the endpoints' annotations at runtime.

import asyncio
import concurrent.futures
import dataclasses
import json
import sys
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from ray import serve
from ray.serve.config import RequestRouterConfig
from starlette.background import BackgroundTask

from cluster import openai_api as api

PROJECT_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_MODEL = str(PROJECT_ROOT / "configs" / "small")


def resolve_model(path: str) -> Path:
    """A checkpoint path as given, or relative to the project root (Serve replicas do
    not run in the directory a YAML was deployed from)."""
    candidate = Path(path)
    if candidate.is_absolute() or (candidate / "config.json").exists():
        return candidate.resolve()
    return PROJECT_ROOT / candidate


@dataclass(frozen=True)
class AppConfig:
    """Validated arguments of the application (every field has a YAML key of the same name)."""

    model: str = DEFAULT_MODEL
    model_name: str = "deepseek-v4.1-small"
    prefill_replicas: int = 1
    decoder_replicas: int = 1
    prefill_resources: dict = field(default_factory=dict)  # Ray custom resources per replica
    decoder_resources: dict = field(default_factory=dict)
    max_batch: int = 16
    max_tokens_default: int = 256
    max_model_len: int = 16384
    chunk_tokens: int = 64
    exact_replay: bool = False
    redis_url: str | None = None
    redis_stores_bytes: bool = False
    ssd_dir: str | None = "/tmp/v41-cache/{node}"
    ram_capacity_bytes: int | None = None
    window_ttl_minutes: float = 30.0
    chunk_retention_hours: float = 72.0
    persist_window_states: bool = False
    api_key: str | None = None
    threads: int = 1
    engram_shards: int = 0  # 0: Engram rows from in-process tables; N: a sharded table service
    engram_replicas: int = 1
    engram_resource: str = "engram_host"
    engram_cpus: float = 1.0
    # DSpark speculative decoding in the decoder pool when the checkpoint has a drafter:
    # "scheduled" (Algorithm 1 on a step-cost table profiled when a replica starts),
    # "fixed" (speculation_k guesses per request and step) or "off".
    speculation: str = "scheduled"
    speculation_k: int = 3
    # A prompt with nothing stored and at most this many tokens is encoded by the
    # decoder replica itself instead of the prefill pool (0: always the pool).
    local_prefill_tokens: int = 128

    @classmethod
    def from_args(cls, args: dict[str, Any] | None) -> "AppConfig":
        args = dict(args or {})
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(args) - names)
        if unknown:
            raise ValueError(f"unknown application arguments: {', '.join(unknown)}")
        args["model"] = str(resolve_model(args.get("model", DEFAULT_MODEL)))
        config = cls(**args)
        if not isinstance(config.engram_shards, int) or config.engram_shards < 0:
            raise ValueError(f"engram_shards must be a non-negative integer, got {config.engram_shards!r}")
        for name in ("prefill_replicas", "decoder_replicas", "max_batch", "max_tokens_default", "max_model_len",
                     "chunk_tokens", "threads", "engram_replicas"):
            value = getattr(config, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        from model.speculative import MODES

        if config.speculation not in MODES:
            raise ValueError(f"speculation must be one of {', '.join(MODES)}, got {config.speculation!r}")
        for name in ("speculation_k", "local_prefill_tokens"):
            value = getattr(config, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
        if not (Path(config.model) / "config.json").exists():
            raise ValueError(f"no checkpoint at {config.model!r} (config.json missing)")
        for name in ("prefill_resources", "decoder_resources"):
            resources = getattr(config, name)
            if not isinstance(resources, dict) or not all(isinstance(v, (int, float)) for v in resources.values()):
                raise ValueError(f"{name} must map resource names to numbers")
        return config

    def retention(self):
        from storage.policy import RetentionPolicy

        extra = {} if self.ram_capacity_bytes is None else {"ram_capacity_bytes": self.ram_capacity_bytes}
        return RetentionPolicy(chunk_retention_hours=self.chunk_retention_hours,
                               window_ttl_minutes=self.window_ttl_minutes,
                               persist_window_states=self.persist_window_states, **extra)


class ModelIdentity:
    """What the router and every replica agree on: config, tokenizer, state naming."""

    def __init__(self, config: AppConfig):
        from actors.state import StateNaming
        from model.chat import Tokenizer
        from model.config import ModelConfig
        from model.loader import weights_digest
        from model.serialize import StateIdentity

        self.model_config = ModelConfig.load(config.model)
        text = self.model_config.text
        self.tokenizer = Tokenizer.from_dir(config.model, noise_token_id=text.dspark_noise_token_id)
        identity = StateIdentity.of(text, weights_digest(config.model), self.tokenizer.fingerprint)
        self.naming = StateNaming.of(identity, text, config.chunk_tokens)
        eos = text.eos_token_id
        self.eos_ids = tuple(eos) if isinstance(eos, tuple) else (() if eos is None else (eos,))


class ModelBundle(ModelIdentity):
    """What every replica loads besides: the model (whole, or the encoder half), the
    Engram hasher, and an engine."""

    def __init__(self, config: AppConfig, drop_decoder: bool = False):
        import torch

        from model.engine import Engine
        from model.loader import load_checkpoint, load_hasher

        super().__init__(config)
        torch.set_num_threads(config.threads)
        checkpoint = load_checkpoint(config.model)
        model, self.drafter = checkpoint.backbone, checkpoint.drafter
        self.hasher = load_hasher(config.model, self.model_config)
        if drop_decoder:
            model.keep_encoder_only()
            self.drafter = None
        self.engine = Engine(model, self.hasher, bounded_replay=not config.exact_replay)

    def speculation(self, config: AppConfig):
        """The decoder's :class:`model.batcher.Speculation`, or None (mode "off", or no
        drafter in the checkpoint). The scheduled mode profiles its step-cost table here,
        for batches of 1, 2, 4, ... up to ``max_batch`` requests."""
        if config.speculation == "off" or self.drafter is None:
            return None
        from model.batcher import Speculation
        from model.speculative import Calibration, SpeculativeDrafter, StepCost

        path = Path(config.model) / "dspark_calibration.json"
        calibration = Calibration.from_dict(json.loads(path.read_text())) if path.exists() else None
        drafter = SpeculativeDrafter(self.drafter, self.engine, calibration)
        cost = None
        if config.speculation == "scheduled":
            sizes = sorted({min(1 << i, config.max_batch) for i in range(config.max_batch.bit_length() + 1)})
            cost = StepCost.profile(self.engine, drafter, requests=sizes, max_tokens=drafter.block_size + 1)
        k = min(config.speculation_k, drafter.block_size)
        return Speculation(drafter, config.speculation, k=k, cost=cost)

    def store(self, config: AppConfig):
        from actors.store import StoreSettings, node_store

        settings = StoreSettings(ssd_dir=config.ssd_dir, redis_url=config.redis_url,
                                 redis_stores_bytes=config.redis_stores_bytes, retention=config.retention())
        return node_store(settings, self.naming.fingerprint.digest)


def _node_id() -> str:
    import ray

    return ray.get_runtime_context().get_node_id()


def _prompt_gil_handoff() -> None:
    """A thread running Python holds the GIL until the interpreter's switch interval
    (5 ms by default) asks it to let go; a replica's event loop, which waits on
    sockets and other threads many times per request, gets it back within 0.5 ms."""
    sys.setswitchinterval(5e-4)


def _one_thread_executor() -> concurrent.futures.ThreadPoolExecutor:
    # The engine is not thread-safe: all model work of a replica runs on one thread,
    # off the event loop (requests in, tokens out).
    _prompt_gil_handoff()
    return concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")


def _engram_rows(engram, metrics):
    """The engine's ``engram_rows`` callable for a lookup the router started when the
    prompt arrived (None without one): the answers are dequantised as they arrive,
    off the engine thread, and awaited only right before the first Engram layer."""
    if engram is None:
        return None
    engram.prepare()

    def rows():
        start = time.perf_counter()
        try:
            return engram.rows()
        finally:
            metrics.engram_wait.observe(time.perf_counter() - start)

    return rows


def _prefilled(handoff, arrived: float, where: str, metrics):
    """Mark a handoff as prefilled ``where`` ("pool" | "decoder"), arrived at
    ``arrived`` and done now, and count its prefill time."""
    handoff.timeline.update(prefill_in=arrived, prefill_out=time.time())
    handoff.prefilled_by = where
    metrics.prefill.observe(handoff.prefill_s)
    return handoff


@serve.deployment(request_router_config=RequestRouterConfig(
    request_router_class="cluster.routing:PrefixAffinityRouter"))
class PrefillPool:
    """A prefill replica: the encoder half and the CED projection, and its node's store."""

    def __init__(self, config: AppConfig):
        from actors.prefill import PrefillService
        from actors.store import peer_store
        from cluster.metrics import PrefillMetrics

        bundle = ModelBundle(config, drop_decoder=True)
        self.service = PrefillService(bundle.engine, bundle.store(config), bundle.naming, _node_id(), peer_store)
        self.executor = _one_thread_executor()
        self.metrics = PrefillMetrics()

    def node(self) -> str:
        """The Ray node this replica runs on (placement checks, tests)."""
        return _node_id()

    async def prefill(self, plan, preferred_nodes: list[str] | None = None, engram=None):
        """``preferred_nodes`` is read by the request router (cache affinity)."""
        arrived = time.time()
        rows = _engram_rows(engram, self.metrics)
        handoff = await asyncio.get_running_loop().run_in_executor(self.executor, self.service.prefill, plan, rows)
        return _prefilled(handoff, arrived, "pool", self.metrics)


@serve.deployment(max_ongoing_requests=64)
class DecoderPool:
    """A decoder replica: the whole model, one continuous batch, streaming tokens out."""

    def __init__(self, config: AppConfig):
        from actors.decoder import DecoderService
        from actors.prefill import PrefillService
        from actors.store import peer_store
        from cluster.metrics import DecoderMetrics, PrefillMetrics

        bundle = ModelBundle(config)
        store = bundle.store(config)
        self.service = DecoderService(bundle.engine, store, bundle.naming, bundle.tokenizer,
                                      bundle.eos_ids, config.max_batch, speculation=bundle.speculation(config),
                                      peers=peer_store)
        # Short new prompts are encoded here (see Router._events): the same logic as a
        # prefill replica, on this replica's engine and store.
        self.prefiller = PrefillService(bundle.engine, store, bundle.naming, _node_id(), peer_store)
        self.executor = _one_thread_executor()
        self.metrics, self.prefill_metrics = DecoderMetrics(), PrefillMetrics()
        self.queues: dict[str, asyncio.Queue] = {}
        self.stepping: asyncio.Task | None = None

    async def generate(self, handoff, params, request_id: str):
        """Yields one dict per generated token; the first also carries ``cached_tokens``,
        ``prompt_tokens`` and ``replica_s`` (one stream item fewer per request)."""
        arrived = time.time()

        def admit():
            handoff.timeline["decode_in"] = arrived
            return handoff, self.service.admit(request_id, handoff, params)

        async for event in self._decode(request_id, admit):
            yield event

    async def prefill_and_generate(self, plan, params, request_id: str, engram=None):
        """:meth:`generate` for a prompt this replica encodes itself: no handoff to
        serialise, and the prefill and the first token in one trip to the engine thread."""
        arrived = time.time()
        rows = _engram_rows(engram, self.prefill_metrics)

        def encode_and_admit():
            handoff = _prefilled(self.prefiller.prefill(plan, rows, in_process=True), arrived, "decoder",
                                 self.prefill_metrics)
            handoff.timeline["decode_in"] = handoff.timeline["prefill_out"]
            return handoff, self.service.admit(request_id, handoff, params)

        async for event in self._decode(request_id, encode_and_admit):
            yield event

    async def _decode(self, request_id: str, admit):
        """Run ``admit`` (-> (handoff, first token)) on the engine thread, then stream
        the request's tokens from the batch."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        self.queues[request_id] = queue
        try:
            handoff, first = await loop.run_in_executor(self.executor, admit)
            timeline = {**handoff.timeline, "decode_out": time.time()}
            yield {"cached_tokens": handoff.cached_tokens, "prompt_tokens": len(handoff.token_ids),
                   "replica_s": handoff.prefill_s + self.service.last_admit_s, "timeline": timeline,
                   "prefilled_by": handoff.prefilled_by,
                   **dataclasses.asdict(first)}
            if first.finish_reason is not None:
                return
            if self.stepping is None or self.stepping.done():
                self.stepping = asyncio.create_task(self._step_loop())
            while True:
                event = await queue.get()
                if isinstance(event, BaseException):
                    raise event
                yield dataclasses.asdict(event)
                if event.finish_reason is not None:
                    return
        finally:
            self.queues.pop(request_id, None)
            if request_id in self.service.batcher.running:  # client gone: drop the request
                await loop.run_in_executor(self.executor, self.service.cancel, request_id)
            # Store finished conversations now that their tokens are out (same engine thread).
            loop.run_in_executor(self.executor, self.service.write_pending)

    async def _step_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while self.service.running:
            batch = self.service.running
            try:
                events = await loop.run_in_executor(self.executor, self.service.step)
            except Exception as error:  # a failed step fails every request in the batch
                for queue in self.queues.values():
                    queue.put_nowait(error)
                return
            self.metrics.step(batch, len(events), self.service.running, self.service.spec_metrics)
            for event in events:
                queue = self.queues.get(event.request_id)
                if queue is not None:
                    queue.put_nowait(event)

    def running(self) -> int:
        return self.service.running

    def node(self) -> str:
        return _node_id()


# A request's trip, mark to mark: (Server-Timing name, from, to).
_STAGES = (
    ("parse", "router_in", "rendered"),  # body, validation, chat template, tokens
    ("plan", "rendered", "planned"),  # the index lookup of the cache plan
    ("dispatch", "planned", "router_sent"),  # Engram lookup started, calls to the pools sent
    ("to_prefill", "router_sent", "prefill_in"),
    ("prefill", "prefill_in", "prefill_out"),  # store reads + encoder (+ executor queue)
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


fastapi_app = FastAPI(title="v41", docs_url=None, redoc_url=None)


@serve.deployment(max_ongoing_requests=256)
@serve.ingress(fastapi_app)
class Router:
    """The OpenAI-compatible ingress: tokenise, plan the cache, route, stream."""

    def __init__(self, config: AppConfig, prefill, decoder):
        from cluster.metrics import RouterMetrics
        from model.chat import ChatTemplate

        _prompt_gil_handoff()
        self.config = config
        # How each call travels. The prefill's answer goes to the decoder by reference:
        # the handoff moves between the replicas through the object store, not through
        # the router. A short prompt's call carries only the plan and goes by gRPC
        # (~3.5 ms less per request than a Ray actor call on two cores).
        self.prefill = prefill.options(_by_reference=True)
        self.decoder = decoder.options(stream=True, _by_reference=True)
        self.decoder_direct = decoder.options(stream=True, _by_reference=False)
        model = ModelIdentity(config)
        self.model_config, self.tokenizer = model.model_config, model.tokenizer
        # It remembers the ids of the long messages it tokenised, up to 4M tokens (~50 MB
        # with their texts): a returning turn re-renders its whole history.
        self.template = ChatTemplate(self.tokenizer, memo_tokens=4 << 20)
        self.naming = model.naming
        self.metrics = RouterMetrics()
        self.index = None
        if config.redis_url:
            from storage.index import RedisIndex
            from storage.redis_link import RedisLink

            link = RedisLink(config.redis_url, namespace="v41", timeout_s=0.5, retry_s=1.0)
            self.index = RedisIndex(link, key_ttl_s=config.chunk_retention_hours * 3600)
        # Recent answers' exact token ids by their text, so that the next turn of a
        # conversation re-renders them verbatim and its prefix stays cached.
        self.answers: OrderedDict[tuple, tuple[int, ...]] = OrderedDict()
        self.think_end = self.tokenizer.special.think_end
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
        if self.config.api_key is None:
            return
        header = request.headers.get("authorization", "")
        if header != f"Bearer {self.config.api_key}":
            raise api.ApiError(401, "invalid API key", kind="authentication_error", code="invalid_api_key")

    def _plan(self, tokens: list[int]):
        """Which leading chunks of the prompt are stored, where, and which window state
        after them the index knows of (one Redis round trip, two after a gap)."""
        from actors.state import CachePlan
        from storage.policy import TierName

        keys = self.naming.chunks(tokens)
        named = tuple(keys)
        if self.index is None:
            return CachePlan(tuple(tokens), len(keys), chunk_keys=named)  # one node: its store knows
        size = self.naming.chunk_tokens
        usable = max(0, min(len(keys), (len(tokens) - 1) // size))  # the prefill encodes the last token
        windows = self.naming.window_candidates(tokens[:-1], usable * size, named)
        now = time.time()
        located = self.index.locate(keys + [key for _, key in windows], now)
        if located is None:  # Redis away: nothing known, the prefill's store decides
            return CachePlan(tuple(tokens), 0, chunk_keys=named)
        found_windows = located[len(keys):]
        depth = 0
        while depth < len(keys) and located[depth]:
            depth += 1
        if depth < usable:  # a gap: the windows after the stored run instead
            windows = self.naming.window_candidates(tokens[:-1], depth * size, named)
            found_windows = self.index.locate([key for _, key in windows], now)
            if found_windows is None:
                return CachePlan(tuple(tokens), depth, chunk_keys=named)
        known = tuple((window, locations) for window, locations in zip(windows, found_windows) if locations)
        best = [known[0][1]] if known else []
        if depth:
            best.append(located[depth - 1])
        order = sorted((loc for locations in best for loc in locations),
                       key=lambda loc: (loc.tier is not TierName.RAM, loc.tier is not TierName.SSD))
        nodes = tuple(dict.fromkeys(loc.node_id for loc in order if loc.node_id != "*"))
        return CachePlan(tuple(tokens), depth, nodes, tuple(window for window, _ in known), named)

    def _render(self, request: api.GenerationRequest) -> list[int]:
        if request.prompt is not None:
            if isinstance(request.prompt, tuple):
                return list(request.prompt)
            return [self.tokenizer.special.bos] + self.tokenizer.encode(request.prompt)
        messages = []
        for message in request.messages:
            known = self.answers.get((message.reasoning, message.content)) if message.role == "assistant" else None
            messages.append(dataclasses.replace(message, token_ids=known) if known else message)
        try:
            return self.template.render(messages, thinking=request.thinking, effort=request.effort)
        except ValueError as error:
            raise api.ApiError(400, str(error), "messages") from None

    def _remember(self, reasoning: str | None, content: str, tokens: list[int]) -> None:
        self.answers[(reasoning, content)] = tuple(tokens)
        while len(self.answers) > 4096:
            self.answers.popitem(last=False)

    async def _events(self, request: api.GenerationRequest, tokens: list[int], rid: str, marks: dict[str, float]):
        if len(tokens) + request.params.max_tokens > self.config.max_model_len:
            raise api.ApiError(400, f"this request needs {len(tokens) + request.params.max_tokens} tokens; the "
                               f"context is {self.config.max_model_len}", "messages", code="context_length_exceeded")
        marks["rendered"] = time.time()
        plan = self._plan(tokens)
        marks["planned"] = time.time()
        lookup = None
        if self.engram is not None:  # start fetching the rows now: they arrive while layer 0 runs
            import torch

            lookup = self.engram.start(self.hasher.hash_ids(torch.tensor([tokens]))[0][0])
        if plan.cached_chunks == 0 and plan.windows == () and len(tokens) <= self.config.local_prefill_tokens:
            # Nothing stored and a short prompt: the decoder encodes it itself, sparing
            # two hops and a handoff (its batch waits about one step for it).
            # (An Engram lookup holds object refs: those travel by reference.)
            decoder = self.decoder_direct if lookup is None else self.decoder
            return decoder.prefill_and_generate.remote(plan, request.params, rid, engram=lookup)
        handoff = self.prefill.prefill.remote(plan, preferred_nodes=list(plan.nodes), engram=lookup)
        return self.decoder.generate.remote(handoff, request.params, rid)

    # ------------------------------------------------------------------ endpoints
    @fastapi_app.get("/health")
    async def health(self):
        return PlainTextResponse("ok")

    @fastapi_app.get("/v1/models")
    async def models(self, request: Request):
        try:
            self._authorize(request)
        except api.ApiError as error:
            return JSONResponse(error.body(), status_code=error.status)
        return {"object": "list", "data": [{"id": self.config.model_name, "object": "model", "created": 0,
                                            "owned_by": "v41"}]}

    @fastapi_app.post("/v1/chat/completions")
    async def chat(self, request: Request):
        return await self._serve(request, chat=True)

    @fastapi_app.post("/v1/completions")
    async def completions(self, request: Request):
        return await self._serve(request, chat=False)

    async def _serve(self, request: Request, chat: bool):
        endpoint, start, arrived = ("chat" if chat else "completions"), time.perf_counter(), time.time()
        try:
            self._authorize(request)
            data = api.parse_json(await request.body())
            if chat:
                parsed = api.parse_chat(data, self.config.model_name, self.config.max_tokens_default)
            else:
                parsed = api.parse_completion(data, self.config.model_name, self.config.max_tokens_default,
                                              self.model_config.text.vocab_size)
            tokens = self._render(parsed)
            rid = api.new_id("chatcmpl" if chat else "cmpl")
            marks = {"router_in": arrived}
            stream = await self._events(parsed, tokens, rid, marks)
            marks["router_sent"] = time.time()
        except api.ApiError as error:
            self.metrics.record(endpoint, str(error.status))
            return JSONResponse(error.body(), status_code=error.status)
        if parsed.stream:
            return StreamingResponse(self._sse(stream, parsed, rid, chat, start), media_type="text/event-stream")
        try:
            result = await self._collect(stream, parsed, start)
        except Exception as error:  # the decoder died or failed: a clear error, nothing cached
            self.metrics.record(endpoint, "503")
            body = api.ApiError(503, f"generation failed: {type(error).__name__}", kind="server_error").body()
            return JSONResponse(body, status_code=503)
        # Counted once the response is out (Ray metrics cost ~0.1 ms a request).
        counted = BackgroundTask(self._count, endpoint, "200", len(tokens), result["cached"],
                                 len(result["tokens"]), result["ttft"], time.perf_counter() - start)
        usage = api.usage(len(tokens), len(result["tokens"]), result["cached"])
        if chat:
            body = api.chat_response(rid, self.config.model_name, result["content"], result["reasoning"],
                                     result["finish"], usage)
        else:
            body = api.completion_response(rid, self.config.model_name, result["content"], result["finish"], usage)
        # Time the replicas spent computing the first token (prefill, replay, sample), and
        # where the rest of the request's time went (Server-Timing, milliseconds).
        marks.update(result["timeline"], router_out=time.time())
        return JSONResponse(body, background=counted,
                            headers={"x-v41-replica-ms": f"{1e3 * result['replica_s']:.3f}",
                                     "server-timing": server_timing(marks, result["replica_s"], result["prefilled_by"])})

    async def _count(self, *args) -> None:
        """``metrics.record`` as a coroutine: Starlette would run a plain function in a
        worker thread, one more thread for the event loop to share the GIL with."""
        self.metrics.record(*args)

    async def _collect(self, stream, request: api.GenerationRequest, start: float) -> dict:
        tokens, parts, reasoning_parts, cached, finish, replica_s = [], [], [], 0, "stop", 0.0
        in_thinking, ttft, timeline, prefilled_by = request.thinking, None, {}, ""
        async for event in stream:
            if "cached_tokens" in event:
                cached, replica_s, prefilled_by = event["cached_tokens"], event["replica_s"], event["prefilled_by"]
                timeline = {**event["timeline"], "first_token": time.time()}
                ttft = time.perf_counter() - start
            tokens.append(event["token_id"])
            if in_thinking and event["token_id"] == self.think_end:
                in_thinking = False
            elif in_thinking:
                reasoning_parts.append(event["text"])
            else:
                parts.append(event["text"])
            if event["finish_reason"]:
                finish = event["finish_reason"]
                break  # the request's last token: do not wait for the stream to close
        content = "".join(parts)
        reasoning = "".join(reasoning_parts) if request.thinking else None
        if request.messages:
            self._remember(reasoning, content, tokens)
        return {"tokens": tokens, "content": content, "reasoning": reasoning, "cached": cached, "finish": finish,
                "replica_s": replica_s, "ttft": ttft, "timeline": timeline, "prefilled_by": prefilled_by}

    async def _sse(self, stream, request: api.GenerationRequest, rid: str, chat: bool, start: float):
        model, prompt_tokens, cached, tokens, ttft = self.config.model_name, 0, 0, [], None
        endpoint = "chat" if chat else "completions"
        in_thinking = request.thinking
        parts, reasoning_parts = [], []
        try:
            if chat:
                yield api.sse(api.chat_chunk(rid, model, {"role": "assistant", "content": ""}, None))
            async for event in stream:
                if "cached_tokens" in event:
                    cached, prompt_tokens = event["cached_tokens"], event["prompt_tokens"]
                    ttft = time.perf_counter() - start
                tokens.append(event["token_id"])
                text = event["text"]
                if in_thinking and event["token_id"] == self.think_end:
                    in_thinking, text = False, ""
                    delta = None
                elif in_thinking:
                    reasoning_parts.append(text)
                    delta = {"reasoning_content": text}
                else:
                    parts.append(text)
                    delta = {"content": text}
                finish = event["finish_reason"]
                if chat:
                    if delta is not None and (text or finish):
                        yield api.sse(api.chat_chunk(rid, model, delta, finish))
                    elif finish:
                        yield api.sse(api.chat_chunk(rid, model, {}, finish))
                else:
                    yield api.sse(api.completion_chunk(rid, model, text, finish))
                if finish:
                    break  # the request's last token: do not wait for the stream to close
            if request.include_usage:
                usage = api.usage(prompt_tokens, len(tokens), cached)
                chunk = api.chat_chunk(rid, model, None, None, usage) if chat else \
                    api.completion_chunk(rid, model, None, None, usage)
                yield api.sse(chunk)
            if request.messages:
                self._remember("".join(reasoning_parts) if request.thinking else None, "".join(parts), tokens)
            self.metrics.record(endpoint, "200", prompt_tokens, cached, len(tokens), ttft, time.perf_counter() - start)
        except Exception as error:  # mid-stream failure: tell the client, end the stream
            self.metrics.record(endpoint, "503")
            yield api.sse(api.ApiError(503, f"generation failed: {type(error).__name__}", kind="server_error").body())
        yield api.sse("[DONE]")


def build_app(args: dict[str, Any] | None = None):
    """The application: ``serve run cluster.app:build_app key=value ...`` or a YAML's ``args``."""
    config = AppConfig.from_args(args)
    prefill = PrefillPool.options(
        num_replicas=config.prefill_replicas,
        ray_actor_options={"num_cpus": 1, "resources": dict(config.prefill_resources)},
    ).bind(config)
    decoder = DecoderPool.options(
        num_replicas=config.decoder_replicas,
        ray_actor_options={"num_cpus": 1, "resources": dict(config.decoder_resources)},
    ).bind(config)
    return Router.options(ray_actor_options={"num_cpus": 0}).bind(config, prefill, decoder)
