"""Continuous batching: stop tokens, length limits, seeded sampling independent of the batch."""

from __future__ import annotations

import torch

from model.runtime.batcher import Batcher, generate
from model.runtime.engine import Engine
from model.runtime.sampling import SamplingParams


def _prompts(golden_prompts):
    return [golden_prompts[0], golden_prompts[1][:77], golden_prompts[2][:120]]


def test_seeded_sampling_is_independent_of_batch_composition(golden_model, golden_hasher, golden_prompts):
    _, model = golden_model
    engine = Engine(model, golden_hasher)
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=11, max_tokens=8)
    together = generate(engine, _prompts(golden_prompts), params, max_batch=3)
    alone = [generate(engine, [p], params)[0] for p in _prompts(golden_prompts)]
    assert together == alone
    assert all(len(t) == 8 for t in together)
    # A batch of one at a time (requests wait for a free slot) gives the same tokens too.
    assert generate(engine, _prompts(golden_prompts), params, max_batch=1) == alone


def test_stop_tokens_end_requests_and_the_batch_shrinks(golden_model, golden_hasher, golden_prompts):
    _, model = golden_model
    engine = Engine(model, golden_hasher, bounded_replay=False)
    # Golden greedy continuation of prompt 0 starts 361, 1178, 2047: stop at the third.
    params = SamplingParams(temperature=0.0, max_tokens=20, stop_token_ids=(2047,))
    batcher = Batcher(engine)
    first = batcher.add("a", params, prompt=golden_prompts[0])
    assert first.token_id == 361 and first.finish_reason is None
    events = batcher.step()
    assert [(e.token_id, e.finish_reason) for e in events] == [(1178, None)]
    events = batcher.step()
    assert [(e.token_id, e.finish_reason) for e in events] == [(2047, "stop")]
    assert not batcher.running and batcher.step() == []
    assert generate(engine, [golden_prompts[0]], params) == [[361, 1178]]
    assert generate(engine, [golden_prompts[0]], SamplingParams(temperature=0.0, max_tokens=2)) == [[361, 1178]]
