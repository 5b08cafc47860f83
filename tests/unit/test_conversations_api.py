"""The Conversations API's records without a server: a conversation's items and
metadata change by versions, are listed as OpenAI lists them, read back from their
bytes (a bad record is a miss), and carried into a Responses request that names the
conversation exactly as the same items sent as input."""

from __future__ import annotations

import json

import pytest
from openai.types.conversations import Conversation, ConversationItem, ConversationItemList
from pydantic import TypeAdapter

from cluster.serving import conversations_api as conversations
from cluster.serving.response_items import encoded
from cluster.serving.responses_api import parse_responses
from cluster.serving.validation import ApiError

pytestmark = pytest.mark.unit

MODEL = "m"
CALL = {"type": "function_call", "call_id": "c1", "name": "count_lines", "arguments": '{"module": "glob"}'}


def _round_trip(record: dict) -> dict:
    back = conversations.read(encoded(record), record["conversation"]["id"])
    assert back == record
    return back


def test_a_conversation_changes_by_versions_and_lists_like_openai() -> None:
    record = _round_trip(conversations.created(
        {"items": [{"role": "user", "content": "Lines of glob?"}, CALL], "metadata": {"topic": "demo"}},
        now=1_700_000_000))
    conversation = record["conversation"]
    assert conversation["id"].startswith("conv_") and conversation["created_at"] == 1_700_000_000
    assert Conversation.model_validate(conversation).metadata == {"topic": "demo"} and record["version"] == 1
    first, call = record["items"]
    assert first["id"].startswith("msg_") and call["id"].startswith("fc_") and call["call_id"] == "c1"

    added = conversations.new_items({"items": [{"type": "function_call_output", "call_id": "c1", "output": "120"}]})
    record = _round_trip(conversations.with_items(record, added))
    assert record["version"] == 2 and [item["type"] for item in record["items"]] == [
        "message", "function_call", "function_call_output"]
    shown = ConversationItemList.model_validate(conversations.added(added))
    assert [item.id for item in shown.data] == [added[0]["id"]] and shown.first_id == shown.last_id == added[0]["id"]

    page = conversations.page(record, limit=2)  # newest first
    assert [item["id"] for item in page["data"]] == [added[0]["id"], call["id"]] and page["has_more"]
    rest = conversations.page(record, after=page["last_id"])
    assert [item["id"] for item in rest["data"]] == [first["id"]] and not rest["has_more"]
    assert rest["data"][0]["content"] == [{"type": "input_text", "text": "Lines of glob?"}]
    items = TypeAdapter(list[ConversationItem]).validate_python(conversations.page(record, order="asc")["data"])
    assert [item.type for item in items] == ["message", "function_call", "function_call_output"]
    assert conversations.item(record, call["id"])["arguments"] == '{"module": "glob"}'

    record = _round_trip(conversations.without_item(record, call["id"]))
    assert record["version"] == 3 and [item["id"] for item in record["items"]] == [first["id"], added[0]["id"]]
    record = _round_trip(conversations.updated(record, {"metadata": {"topic": "other"}}))
    assert record["version"] == 4 and record["conversation"]["metadata"] == {"topic": "other"}
    assert record["conversation"]["created_at"] == 1_700_000_000
    for missing in (lambda: conversations.item(record, call["id"]),
                    lambda: conversations.without_item(record, "msg_nope")):
        with pytest.raises(ApiError) as caught:
            missing()
        assert caught.value.status == 404


