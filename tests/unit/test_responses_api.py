"""The Responses API's request mapping and stream events, without a server: input items
become the chat turns they mean, errors name the Responses parameter, and the events a
response streams rebuild (through the OpenAI SDK's own accumulator) the response the
server returns unstreamed."""

from __future__ import annotations

import json

import pytest
from openai import omit
from openai._models import construct_type
from openai.lib.streaming.responses._responses import ResponseStreamState
from openai.types.responses import ResponseStreamEvent

from cluster.serving.records import RecentRecords
from cluster.serving.request import OPENAI_EFFORT
from cluster.serving.response_items import encoded, history, input_items_page, read_record
from cluster.serving.responses_api import parse_responses, record
from cluster.serving.responses_render import ResponseBuilder, usage
from cluster.serving.validation import ApiError
from model.chat import Message
from model.tools import ToolCall

pytestmark = pytest.mark.unit

MODEL = "m"
TOOL = {"type": "function", "name": "count_lines", "description": "Lines of a module.",
        "parameters": {"type": "object", "properties": {"module": {"type": "string"}}, "required": ["module"]}}


def _parse(**body):
    return parse_responses({"model": MODEL, **body}, MODEL, ceiling=64, vocab_size=4096)


def test_input_items_become_the_chat_turns_they_mean() -> None:
    """An assistant turn is the reasoning, text and calls of its consecutive items;
    results and user turns stay apart; instructions are the system turn."""
    parsed = _parse(instructions="Be brief.", tools=[TOOL], tool_choice={"type": "function", "name": "count_lines"},
                    reasoning={"effort": "medium"}, max_output_tokens=9, input=[
                        {"role": "user", "content": [{"type": "input_text", "text": "Lines of "},
                                                     {"type": "input_text", "text": "glob?"}]},
                        {"type": "reasoning", "id": "rs_1", "summary": [],
                         "content": [{"type": "reasoning_text", "text": "Count them."}]},
                        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
                         "content": [{"type": "output_text", "text": "Calling.", "annotations": [], "logprobs": []}]},
                        {"type": "function_call", "call_id": "c1", "name": "count_lines",
                         "arguments": '{"module": "glob"}', "id": "fc_1", "status": "completed"},
                        {"type": "function_call", "call_id": "c2", "name": "count_lines",
                         "arguments": '{"module": "re"}'},
                        {"type": "function_call_output", "call_id": "c2", "output": "400"},
                        {"type": "function_call_output", "call_id": "c1",
                         "output": [{"type": "input_text", "text": "12"}, {"type": "input_text", "text": "0"}]},
                        {"role": "developer", "content": "Now sum."}])
    request = parsed.generation
    assert request.messages == (
        Message("system", "Be brief."), Message("user", "Lines of glob?"),
        Message("assistant", "Calling.", reasoning="Count them.", tool_calls=(
            ToolCall("count_lines", '{"module": "glob"}', "c1"), ToolCall("count_lines", '{"module": "re"}', "c2"))),
        Message("tool", "400", tool_call_id="c2"), Message("tool", "120", tool_call_id="c1"),
        Message("developer", "Now sum."))
    assert request.tool_choice == "function" and request.tool_name == "count_lines"
    assert request.strict_tools == {"count_lines"}  # the Responses API's default
    assert request.thinking and request.effort == OPENAI_EFFORT["medium"] and request.params.max_tokens == 9
    assert parsed.echo["tools"] == [TOOL] and parsed.echo["reasoning"] == {"effort": "medium", "summary": None}


def test_text_format_logprobs_and_plain_input() -> None:
    schema = {"type": "object", "properties": {"x": {"type": "integer"}}}
    parsed = _parse(input="hi", text={"format": {"type": "json_schema", "name": "p", "schema": schema}},
                    include=["message.output_text.logprobs"], top_logprobs=3, temperature=0)
    request = parsed.generation
    assert request.messages == (Message("user", "hi"),)
    assert request.response_format == {"schema": schema} and request.params.logprobs == 3 and parsed.logprobs
    assert not request.thinking and request.params.temperature == 0
    assert _parse(input="hi", text={"format": {"type": "json_object"}}).generation.response_format == {"schema": None}
    assert _parse(input="hi", tools=[{**TOOL, "strict": False}]).generation.strict_tools == frozenset()


