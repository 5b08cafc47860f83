"""The Responses and Conversations APIs end to end through the OpenAI SDK: a cached tool
loop, stored responses continued, retrieved and deleted, conversations carrying a tool
loop and changed concurrently, and the 4xx of bad requests and unknown records."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Literal

import openai
import pytest

from tests.serve_harness import post_json

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
MODEL = "deepseek-v4.1-small"


def test_the_responses_api_runs_a_cached_tool_loop_through_the_sdk(client):
    """The Responses API (the OpenAI Agents SDK's default): a forced call, its output
    items and result sent back as input (the next turn reads the first from the cache),
    a stream the SDK reassembles into the unstreamed response, logprobs, and
    ``responses.parse`` with a pydantic model."""
    import pydantic

    class Point(pydantic.BaseModel):
        x: int = pydantic.Field(ge=0, le=99)
        label: Literal["a", "b"]

    tool = {"type": "function", "name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"],
        "additionalProperties": False}}
    common = {"model": MODEL, "tools": [tool], "instructions": "Answer briefly.", "temperature": 0}
    question = [{"role": "user", "content": "What is the weather in Paris?\n" * 4}]
    first = client.responses.create(input=question, tool_choice="required", parallel_tool_calls=False,
                                    max_output_tokens=300, **common)
    assert first.status == "completed" and [item.type for item in first.output] == ["function_call"]
    call = first.output[0]
    assert call.name == "get_weather" and json.loads(call.arguments)["city"] in ("Paris", "Rome")
    turn = question + [item.model_dump(exclude_none=True) for item in first.output] + [
        {"type": "function_call_output", "call_id": call.call_id, "output": "18 C"}]
    asked = {"input": turn, "max_output_tokens": 8, "include": ["message.output_text.logprobs"], "top_logprobs": 2,
             **common}
    second = client.responses.create(**asked)
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens + first.usage.output_tokens - 1
    with client.responses.stream(**asked) as stream:  # (get_final_response wants a completed one)
        streamed = [event for event in stream if event.type in ("response.completed", "response.incomplete")][-1]
    streamed = streamed.response
    assert [item.type for item in streamed.output] == [item.type for item in second.output]
    assert streamed.output_text == second.output_text and streamed.status == second.status
    for message in (item for item in second.output if item.type == "message"):
        assert message.content[0].logprobs and all(len(entry.top_logprobs) == 2
                                                   for entry in message.content[0].logprobs)
    parsed = client.responses.parse(model=MODEL, input="def distance(p, q):\n", text_format=Point,
                                    max_output_tokens=300, temperature=0)
    assert isinstance(parsed.output_parsed, Point), parsed.output_text


@pytest.mark.parametrize("path, status, param", [
    ("/v1/responses/resp_nope", 404, None),
    ("/v1/responses/resp_nope/input_items", 404, None),
    ("/v1/responses/resp_nope/input_items?limit=x", 400, "limit"),
    ("/v1/conversations/conv_nope", 404, None),
    ("/v1/conversations/conv_nope/items", 404, None),
    ("/v1/conversations/conv_nope/items/msg_1", 404, None),
    ("/v1/conversations/conv_nope/items?limit=x", 400, "limit"),
    ("/v1/conversations/conv_nope/items?include=message.output_text.logprobs", 400, "include"),
])
def test_stored_response_lookups_answer_4xx_in_the_openai_shape(app, path, status, param):
    try:
        with urllib.request.urlopen(f"{app}{path}", timeout=60) as response:
            got, payload = response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        got, payload = error.code, json.loads(error.read())
    assert got == status and payload["error"]["param"] == param and payload["error"]["message"]


def test_a_stored_response_is_continued_retrieved_and_deleted(client):
    """``store`` (the default): a turn that names the previous response
    (``previous_response_id``) and sends only the call's output is the turn that sends
    the whole conversation, read from the cache; the response and its input come back
    through the SDK; deleted, it is gone."""
    tool = {"type": "function", "name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"],
        "additionalProperties": False}}
    common = {"model": MODEL, "tools": [tool], "instructions": "Answer briefly.", "temperature": 0}
    question = "What is the weather in Rome?\n" * 4
    first = client.responses.create(input=question, tool_choice="required", parallel_tool_calls=False,
                                    max_output_tokens=300, **common)
    call = first.output[-1]
    assert call.type == "function_call" and first.store and first.previous_response_id is None
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "21 C"}
    second = client.responses.create(previous_response_id=first.id, input=[result], max_output_tokens=8, **common)
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens + first.usage.output_tokens - 1
    whole = client.responses.create(input=[{"role": "user", "content": question}, *(
        item.model_dump(exclude_none=True) for item in first.output), result], max_output_tokens=8, store=False,
        **common)
    assert whole.usage.input_tokens == second.usage.input_tokens and whole.output_text == second.output_text
    assert not whole.store

    got = client.responses.retrieve(second.id)
    assert got.output_text == second.output_text and got.usage == second.usage
    items = client.responses.input_items.list(second.id, order="asc")
    assert [item.type for item in items.data] == ["message", "function_call", "function_call_output"]
    assert items.data[0].content[0].text == question and items.data[2].call_id == call.call_id
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(whole.id)  # store: false
    client.responses.delete(second.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(second.id)
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model=MODEL, previous_response_id=second.id, input="and?")
    assert caught.value.param == "previous_response_id" and caught.value.code == "previous_response_not_found"
    assert client.responses.retrieve(first.id).id == first.id  # the one before is still kept


def test_a_conversation_carries_a_tool_loop_and_is_listed_changed_and_deleted(client, app):
    """The Conversations API through the SDK: a Responses turn naming a conversation
    joins its input and output to it; the next turn sends only the call's output and is
    the turn that sends the whole conversation, read from the cache; its items are
    listed in pages, added, retrieved and deleted, its metadata replaced; deleted, it is
    a 404, and a 400 naming it as a Responses ``conversation``."""
    tool = {"type": "function", "name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"],
        "additionalProperties": False}}
    common = {"model": MODEL, "tools": [tool], "instructions": "Answer briefly.", "temperature": 0}
    question = "What is the weather in Paris?\n" * 4
    conversation = client.conversations.create(items=[{"role": "user", "content": question}],
                                               metadata={"user": "test"})
    assert conversation.id.startswith("conv_") and conversation.metadata == {"user": "test"}
    first = client.responses.create(conversation=conversation.id, input=[], tool_choice="required",
                                    parallel_tool_calls=False, max_output_tokens=300, **common)
    call = first.output[-1]
    assert call.type == "function_call" and first.conversation.id == conversation.id
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "18 C"}
    second = client.responses.create(conversation={"id": conversation.id}, input=[result], max_output_tokens=8,
                                     **common)
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens + first.usage.output_tokens - 1
    whole = client.responses.create(input=[{"role": "user", "content": question}, *(
        item.model_dump(exclude_none=True) for item in first.output), result], max_output_tokens=8, store=False,
        **common)
    assert whole.usage.input_tokens == second.usage.input_tokens and whole.output_text == second.output_text

    # Every item, oldest first, through the SDK's pagination (two a page).
    items = list(client.conversations.items.list(conversation.id, order="asc", limit=2))
    assert [item.type for item in items] == ["message", *(item.type for item in first.output),
                                             "function_call_output", *(item.type for item in second.output)]
    assert items[0].content[0].text == question and items[len(first.output)].call_id == call.call_id
    assert [item.id for item in client.conversations.items.list(conversation.id, limit=100).data] == \
        [item.id for item in reversed(items)]  # newest first by default
    added = client.conversations.items.create(conversation.id, items=[{"role": "user", "content": "Thanks."}])
    assert client.conversations.items.retrieve(added.data[0].id, conversation_id=conversation.id).content[0].text \
        == "Thanks."
    assert client.conversations.items.delete(items[0].id, conversation_id=conversation.id).id == conversation.id
    left = [item.id for item in client.conversations.items.list(conversation.id, order="asc", limit=100).data]
    assert left == [item.id for item in items[1:]] + [added.data[0].id]
    assert client.conversations.update(conversation.id, metadata={"user": "other"}).metadata == {"user": "other"}
    assert client.conversations.retrieve(conversation.id).created_at == conversation.created_at

    status, payload = post_json(f"{app}/v1/conversations/{conversation.id}/items", b'{"items": [{"type": "x"}]}')
    assert status == 400 and payload["error"]["param"] == "items"
    assert client.conversations.delete(conversation.id).deleted
    with pytest.raises(openai.NotFoundError):
        client.conversations.retrieve(conversation.id)
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model=MODEL, conversation=conversation.id, input="and?")
    assert caught.value.param == "conversation" and caught.value.code == "conversation_not_found"


def test_concurrent_changes_to_a_conversation_take_turns(client):
    """Sixteen clients adding items to one conversation at once: every item is kept,
    once (each change reads the version the one before it wrote)."""
    from concurrent.futures import ThreadPoolExecutor

    conversation = client.conversations.create()
    with ThreadPoolExecutor(16) as pool:
        added = list(pool.map(lambda n: client.conversations.items.create(
            conversation.id, items=[{"role": "user", "content": f"item {n}"}]).data[0].id, range(16)))
    listed = client.conversations.items.list(conversation.id, limit=100).data
    assert sorted(item.id for item in listed) == sorted(added)
    assert sorted(item.content[0].text for item in listed) == sorted(f"item {n}" for n in range(16))


@pytest.mark.parametrize("body, status, param", [
    ({"model": "gpt-9", "input": "x"}, 404, "model"),
    ({"model": MODEL, "input": "x", "previous_response_id": "resp_1"}, 400, "previous_response_id"),
    ({"model": MODEL, "input": "x", "previous_response_id": 7}, 400, "previous_response_id"),
    ({"model": MODEL, "input": "x", "conversation": "conv_1"}, 400, "conversation"),
    ({"model": MODEL, "input": [{"type": "item_reference", "id": "msg_1"}]}, 400, "input"),
])
def test_bad_responses_requests_are_4xx_naming_the_parameter(app, body, status, param):
    got, payload = post_json(f"{app}/v1/responses", json.dumps(body).encode())
    assert got == status and payload["error"]["param"] == param and payload["error"]["message"]
