"""The per-token work of a layer as functions of tensors, for the compiled step.

What :class:`model.runtime.compiled.CompiledBlocks` builds and calls: each function
takes tensors (activations and weights) and plain numbers, never a module, so that
AOTInductor can export it once and run it for every layer that shares its shapes. A
layer over the engine's caches is :func:`layer_in` (an Engram layer's write of its rows
into the streams, the attention site's mHC mixes, collapse and norm, then the queries,
the new window rows and their FP8 bytes, and the indexer's query of a layer that runs
one) and :func:`layer_out` (each token's attention over the keys the engine gathered
for it, its window places and its picked entries read as two parts, not copied side by
side; the output projection, then expand, the FFN site's mixes, collapse, norm, the
MoE, expand). :func:`pick` and
:func:`repick` are a batched step's indexer picks, :func:`pool_groups` a Full layer's
pooling of the groups completed in the step, :func:`draft_attention` a DSpark drafter
layer's attention, and :func:`before_attention` / :func:`after_attention` the
drafter's work around it.

No shape in the MoE here depends on the routing. With fewer routed slots (tokens x
``k``) than experts it gathers each token's ``k`` experts' weights ([N, k, inter,
hidden]) and contracts them; with more, every expert runs on every token and the
experts a token was not routed to weigh 0 (each expert's weights read once, not once
per slot: three matrix products over the experts side by side). Both are forms for
the few tokens of a decode or verify step, not for a long prefill, which keeps the
eager block.

The eager :class:`model.transformer.Block` stays the oracle: these compute the same
formulas (the same functions of :mod:`model.attention`, :mod:`model.mhc` and
:mod:`model.moe`), but fused reductions and the gathered experts add in a different
order, so the two agree to float rounding, not bit for bit.
"""

from __future__ import annotations

import torch

from model import attention, engram_gate, formats, mhc, selection
from model.formats import BlockFormat
from model.moe import expert, route, swiglu
from model.norm import rms_norm
from model.runtime import batch_layout
from model.runtime.cache import encode_rows


def before_attention(streams, pre, fn, scale, base, norm_weight, iters: int, hc_eps: float, norm_eps: float):
    """The attention site's mixes and the normalised attention input."""
    attn_pre, attn_post, attn_comb = mhc.hc_mixes(streams, fn, scale, base, iters, hc_eps, norm_eps)
    return rms_norm(mhc.collapse(streams, pre), norm_weight, norm_eps), attn_pre, attn_post, attn_comb


def after_attention(out, streams, attn_pre, attn_post, attn_comb, fn, scale, base, norm_weight,
                    router_weight, router_bias, w1, w3, w2, shared_w1, shared_w3, shared_w2,
                    iters: int, hc_eps: float, norm_eps: float, top_k: int, scoring_func: str, gate_temp: float,
                    norm_topk_prob: bool, scaling: float, limit: float):
    """Expand the attention output into the streams, then the MoE sublayer under mHC:
    returns (streams, the next site's ``pre``)."""
    streams = mhc.expand(out, streams, attn_post, attn_comb)
    ffn_pre, ffn_post, ffn_comb = mhc.hc_mixes(streams, fn, scale, base, iters, hc_eps, norm_eps)
    x = rms_norm(mhc.collapse(streams, attn_pre), norm_weight, norm_eps)
    out = moe(x, router_weight, router_bias, w1, w3, w2, shared_w1, shared_w3, shared_w2, top_k, scoring_func,
              gate_temp, norm_topk_prob, scaling, limit)
    return mhc.expand(out, streams, ffn_post, ffn_comb), ffn_pre