@pytest.mark.parametrize("body, param, says", [
    ({"store": True}, "store", "keeps no responses"),
    ({"previous_response_id": "resp_1"}, "previous_response_id", "keeps no responses"),
    ({"conversation": "conv_1"}, "conversation", "keeps no responses or conversations"),
    ({"tools": [{"type": "web_search"}]}, "tools", "tools[0].type"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input", "input[0]"),
    ({"input": [{"role": "user", "content": "a"}, {"role": "user", "content": [
        {"type": "output_text", "text": "b"}]}]}, "input", "input[1].content[0]"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f"}]}, "input", "input[0].arguments"),
    ({"max_output_tokens": 0}, "max_output_tokens", "positive"),
    ({"top_logprobs": 2}, "top_logprobs", "include"),
    ({"reasoning": {"effort": "huge"}}, "reasoning.effort", "huge"),
    ({"reasoning": {"effort": "low", "summary": "auto"}}, "reasoning", "reasoning.summary"),
    ({"text": {"format": {"type": "json_schema", "schema": {}}}}, "text.format", "name"),
    ({"text": {"format": {"type": "json_object", "schema": {}}}}, "text.format", "only type json_schema takes schema"),
    ({"input": [{"type": "function_call_output", "call_id": "c9", "output": "1"}]}, "input", "input[0]: no function"),
    ({"input": [{"role": "user", "content": "a"}, {"type": "function_call", "call_id": "c", "name": "f",
                                                   "arguments": "{}"}, {"type": "reasoning", "summary": []}]},
     "input", "input[2]: a reasoning item begins"),
    ({"tools": [TOOL], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice", "nope"),
    ({"instructions": "x", "input": [{"role": "user", "content": "a"}, {"role": "user", "content": [
        {"type": "input_image", "image_url": "data:image/png;base64,AAAA"}]}]},
     "input[1].content[0].image_url", "input[1].content[0].image_url: this model reads no images"),
])
def test_errors_name_the_responses_parameter(body, param, says) -> None:
    with pytest.raises(ApiError) as caught:
        _parse(**{"input": "hi", **body})
    assert caught.value.status == 400 and caught.value.param == param and says in caught.value.message


def _kept(history_=(), **body):
    return parse_responses({"model": MODEL, **body}, MODEL, ceiling=64, vocab_size=4096, keeps=True,
                           history=history_)


def _answered(parsed, deltas: list[dict]) -> dict:
    """The final response object of ``parsed`` answered by ``deltas``."""
    builder = parsed.builder("resp_1", MODEL)
    builder.push(deltas)
    return builder.finish("stop", usage(5, 2, 0, 0, 64))[-1]["response"]


def test_a_stored_response_carries_its_conversation_into_the_next() -> None:
    """What the store keeps of a response, read back, puts its input and output before
    the input of a request naming it: the same chat turns as the whole conversation sent
    as input, the call's output answering a call of the stored turn."""
    first = _kept(instructions="Be brief.", tools=[TOOL], input="Lines of glob?")
    assert first.store and first.echo["store"] is True and first.echo["previous_response_id"] is None
    assert first.input_items[0]["id"].startswith("msg_") and first.input_items[0]["content"] == "Lines of glob?"
    response = _answered(first, [{"content": "Calling."}, {"tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "count_lines", "arguments": '{"module": "glob"}'}}]}])
    stored = read_record(encoded(record(first, response)))
    assert stored == record(first, response) and stored["response"] == response

    carried = history(stored)
    then = [{"type": "function_call_output", "call_id": "c1", "output": "120"}]
    second = _kept(carried, instructions="Be brief.", tools=[TOOL], input=then, previous_response_id="resp_1")
    whole = _kept(instructions="Be brief.", tools=[TOOL], input=[*carried, *then])
    assert second.generation.messages == whole.generation.messages == (
        Message("system", "Be brief."), Message("user", "Lines of glob?"),
        Message("assistant", "Calling.", tool_calls=(ToolCall("count_lines", '{"module": "glob"}', "c1"),)),
        Message("tool", "120", tool_call_id="c1"))
    assert second.echo["previous_response_id"] == "resp_1"
    # Its own record holds the whole input, every item with an id, this request's last.
    assert [item["type"] for item in second.input_items] == ["message", "message", "function_call",
                                                             "function_call_output"]
    assert second.input_items[-1]["id"].startswith("fco_") and second.input_items[-1]["output"] == "120"
    # The instructions are not carried over (OpenAI's rule): each request gives its own.
    assert _kept(carried, input=then, previous_response_id="resp_1").generation.messages[0] == \
        Message("user", "Lines of glob?")
    # An error in this request's input is named by its own index, not the carried items'.
    with pytest.raises(ApiError) as caught:
        _kept(carried, input=[{"type": "function_call_output", "call_id": "c9", "output": "1"}],
              previous_response_id="resp_1")
    assert caught.value.message.startswith("input[0]: no function_call")


def test_store_false_keeps_nothing_and_bad_records_read_as_misses() -> None:
    assert not _kept(input="hi", store=False).store and _kept(input="hi", store=False).input_items == ()
    assert _kept(input="hi", store=False).echo["store"] is False
    good = encoded(record(_kept(input="hi"), _answered(_kept(input="hi"), [{"content": "yo"}])))
    for payload in (None, b"", b"\x80\x04pickle", b"[]", good[:-1], good.replace(b'"output":[', b'"output":[7,'),
                    json.dumps({"response": {"id": "r", "output": []}, "input": [{"type": "nope"}]}).encode()):
        assert read_record(payload) is None
    assert read_record(good) is not None


def test_input_items_are_listed_newest_first_in_pages() -> None:
    parsed = _kept(input=[{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                          {"role": "user", "content": [{"type": "input_text", "text": "c"}], "id": "msg_mine"}])
    stored = read_record(encoded(record(parsed, _answered(parsed, [{"content": "d"}]))))
    ids = [item["id"] for item in parsed.input_items]
    assert ids[2] == "msg_mine" and len(set(ids)) == 3
    page = input_items_page(stored, limit=2)
    assert [item["id"] for item in page["data"]] == [ids[2], ids[1]] and page["has_more"]
    assert page["first_id"] == ids[2] and page["last_id"] == ids[1]
    assert page["data"][1]["content"] == [{"type": "output_text", "text": "b", "annotations": []}]
    rest = input_items_page(stored, after=page["last_id"], limit=2)
    assert [item["id"] for item in rest["data"]] == [ids[0]] and not rest["has_more"]
    assert rest["data"][0]["content"] == [{"type": "input_text", "text": "a"}]
    assert [item["id"] for item in input_items_page(stored, order="asc")["data"]] == ids
    for args, param in (({"limit": 0}, "limit"), ({"order": "up"}, "order"), ({"after": "msg_x"}, "after")):
        with pytest.raises(ApiError) as caught:
            input_items_page(stored, **args)
        assert caught.value.status == 400 and caught.value.param == param


def test_recent_records_keep_their_bytes_least_recently_used_out() -> None:
    recent = RecentRecords(10)
    for rid, size in (("a", 4), ("b", 4), ("a", 4)):  # "a" again: replaced, and now the newest
        recent.put(rid, {"id": rid}, size)
    assert len(recent) == 2 and recent.get("b") == {"id": "b"}  # "b" is now the newest
    recent.put("c", {"id": "c"}, 4)  # 12 bytes: the least recently used ("a") goes
    assert recent.get("a") is None and len(recent) == 2
    recent.pop("b")
    recent.put("d", {"id": "d"}, 6)
    assert recent.get("c") == {"id": "c"} and recent.get("d") == {"id": "d"}
    recent.put("e", {"id": "e"}, 11)  # bigger than it holds: nothing stays
    assert len(recent) == 0


def _events(builder: ResponseBuilder, deltas: list[dict], finish: str) -> list[dict]:
    return builder.start() + builder.push(deltas) + builder.finish(finish, usage(5, len(deltas), 2, 3, 64))


def _reassembled(events: list[dict]):
    """The final response as the OpenAI SDK's stream helper builds it from the events."""
    state = ResponseStreamState(input_tools=[TOOL], text_format=omit)
    for event in events:
        state.handle_event(construct_type(type_=ResponseStreamEvent, value=json.loads(json.dumps(event))))
    return state._completed_response


def test_the_stream_events_rebuild_the_response_in_the_sdk() -> None:
    """Reasoning, text, a call and text after it: four items, each added then done, in
    sequence; the SDK's accumulator rebuilds the response the builder ends with."""
    call = {"index": 0, "id": "call_1", "type": "function",
            "function": {"name": "count_lines", "arguments": '{"module": "glob"}'}}
    lp = {"token": "Hi", "logprob": -0.5, "bytes": [72, 105], "top_logprobs": []}
    deltas = [{"reasoning_content": "Let me "}, {"reasoning_content": "count."},
              {"content": "Hi", "logprobs": {"content": [lp]}}, {"content": " there."},
              {"tool_calls": [call], "logprobs": {"content": [lp, lp]}},  # the markup's: nowhere to go
              {"content": "Done."}]
    builder = ResponseBuilder("resp_1", MODEL, {"tools": [TOOL], "parallel_tool_calls": True, "tool_choice": "auto"},
                              logprobs=True, thinking=True)
    events = _events(builder, deltas, "tool_calls")
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    kinds = [e["type"] for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert kinds.count("response.output_item.added") == kinds.count("response.output_item.done") == 4
    final = events[-1]["response"]
    assert [item["type"] for item in final["output"]] == ["reasoning", "message", "function_call", "message"]
    assert final["output"][0]["content"] == [{"type": "reasoning_text", "text": "Let me count."}]
    assert final["output"][1]["content"][0]["text"] == "Hi there." and final["output"][1]["content"][0]["logprobs"] \
        == [lp]
    assert final["output"][2]["call_id"] == "call_1" and final["output"][2]["arguments"] == '{"module": "glob"}'
    assert final["status"] == "completed" and final["usage"]["output_tokens_details"] == {"reasoning_tokens": 3}
    rebuilt = _reassembled(events)
    assert rebuilt.output_text == "Hi there.Done."
    assert [item.type for item in rebuilt.output] == ["reasoning", "message", "function_call", "message"]
    assert rebuilt.output[2].arguments == '{"module": "glob"}' and rebuilt.output[1].content[0].logprobs[0].logprob \
        == -0.5


def test_a_turn_that_thought_nothing_still_says_it_thought() -> None:
    """Thinking on and an empty reasoning: an empty reasoning item comes first, so the
    turn sent back renders as it was generated; out of tokens, the response is incomplete."""
    builder = ResponseBuilder("resp_2", MODEL, {"tools": [], "parallel_tool_calls": True, "tool_choice": "auto"},
                              thinking=True)
    events = _events(builder, [{"content": "Four."}], "length")
    final = events[-1]["response"]
    assert events[-1]["type"] == "response.incomplete" and final["status"] == "incomplete"
    assert final["incomplete_details"] == {"reason": "max_output_tokens"}
    assert [item["type"] for item in final["output"]] == ["reasoning", "message"]
    assert final["output"][0]["content"] == [{"type": "reasoning_text", "text": ""}]
    assert final["output"][1]["status"] == "incomplete"
    again = _parse(input=[{"role": "user", "content": "2+2?"}, *final["output"]]).generation.messages[-1]
    assert again == Message("assistant", "Four.", reasoning="")
    plain = ResponseBuilder("resp_3", MODEL, {}, thinking=False)
    assert [e["item"]["type"] for e in _events(plain, [{"content": "x"}], "stop")
            if e["type"] == "response.output_item.added"] == ["message"]


def test_a_record_names_its_cache_once_and_reads_junk_as_no_name():
    """A record's ``cache``: the store's objects of its conversation, each once, kinds
    kept; what is not a name (a record is data read back) is skipped."""
    from cluster.serving.records import cache_names, with_cache
    from storage.keys import CacheRetention, Fingerprint, KeyScope, Kind, ObjectKey, chunk_keys

    fp = Fingerprint.of("m", {"a": 1})
    keys = chunk_keys(fp, range(96), 32) + chunk_keys(fp, range(64), 32, scope=KeyScope(retention=CacheRetention.DAY))
    record = with_cache(with_cache({"response": {}}, keys[:2]), keys[1:])
    assert cache_names(record) == keys and record["response"] == {}
    assert cache_names(read_record(encoded({**record, "input": [], "response": {"id": "r", "output": []}}))) == keys
    junk = {"cache": [[1, "zz"], [99, keys[0].hex], "x", [1], None, [2, keys[0].hex]]}
    assert cache_names(junk) == [ObjectKey(Kind.WINDOW, keys[0].digest)]
    assert cache_names({"cache": "not a list"}) == [] and cache_names({}) == []
