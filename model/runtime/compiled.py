"""The compiled layer step: a block's per-token work as a few compiled functions.

A decode step on a small model is bound by dispatch, not arithmetic: each layer runs
two mHC mixes (a 24-wide projection and 20 Sinkhorn normalisations of a 4x4 matrix
per token), two collapses and expansions of the streams, two RMS norms and the MoE
(router, top-k, a dispatch loop over experts), hundreds of tiny ops.
:class:`CompiledBlocks` runs them as the functions of tensors in
:mod:`model.runtime.step_functions`, each compiled with dynamic token counts, so a
batch of any size reuses the same code. Over the engine's caches a layer is two calls,
the work before its cache reads and the work after them, not four, because each call
costs ~40-90 us at batch 1 however little it computes. What reads the caches between
them (window places, the gathers) stays eager, in
:meth:`model.runtime.gather.CachedKeys.read`, but for the indexer's pick of a batched
step: its scores, candidate blocks and top-k are one call (a Reindex layer's, over its
candidates' keys, another), with the selection rule of the eager path
(:func:`model.selection.top_k` has no branch and no read back to the host). A Full
layer's pooling of the groups completed in the step is one more call, and a DSpark
drafter layer's attention another (each request's block over its drafter context and
its own window entries: one call instead of ~40 eager ops, 0.8 ms of a 2.9 ms draft at
batch 1); the drafter's layers run the work before and after attention as two more.

By default (``mode="aot"``) each function is built ahead of time by AOTInductor into a
package kept on disk (:mod:`model.runtime.aot`), one per signature: a call then costs
~40-140 us at batch 1 instead of ~120-330 us through ``torch.compile``, whose guards
and Python wrapper run on every call. Packages are built by the first call of each
variant, which :meth:`~model.runtime.engine.Engine.warm_compiled` makes at replica
start: ~2.5 minutes for configs/small's 9 packages (and the drafter's with
:meth:`~model.runtime.speculative.SpeculativeDrafter.warm_compiled`), 2-5 s to load
them afterwards. ``mode="jit"`` keeps ``torch.compile``.

The routed experts' weights are stacked once per layer, input-major (w1 and w3 [hidden,
E, inter], w2 [E, inter, hidden]: :func:`_stack_experts`) for the MoE forms of
:func:`~model.runtime.step_functions.after_attention`, and the experts' parameters
re-seated as views of the stacks (one copy, and a weight loaded later into a parameter
lands in the stack too). The eager :class:`model.transformer.Block` stays the oracle:
tests compare logits with the golden tolerances and greedy tokens exactly on the
shipped checkpoint.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch

from model import attention, engram_gate, formats, mhc, moe, norm, selection
from model.attention import CSA2Attention
from model.formats import BlockFormat
from model.moe import MoE
from model.runtime import aot, batch_layout, cache, step_functions
from model.runtime.cache import PackedRows
from model.runtime.gather import CachedKeys
from model.runtime.step_functions import (after_attention, before_attention, draft_attention, layer_in, layer_out,
                                          pick, pool_groups, repick)
from model.transformer import Block, Keys, Transformer

def _stack_experts(moe: MoE) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The routed experts' weights stacked input-major: w1 and w3 [hidden, E, inter], w2
    [E, inter, hidden]. All experts side by side are then the row-major [in, out] right
    operand of one product (``x @ w1.flatten(1)``, ``h @ w2.flatten(0, 1)``), which MKL
    reads as it is; an [out, in] weight (``F.linear``'s) it reads transposed, at 16
    tokens ~1.6x slower once the weights are out of cache (configs/small's layer_out
    680-780 us a call against 640-660). Each expert's parameter becomes the transpose of
    its slice of the stack: the same [out, in] weight to the module, no copy."""
    stacks = []
    for name, dim in (("w1", 1), ("w3", 1), ("w2", 0)):
        stack = torch.stack([getattr(module, name).weight.detach().t() for module in moe.experts], dim=dim)
        for index, module in enumerate(moe.experts):
            getattr(module, name).weight.data = stack.select(dim, index).t()
        stacks.append(stack)
    return tuple(stacks)