def moe(x, router_weight, router_bias, w1, w3, w2, shared_w1, shared_w3, shared_w2, top_k: int, scoring_func: str,
        gate_temp: float, norm_topk_prob: bool, scaling: float, limit: float):
    """:class:`model.moe.MoE` of ``x`` [N, D] over stacked routed experts (w1 and w3
    [D, E, inter], w2 [E, inter, D]), in one of the two forms of the module docstring."""
    weights, indices = route(x, router_weight, router_bias.float(), top_k, scoring_func, gate_temp, norm_topk_prob,
                             scaling)
    shared = expert(x, shared_w1, shared_w3, shared_w2, limit).float()
    experts, inter = w1.shape[1], w1.shape[2]
    if x.shape[0] * top_k < experts:  # few tokens: each token's k experts, gathered
        gate = torch.einsum("nd,nkdi->nki", x, w1.transpose(0, 1)[indices]).float()
        up = torch.einsum("nd,nkdi->nki", x, w3.transpose(0, 1)[indices]).float()
        hidden = swiglu(gate, up, limit, weights.unsqueeze(-1)).to(x.dtype)
        routed = torch.einsum("nki,nkid->nd", hidden, w2[indices]).float()
    else:  # as many routed slots as experts: every expert on every token, the unrouted weighted 0,
        # as three matrix products over the experts side by side ([D, E * inter] and [E * inter, D])
        dense = torch.zeros(x.shape[0], experts, dtype=weights.dtype, device=x.device)
        dense = dense.scatter(1, indices, weights)
        gate = (x @ w1.flatten(1)).unflatten(-1, (experts, inter)).float()
        up = (x @ w3.flatten(1)).unflatten(-1, (experts, inter)).float()
        hidden = swiglu(gate, up, limit, dense.unsqueeze(-1)).to(x.dtype)
        routed = (hidden.flatten(1) @ w2.flatten(0, 1)).float()
    return (routed + shared).to(x.dtype)


def attention_in(x, cos, sin, wq_a, q_norm, wq_b, wkv, kv_norm, n_heads: int, eps: float,
                 window_format: BlockFormat | None, payload: int, index_wq_b, index_weights, index_heads: int):
    """Queries, their low-rank residual, the new window rows of ``x`` [N, D] (encoded:
    bytes and values in ``window_format``; raw and None without one) and, for a layer
    that runs its indexer (``index_wq_b`` given), the indexer's queries and head weights."""
    q, q_residual = attention.queries(x[None], cos, sin, wq_a, q_norm, wq_b, n_heads, eps)
    rows = attention.window_raw(x[None], cos, sin, wkv, kv_norm, eps)[0]
    index_query = None
    if index_wq_b is not None:
        index_query = attention.indexer_query(x[None], q_residual, cos, sin, index_wq_b, index_weights, index_heads)
    if window_format is None:
        return q, q_residual, rows, None, index_query
    return q, q_residual, *encode_rows(window_format, payload, rows), index_query


def draft_attention(x, cos, sin, context, in_window, wq_a, q_norm, wq_b, wkv, kv_norm, sink, wo_a, wo_b,
                    n_heads: int, eps: float, kv_eps: float, scaling: float, o_groups: int):
    """A DSpark drafter layer's attention (:meth:`model.dspark.DSparkDrafter.draft`): each
    request's block ``x`` [B, K, D] over its context entries [B, T, hd] where
    ``in_window`` [B, T], and over the whole block's own FP8 window entries: [B, K, D]."""
    k = x.shape[1]
    q, _ = attention.queries(x, cos, sin, wq_a, q_norm, wq_b, n_heads, eps)
    own = formats.WINDOW_KV.fake_quant(attention.window_raw(x, cos, sin, wkv, kv_norm, kv_eps))
    keys = torch.cat((context.to(x.dtype), own), dim=1)
    block = torch.ones_like(in_window[:, :1, None]).expand(-1, k, k)  # the whole block, both ways
    mask = torch.cat((in_window.unsqueeze(1).expand(-1, k, -1), block), dim=-1)
    return attention.output(attention.attend(q, keys, mask, sink, scaling), cos, sin, wo_a, wo_b, o_groups)


def pool_groups(rows, cos, sin, wkv, wgate, norm, ratio: int, eps: float, wk, k_norm, k_eps: float,
                entry_format: BlockFormat | None, entry_payload: int, key_format: BlockFormat | None,
                key_payload: int):
    """A Full layer's new long-range entries and indexer keys from whole pooling groups
    ``rows`` [B, G * ratio, D] (cos/sin at each group's first position), each encoded
    (bytes, values) in its format, or raw (and None) without one: [B * G, ...]."""
    latent = attention.pool_latents(rows, wkv, wgate, norm, ratio, eps)
    entries = attention.CSA2Attention.compressed_raw(latent, cos, sin).flatten(0, 1)
    keys = attention.index_keys_raw(latent, cos, sin, wk, k_norm, k_eps).flatten(0, 1)
    return ((entries, None) if entry_format is None else encode_rows(entry_format, entry_payload, entries),
            (keys, None) if key_format is None else encode_rows(key_format, key_payload, keys))


