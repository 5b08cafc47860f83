"""The engine's projection weights kept input-major (model/runtime/weight_layout.py)."""

from __future__ import annotations

import pytest
import torch

from model.runtime.compiled import _stack_experts
from model.runtime.weight_layout import store_input_major

pytestmark = pytest.mark.unit


def _fresh_model(directory):
    from model.loader import load_model

    return load_model(directory)[1].eval()  # (the session's golden model has met an engine: already input-major)


def test_every_projection_is_kept_transposed_with_its_values_and_the_model_computes_the_same(golden_dir, golden_hasher):
    model = _fresh_model(golden_dir)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    ids = torch.tensor([[5, 9, 14, 200, 31, 7, 5, 9, 14]])
    engram_ids, _ = golden_hasher.hash_ids(ids)
    with torch.no_grad():
        want = model(ids, engram_ids)
        moved = store_input_major(model)
        got = model(ids, engram_ids)
    layer = model.layers[0]
    projections = [layer.hc_attn_fn, layer.attn.wq_a.weight, layer.ffn.gate.weight, model.lm_head.weight]
    assert all(w.stride() == (1, w.shape[0]) for w in projections)  # stored [in, out]
    assert moved >= 10 * len(projections) and store_input_major(model) == 0  # once
    assert all(torch.equal(before[name], p) for name, p in model.named_parameters())  # the same values
    assert layer.attn.q_norm.weight.is_contiguous() and layer.attn.attn_sink.is_contiguous()  # not projections
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-4)  # (MKL reads them otherwise: another order of sums)


def test_a_weight_loaded_later_lands_in_the_kept_storage_and_stacked_experts_stay_views(golden_dir):
    model = _fresh_model(golden_dir)
    store_input_major(model)
    wq_a = model.layers[0].attn.wq_a.weight
    storage = wq_a.data_ptr()
    wq_a.data.copy_(torch.ones_like(wq_a))  # as the loader writes a parameter
    assert wq_a.data_ptr() == storage and wq_a.stride() == (1, wq_a.shape[0]) and bool((wq_a == 1).all())
    ffn = model.layers[0].ffn
    w1, _, _ = _stack_experts(ffn)
    assert store_input_major(model) == 0  # the experts' views of their stack stay views
    assert torch.equal(ffn.experts[3].w1.weight, w1[:, 3].t())
    assert ffn.experts[3].w1.weight.data_ptr() == w1[:, 3].data_ptr()