@pytest.mark.parametrize("call, body, param", [
    (conversations.created, {"items": [{"type": "item_reference", "id": "x"}]}, "items"),
    (conversations.created, {"items": [{"role": "user", "content": "a"}] * 21}, "items"),
    (conversations.created, {"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
    (conversations.created, {"metadata": {"k": "v" * 513}}, "metadata"),
    (conversations.created, {"metadata": {"k" * 65: "v"}}, "metadata"),
    (conversations.created, {"title": "x"}, "title"),
    (conversations.new_items, {}, "items"),
    (conversations.new_items, {"items": []}, "items"),
    (conversations.new_items, {"items": [{"type": "function_call", "call_id": "c", "name": "f"}]}, "items"),
])
def test_bad_requests_are_400s_naming_the_parameter(call, body, param) -> None:
    with pytest.raises(ApiError) as caught:
        call(body)
    assert caught.value.status == 400 and caught.value.param == param


def test_an_update_names_its_metadata() -> None:
    with pytest.raises(ApiError) as caught:
        conversations.updated(conversations.created({}), {})
    assert caught.value.status == 400 and caught.value.param == "metadata"


def test_bad_records_read_as_misses() -> None:
    record = conversations.created({"items": [{"role": "user", "content": "hi"}]})
    cid, good = record["conversation"]["id"], encoded(record)
    assert conversations.read(good, cid) == record
    bad = [None, b"", b"\x80\x04pickle", b"[]", good[:-1], good.replace(b'"version":1', b'"version":0'),
           good.replace(b'"version":1', b'"version":true'), good.replace(b'"items":[', b'"items":[7,'),
           json.dumps({**record, "conversation": {**record["conversation"], "metadata": None}}).encode()]
    for payload in bad:
        assert conversations.read(payload, cid) is None
    assert conversations.read(good, "conv_other") is None  # another conversation's bytes under this name


def test_a_responses_request_naming_a_conversation_reads_as_its_items_sent_as_input() -> None:
    record = conversations.created({"items": [{"role": "user", "content": "Lines of glob?"}, CALL]})
    cid = record["conversation"]["id"]
    then = [{"type": "function_call_output", "call_id": "c1", "output": "120"}]

    def parsed(**body):
        return parse_responses({"model": MODEL, **body}, MODEL, ceiling=64, vocab_size=4096, keeps=True,
                               history=record["items"] if "conversation" in body else ())

    named = parsed(input=then, conversation=cid)
    assert named.generation.messages == parsed(input=[*record["items"], *then]).generation.messages
    assert named.conversation == cid and named.echo["conversation"] == {"id": cid}
    assert parsed(input=then, conversation={"id": cid}).conversation == cid
    # What joins the conversation after the answer: this request's input, each with an id.
    assert [item["type"] for item in named.new_items] == ["function_call_output"]
    assert named.new_items[0]["id"].startswith("fco_") and parsed(input="x").new_items == ()
    with pytest.raises(ApiError) as caught:
        parsed(input="x", conversation=cid, previous_response_id="resp_1")
    assert caught.value.param == "conversation"


def test_an_item_id_a_conversation_or_request_already_has_is_a_400() -> None:
    """As OpenAI answers it ("Duplicate item found with id ..."): an item sent with the id
    of one the conversation (or the response continued) holds, or sent twice, is refused
    before anything changes; the same item without its id is a new item."""
    record = conversations.created({"items": [{"role": "user", "content": "Lines of glob?", "id": "msg_1"}]})
    again = {"type": "message", "role": "user", "content": "Again", "id": "msg_1"}
    cases = [(lambda: conversations.with_items(record, conversations.new_items({"items": [again]})), "items"),
             (lambda: conversations.created({"items": [again, again]}), "items"),
             (lambda: parse_responses({"model": MODEL, "input": [again], "conversation": record["conversation"]["id"]},
                                      MODEL, ceiling=64, vocab_size=4096, keeps=True, history=record["items"]),
              "input"),
             (lambda: parse_responses({"model": MODEL, "input": [again], "previous_response_id": "resp_1"},
                                      MODEL, ceiling=64, vocab_size=4096, keeps=True, history=record["items"]),
              "input")]
    for call, param in cases:
        with pytest.raises(ApiError) as caught:
            call()
        assert (caught.value.status, caught.value.param, caught.value.code) == (400, param, "duplicate_item")
        assert "msg_1" in str(caught.value)
    fresh = conversations.with_items(record, conversations.new_items({"items": [{**again, "id": None}]}))
    assert len({entry["id"] for entry in fresh["items"]}) == 2 and fresh["version"] == 2
