"""Continuous batching: stop tokens, length limits, seeded sampling independent of the batch."""

from __future__ import annotations

import math

import pytest

from model.runtime.batcher import Batcher, generate
from model.runtime.engine import Engine
from model.runtime.sampling import SamplingParams

pytestmark = pytest.mark.unit


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


def test_the_image_placeholder_is_never_sampled(golden_model, golden_hasher, golden_prompts):
    """A model that reads images never answers with its image token (a next turn would
    carry it without an image): greedy takes the next best token, sampling cannot draw it."""
    _, model = golden_model
    prompt = golden_prompts[0]
    greedy = SamplingParams(temperature=0.0, max_tokens=6)
    plain = generate(Engine(model, golden_hasher), [prompt], greedy)[0]
    assert plain[:2] == [361, 1178] and 1178 not in prompt  # the golden greedy continuation
    reader = Engine(model, golden_hasher, image_token_id=1178)  # as if 1178 were the image placeholder
    banned = generate(reader, [prompt], greedy)[0]
    lowered = generate(Engine(model, golden_hasher), [prompt],
                       SamplingParams(temperature=0.0, max_tokens=6, logit_bias=((1178, -100),)))[0]
    assert banned == lowered and banned[0] == 361 and 1178 not in banned
    pushed = SamplingParams(temperature=1.0, seed=5, max_tokens=8, logit_bias=((1178, 100),))
    assert generate(Engine(model, golden_hasher), [prompt], pushed)[0].count(1178) == 8  # the bias alone wins
    assert 1178 not in generate(reader, [prompt], pushed)[0]
    # Log-probabilities stay the model's own: after 361 the placeholder is still its first choice.
    batcher = Batcher(reader)
    events = [batcher.add("a", SamplingParams(temperature=0.0, max_tokens=2, logprobs=1), prompt=prompt)]
    events += batcher.step()
    assert events[1].token_id == banned[1] and events[1].top_logprobs[0][0] == 1178
    assert math.isfinite(events[1].top_logprobs[0][1]) and events[1].top_logprobs[0][1] > events[1].logprob
