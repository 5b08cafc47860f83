"""Model configuration: frozen dataclasses read straight from a released `config.json`.

The released checkpoint's `config.json` is composite (``text_config``,
``vision_config``, ``quantization_config``); the tiny golden checkpoint's is the flat
text config as Hugging Face's ``save_pretrained`` writes it. Both load. A key this
module does not know is an error: a silently ignored key is how a port drifts from
the model it claims to be.

Everything structural (which layers keep a long-range cache, which run an indexer,
where the decoder half starts) is derived here into a per-layer :class:`LayerPlan`;
no other module decides behaviour from layer numbers or widths.
"""

from __future__ import annotations

import dataclasses
import enum
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """The configuration is malformed, inconsistent, or has unknown keys."""


# Keys that describe the file rather than the model (written by tooling).
_METADATA_KEYS = frozenset(
    {"architectures", "model_type", "dtype", "torch_dtype", "transformers_version", "_name_or_path", "auto_map"}
)


class AttentionMode(enum.Enum):
    """How a layer reads long-range memory (the seed's CSA2 layer modes)."""

    WINDOW = "window"  # sliding window only, no long-range memory
    FULL = "full"  # builds its own long-range cache and indexer keys, runs its indexer
    REINDEX = "reindex"  # borrows cache + indexer keys, runs its own indexer query
    REUSE = "reuse"  # borrows cache and the last indexer's picks


@dataclass(frozen=True)
class LayerPlan:
    """What one backbone layer does, derived from the config.

    ``kv_source`` is the layer whose compressed cache (and indexer keys) this layer
    reads; ``index_source`` the layer whose top-k picks it uses (itself for FULL and
    REINDEX); ``candidate_source`` the layer whose candidate-block pool constrains
    this layer's indexer (only for index layers after the candidate source).
    """

    index: int
    half: str  # "encoder" or "decoder"
    compress_ratio: int
    mode: AttentionMode
    kv_source: int | None
    index_source: int | None
    candidate_source: int | None
    is_candidate_source: bool
    has_engram: bool

    @property
    def rope(self) -> str:
        """Layers with a compressed branch rotate everything with the compress rope."""
        return "compress" if self.compress_ratio else "main"

    @property
    def is_kv_source(self) -> bool:
        return self.mode is AttentionMode.FULL

    @property
    def runs_indexer(self) -> bool:
        return self.mode in (AttentionMode.FULL, AttentionMode.REINDEX)


@dataclass(frozen=True)
class RopeSpec:
    """One rotary embedding: base, rotated width, optional YaRN scaling."""

    theta: float
    rope_type: str  # "default" or "yarn"
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float = 1.0
    truncate: bool = True


