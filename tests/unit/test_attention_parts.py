"""Attention over keys given in parts (model.attention.attend_parts: a token's window
places and its picked entries, as the compiled step reads them, without concatenating
them) against attention over the parts side by side, and against the formula written
out for one token."""

from __future__ import annotations

import math

import pytest
import torch

from model.attention import attend_each, attend_parts

pytestmark = pytest.mark.unit


def _inputs(picked: int):
    generator = torch.Generator().manual_seed(3)
    q = torch.randn(5, 4, 16, generator=generator)
    window, entries = torch.randn(5, 7, 16, generator=generator), torch.randn(5, picked, 16, generator=generator)
    window_mask, valid = torch.rand(5, 7, generator=generator) > 0.3, torch.rand(5, picked, generator=generator) > 0.4
    window_mask[1] = False  # a token that reads only picked entries
    window_mask[2], valid[2] = False, False  # and one that reads nothing: only the sink
    window_mask[0], valid[0] = True, True
    return q, [(window, window_mask), (entries, valid)], torch.randn(4, generator=generator)


@pytest.mark.parametrize("picked", [3, 0])
def test_attention_in_parts_is_attention_over_the_parts_side_by_side(picked):
    q, parts, sink = _inputs(picked)
    keys, mask = (torch.cat(side, dim=1) for side in zip(*parts))
    got = attend_parts(q, parts, sink, 0.25)
    assert got.shape == (5, 4, 16)
    assert torch.allclose(got, attend_each(q, keys, mask, sink, 0.25), atol=1e-6, rtol=1e-6)
    assert torch.equal(got[2], torch.zeros(4, 16))  # all its weight on the sink


def test_attention_in_parts_is_the_softmax_with_a_sink_written_out():
    q, parts, sink = _inputs(3)
    keys = torch.cat([part[0][0] for part in parts]).double()  # token 0 reads every place
    for head in range(4):
        logits = [float(q[0, head].double() @ key) * 0.25 for key in keys]
        weights = [math.exp(x) for x in logits]
        total = sum(weights) + math.exp(float(sink[head]))
        expected = sum(w / total * key for w, key in zip(weights, keys))
        assert torch.allclose(attend_parts(q, parts, sink, 0.25)[0, head].double(), expected, atol=1e-5)
