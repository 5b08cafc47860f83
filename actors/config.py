"""The application's configuration: the arguments of ``build_app``, validated.

One :class:`AppConfig` reaches the router and every replica; ``v41 serve``, the YAMLs in
``configs/`` (``args:``) and ``serve run cluster.serving.app:build_app key=value`` all give it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from storage.slots import default_ssd_dir

PROJECT_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_MODEL = str(PROJECT_ROOT / "configs" / "small")


def resolve_model(path: str) -> Path:
    """A checkpoint path as given, or relative to the project root (Serve replicas do
    not run in the directory a YAML was deployed from)."""
    candidate = Path(path)
    if candidate.is_absolute() or (candidate / "config.json").exists():
        return candidate.resolve()
    return PROJECT_ROOT / candidate


PositiveInt = Annotated[int, Field(strict=True, ge=1)]
NonNegativeInt = Annotated[int, Field(strict=True, ge=0)]
PositiveFloat = Annotated[float, Field(gt=0)]


class ParallelConfig(BaseModel):
    """How one replica of a pool is split (model/parallel.py): ``experts`` workers share
    every MoE layer's routed experts (the replica's own process is the first; the others
    are Ray actors in a placement group it owns, one bundle of ``worker_resources``
    each: ``{"GPU": 1}`` on GPUs). ``tensor`` (the attention's heads split) is not
    built and must be 1."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    experts: PositiveInt = 1
    tensor: PositiveInt = 1
    worker_resources: dict[str, float] = Field(default_factory=lambda: {"CPU": 1.0})

    @field_validator("tensor")
    @classmethod
    def _tensor(cls, value: int) -> int:
        from model.parallel import ParallelSpec

        return ParallelSpec(tensor=value).tensor  # refuses what is not built, saying why


class AppConfig(BaseModel):
    """Validated arguments of the application (every field has a YAML key of the same name)."""

    model_config = ConfigDict(frozen=True, extra="forbid", protected_namespaces=())

    model: str = DEFAULT_MODEL
    model_name: str = "deepseek-v4.1-small"
    prefill_replicas: PositiveInt = 1
    decoder_replicas: PositiveInt = 1
    decoder_max_replicas: PositiveInt | None = None  # set: Serve autoscales the decoders up to this many
    prefill_resources: dict[str, float] = Field(default_factory=dict)  # Ray custom resources per replica
    decoder_resources: dict[str, float] = Field(default_factory=dict)
    # Where the router (which listens for HTTP itself) runs: the node clients call. None:
    # anywhere Ray places it; `v41 serve --address` pins it to its own node.
    router_resources: dict[str, float] = Field(default_factory=dict)
    max_batch: PositiveInt = 16
    # Requests beyond every decoder batch's places wait at the router, in arrival order;
    # beyond this many waiting, a request is answered 429 with Retry-After.
    max_queued_requests: PositiveInt = 256
    max_request_bytes: PositiveInt = 4 << 20  # a bigger body is answered 413 before it is read
    # The most tokens an answer may have (None: the room the context leaves). A request
    # that sets no length (chat, Responses) gets the room its prompt leaves, at most this;
    # one asking for more is a 400.
    max_answer_tokens: PositiveInt | None = None
    # Images (a model with a vision tower): per request at most this many, each at most
    # this many encoded bytes and decoded pixels, and all of them at most
    # max_request_image_pixels (a 1-bit PNG of a few KB decodes to 3 bytes a pixel);
    # file:// URLs only under image_dir.
    max_images_per_request: NonNegativeInt = 8
    max_image_bytes: PositiveInt = 8 << 20
    max_image_pixels: PositiveInt = 40_000_000
    max_request_image_pixels: PositiveInt = 40_000_000
    image_dir: str | None = None
    max_model_len: PositiveInt = 16384
    chunk_tokens: PositiveInt = 64
    # Both bounded replays exact: the decoder replays whole prompts, and a conversation
    # whose window state expired has its windows rebuilt exactly (one window of tokens
    # per layer rerun: 640 on configs/small, 5,120 on the release).
    exact_replay: bool = False
    # A conversation whose window state expired (Encoder SWA Bounded Replay): the encoder
    # reruns this many windows of its last tokens from empty windows. The seed reruns
    # one; on configs/small one drifts (greedy agreement 54.9% on held-out text) and
    # four agree (100%) for a rerun of 256 tokens: `v41 bench replay`, docs/engine.md.
    encoder_replay_windows: PositiveInt = 4
    # Each layer's per-token work compiled (AOTInductor; model/runtime/compiled.py) in
    # every one-process replica: decode steps x3-4 faster at batch 1, and the prefill
    # pool encodes in 128-token chunks through the same functions (x1.1-1.25). Its
    # packages are built on a host's first start (~2.5 min on configs/small; `v41 serve`
    # builds them before the app starts, saying so) and kept in ~/.cache/v41/aot for the
    # next (a few s). None (the default): compiled where it can run (a C++ compiler on
    # the host; a pool whose experts are split over workers runs eager), eager where not,
    # saying why; True: the same, and an error with split decoder experts; False: eager.
    compiled_step: bool | None = None
    # Each replica's engine thread keeps to a CPU no other engine thread of this user on
    # the host holds (actors/engine_cpu.py): left free, the kernel wakes it on another
    # CPU after each wait, caches cold (16 streams on 2 cores: 0.75 of the engine's own
    # rate free, 0.80-0.95 kept). False leaves it free.
    pin_engine_thread: bool = True
    decoder_parallel: ParallelConfig = ParallelConfig()
    prefill_parallel: ParallelConfig = ParallelConfig()
    redis_url: str | None = None
    redis_stores_bytes: bool = False
    # The user's own cache folder ($XDG_CACHE_HOME/v41/v41-slots/{node}, else ~/.cache/...),
    # resolved where the config is built; never a shared /tmp path (storage/slots.py).
    ssd_dir: str | None = Field(default_factory=default_ssd_dir)
    ram_capacity_bytes: NonNegativeInt | None = None
    window_ttl_minutes: float = 30.0
    chunk_retention_hours: float = 72.0
    persist_window_states: bool = False
    # POST /v1/responses keeps each response (and its input) in the node's store for
    # previous_response_id and GET/DELETE /v1/responses/{id} (OpenAI's default is
    # store: true); false refuses store: true. Kept this long after the last use, on SSD.
    store_responses: bool = True
    response_retention_hours: PositiveFloat = 72.0
    api_key: str | None = None  # prefer api_key_file: a key here is in the YAML and the Serve config
    api_key_file: str | None = None  # a file holding the key (read by the router when it starts)
    # Many customers on one deployment (cluster/serving/tenants.py): a YAML/JSON file mapping
    # API keys to tenants, each with its own cache namespace, stored records and share of
    # the router's places; read again when it changes. Excludes api_key and api_key_file.
    api_keys_file: str | None = None
    # The cluster's secret (a file of at least 16 bytes that every node holds, 0600): it
    # keys every stored object's MAC (storage/codec.py) and the tenants' cache salts.
    # None: the MAC is keyed by the model's fingerprint (a checksum), and the router makes
    # the salts' secret once in the user's v41 cache folder. `v41 serve` names one.
    cache_secret_file: str | None = None
    # The leading tokens of a prompt that tenants with share_prefixes name in the
    # deployment's shared namespace (a system prompt every tenant sends hits for all).
    shared_prefix_tokens: NonNegativeInt = 0
    # With a keys file, the debugging headers (x-v41-*, Server-Timing) go to every tenant,
    # not only to those whose entry says debug_headers (without one they always do).
    debug_headers: bool = False
    threads: PositiveInt = 1
    engram_shards: NonNegativeInt = 0  # 0: Engram rows from in-process tables; N: a sharded table service
    engram_replicas: PositiveInt = 1
    engram_resource: str = "engram_host"
    engram_cpus: float = 1.0
    # DSpark speculative decoding in the decoder pool when the checkpoint has a drafter:
    # "scheduled" (Algorithm 1 on a step-cost table profiled when a replica starts),
    # "fixed" (speculation_k guesses per request and step) or "off".
    speculation: Literal["off", "fixed", "scheduled"] = "scheduled"
    speculation_k: NonNegativeInt = 3
    # Which replica of a pool takes a request: "affinity" (where its cache is, RAM first;
    # cluster/serving/routing.py), "pow2" (Serve's default) or "round_robin": the last two for
    # comparison (`v41 bench agents`).
    routing: Literal["affinity", "pow2", "round_robin"] = "affinity"
    # A prompt with nothing stored and at most this many tokens is encoded by the
    # decoder replica itself instead of the prefill pool (0: always the pool).
    local_prefill_tokens: NonNegativeInt = 128
    # Memory each decoder replica gives to the finished conversations it keeps for their
    # next turn (actors/resident.py; 0: none kept, every returning turn reads the store).
    resident_mb: NonNegativeInt = 1024
    # A returning turn whose conversation a decoder replica keeps goes to that replica,
    # which encodes it from that cache, when it adds at most this many tokens; a longer
    # addition goes through the prefill pool (encoded there, it does not hold up the
    # decoder's batch). 0: never.
    resume_tokens: NonNegativeInt = 1024

    @field_validator("model")
    @classmethod
    def _checkpoint(cls, value: str) -> str:
        path = resolve_model(value)
        if not (path / "config.json").exists():
            raise ValueError(f"no checkpoint at {str(path)!r} (config.json missing)")
        return str(path)

    @classmethod
    def from_args(cls, args: dict[str, Any] | None) -> "AppConfig":
        """Validate ``args``; a mistake is a ValueError of one line naming each argument."""
        try:
            return cls.model_validate(dict(args or {}))
        except ValidationError as error:
            raise ValueError("; ".join(_describe(e) for e in error.errors())) from None

    @model_validator(mode="after")
    def _one_key(self) -> "AppConfig":
        if sum(key is not None for key in (self.api_key, self.api_key_file, self.api_keys_file)) > 1:
            raise ValueError("give one of api_key, api_key_file and api_keys_file")
        if self.compiled_step is True and self.decoder_parallel.experts > 1:
            raise ValueError("compiled_step runs every expert in the decoder's process: "
                             "it cannot be combined with decoder_parallel experts > 1")
        split = {pool: getattr(self, f"{pool}_parallel").experts for pool in ("decoder", "prefill")}
        routed = self.routed_experts() if max(split.values()) > 1 else 1
        for pool, experts in split.items():
            if routed % experts:
                raise ValueError(f"{pool}_parallel.experts={experts} does not divide the model's "
                                 f"{routed} routed experts")
        if self.decoder_max_replicas is not None and self.decoder_max_replicas < self.decoder_replicas:
            raise ValueError(f"decoder_max_replicas ({self.decoder_max_replicas}) is below decoder_replicas "
                             f"({self.decoder_replicas})")
        return self

    def compiles(self, parallel: ParallelConfig) -> bool:
        """Whether a pool with ``parallel`` runs the compiled step on a host that can build
        it: not with ``compiled_step`` False, nor with its experts split over workers
        (their MoE runs in other processes, eager)."""
        return self.compiled_step is not False and parallel.experts == 1

    def replica_places(self) -> int:
        """Requests a decoder replica takes at once: its batch and a few more (they wait in
        it for a place, and the prefetches get through)."""
        return self.max_batch + max(4, self.max_batch // 4)

    def places(self) -> int:
        """Generation requests the app holds at once before its queue's 429: every decoder
        replica's places (at the most replicas) and the router's queue."""
        return (self.decoder_max_replicas or self.decoder_replicas) * self.replica_places() + self.max_queued_requests

    def routed_experts(self) -> int:
        import json

        raw = json.loads((Path(self.model) / "config.json").read_text())
        return int(raw.get("text_config", raw)["n_routed_experts"])

    def resolved_api_key(self) -> str | None:
        """The API key clients must send (None: no key), read from ``api_key_file`` if set."""
        if self.api_key_file is None:
            return self.api_key
        key = Path(self.api_key_file).read_text().strip()
        if not key:
            raise ValueError(f"api_key_file {self.api_key_file} is empty")
        return key

    def retention(self):
        from storage.policy import RetentionPolicy

        extra = {} if self.ram_capacity_bytes is None else {"ram_capacity_bytes": self.ram_capacity_bytes}
        return RetentionPolicy(chunk_retention_hours=self.chunk_retention_hours,
                               window_ttl_minutes=self.window_ttl_minutes,
                               persist_window_states=self.persist_window_states,
                               response_retention_hours=self.response_retention_hours, **extra)

    def store_settings(self):
        """What every node's store actor is opened with (actors/store.py)."""
        from actors.store import StoreSettings

        return StoreSettings(ssd_dir=self.ssd_dir, redis_url=self.redis_url,
                             redis_stores_bytes=self.redis_stores_bytes, retention=self.retention(),
                             secret_file=self.cache_secret_file)


def _describe(error: dict) -> str:
    name = ".".join(str(part) for part in error["loc"]) or "arguments"
    if error["type"] == "extra_forbidden":
        return f"unknown application argument {name!r}"
    if error["type"] == "literal_error":
        return f"{name} must be one of {error['ctx']['expected'].replace(chr(39), '')}, got {error['input']!r}"
    message = error["msg"].removeprefix("Value error, ")
    if not error["loc"]:  # a rule over several arguments: the input is all of them (an API key too)
        return message
    return f"{name}: {message} (got {error['input']!r})"
