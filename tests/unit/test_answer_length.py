"""How long an answer may be (issue #62): a request that sets no length may run to the
end of the context, at most the server's ceiling, as OpenAI's API does; the prompt's
length, known once it is rendered, decides the room (:meth:`Prompts.fit`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from cluster.serving.images import ImageLimits
from cluster.serving.openai_api import parse_chat, parse_completion
from cluster.serving.prompts import Prompts
from cluster.serving.responses_api import parse_responses
from cluster.serving.validation import ApiError
from model.tokenizer import Tokenizer

pytestmark = pytest.mark.unit

GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "A"
MODEL = "m"
CONTEXT = 100


@pytest.fixture(scope="module")
def prompts() -> Prompts:
    return Prompts(Tokenizer.from_dir(GOLDEN), None, None, ImageLimits(), CONTEXT)


def _chat(prompts: Prompts, ceiling: int | None, text: str = "hi", **extra):
    request = parse_chat({"model": MODEL, "messages": [{"role": "user", "content": text}], **extra}, MODEL, ceiling)
    request, tokens = prompts.prepare(request)
    return prompts.fit(request, tokens), tokens


@pytest.mark.parametrize("ceiling", [None, 1000])
def test_a_chat_with_no_length_gets_the_room_its_prompt_leaves(prompts, ceiling):
    fitted, tokens = _chat(prompts, ceiling)
    assert fitted.params.max_tokens == CONTEXT - len(tokens) > 0


def test_the_ceiling_bounds_the_room_and_an_asked_length_is_kept(prompts):
    assert _chat(prompts, 7)[0].params.max_tokens == 7
    fitted, tokens = _chat(prompts, None, max_tokens=5)
    assert fitted.params.max_tokens == 5 and not fitted.fills_context


def test_a_prompt_with_no_room_left_is_a_400_and_an_asked_length_past_the_context_too(prompts):
    _, tokens = _chat(prompts, None)
    with pytest.raises(ApiError) as full:
        _chat(prompts, None, max_tokens=CONTEXT - len(tokens) + 1)
    assert full.value.code == "context_length_exceeded" and f"needs {CONTEXT + 1} tokens" in full.value.message
    long = "hi " * CONTEXT  # (at least CONTEXT tokens: no room for one answer token)
    with pytest.raises(ApiError) as no_room:
        _chat(prompts, None, text=long)
    assert no_room.value.status == 400 and no_room.value.code == "context_length_exceeded"
    assert _chat(prompts, None, max_tokens=CONTEXT - len(tokens))[0].params.max_tokens == CONTEXT - len(tokens)


def test_responses_with_no_max_output_tokens_fill_the_context_and_completions_take_openais_16(prompts):
    parsed = parse_responses({"model": MODEL, "input": "hi"}, MODEL, None, 4096)
    request, tokens = prompts.prepare(parsed.generation)
    assert prompts.fit(request, tokens).params.max_tokens == CONTEXT - len(tokens)
    with pytest.raises(ApiError) as caught:
        parse_responses({"model": MODEL, "input": "hi", "max_output_tokens": 65}, MODEL, 64, 4096)
    assert caught.value.param == "max_output_tokens" and "at most 64" in caught.value.message
    completion = parse_completion({"model": MODEL, "prompt": "def f"}, MODEL, None, 4096)
    request, tokens = prompts.prepare(completion)
    assert prompts.fit(request, tokens).params.max_tokens == 16
