"""The application's configuration: the arguments of ``build_app``, validated.

One :class:`AppConfig` reaches the router and every replica; ``v41 serve``, the YAMLs in
``configs/`` (``args:``) and ``serve run cluster.app:build_app key=value`` all give it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

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
        from model.runtime.speculative import MODES

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