@dataclass(frozen=True)
class TextConfig:
    """The ``text_config`` of a V4.1 checkpoint, with the released key names.

    Defaults are those of DeepSeek-V4.1-Flash; list-valued keys default to ``None``
    in the file and are filled by :func:`TextConfig.from_dict` exactly as the
    release does.
    """

    vocab_size: int = 129280
    hidden_size: int = 5120
    num_hidden_layers: int = 40
    num_attention_heads: int = 64
    num_key_value_heads: int = 1
    head_dim: int = 512
    q_lora_rank: int = 1280
    qk_rope_head_dim: int = 64
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    rope_parameters: dict | None = None
    rope_scaling: dict | None = None
    max_position_embeddings: int = 1048576
    attention_bias: bool = False
    attention_dropout: float = 0.0
    sliding_window: int = 128
    compress_ratios: tuple[int, ...] | None = None
    kv_source_layer_ids: tuple[int, ...] | None = None
    index_source_layer_ids: tuple[int, ...] | None = None
    candidate_source_layer_id: int | None = None
    candidate_topk_blocks: int = 2048
    candidate_block_size: int = 8
    index_n_heads: int = 32
    index_head_dim: int = 128
    index_topk: int = 512
    o_groups: int = 8
    o_lora_rank: int = 1024
    moe_intermediate_size: int = 2304
    n_routed_experts: int = 384
    n_shared_experts: int = 1
    num_experts_per_tok: int = 6
    scoring_func: str = "sqrtsoftplus"
    gate_temp: float = 1.0
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.5
    topk_method: str = "noaux_tc"
    swiglu_limit: float = 10.0
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    engram_layer_ids: tuple[int, ...] = ()
    engram_vocab_size: int = 16000000
    engram_num_embeddings: tuple[int, ...] = ()
    engram_max_ngram_size: int = 4
    engram_n_heads: int = 8
    engram_head_dim: int = 256
    engram_pad_id: int = 2
    engram_compressed_vocab_size: int = 99092
    num_nextn_predict_layers: int = 3
    dspark_block_size: int = 5
    dspark_noise_token_id: int = 128799
    dspark_target_layer_ids: tuple[int, ...] | None = None
    dspark_markov_rank: int = 256
    dspark_n_routed_experts: int = 128
    dspark_num_experts_per_tok: int = 3
    hidden_act: str = "silu"
    initializer_range: float = 0.02
    rms_norm_eps: float = 1e-20
    use_cache: bool = True
    tie_word_embeddings: bool = False
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = 1
    output_router_logits: bool = False
    router_aux_loss_coef: float = 0.001
    router_jitter_noise: float = 0.0
    layer_types: tuple[str, ...] | None = None

    # ------------------------------------------------------------------ loading
    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "TextConfig":
        """Build and validate from a ``text_config`` mapping (unknown keys: error)."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(raw) - names - _METADATA_KEYS)
        if unknown:
            raise ConfigError(f"unknown text_config keys: {', '.join(unknown)}")
        values = {k: _freeze(v) for k, v in raw.items() if k in names}
        config = cls(**values)
        return config._with_derived_defaults()._validated()

    def to_dict(self) -> dict[str, Any]:
        """The mapping :meth:`from_dict` reads back (lists, not tuples)."""
        return {f.name: _thaw(getattr(self, f.name)) for f in dataclasses.fields(self)}

    def _with_derived_defaults(self) -> "TextConfig":
        """Fill the list-valued keys the way the release does when they are absent."""
        n = self.num_hidden_layers
        updates: dict[str, Any] = {}
        ratios = self.compress_ratios
        if ratios is None:
            n_slide = min(2, n)
            n_enc = max(0, (n - n_slide + 1) // 2)
            ratios = (0,) * n_slide + (2,) * n_enc + (1,) * max(0, n - n_slide - n_enc)
        if len(ratios) < n:
            raise ConfigError(f"compress_ratios has {len(ratios)} entries for {n} layers")
        # The release lists the DSpark layers' ratios (always 0) after the backbone's.
        updates["compress_ratios"] = tuple(ratios[:n])
        kv_sources = self.kv_source_layer_ids
        if kv_sources is None:
            b = updates["compress_ratios"]
            kv_sources = tuple(i for i in range(n) if b[i] > 0 and (i == 0 or b[i - 1] != b[i]))
        updates["kv_source_layer_ids"] = tuple(kv_sources)
        if self.index_source_layer_ids is None:
            updates["index_source_layer_ids"] = tuple(kv_sources)
        if self.candidate_source_layer_id is None:
            updates["candidate_source_layer_id"] = kv_sources[-1] if kv_sources else -1
        if self.dspark_target_layer_ids is None:
            updates["dspark_target_layer_ids"] = tuple(sorted(i for i in range(n) if i not in kv_sources)[-3:])
        if not self.engram_num_embeddings and self.engram_layer_ids:
            updates["engram_num_embeddings"] = (0,) * len(self.engram_layer_ids)
        updates["layer_types"] = tuple(
            "shared_compressed_attention" if i in kv_sources else "sliding_attention" for i in range(n)
        )
        return dataclasses.replace(self, **updates)

    def _validated(self) -> "TextConfig":
        n = self.num_hidden_layers
        ratios = self.compress_ratios
        kv, ix = self.kv_source_layer_ids, self.index_source_layer_ids
        for name, ids in (("kv_source_layer_ids", kv), ("index_source_layer_ids", ix)):
            bad = [i for i in ids if not 0 <= i < n or ratios[i] == 0]
            if bad:
                raise ConfigError(f"{name} {list(bad)} must be layers with compress_ratios > 0")
        missing = [i for i in kv if i not in ix]
        if missing:
            raise ConfigError(f"KV-source layers {missing} must also be index sources (they publish indexer keys)")
        for i in range(n):
            if ratios[i] and not any(s <= i for s in kv):
                raise ConfigError(f"layer {i} has a compressed branch but no KV source at or before it")
        if self.candidate_source_layer_id >= 0 and self.candidate_source_layer_id not in ix:
            raise ConfigError("candidate_source_layer_id must be an index source")
        if len(self.engram_num_embeddings) != len(self.engram_layer_ids):
            raise ConfigError("engram_num_embeddings must have one entry per engram layer")
        if self.num_attention_heads * self.head_dim % self.o_groups:
            raise ConfigError("num_attention_heads * head_dim must divide into o_groups")
        if self.qk_rope_head_dim % 2 or self.qk_rope_head_dim > min(self.head_dim, self.index_head_dim):
            raise ConfigError("qk_rope_head_dim must be even and fit in the attention and indexer heads")
        if self.scoring_func not in ("sqrtsoftplus", "softmax", "sigmoid"):
            raise ConfigError(f"unsupported scoring_func {self.scoring_func!r}")
        if self.hidden_act != "silu":
            raise ConfigError(f"unsupported hidden_act {self.hidden_act!r}")
        return self

    # ------------------------------------------------------------------ derived
    @property
    def decoder_start(self) -> int:
        """First layer of the CED decoder half: the first ratio-1 layer (else none)."""
        return next((i for i, r in enumerate(self.compress_ratios) if r == 1), self.num_hidden_layers)

    @property
    def pooling_ratio(self) -> int:
        """The encoder's pooling ratio (largest compress ratio, 1 if none pool)."""
        return max([r for r in self.compress_ratios if r] or [1])

    def layer_plans(self) -> tuple[LayerPlan, ...]:
        """The per-layer plan of the backbone, derived from the config."""
        plans = []
        kv, ix, cand = self.kv_source_layer_ids, self.index_source_layer_ids, self.candidate_source_layer_id
        for i, ratio in enumerate(self.compress_ratios):
            if ratio == 0:
                mode, kv_src, ix_src = AttentionMode.WINDOW, None, None
            else:
                kv_src = max(s for s in kv if s <= i)
                earlier = [s for s in ix if s <= i]
                ix_src = max(earlier) if earlier else None
                mode = (
                    AttentionMode.FULL
                    if i in kv
                    else AttentionMode.REINDEX
                    if i in ix
                    else AttentionMode.REUSE
                )
                if ix_src is None or ix_src < kv_src:
                    raise ConfigError(f"layer {i} reuses picks from outside its KV group")
            plans.append(
                LayerPlan(
                    index=i,
                    half="decoder" if i >= self.decoder_start else "encoder",
                    compress_ratio=ratio,
                    mode=mode,
                    kv_source=kv_src,
                    index_source=ix_src,
                    candidate_source=cand if (0 <= cand < i and mode is AttentionMode.REINDEX) else None,
                    is_candidate_source=(i == cand),
                    has_engram=i in self.engram_layer_ids,
                )
            )
        return tuple(plans)

    def rope_spec(self, kind: str) -> RopeSpec:
        """The ``main`` (window-only layers) or ``compress`` rotary embedding."""
        params = self.rope_parameters or {}
        if isinstance(params.get(kind), dict):
            p = dict(params[kind])
        elif kind == "main":
            p = {"rope_type": "default", "rope_theta": self.rope_theta}
        else:
            p = {k: v for k, v in (self.rope_scaling or {}).items()}
            p["rope_theta"] = self.compress_rope_theta
            p.setdefault("rope_type", "default")
        rope_type = p.get("rope_type", p.get("type", "default"))
        if rope_type not in ("default", "yarn"):
            raise ConfigError(f"unsupported rope_type {rope_type!r}")
        partial = p.get("partial_rotary_factor", self.qk_rope_head_dim / self.head_dim)
        if int(self.head_dim * partial) != self.qk_rope_head_dim:
            raise ConfigError("partial_rotary_factor disagrees with qk_rope_head_dim")
        if rope_type == "default":
            return RopeSpec(theta=float(p["rope_theta"]), rope_type="default")
        original = p.get("original_max_position_embeddings")
        factor = p.get("factor") or self.max_position_embeddings / original
        return RopeSpec(
            theta=float(p["rope_theta"]),
            rope_type="yarn",
            factor=float(factor),
            original_max_position_embeddings=int(original),
            beta_fast=float(p.get("beta_fast") or 32),
            beta_slow=float(p.get("beta_slow") or 1),
            attention_factor=float(p.get("attention_factor", 1.0)),
            truncate=bool(p.get("truncate", True)),
        )


