"""Checkpoint I/O in the released Hugging Face layout.

A checkpoint directory holds ``config.json`` and either ``model.safetensors`` or
``model.safetensors.index.json`` plus shards. Tensor names are the released ones
(``model.layers.N.attn.wq_a.weight``, ``lm_head.weight``, ...). Quantised tensors
are dequantised on load:

- dense FP8 matrices: ``X.weight`` (F8_E4M3) with ``X.scale`` (UE8M0 per 32x32 tile);
- routed experts: ``X.weight`` (two FP4 codes per byte) with ``X.scale`` (UE8M0 per 32);
- Engram rows: ``embed.weight`` (F8_E4M3) with ``embed.scale`` (UE8M0 per 32 values).

The safetensors files themselves are read by :mod:`model.checkpoint_files`.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch.overrides import TorchFunctionMode

from . import formats
from .checkpoint_files import CheckpointError, checkpoint_files, file_header, read_tensors, tensor_index
from .config import ModelConfig, VisionConfig
from .parallel import ExpertShard
from .transformer import Transformer


_PREFIX = "model."
_BLOCK = (32, 32)


def _module_name(name: str) -> str:
    """Released name -> parameter name. Both the DeepSeek layout (``layers.N...``,
    ``head.weight``) and the Hugging Face one (``model.layers.N...``, ``lm_head.weight``)
    are accepted."""
    name = name[len(_PREFIX) :] if name.startswith(_PREFIX) else name
    return "lm_head" + name[len("head") :] if name.startswith("head.") else name


def weight_block(config: ModelConfig) -> tuple[int, int]:
    """The tile of the dense FP8 weights' scales: ``quantization_config.weight_block_size``."""
    block = (config.quantization or {}).get("weight_block_size", _BLOCK)
    if not (isinstance(block, (list, tuple)) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise CheckpointError(f"quantization_config.weight_block_size must be two positive integers, got {block!r}")
    return tuple(block)


def _dequantize(name: str, weight: torch.Tensor, scale: torch.Tensor, target_shape: torch.Size,
                block: tuple[int, int] = _BLOCK) -> torch.Tensor:
    """Float32 values of a quantised checkpoint tensor (layouts in the module doc)."""
    if weight.dtype == torch.float8_e4m3fn and weight.ndim == 2:
        if name.endswith(".engram.embed.weight"):
            if weight.shape[-1] % formats.ENGRAM_ROW.block:
                raise CheckpointError(f"{name}: FP8 Engram rows need a multiple of {formats.ENGRAM_ROW.block} channels")
            packed = formats.Packed(weight.view(torch.uint8), scale.view(torch.uint8))
            return formats.ENGRAM_ROW.dequantize(packed)
        return formats.dequantize_fp8_weight(weight, scale, block)
    if weight.dtype in (torch.int8, torch.uint8) and weight.shape[-1] * 2 == target_shape[-1]:
        return formats.dequantize_fp4_weight(weight, scale, block=32)
    raise CheckpointError(f"{name}: unsupported quantised storage {weight.dtype} {tuple(weight.shape)}")


def load_state(directory: Path, modules: list[torch.nn.Module], block: tuple[int, int] = _BLOCK,
               keep: Callable[[str], bool] | None = None) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Copy a checkpoint's tensors into ``modules`` (dequantising), strictly.

    The modules' parameter names must not collide (the backbone owns ``layers.``,
    ``embed.``, ``norm.``, ``lm_head.``; the drafter ``mtp.``; the vision tower
    ``vision.``, ``aligner.``, ``image_*``). Every parameter must be present, every
    tensor used, every shape equal; with ``keep`` (a worker's share of the model), the
    tensors it refuses are not read. Returns the stored bytes of every quantised
    parameter, ``{parameter name: (data, scale)}``, as read.
    """
    params: dict[str, torch.Tensor] = {}
    for module in modules:
        params.update(module.named_parameters())
    pending_scales: dict[str, torch.Tensor] = {}
    quantised: dict[str, torch.Tensor] = {}
    loaded: set[str] = set()
    for raw_name, tensor in read_tensors(directory, None if keep is None else lambda raw: keep(_module_name(raw))):
        name = _module_name(raw_name)
        if name.endswith(".scale") and name[: -len(".scale")] + ".weight" in params:
            pending_scales[name[: -len(".scale")] + ".weight"] = tensor
            continue
        if name not in params:
            raise CheckpointError(f"unexpected tensor {raw_name} in {directory}")
        if tensor.element_size() == 1 and tensor.dtype != torch.bool:
            quantised[name] = tensor
            continue
        _copy(params[name], tensor, raw_name)
        loaded.add(name)
    for name, tensor in quantised.items():
        if name not in pending_scales:
            raise CheckpointError(f"{name}: quantised tensor without its scale")
        scale = pending_scales.pop(name)
        _copy(params[name], _dequantize(name, tensor, scale, params[name].shape, block), name)
        quantised[name] = (tensor, scale)
        loaded.add(name)
        scale_param = name[: -len(".weight")] + ".scale"
        if scale_param in params:  # Engram rows are held dequantised: their scales are 1
            with torch.no_grad():
                params[scale_param].fill_(1.0)
            loaded.add(scale_param)
    # A float weight may still carry a (unused) scale, e.g. Engram rows saved unquantised.
    for name, scale in pending_scales.items():
        scale_param = name[: -len(".weight")] + ".scale"
        if scale_param in params:
            _copy(params[scale_param], scale, scale_param)
            loaded.add(scale_param)
    missing = sorted(set(params) - loaded)
    if missing:
        raise CheckpointError(f"{len(missing)} parameters missing from {directory}, e.g. {missing[:3]}")
    return quantised


def _copy(param: torch.Tensor, tensor: torch.Tensor, name: str) -> None:
    if tuple(param.shape) != tuple(tensor.shape):
        raise CheckpointError(f"{name}: checkpoint shape {tuple(tensor.shape)} != model shape {tuple(param.shape)}")
    with torch.no_grad():
        param.copy_(tensor.to(param.dtype))


@dataclass
class Checkpoint:
    """A loaded checkpoint: the backbone, and the drafter and vision tower when the
    checkpoint has them (fp32, eval mode).

    ``stored`` (when loaded with ``keep_stored``) holds the quantised bytes of each
    quantised parameter as read, ``{name: (data, scale)}``: :func:`save_checkpoint`
    writes them back unchanged while the parameter still equals their values. A
    quantised tensor cannot be re-derived from its values alone (a tile whose largest
    code is 224 reads the same at scale ``s`` as 448 at ``s / 2``), so without them
    a re-saved checkpoint holds the same values in other bytes.
    """

    config: ModelConfig
    backbone: Transformer
    drafter: torch.nn.Module | None = None
    vision: torch.nn.Module | None = None
    stored: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict, repr=False)


def build_modules(config: ModelConfig, device: str | torch.device = "cpu", initialise: bool = True) -> Checkpoint:
    """The modules a config describes, on ``device`` (``meta``: shapes without memory).
    Without ``initialise`` torch's initialisers are skipped: the parameters keep the
    memory they were allocated, for a load to fill."""
    from .dspark import DSparkDrafter
    from .vision import VisionTower

    with torch.device(device), contextlib.nullcontext() if initialise else _Unfilled():
        backbone = Transformer(config.text)
        drafter = DSparkDrafter(config.text) if config.text.num_nextn_predict_layers else None
        vision = VisionTower(config.vision, config.text) if config.vision is not None else None
    return Checkpoint(config, backbone, drafter, vision)


class _Unfilled(TorchFunctionMode):
    """``torch.nn.init``'s fills do nothing (each returns its tensor as it is)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__module__", None) == "torch.nn.init":
            return args[0] if args else kwargs["tensor"]
        return func(*args, **kwargs)


# Tensor-name prefixes of the optional parts (after ``model.``): a checkpoint holds all of
# a part's tensors or none (the Hugging Face reference saves neither the drafter nor the
# vision tower, whatever its config says).
_PART_PREFIXES = {"drafter": ("mtp.",), "vision": ("vision.", "aligner.", "image_")}


def load_checkpoint(directory: str | Path, device: str | torch.device = "cpu", keep_stored: bool = False,
                    shard: ExpertShard | None = None, vision: bool = True,
                    config: ModelConfig | None = None) -> Checkpoint:
    """Build every part of the checkpoint from ``config.json`` (or ``config``, whose
    tensors' shapes must be the checkpoint's) and load its weights.

    The drafter and the vision tower are loaded when the checkpoint has their tensors
    (a checkpoint with none of a part's tensors loads without that part). With
    ``keep_stored`` the quantised bytes are kept for an exact re-save. With ``shard``
    (the lead worker of an expert-parallel replica) every MoE layer keeps only the
    shard's routed experts, and the others' tensors are not read. Without ``vision``
    the vision tower's tensors are not read either (a decoder replica holds none).
    """
    directory = Path(directory)
    config = config or ModelConfig.load(directory)
    # Built in memory, unfilled (a part the checkpoint lacks is allocated, never touched,
    # and dropped). A lead worker's shard is built on meta first, its experts cut to the
    # shard's before any memory is given. (A meta build costs 1.5 s more a process: torch
    # runs its random fills and factories on meta in Python, which imports dynamo.)
    built = build_modules(config, initialise=False) if shard is None else build_modules(config, "meta")
    if shard is not None:
        if shard.rank != 0:
            raise ValueError("load_checkpoint loads the lead worker's share; the others load_experts")
        for block in built.backbone.layers:
            block.ffn.experts = _expert_table(block.ffn.experts, shard.experts)
    names = [_module_name(entry.name) for entry in tensor_index(directory)]
    present = {part: any(n.startswith(prefixes) for n in names) for part, prefixes in _PART_PREFIXES.items()}
    present["vision"] = present["vision"] and vision
    parts = {
        name: module if shard is None else module.to_empty(device="cpu")
        for name, module in (("backbone", built.backbone), ("drafter", built.drafter), ("vision", built.vision))
        if module is not None and present.get(name, True)
    }
    if shard is not None:  # to_empty left the rotary tables, buffers no checkpoint stores, unfilled
        for module in parts.values():
            module.apply(_rebuild_rotary)
    def keep(name: str) -> bool:
        if not present["vision"] and name.startswith(_PART_PREFIXES["vision"]):
            return False
        return shard is None or shard.holds(name)

    stored = load_state(directory, list(parts.values()), weight_block(config), keep)
    return Checkpoint(config, **{name: module.to(device).eval() for name, module in parts.items()},
                      stored=stored if keep_stored else {})


def _expert_table(experts: torch.nn.ModuleList, keep: range) -> torch.nn.ModuleDict:
    """The experts numbered in ``keep``, under the same parameter names."""
    return torch.nn.ModuleDict({str(e): experts[e] for e in keep})


def load_experts(directory: str | Path, shard: ExpertShard, layers: Sequence[int] | None = None,
                 device: str | torch.device = "cpu") -> dict[int, torch.nn.ModuleDict]:
    """A worker's share of the routed experts, ``{layer: {str(expert): Expert}}`` (of
    ``layers``, default all), reading only those tensors of the checkpoint."""
    from .moe import Expert

    directory = Path(directory)
    config = ModelConfig.load(directory)
    text = config.text
    layers = range(text.num_hidden_layers) if layers is None else layers
    holder = torch.nn.Module()
    holder.layers = torch.nn.ModuleDict()
    with torch.device("meta"):
        for layer in layers:
            ffn = torch.nn.Module()
            ffn.experts = torch.nn.ModuleDict(
                {str(e): Expert(text.hidden_size, text.moe_intermediate_size, text.swiglu_limit) for e in shard.experts}
            )
            holder.layers[str(layer)] = torch.nn.Module()
            holder.layers[str(layer)].ffn = ffn
    holder.to_empty(device="cpu")
    names = {f"layers.{layer}." for layer in layers}
    load_state(directory, [holder], weight_block(config),
               lambda name: shard.holds(name) and name.startswith(tuple(names)) and ".ffn.experts." in name)
    return {layer: holder.layers[str(layer)].ffn.experts.to(device).eval() for layer in layers}


def add_vision_tower(source: str | Path, out: str | Path, vision: VisionConfig, seed: int = 0,
                     std: float = 0.1) -> Path:
    """A copy of the checkpoint at ``source`` that reads images: its parts and files, a
    vision tower of ``vision`` with seeded random weights (``std``), and the tokenizer's
    ``<｜deepseek_image｜>`` as the image token. Weights are written unquantised."""
    from .tokenizer import IMAGE_TOKEN, Tokenizer
    from .transformer import init_module
    from .vision import VisionTower

    checkpoint = load_checkpoint(source, keep_stored=True)
    image_token_id = Tokenizer.from_dir(source).token_id(IMAGE_TOKEN)
    if image_token_id is None:
        raise CheckpointError(f"the tokenizer of {source} has no {IMAGE_TOKEN} token")
    tower = init_module(VisionTower(vision, checkpoint.config.text), seed, std).eval()
    return save_with_vision(source, out, checkpoint, tower, image_token_id, quantize=False)


def save_with_vision(source: str | Path, out: str | Path, checkpoint: Checkpoint, tower: torch.nn.Module,
                     image_token_id: int, quantize: bool = True) -> Path:
    """``checkpoint`` (loaded from ``source``; with ``keep_stored``, its quantised bytes
    are written back unchanged) plus the vision ``tower``, saved in ``out`` with the
    source's other files (tokenizer, model card, ...)."""
    import shutil

    source, out = Path(source), Path(out)
    config = replace(checkpoint.config, vision=tower.config, image_token_id=image_token_id)
    save_checkpoint(out, replace(checkpoint, config=config, vision=tower), quantize=quantize)
    for path in source.iterdir():
        if path.is_file() and path.name != "config.json" and not path.name.endswith((".safetensors", ".index.json")) \
                and (out / path.name).resolve() != path.resolve():
            shutil.copy(path, out / path.name)
    return out


def load_model(directory: str | Path, device: str | torch.device = "cpu") -> tuple[ModelConfig, Transformer]:
    """The config and the backbone of a checkpoint (every part is loaded and checked)."""
    checkpoint = load_checkpoint(directory, device)
    return checkpoint.config, checkpoint.backbone


def _rebuild_rotary(module: torch.nn.Module) -> None:
    from .rope import Rotary, inv_frequencies

    if isinstance(module, Rotary):
        module.inv_freq = inv_frequencies(module.spec, module.rope_dim)


def save_checkpoint(directory: str | Path, checkpoint: Checkpoint, quantize: bool = True,
                    hugging_face_names: bool = False) -> None:
    """Write ``config.json`` and ``model.safetensors`` in the released layout and names
    (with ``hugging_face_names``, transformers' names: ``model.`` before every name but
    the output head's, ``lm_head.weight``, as tests/golden/A holds them).

    With ``quantize``, 2-D projection matrices become FP8 with UE8M0 scales per 32x32
    tile, routed experts FP4 with UE8M0 per 32, Engram rows FP8 with UE8M0 per 32, the
    vision tower BF16; embeddings, head, routers, norms, mHC parameters, sinks and
    biases stay fp32.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    block = weight_block(checkpoint.config)
    tensors: dict[str, torch.Tensor] = {}
    modules = [m for m in (checkpoint.backbone, checkpoint.drafter, checkpoint.vision) if m is not None]
    for module in modules:
        params = dict(module.named_parameters())
        for name, param in params.items():
            full = _stored_name(name, hugging_face_names)
            tensor = param.detach().to("cpu", torch.float32).contiguous()
            if quantize and name.endswith(".engram.embed.scale"):
                rows = name[: -len(".scale")] + ".weight"
                if _is_quantised(rows, params[rows]):
                    continue  # replaced by the quantised rows' own scales
            if quantize and _is_quantised(name, tensor):
                stem = full[: -len(".weight")]
                data, scale = _stored_bytes(name, tensor, checkpoint.stored.get(name), block) or _quantise(name, tensor, block)
                tensors[full], tensors[stem + ".scale"] = data.contiguous(), scale.contiguous()
            elif quantize and name.startswith(_PART_PREFIXES["vision"]):
                tensors[full] = tensor.to(torch.bfloat16)  # the release keeps the vision tower in BF16
            else:
                tensors[full] = tensor
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(config_to_dict(checkpoint.config), indent=2) + "\n")


def _stored_name(name: str, hugging_face: bool) -> str:
    """Parameter name -> the name it is saved under (the inverse of :func:`_module_name`)."""
    if name.startswith("lm_head."):
        return name if hugging_face else "head" + name[len("lm_head") :]
    return _PREFIX + name if hugging_face else name


def _quantise(name: str, tensor: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(data, scale) of a parameter in its released storage (layouts in the module doc)."""
    if ".embed." in name:
        packed = formats.ENGRAM_ROW.quantize(tensor)
        return packed.data.view(torch.float8_e4m3fn), packed.scales.view(torch.float8_e8m0fnu)
    if ".experts." in name and ".shared_experts." not in name:
        return formats.quantize_fp4_weight(tensor)
    return formats.quantize_fp8_weight(tensor, block)


def stored_values(name: str, tensor: torch.Tensor, block: tuple[int, int] = _BLOCK) -> torch.Tensor:
    """The float32 values a quantised parameter has after :func:`save_checkpoint` and
    :func:`load_checkpoint` (the same rule for its format)."""
    data, scale = _quantise(name, tensor.detach().float(), block)
    return _dequantize(name, data, scale, tensor.shape, block)


def _stored_bytes(name: str, tensor: torch.Tensor, stored, block: tuple[int, int]):
    """The bytes a parameter was loaded from, while it still holds exactly their values."""
    if stored is None:
        return None
    data, scale = stored
    if not torch.equal(_dequantize(name, data, scale, tensor.shape, block), tensor):
        return None
    return data, scale


def _is_quantised(name: str, tensor: torch.Tensor) -> bool:
    if not name.endswith(".weight") or tensor.ndim != 2 or "norm" in name:
        return False
    if name.startswith(("embed.", "lm_head.", "vision.", "aligner.")) or ".gate.weight" in name:
        return False
    if "markov_head" in name or "confidence_head" in name:
        return False
    if ".embed." in name:
        return tensor.shape[-1] % 32 == 0
    if ".experts." in name and ".shared_experts." not in name:
        return tensor.shape[-1] % 32 == 0
    return True


def config_to_dict(config: ModelConfig) -> dict:
    """The composite config mapping :meth:`ModelConfig.from_dict` reads back."""
    out: dict = dict(config.extra)
    out["text_config"] = config.text.to_dict()
    if config.vision is not None:
        from dataclasses import asdict

        out["vision_config"] = asdict(config.vision)
    if config.quantization is not None:
        out["quantization_config"] = config.quantization
    if config.image_token_id is not None:
        out["image_token_id"] = config.image_token_id
    return out


def weights_digest(directory: str | Path) -> bytes:
    """A digest identifying a checkpoint's weights without reading them: the
    safetensors headers (names, dtypes, shapes, offsets) and file sizes. Cache bytes
    are only ever shared between processes that agree on it."""
    import hashlib

    digest = hashlib.blake2b(digest_size=16)
    for path in checkpoint_files(Path(directory)):
        digest.update(file_header(path))
        digest.update(path.stat().st_size.to_bytes(8, "little"))
    return digest.digest()


def load_tokenizer(directory: str | Path):
    """The checkpoint's ``tokenizers.Tokenizer`` (``tokenizer.json``)."""
    from tokenizers import Tokenizer

    path = Path(directory) / "tokenizer.json"
    if not path.exists():
        raise CheckpointError(f"no tokenizer.json in {directory}")
    return Tokenizer.from_file(str(path))


def load_hasher(directory: str | Path, config: ModelConfig):
    """The Engram n-gram hasher of a checkpoint (None when it has no Engram layers)."""
    from .engram import EngramLayout, NgramHasher

    if not config.text.engram_layer_ids:
        return None
    return NgramHasher.from_tokenizer(EngramLayout.from_config(config.text), load_tokenizer(directory))