def attention_out(q, keys, mask, picked, picked_valid, cos, sin, sink, wo_a, wo_b, scaling: float, o_groups: int):
    """Each token's attention over its own window places ``keys`` [N, Tw, hd] (``mask``
    [N, Tw]) and picked entries [N, k, hd] (``picked_valid``; None at a Window layer),
    projected out: [N, D]."""
    parts = [(keys, mask)] + ([] if picked is None else [(picked, picked_valid)])
    out = attention.attend_parts(q[0], parts, sink, scaling)
    return attention.output(out[None], cos, sin, wo_a, wo_b, o_groups)[0]


def layer_in(streams, pre, fn, scale, base, norm_weight, cos, sin, wq_a, q_norm, wq_b, wkv, kv_norm, iters: int,
             hc_eps: float, norm_eps: float, n_heads: int, eps: float, window_format: BlockFormat | None,
             payload: int, index_wq_b, index_weights, index_heads: int, engram_rows, engram_wkv, engram_q,
             engram_k, engram_eps: float):
    """A layer's work before its cache reads, in one call: an Engram layer's write of
    its ``engram_rows`` [N, cols, hd] into the streams (None: not one), then
    :func:`before_attention` and :func:`attention_in` of its output: (the written
    streams of an Engram layer, x, its three mixes, then what :func:`attention_in`
    returns)."""
    written = ()
    if engram_rows is not None:
        streams = engram_gate.write(streams, engram_rows, engram_wkv, engram_q, engram_k, engram_eps)
        written = (streams,)
    x, attn_pre, attn_post, attn_comb = before_attention(streams, pre, fn, scale, base, norm_weight, iters, hc_eps,
                                                         norm_eps)
    return (*written, x, attn_pre, attn_post, attn_comb,
            *attention_in(x, cos, sin, wq_a, q_norm, wq_b, wkv, kv_norm, n_heads, eps, window_format, payload,
                           index_wq_b, index_weights, index_heads))


def layer_out(q, keys, mask, picked, picked_valid, cos, sin, sink, wo_a, wo_b, streams, attn_pre, attn_post,
              attn_comb, fn, scale, base, norm_weight, router_weight, router_bias, w1, w3, w2, shared_w1, shared_w3,
              shared_w2, scaling: float, o_groups: int, iters: int, hc_eps: float, norm_eps: float, top_k: int,
              scoring_func: str, gate_temp: float, norm_topk_prob: bool, moe_scaling: float, limit: float):
    """A layer's work after its cache reads, in one call: :func:`attention_out` then
    :func:`after_attention`: (streams, the next site's ``pre``)."""
    out = attention_out(q, keys, mask, picked, picked_valid, cos, sin, sink, wo_a, wo_b, scaling, o_groups)
    return after_attention(out, streams, attn_pre, attn_post, attn_comb, fn, scale, base, norm_weight, router_weight,
                           router_bias, w1, w3, w2, shared_w1, shared_w3, shared_w2, iters, hc_eps, norm_eps, top_k,
                           scoring_func, gate_temp, norm_topk_prob, moe_scaling, limit)


def pick(q, weights, keys, n_visible, k: int, topk_blocks: int, block: int):
    """An indexer's pick over its own keys for the n new tokens of each of b sequences:
    queries ``q`` [b, n, H, d] weighted [b, n, H] against each sequence's keys
    [b, W, d], the first ``n_visible`` [b, n] of them visible to each token: (entries
    [b * n, k] ascending, valid [b * n, k]), and for a candidate source (``topk_blocks``
    > 0) its listed pool (entries [b * n, P], valid), as
    :func:`model.selection.select_entries` picks them."""
    scores = selection.unseen_masked(attention.index_scores(q, weights, keys), n_visible).flatten(0, 1)
    top, values = selection.top_k(scores, k)
    if not topk_blocks:
        return top, values > float("-inf")
    return top, values > float("-inf"), *selection.candidate_entries(scores, n_visible.flatten(), topk_blocks, block)


def repick(q, weights, table, rows, entries, valid, n_visible, k: int):
    """A Reindex layer's pick among each token's candidates: queries ``q`` [1, N, H, d]
    weighted [1, N, H] against the keys of its pool's ``entries`` [N, P] (``valid``)
    in its row ``rows`` [N] of ``table`` [R, E, d], ``n_visible`` [N]: (entries [N, k]
    ascending by pool place, valid [N, k]), as :func:`model.selection.select_entries`
    picks them."""
    scores = attention.index_scores(q, weights, batch_layout.table_rows(table, entries, rows)[None])[0]
    top, values = selection.top_k(selection.pool_masked(scores, entries, valid, n_visible), k)
    return entries.gather(-1, top), values > float("-inf")