@dataclass(frozen=True)
class VisionConfig:
    """The ``vision_config`` of the release (DeepSeek-ViT with 2D RoPE)."""

    hidden_size: int = 1024
    intermediate_size: int = 2816
    num_hidden_layers: int = 32
    num_attention_heads: int = 16
    patch_size: int = 14
    downsample_ratio: int = 3
    rope_theta: float = 10000.0
    max_image_tokens: int = 1024
    min_pixels: int = 295936
    max_wh_ratio: int | None = None
    rms_norm_eps: float = 1e-6
    num_channels: int = 3

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "VisionConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(raw) - names - _METADATA_KEYS)
        if unknown:
            raise ConfigError(f"unknown vision_config keys: {', '.join(unknown)}")
        return cls(**{k: _freeze(v) for k, v in raw.items() if k in names})


@dataclass(frozen=True)
class ModelConfig:
    """A whole checkpoint's configuration: text backbone, vision tower, quantization.

    ``quantization`` is kept as the released mapping (the loader interprets it).
    """

    text: TextConfig
    vision: VisionConfig | None = None
    quantization: dict | None = None
    image_token_id: int | None = None
    extra: dict = field(default_factory=dict)  # top-level metadata (architectures, ...)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "ModelConfig":
        """Accept the composite released form and the flat text form."""
        if "text_config" in raw:
            allowed = {
                "text_config", "vision_config", "quantization_config", "image_token_id",
                "tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id",
            }
            unknown = sorted(set(raw) - allowed - _METADATA_KEYS)
            if unknown:
                raise ConfigError(f"unknown top-level config keys: {', '.join(unknown)}")
            vision = raw.get("vision_config")
            return cls(
                text=TextConfig.from_dict(raw["text_config"]),
                vision=VisionConfig.from_dict(vision) if vision is not None else None,
                quantization=raw.get("quantization_config"),
                image_token_id=raw.get("image_token_id"),
                extra={k: raw[k] for k in raw if k not in ("text_config", "vision_config", "quantization_config", "image_token_id")},
            )
        text = {k: v for k, v in raw.items() if k != "quantization_config"}
        return cls(
            text=TextConfig.from_dict(text),
            quantization=raw.get("quantization_config"),
            extra={k: raw[k] for k in raw if k in _METADATA_KEYS},
        )

    @classmethod
    def load(cls, path: str | Path) -> "ModelConfig":
        """Read ``config.json`` from a checkpoint directory or a file path."""
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"no config.json at {path}") from None
        except json.JSONDecodeError as error:
            raise ConfigError(f"{path} is not valid JSON: {error}") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{path} must hold a JSON object")
        return cls.from_dict(raw)


def _freeze(value: Any) -> Any:
    return tuple(_freeze(v) for v in value) if isinstance(value, list) else value


def _thaw(value: Any) -> Any:
    return [_thaw(v) for v in value] if isinstance(value, tuple) else value