def _encoded(window: PackedRows, rows: torch.Tensor, values: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """New window rows as the compiled input half gave them, as (bytes, values) for
    ``window``: encoded there in a block format, encoded here for a float32 cache."""
    return (rows, values) if isinstance(window.fmt, BlockFormat) else window.encode(rows)


class _LayerArgs(NamedTuple):
    """One block's arguments to the compiled functions that are the same on every call:
    its weights and sizes, gathered once (a weight loaded later lands in the same
    tensors)."""

    before: tuple  # the attention site's mixes and norm
    after: tuple  # the FFN site's mixes and norm, the router, the routed and shared experts
    routing: tuple  # the router's and the shared expert's numbers
    attention_in: tuple  # the queries' and window rows' weights
    attention_in_sizes: tuple  # heads, the query norm's eps
    indexer: tuple  # the indexer's query weights and heads (Nones and 0 without one)
    attention_out: tuple  # the sink and the output projection's weights
    attention_out_sizes: tuple  # the scaling and the output groups
    engram: tuple  # an Engram layer's gate weights and eps (Nones and 0.0 without one)


def _jit(compiled: Callable) -> Callable:
    """A ``torch.compile``d function called as an :class:`~model.runtime.aot.AotFunction`
    is (variant and dimensions first: dynamo guards on shapes itself)."""
    def call(variant, dims, *args):
        return compiled(*args)
    return call


class CompiledBlocks:
    """Runs a model's blocks with the compiled functions (see the module docstring),
    for steps of at most ``max_tokens`` tokens without images."""

    def __init__(self, model: Transformer, max_tokens: int = 128, mode: str = "aot", backend: str = "inductor",
                 cache_dir: Path | None = None) -> None:
        """``mode``: ``"aot"`` builds each function with AOTInductor, once per signature,
        kept under ``cache_dir`` (:mod:`model.runtime.aot`; default
        :func:`~model.runtime.aot.default_cache_dir`); ``"jit"`` compiles them with
        ``torch.compile`` (``backend``), dynamic token counts, inductor's own disk cache."""
        if mode not in ("aot", "jit"):
            raise ValueError(f"compiled mode {mode!r}: 'aot' or 'jit'")
        self.max_tokens, self.mode = max_tokens, mode
        self.cache_dir = (cache_dir or aot.default_cache_dir()) if mode == "aot" else None
        functions = {"before": before_attention, "after": after_attention, "layer_in": layer_in,
                     "layer_out": layer_out, "pick": pick, "repick": repick, "pool_groups": pool_groups,
                     "draft_attention": draft_attention}
        if mode == "aot":
            digest = aot.source_digest([sys.modules[__name__], step_functions, attention, selection, mhc, moe, norm,
                                        formats, cache, batch_layout, engram_gate])
            self.functions: dict[str, Callable] = {
                name: aot.AotFunction(fn, self.cache_dir, digest) for name, fn in functions.items()}
        else:
            self.functions = {name: _jit(torch.compile(fn, dynamic=True, fullgraph=True, backend=backend))
                              for name, fn in functions.items()}
        self._before, self._after = self.functions["before"], self.functions["after"]
        self._layer_in, self._layer_out = self.functions["layer_in"], self.functions["layer_out"]
        self._pool_groups, self._pick, self._repick = (self.functions[name] for name in ("pool_groups", "pick",
                                                                                          "repick"))
        self._draft_attention = self.functions["draft_attention"]
        tokens, keys = aot.Dynamic("n", 1, max_tokens), aot.Dynamic("t", 1, 1 << 24)
        self._keys_width = keys
        self._token_dims = {i: {0: tokens} for i in range(2)}
        blocks, width = aot.Dynamic("b", 1, max_tokens), aot.Dynamic("t", 1, 1 << 16)
        self._draft_dims = {0: {0: blocks}, 1: {0: blocks}, 2: {0: blocks}, 3: {0: blocks, 1: width},
                            4: {0: blocks, 1: width}}
        self._layer_in_dims = {0: {0: tokens}, 1: {0: tokens}, 6: {1: tokens}, 7: {1: tokens}, 23: {0: tokens}}
        config = model.config
        self._mhc = (config.hc_sinkhorn_iters, config.hc_eps, config.rms_norm_eps)
        self._weights: dict[int, _LayerArgs] = {}
        # (an encoder-only model, a prefill replica's, has no decoder blocks to run)
        self.add_blocks([block for block in model.layers if isinstance(block, Block) and block.ffn is not None])

    def add_blocks(self, blocks) -> None:
        """Make ``blocks`` runnable here (the model's at construction; a DSpark drafter's
        layers later): their routed experts stacked, their weights gathered per call."""
        for block in blocks:
            ffn, gate, attn = block.ffn, block.ffn.gate, block.attn
            w1, w3, w2 = _stack_experts(ffn)
            indexer = attn.indexer
            self._weights[block.plan.index] = _LayerArgs(
                (block.hc_attn_fn, block.hc_attn_scale, block.hc_attn_base, block.attn_norm.weight),
                (block.hc_ffn_fn, block.hc_ffn_scale, block.hc_ffn_base, block.ffn_norm.weight, gate.weight, gate.bias,
                 w1, w3, w2, ffn.shared_experts.w1.weight, ffn.shared_experts.w3.weight, ffn.shared_experts.w2.weight),
                (gate.top_k, gate.scoring_func, gate.gate_temp, gate.norm_topk_prob, gate.scaling,
                 ffn.shared_experts.limit),
                (attn.wq_a.weight, attn.q_norm.weight, attn.wq_b.weight, attn.wkv.weight, attn.kv_norm.weight),
                (attn.n_heads, attn.q_norm.eps),
                (None, None, 0) if indexer is None else (indexer.wq_b.weight, indexer.weights_proj.weight,
                                                         indexer.n_heads),
                (attn.attn_sink, attn.wo_a.weight, attn.wo_b.weight),
                (attn.scaling, attn.o_groups),
                (None, None, None, 0.0) if block.engram is None else (
                    block.engram.wkv.weight, block.engram.q_weight, block.engram.k_weight, block.engram.eps),
            )

    def handles(self, n_tokens: int) -> bool:
        return 0 < n_tokens <= self.max_tokens

    def pick(self, layer: int, q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, n_visible: torch.Tensor,
             k: int, topk_blocks: int = 0, block: int = 1) -> tuple[torch.Tensor, ...]:
        """:func:`pick` of ``layer``'s indexer: queries [b, n, H, d], weights [b, n, H],
        keys [b, W, d] (W at least ``k``), ``n_visible`` [b, n]; a candidate source's
        ``topk_blocks`` and ``block`` (its keys whole blocks, at least ``topk_blocks``)."""
        return self._pick(layer, lambda: self._pick_dims(k, topk_blocks, block), q, weights, keys, n_visible, k,
                          topk_blocks, block)

    def _pick_dims(self, k: int, topk_blocks: int, block: int) -> aot.Dims:
        """:func:`pick`'s sequences, tokens per sequence and key width: at least ``k``
        and ``topk_blocks`` whole blocks of ``block``."""
        sequences, each = aot.Dynamic("b", 1, self.max_tokens), aot.Dynamic("n", 1, self.max_tokens)
        width = aot.Dynamic("w", max(-(-k // block), topk_blocks), (1 << 24) // block, block)
        return {0: {0: sequences, 1: each}, 1: {0: sequences, 1: each}, 2: {0: sequences, 1: width},
                3: {0: sequences, 1: each}}

    def repick(self, layer: int, q: torch.Tensor, weights: torch.Tensor, table: torch.Tensor, rows: torch.Tensor,
               entries: torch.Tensor, valid: torch.Tensor, n_visible: torch.Tensor, k: int):
        """:func:`repick` of ``layer``'s indexer (a Reindex layer's)."""
        return self._repick(layer, self._repick_dims, q, weights, table, rows, entries, valid, n_visible, k)

    def _repick_dims(self) -> aot.Dims:
        """:func:`repick`'s token count, and the table's rows and places."""
        tokens = aot.Dynamic("n", 1, self.max_tokens)
        return {0: {1: tokens}, 1: {1: tokens}, 2: {0: aot.Dynamic("r", 1, 1 << 16), 1: aot.Dynamic("e", 1, 1 << 24)},
                3: {0: tokens}, 4: {0: tokens}, 5: {0: tokens}, 6: {0: tokens}}

    def pool_groups(self, attn: CSA2Attention, rows: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                    entries: PackedRows, keys: PackedRows):
        """:meth:`CSA2Attention.compress` of whole groups ``rows`` [B, G * ratio, D] (cos
        and sin at the groups' first positions), encoded for the ``entries`` and ``keys``
        caches: ((bytes, values) of the entries, (bytes, values) of the keys), [B * G, ...]."""
        compressor, indexer = attn.compressor, attn.indexer
        formats = [(rows.fmt, rows.payload) if isinstance(rows.fmt, BlockFormat) else (None, 0)
                   for rows in (entries, keys)]
        entry_rows, key_rows = self._pool_groups(
            id(attn), lambda: self._pool_dims(compressor.ratio),
            rows, cos, sin, compressor.wkv.weight, None if compressor.wgate is None else compressor.wgate.weight,
            compressor.norm.weight, compressor.ratio, compressor.norm.eps, indexer.wk.weight, indexer.k_norm.weight,
            indexer.k_norm.eps, *formats[0], *formats[1])
        return (entry_rows if formats[0][0] is not None else entries.encode(entry_rows[0]),
                key_rows if formats[1][0] is not None else keys.encode(key_rows[0]))

    def draft_attention(self, attn: CSA2Attention, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                        context: torch.Tensor, in_window: torch.Tensor) -> torch.Tensor:
        """A drafter layer's attention: blocks ``x`` [B, K, D] over their context entries
        [B, T, hd] (``in_window`` [B, T] bool) and their own window entries: [B, K, D]."""
        return self._draft_attention(
            id(attn), lambda: self._draft_dims, x, cos, sin, context, in_window, attn.wq_a.weight,
            attn.q_norm.weight, attn.wq_b.weight, attn.wkv.weight, attn.kv_norm.weight, attn.attn_sink,
            attn.wo_a.weight, attn.wo_b.weight, attn.n_heads, attn.q_norm.eps, attn.kv_norm.eps, attn.scaling,
            attn.o_groups)

    def __call__(self, block: Block, streams: torch.Tensor, pre: torch.Tensor, keys: Keys,
                 engram_rows: torch.Tensor | None = None):
        """:meth:`Block.forward` (no image tokens) reading ``keys``: (streams, the next
        ``pre``). Over the engine's caches (:class:`~model.runtime.gather.CachedKeys`) a
        layer is two calls, :func:`layer_in` (an Engram layer's write of ``engram_rows``
        in it) and :func:`layer_out` (the keys read in two parts: the window places and
        the picked entries), around the cache reads; over other keys, four, their
        ``attend`` between."""
        layer = self._weights[block.plan.index]
        before, after, routing = layer.before, layer.after, layer.routing
        index = block.plan.index
        experts = after[6].shape[1]
        gathered = streams.shape[0] * routing[0] < experts  # the MoE's form (see after_attention)
        moe_dims = lambda: self._moe_dims(gathered, routing[0], experts)  # noqa: E731
        if not isinstance(keys, CachedKeys):
            if block.engram is not None:
                streams = block.engram(streams, engram_rows, None)
            x, attn_pre, attn_post, attn_comb = self._before(index, lambda: self._token_dims, streams, pre, *before,
                                                             *self._mhc)
            out = keys.attend(block, x)
            return self._after((index, gathered), moe_dims, out, streams, attn_pre, attn_post, attn_comb, *after,
                               *self._mhc, *routing)
        cos, sin = keys.rotary_at(block)
        window = keys.window_rows(block)
        blocked = isinstance(window.fmt, BlockFormat)  # (a float32 cache: tiny test configs)
        if engram_rows is not None and not engram_rows.is_floating_point():
            engram_rows = block.engram.lookup(engram_rows)
        out = self._layer_in(
            index, lambda: self._layer_in_dims, streams, pre, *before, cos, sin, *layer.attention_in, *self._mhc,
            *layer.attention_in_sizes, window.fmt if blocked else None, window.payload, *layer.indexer, engram_rows,
            *layer.engram)
        if engram_rows is not None:  # (an Engram layer's call gives the streams it wrote first)
            streams, out = out[0], out[1:]
        x, attn_pre, attn_post, attn_comb, q, q_residual, rows, values, index_query = out
        read = keys.read(block, x, q_residual, _encoded(window, rows, values), index_query)
        picked = read.picked if read.picked is not None and read.picked.shape[1] else None  # (none picked: none)
        return self._layer_out((index, gathered, picked is None), lambda: self._layer_out_dims(moe_dims()), q,
                               read.window, read.window_mask, picked, None if picked is None else read.picked_valid,
                               cos, sin, *layer.attention_out, streams, attn_pre, attn_post, attn_comb, *after,
                               *layer.attention_out_sizes, *self._mhc, *routing)

    def _layer_out_dims(self, moe_dims: aot.Dims) -> aot.Dims:
        """:func:`layer_out`'s dynamic dimensions: the token count (in the MoE form's
        range) of the queries, window keys and mask, picked entries and their mask, cos,
        sin, streams and mixes; the window's width and the number picked."""
        tokens, width, picked = moe_dims[0][0], self._keys_width, aot.Dynamic("k", 1, 1 << 16)
        return {0: {1: tokens}, 1: {0: tokens, 1: width}, 2: {0: tokens, 1: width}, 3: {0: tokens, 1: picked},
                4: {0: tokens, 1: picked}, 5: {1: tokens}, 6: {1: tokens}, **{i: {0: tokens} for i in range(10, 14)}}

    def _pool_dims(self, ratio: int) -> aot.Dims:
        """Pooling's rows [B, G * ratio, D] and cos / sin [B, G, rd]: B and G dynamic."""
        sequences, groups = aot.Dynamic("b", 1, self.max_tokens), aot.Dynamic("g", 1, self.max_tokens)
        return {0: {0: sequences, 1: aot.Dynamic("g", 1, self.max_tokens, ratio)},
                1: {0: sequences, 1: groups}, 2: {0: sequences, 1: groups}}

    def _moe_dims(self, gathered: bool, top_k: int, experts: int) -> aot.Dims:
        """The token count's range of one MoE form: fewer routed slots than experts, or not."""
        few = min(-(-experts // top_k) - 1, self.max_tokens)  # the most tokens with fewer slots than experts
        tokens = aot.Dynamic("n", 1, few) if gathered else aot.Dynamic("n", few + 1, self.max_tokens)
        return {i: {0: tokens} for i in range(5)}
