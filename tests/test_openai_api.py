"""The OpenAI request schemas: what they take, and what they refuse by name (no Ray)."""

from __future__ import annotations

import pytest

from cluster.openai_api import ApiError, parse_chat, parse_completion, parse_json

MODEL = "m"


def _chat(**extra):
    return parse_chat({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **extra}, MODEL, 16)


def test_a_chat_request_becomes_a_generation_request():
    request = parse_chat({"model": MODEL, "messages": [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None, "reasoning_content": "hmm"},
    ], "max_completion_tokens": 5, "temperature": 0, "top_p": 0.5, "seed": 3, "stop": ["x", "y"], "stream": True,
        "stream_options": {"include_usage": True}, "n": 1, "presence_penalty": 0, "user": "u-1"}, MODEL, 16)
    assert [m.content for m in request.messages] == ["be brief", "ab", ""]
    assert request.messages[2].reasoning == "hmm"
    assert request.params.max_tokens == 5 and request.params.temperature == 0.0 and request.params.seed == 3
    assert request.params.stop == ("x", "y") and request.stream and request.include_usage
    assert _chat().params.max_tokens == 16  # the server's default


@pytest.mark.parametrize("extra, param, words", [
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools", "tools is not supported"),
    ({"response_format": {"type": "json_object"}}, "response_format", "not supported"),
    ({"logprobs": True}, "logprobs", "logprobs is not supported"),
    ({"presence_penalty": 0.5}, "presence_penalty", "presence_penalty is not supported"),
    ({"logit_bias": {"5": 1.0}}, "logit_bias", "logit_bias is not supported"),
    ({"n": 3}, "n", "only n=1"),
    ({"temperature": "hot"}, "temperature", "temperature"),
    ({"temperature": True}, "temperature", "temperature"),
    ({"max_tokens": 0}, "max_tokens", "max_tokens"),
    ({"max_tokens": 2.5}, "max_tokens", "max_tokens"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop", "stop"),
    ({"stream": "yes"}, "stream", "stream"),
    ({"top_p": 7}, None, "top_p"),
])
def test_a_parameter_is_implemented_or_refused_by_name(extra, param, words):
    with pytest.raises(ApiError, match=words) as caught:
        _chat(**extra)
    assert caught.value.status == 400 and caught.value.param == param
    assert caught.value.body()["error"]["type"] == "invalid_request_error"


def test_messages_are_checked_field_by_field():
    for messages, words in (([], "messages"), ([{"content": "x"}], r"messages\[0\].role"),
                            ([{"role": "user", "content": "x", "tool_calls": []}], r"messages\[0\].tool_calls is not"),
                            ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], "messages"),
                            ([{"role": "wizard", "content": "x"}], "messages")):
        with pytest.raises(ApiError, match=words) as caught:
            parse_chat({"model": MODEL, "messages": messages}, MODEL, 16)
        assert caught.value.status == 400


def test_the_model_is_required_and_must_be_served():
    with pytest.raises(ApiError, match="model is required"):
        parse_chat({"messages": [{"role": "user", "content": "x"}]}, MODEL, 16)
    with pytest.raises(ApiError, match="does not exist") as caught:
        parse_chat({"model": "other", "messages": [{"role": "user", "content": "x"}]}, MODEL, 16)
    assert caught.value.status == 404 and caught.value.code == "model_not_found"


def test_completions_take_text_or_ids_in_the_vocabulary():
    assert parse_completion({"model": MODEL, "prompt": "def f"}, MODEL, 8, 100).prompt == "def f"
    assert parse_completion({"model": MODEL, "prompt": [1, 2, 99]}, MODEL, 8, 100).prompt == (1, 2, 99)
    for prompt in ([1, 100], [], "", [True]):
        with pytest.raises(ApiError, match="prompt"):
            parse_completion({"model": MODEL, "prompt": prompt}, MODEL, 8, 100)
    for extra in ({"echo": True}, {"best_of": 2}, {"suffix": "x"}, {"logprobs": 2}):
        with pytest.raises(ApiError, match="not supported"):
            parse_completion({"model": MODEL, "prompt": "x", **extra}, MODEL, 8, 100)


@pytest.mark.parametrize("body, words", [
    (b"{not json", "not valid JSON"),
    (b"\xff\xfe{}", "not valid JSON"),
    (b"[1, 2]", "must be a JSON object"),
    (b'{"a":' * 100_000 + b"1" + b"}" * 100_000, "nested deeper than 64"),  # past the parser's recursion
    (b'{"a": ' + b"[" * 65 + b"]" * 65 + b"}", "nested deeper than 64"),
    (b'{"messages": [{"role": "user", "content": "\\ud800"}]}', "messages[0].content: not valid Unicode"),
    (b'{"\\udfff": 1}', "not valid Unicode"),
])
def test_hostile_bodies_are_refused_with_a_400(body, words):
    with pytest.raises(ApiError) as error:
        parse_json(body)
    assert error.value.status == 400 and words in error.value.message


def test_a_body_within_the_limits_parses():
    body = b'{"a": ' + b"[" * 63 + b"]" * 63 + b', "b": "\\ud83d\\ude00"}'  # a surrogate pair is one character
    assert parse_json(body)["b"] == "\U0001F600"
