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
        config = cls(**_known_keys(cls, raw, "text_config"))
        return config._with_derived_defaults()._validated()

    def to_dict(self) -> dict[str, Any]:
        """The mapping :meth:`from_dict` reads back (lists, not tuples)."""
        return {f.name: _thaw(getattr(self, f.name)) for f in dataclasses.fields(self)}

    # The released schedule: what the release fills in when a config leaves these keys out.
    _RELEASED_RATIOS = (0, 0) + (2,) * 18 + (1,) * 20
    _RELEASED_KV_SOURCES = (2, 8, 14, 20)
    _RELEASED_INDEX_SOURCES = (2, 8, 14, 20, 24, 28, 32, 36)

    def _with_derived_defaults(self) -> "TextConfig":
        """Fill the list-valued keys the way the release does when they are absent."""
        n, n_draft = self.num_hidden_layers, self.num_nextn_predict_layers
        updates: dict[str, Any] = {}
        ratios = self.compress_ratios
        if ratios is None:
            if n == len(self._RELEASED_RATIOS):
                ratios = self._RELEASED_RATIOS
            else:  # the released pattern scaled to n layers
                n_slide = min(2, n)
                n_enc = max(0, (n - n_slide + 1) // 2)
                ratios = (0,) * n_slide + (2,) * n_enc + (1,) * max(0, n - n_slide - n_enc)
        if len(ratios) < n:
            raise ConfigError(f"compress_ratios has {len(ratios)} entries for {n} layers")
        if len(ratios) > n + n_draft:
            raise ConfigError(f"compress_ratios has {len(ratios)} entries for {n} layers + {n_draft} draft layers")
        # The release lists the DSpark layers' ratios (always 0) after the backbone's.
        backbone = updates["compress_ratios"] = tuple(ratios[:n])
        kv_sources = self.kv_source_layer_ids
        if kv_sources is None:
            if backbone == self._RELEASED_RATIOS[:n]:
                kv_sources = self._RELEASED_KV_SOURCES
            else:  # the first layer of each run of equal ratios publishes for the run
                kv_sources = tuple(i for i in range(n)
                                   if backbone[i] > 0 and (i == 0 or backbone[i - 1] != backbone[i]))
        updates["kv_source_layer_ids"] = tuple(kv_sources)
        if self.index_source_layer_ids is None:
            released = tuple(kv_sources) == self._RELEASED_KV_SOURCES
            updates["index_source_layer_ids"] = self._RELEASED_INDEX_SOURCES if released else tuple(kv_sources)
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
        """The release's checks, and the few layer plans it runs but cannot mean.

        Each error names the key to change. Rejected beyond the release's own checks,
        because the release computes something inconsistent for them: a KV source that
        runs no indexer (its layers would use another group's picks), a layer whose
        compress ratio differs from its KV source's (its visibility rule would let it
        read an entry before the entry's last token), an index source after the
        candidate source that reads another KV group (the candidate pool indexes the
        candidate source's entries).
        """
        n = self.num_hidden_layers
        ratios = self.compress_ratios
        kv, ix = self.kv_source_layer_ids, self.index_source_layer_ids
        for name, ids in (("kv_source_layer_ids", kv), ("index_source_layer_ids", ix)):
            bad = [i for i in ids if not 0 <= i < n or ratios[i] == 0]
            if bad:
                raise ConfigError(f"{name} {list(bad)} must be layers with compress_ratios > 0")
        missing = [i for i in kv if i not in ix]
        if missing:
            raise ConfigError(f"kv_source_layer_ids {missing} must also be in index_source_layer_ids "
                              "(a KV source publishes the indexer keys its group scores)")
        for i in range(n):
            if ratios[i] and not any(s <= i for s in kv):
                raise ConfigError(f"compress_ratios: layer {i} has a compressed branch but no "
                                  "kv_source_layer_ids entry at or before it")
        plans = self.layer_plans()
        for plan in plans:
            source = plan.kv_source
            if source is not None and ratios[source] != plan.compress_ratio:
                raise ConfigError(f"compress_ratios: layer {plan.index} has ratio {plan.compress_ratio} but reads the "
                                  f"entries of KV source {source} (ratio {ratios[source]}); a layer's ratio must be "
                                  "its source's")
        cand = self.candidate_source_layer_id
        if cand >= 0:
            if cand not in ix:
                raise ConfigError(f"candidate_source_layer_id {cand} must be in index_source_layer_ids")
            strangers = [i for i in ix if i > cand and plans[i].kv_source != plans[cand].kv_source]
            if strangers:
                raise ConfigError(f"candidate_source_layer_id {cand}: later index sources {strangers} read another "
                                  "KV group than the candidate pool's")
        if len(self.engram_num_embeddings) != len(self.engram_layer_ids):
            raise ConfigError("engram_num_embeddings must have one entry per engram_layer_ids entry")
        bad_engram = [i for i in self.engram_layer_ids if not 0 <= i < n]
        if bad_engram or len(set(self.engram_layer_ids)) != len(self.engram_layer_ids):
            raise ConfigError(f"engram_layer_ids {list(self.engram_layer_ids)} must be distinct layers in [0, {n})")
        if self.num_attention_heads * self.head_dim % self.o_groups:
            raise ConfigError("o_groups must divide num_attention_heads * head_dim")
        if self.qk_rope_head_dim % 2 or self.qk_rope_head_dim > min(self.head_dim, self.index_head_dim):
            raise ConfigError("qk_rope_head_dim must be even and fit in head_dim and index_head_dim")
        if not isinstance(self.swiglu_limit, (int, float)) or isinstance(self.swiglu_limit, bool):
            raise ConfigError(f"swiglu_limit must be a number (0 turns the clamp off), got {self.swiglu_limit!r}")
        if self.sliding_window < 1:
            raise ConfigError(f"sliding_window must be at least 1, got {self.sliding_window}")
        if self.num_nextn_predict_layers:
            bad = [i for i in self.dspark_target_layer_ids if not 0 <= i < n]
            if not self.dspark_target_layer_ids or bad:
                raise ConfigError(f"dspark_target_layer_ids {list(self.dspark_target_layer_ids)} must name layers in "
                                  f"[0, {n}) for the {self.num_nextn_predict_layers} DSpark layers (the default takes "
                                  "the last three layers that are not KV sources)")
        if self.scoring_func not in ("sqrtsoftplus", "softmax", "sigmoid"):
            raise ConfigError(f"unsupported scoring_func {self.scoring_func!r}")
        if self.hidden_act != "silu":
            raise ConfigError(f"unsupported hidden_act {self.hidden_act!r}")
        return self

    # ------------------------------------------------------------------ derived
    @property
    def eos_ids(self) -> tuple[int, ...]:
        """``eos_token_id`` as a tuple of ids (none, one or several)."""
        eos = self.eos_token_id
        return tuple(eos) if isinstance(eos, tuple) else (() if eos is None else (eos,))

    @property
    def candidate_pool(self) -> int:
        """Entries in a whole candidate pool: ``candidate_topk_blocks`` blocks of
        ``candidate_block_size``."""
        return self.candidate_topk_blocks * self.candidate_block_size

    @property
    def decoder_start(self) -> int:
        """First layer of the CED decoder half, the layers the decoder pool replays over a
        prompt's tail.

        The decoder half holds the ratio-1 layers, and starts at the last KV source: that
        layer's long-range entries are the CED projection of everything before it, which
        the prefill computes for every token (layer 20 of the release, its first ratio-1
        layer). A ratio-1 KV source after the first one makes the layers before it part of
        the prefill, since a replay over the tail could not build its entries. Without
        ratio-1 layers there is no decoder half.
        """
        n = self.num_hidden_layers
        if 1 not in self.compress_ratios:
            return n
        return max(self.kv_source_layer_ids)

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
        return cls(**_known_keys(cls, raw, "vision_config"))


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

    def with_window(self, sliding_window: int) -> "ModelConfig":
        """This model with another sliding window. No weight's shape depends on it, so a
        checkpoint pretrained at 64 tokens can be fine-tuned at the release's 128."""
        text = dataclasses.replace(self.text, sliding_window=sliding_window)._validated()
        return dataclasses.replace(self, text=text)


def _known_keys(cls, raw: dict[str, Any], section: str) -> dict[str, Any]:
    """The fields of dataclass ``cls`` in ``raw`` (lists frozen to tuples); a key it does
    not know, metadata aside, is an error naming the ``section``."""
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - names - _METADATA_KEYS)
    if unknown:
        raise ConfigError(f"unknown {section} keys: {', '.join(unknown)}")
    return {k: _freeze(v) for k, v in raw.items() if k in names}


def _freeze(value: Any) -> Any:
    return tuple(_freeze(v) for v in value) if isinstance(value, list) else value


def _thaw(value: Any) -> Any:
    return [_thaw(v) for v in value] if isinstance(value, tuple) else value
