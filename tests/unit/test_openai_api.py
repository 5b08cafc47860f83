"""The OpenAI request schemas: what they take, and what they refuse by name (no Ray)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from openai.types.chat import ChatCompletionChunk

from cluster.serving.openai_api import parse_chat, parse_completion
from cluster.serving.validation import ApiError, parse_json

pytestmark = pytest.mark.unit

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
    assert not request.fills_context


def test_an_answer_with_no_length_asked_may_run_to_the_ceiling_and_no_request_past_it():
    """As OpenAI: a chat that sets no length may run to the end of the context (here at
    most the server's ceiling, 16: the prompt's length, unknown yet, cuts it further;
    tests/unit/test_answer_length.py); a completion's default is OpenAI's 16 tokens; a
    request asking more than the ceiling is refused by the name it used."""
    unset = _chat()
    assert unset.fills_context and unset.params.max_tokens == 16
    assert parse_chat({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}, MODEL, None).params.max_tokens \
        == 1 << 20  # (no ceiling: the context decides)
    completion = parse_completion({"model": MODEL, "prompt": "x"}, MODEL, None, 100)
    assert completion.params.max_tokens == 16 and not completion.fills_context
    assert parse_completion({"model": MODEL, "prompt": "x"}, MODEL, 8, 100).params.max_tokens == 8
    for param in ("max_tokens", "max_completion_tokens"):
        assert _chat(**{param: 16}).params.max_tokens == 16
        with pytest.raises(ApiError, match="at most 16") as caught:
            _chat(**{param: 17})
        assert caught.value.status == 400 and caught.value.param == param


@pytest.mark.parametrize("extra, param, words", [
    ({"tools": [{"type": "function", "function": {"name": "f", "strict": True, "parameters": {"type": 7}}}]},
     "tools", "not a JSON schema"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}] * 2}, "tools", "same name"),
    ({"tools": [{"type": "function", "function": {"name": "no spaces"}}]}, "tools", "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice", "not among"),
    ({"tool_choice": "auto"}, "tool_choice", "no tools"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "json_schema is required"),
    ({"response_format": {"type": "yaml"}}, "response_format", "response_format"),
    ({"reasoning_effort": "huge"}, "reasoning_effort", "unknown reasoning_effort"),
    ({"top_logprobs": 2}, "top_logprobs", "needs logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", "0..20"),
    ({"presence_penalty": 2.5}, "presence_penalty", "presence_penalty"),
    ({"frequency_penalty": -2.5}, "frequency_penalty", "frequency_penalty"),
    ({"logit_bias": {"5": 101}}, "logit_bias", "logit_bias"),
    ({"logit_bias": {"a": 1}}, "logit_bias", "not a token id"),
    ({"n": 17}, "n", "n must be"),
    ({"n": 0}, "n", "n must be"),
    ({"temperature": "hot"}, "temperature", "temperature"),
    ({"temperature": True}, "temperature", "temperature"),
    ({"max_tokens": 0}, "max_tokens", "max_tokens"),
    ({"max_tokens": 2.5}, "max_tokens", "max_tokens"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop", "stop"),
    ({"stream": "yes"}, "stream", "stream"),
    ({"top_p": 7}, "top_p", "top_p"),
])
def test_a_parameter_is_implemented_or_refused_by_name(extra, param, words):
    with pytest.raises(ApiError, match=words) as caught:
        _chat(**extra)
    assert caught.value.status == 400 and caught.value.param == param
    assert caught.value.body()["error"]["type"] == "invalid_request_error"


def test_each_answer_gets_the_grammar_its_tool_choice_asks_for():
    """required / named: a calls block from the first answer token; auto: free text until
    the model's ｜DSML｜ token, then the rest of a block; none: free. With thinking, after
    </think>. Without the DSML token auto is free, and it cannot hold parallel_tool_calls
    false: that is a 400 naming it. A JSON answer asked beside tools is JSON or a calls
    block."""
    dsml, think_end = 9, 7
    weather = {"type": "function", "function": {"name": "weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
    tools = {"tools": [weather]}
    grammar, after, param = _chat(**tools, tool_choice="required").grammar(dsml, think_end)
    assert after == () and param == "tools" and 'calls>' in grammar and "weather" in grammar
    grammar, after, param = _chat(**tools).grammar(dsml, think_end)
    assert after == (dsml,) and param == "tools" and "weather" in grammar
    assert grammar.startswith('start: (" calls>\\n")')  # the marker's tail: its <｜DSML｜ is out already
    assert _chat(**tools, reasoning_effort="high").grammar(dsml, think_end)[1] == (think_end, dsml)
    single = _chat(**tools, parallel_tool_calls=False).grammar(dsml, think_end)[0]
    assert single != grammar and "invoke)*" in grammar and "invoke)*" not in single
    assert _chat(**tools, tool_choice="none").grammar(dsml, think_end) is None
    assert _chat().grammar(dsml, think_end) is None
    assert _chat(**tools).grammar(None, think_end) is None
    with pytest.raises(ApiError, match="parallel_tool_calls") as caught:
        _chat(**tools, parallel_tool_calls=False).grammar(None, think_end)
    assert caught.value.status == 400 and caught.value.param == "parallel_tool_calls"
    assert _chat(response_format={"type": "json_object"}).grammar(dsml, think_end)[1:] == ((), "response_format")
    # A JSON answer beside tools: under auto JSON or a calls block from the first token;
    # a forced call is a call; with no DSML token to tell them apart, a 400.
    json_format = {"response_format": {"type": "json_object"}}
    grammar, after, param = _chat(**tools, **json_format).grammar(dsml, think_end)
    assert after == () and param == "response_format" and grammar.startswith("start: answer | calls")
    assert _chat(**tools, **json_format, tool_choice="required").grammar(dsml, think_end)[2] == "tools"
    with pytest.raises(ApiError, match="tools") as caught:
        _chat(**tools, **json_format).grammar(None, think_end)
    assert caught.value.param == "response_format"


def test_messages_are_checked_field_by_field():
    for messages, words in (([], "messages"), ([{"content": "x"}], r"messages\[0\].role"),
                            ([{"role": "user", "content": "x", "tool_calls": [{"id": "c", "type": "function",
                                "function": {"name": "f", "arguments": "{}"}}]}], r"messages\[0\].*only assistant"),
                            ([{"role": "user", "content": "x", "tool_call_id": "c"}], r"messages\[0\].*only tool"),
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
    for extra in ({"echo": True}, {"best_of": 2}, {"suffix": "x"}):
        with pytest.raises(ApiError, match="not supported"):
            parse_completion({"model": MODEL, "prompt": "x", **extra}, MODEL, 8, 100)
    assert parse_completion({"model": MODEL, "prompt": "x", "logprobs": 2}, MODEL, 8, 100).params.logprobs == 2
    for extra in ({"logprobs": 6}, {"logit_bias": {"100": 1}}):
        with pytest.raises(ApiError, match="logprobs|vocabulary"):
            parse_completion({"model": MODEL, "prompt": "x", **extra}, MODEL, 8, 100)


def test_penalties_bias_and_logprobs_reach_the_sampling_parameters():
    params = _chat(presence_penalty=0.5, frequency_penalty=-1, logit_bias={"5": -100, "7": 2.5}, logprobs=True,
                   top_logprobs=3).params
    assert (params.presence_penalty, params.frequency_penalty) == (0.5, -1.0)
    assert params.logit_bias == ((5, -100.0), (7, 2.5)) and params.logprobs == 3
    assert _chat(logprobs=True).params.logprobs == 0 and _chat().params.logprobs is None


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


def test_tools_and_calls_in_the_history_are_parsed():
    weather = {"name": "get_weather", "description": "d", "parameters": {"type": "object"}}
    request = parse_chat({"model": MODEL, "tools": [{"type": "function", "function": weather}], "messages": [
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "x"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]}, MODEL, 16)
    assert request.tools == (weather,) and request.tool_choice == "auto" and request.parses_calls
    assert request.messages[0].role == "developer"
    assert request.messages[2].tool_calls[0].name == "get_weather"
    assert request.messages[2].tool_calls[0].arguments == '{"city": "x"}'
    assert request.messages[3].tool_call_id == "call_1"
    # The system block lists the function's name, description and parameters in that order.
    schema = {"parameters": {"type": "object"}, "name": "f"}
    listed = parse_chat({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "tool_choice": "none",
                         "tools": [{"type": "function", "function": schema}]}, MODEL, 16)
    assert list(listed.tools[0]) == ["name", "parameters"] and not listed.parses_calls


@pytest.mark.parametrize("name, thinking, effort", [
    (None, False, None), ("none", False, None), ("minimal", True, 25), ("low", True, 50), ("medium", True, 62),
    ("high", True, 75), ("xhigh", True, 100), ("max", True, 100)])
def test_openai_reasoning_effort_maps_onto_the_dial(name, thinking, effort):
    request = _chat(**({} if name is None else {"reasoning_effort": name}))
    assert (request.thinking, request.effort) == (thinking, effort)


def _released_tokenizer():
    import tokenizers

    from model.tokenizer import SYSTEM_TOKEN, Tokenizer
    from model.tools import DSML

    raw = tokenizers.Tokenizer.from_file(str(Path(__file__).parents[1] / "golden" / "A" / "tokenizer.json"))
    raw.add_special_tokens([tokenizers.AddedToken(t, special=True, normalized=False) for t in (SYSTEM_TOKEN, DSML)])
    return Tokenizer(raw.to_str())


def _generated_ids(tokenizer, text: str) -> list[int]:
    """``text`` as the model would generate it: ｜DSML｜ as its special token."""
    from model.tools import DSML

    ids = []
    for index, part in enumerate(text.split(DSML)):
        ids += ([tokenizer.special.dsml] if index else []) + tokenizer.encode(part)
    return ids


@pytest.mark.parametrize("thinking", [False, True])
def test_streamed_tool_calls_assemble_in_the_openai_sdk(thinking):
    """The deltas a chat answer with two calls streams, fed to the OpenAI SDK's own
    stream accumulator, give the message the non-streaming response gives."""
    from openai.lib.streaming.chat import ChatCompletionStreamState

    from cluster.serving.chat_answer import ChatAnswer
    from cluster.serving.openai_render import chat_choice, chat_chunk, chat_chunks, chat_response
    from model.tools import ToolCall, calls_text

    tokenizer = _released_tokenizer()
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}
    request = _chat(tools=[tool], **({"reasoning_effort": "low"} if thinking else {}))
    text = ("I should look." if thinking else "") + "Checking both." + calls_text(
        [ToolCall("get_weather", '{"city": "Paris", "days": 1}'), ToolCall("get_weather", '{"city": "Tokyo"}')])
    ids = _generated_ids(tokenizer, text)
    if thinking:
        cut = _generated_ids(tokenizer, "I should look.")
        ids = cut + [tokenizer.special.think_end] + ids[len(cut):]
    ids.append(tokenizer.special.eos)

    detokenizer = tokenizer.detokenizer()  # skips special tokens, as the decoder's does
    streamed, whole = ChatAnswer(request, tokenizer.special.think_end, tokenizer.special.dsml), \
        ChatAnswer(request, tokenizer.special.think_end, tokenizer.special.dsml)
    state = ChatCompletionStreamState(input_tools=[tool])
    state.handle_chunk(ChatCompletionChunk.model_validate(chat_chunk("id", MODEL, {"role": "assistant"}, None)))
    for position, token in enumerate(ids):
        piece = detokenizer.push(token)
        last = position == len(ids) - 1
        whole.push(token, piece)
        deltas = streamed.push(token, piece) + (streamed.finish() if last else [])
        finish = streamed.finish_reason("stop") if last else None
        for chunk in chat_chunks("id", MODEL, deltas, finish):
            state.handle_chunk(ChatCompletionChunk.model_validate(chunk))
    whole.finish()
    message = state.get_final_completion().choices[0].message
    assert message.content == "Checking both."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == [
        ("get_weather", {"city": "Paris", "days": 1}), ("get_weather", {"city": "Tokyo"})]
    assert state.get_final_completion().choices[0].finish_reason == "tool_calls"
    assert getattr(message, "reasoning_content", None) == ("I should look." if thinking else None)
    body = chat_response("id", MODEL, [chat_choice(0, whole.content, whole.reasoning, whole.finish_reason("stop"),
                                                whole.calls)], {})
    assert body["choices"][0]["message"]["content"] == message.content
    assert [c["function"]["name"] for c in body["choices"][0]["message"]["tool_calls"]] == ["get_weather"] * 2
    assert body["choices"][0]["finish_reason"] == "tool_calls"


def test_forced_calls_and_json_answers_are_parsed():
    tool = {"type": "function", "function": {"name": "f", "strict": True, "parameters": {"type": "object"}}}
    named = _chat(tools=[tool], tool_choice={"type": "function", "function": {"name": "f"}},
                  parallel_tool_calls=False)
    assert (named.tool_choice, named.tool_name, named.parallel_tool_calls) == ("function", "f", False)
    assert named.forces_calls and named.parses_calls
    assert _chat(tools=[tool], tool_choice="required").forces_calls
    assert _chat(response_format={"type": "json_object"}).response_format == {"schema": None}
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    assert _chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema,
                                                                          "strict": True}}).response_format == {
        "schema": schema}
    assert _chat(response_format={"type": "text"}).response_format is None


def test_a_strict_tools_call_that_breaks_its_schema_comes_back_as_text():
    from cluster.serving.chat_answer import ChatAnswer
    from model.tools import ToolCall, calls_text

    tool = {"type": "function", "function": {"name": "f", "strict": True, "parameters": {
        "type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}}}
    loose = {"type": "function", "function": {"name": "g", "parameters": {"type": "object"}}}
    request = _chat(tools=[tool, loose])
    assert request.strict_tools == {"f"}
    for calls, kept in (([ToolCall("f", '{"n": 3}'), ToolCall("g", '{"x": "y"}')], 2),
                        ([ToolCall("f", '{"n": "three"}')], 0),  # breaks f's schema
                        ([ToolCall("h", '{}')], 0)):  # no such tool
        answer = ChatAnswer(request, think_end=6, dsml=None)
        text = "ok" + calls_text(calls)
        for piece in (text[:20], text[20:]):
            answer.push(-1, piece)
        answer.finish()
        assert len(answer.calls) == kept
        assert answer.content == ("ok" if kept else text)
