"""The Responses API's items (messages, function calls and their outputs, reasoning):
their schemas, and how they are kept and listed.

A request's input items, a response's output and a conversation's items are all items.
Each is stored as sent, with an id (:func:`identified`); a stored response's record is
its response object and the input it answered (:func:`record`), JSON in the store
(:func:`encoded`, :func:`read_record`). No I/O here.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, StringConstraints, Tag, TypeAdapter, ValidationError

from cluster.serving.validation import ApiError, Schema


class InputText(Schema):
    type: Literal["input_text"]
    text: str


class InputImage(Schema):
    type: Literal["input_image"]
    image_url: str
    detail: Literal["auto"] | None = None  # "low" / "high": one resolution rule here (the processor's)


class OutputText(Schema):
    """An earlier answer's text, as this server returned it (``annotations`` and
    ``logprobs`` are read back and dropped: they do not change the conversation)."""

    type: Literal["output_text"]
    text: str
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


_Status = Literal["in_progress", "completed", "incomplete"]
_Part = Annotated[InputText | InputImage | OutputText, Field(discriminator="type")]


class MessageItem(Schema):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[_Part]
    id: str | None = None
    status: _Status | None = None


class FunctionCallItem(Schema):
    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    arguments: str
    id: str | None = None
    status: _Status | None = None


class FunctionCallOutputItem(Schema):
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: str | list[InputText]
    id: str | None = None
    status: _Status | None = None


class _ReasoningText(Schema):
    type: Literal["reasoning_text"]
    text: str


class _SummaryText(Schema):
    type: Literal["summary_text"]
    text: str


class ReasoningItem(Schema):
    """An earlier answer's reasoning: its ``content`` (the model's reasoning text, as this
    server returns it); a summary alone is not what the model wrote, and is not rendered."""

    type: Literal["reasoning"]
    id: str | None = None
    summary: list[_SummaryText] = Field(default_factory=list)
    content: list[_ReasoningText] | None = None
    encrypted_content: None = None
    status: _Status | None = None


def _item_type(value: Any) -> str:
    """An input item's kind: its ``type`` (a message may leave it out)."""
    kind = value.get("type", "message") if isinstance(value, dict) else getattr(value, "type", "message")
    return kind if kind in _ITEM_TYPES else "unknown"


_ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")
Item = Annotated[
    Annotated[MessageItem, Tag("message")] | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")] | Annotated[ReasoningItem, Tag("reasoning")],
    Discriminator(_item_type, custom_error_type="item_type",
                  custom_error_message=f"an input item's type must be one of {', '.join(_ITEM_TYPES)}"),
]


TAGS = (*_ITEM_TYPES, "input_text", "input_image", "output_text")  # type tags a location names after an index
ITEMS = TypeAdapter(list[Item])


# A response's or a conversation's metadata, as OpenAI bounds it: 16 pairs, keys of at
# most 64 characters, values of at most 512.
Metadata = Annotated[dict[Annotated[str, StringConstraints(max_length=64)],
                          Annotated[str, StringConstraints(max_length=512)]], Field(max_length=16)]


_ID_PREFIX = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}


def identified(raw: str | list, items: str | list[Item]) -> list[dict]:
    """This request's input as stored: the items as sent, each with an id (an input
    string is one user message)."""
    if isinstance(raw, str):
        return [{"id": item_id("msg"), "type": "message", "role": "user", "content": raw}]
    return [{**sent, "id": sent.get("id") or item_id(_ID_PREFIX[item.type]), "type": item.type}
            for sent, item in zip(raw, items)]


def distinct(items: Sequence[dict], earlier: Sequence[dict], param: str) -> None:
    """A 400 naming ``param``, as OpenAI answers it, when one of ``items`` has the id of an
    item ``earlier`` (the response or conversation continued) or of another one sent."""
    seen = {entry.get("id") for entry in earlier}
    for entry in items:
        if entry["id"] in seen:
            raise ApiError(400, f"Duplicate item found with id {entry['id']!r}. Remove duplicate items from your "
                                f"{param} and try again.", param, code="duplicate_item")
        seen.add(entry["id"])



def stored_items(history: Sequence[dict], param: str) -> list[Item]:
    """The items of a stored response or conversation (``param`` names it) as schemas."""
    try:
        return ITEMS.validate_python(list(history))
    except ValidationError:  # checked when read: a record written by another version
        what = param.removeprefix("previous_").removesuffix("_id")  # response, conversation
        raise ApiError(400, f"{param}: that {what}'s items cannot be read by this server", param,
                       code=f"{param.removesuffix('_id')}_not_found") from None


def encoded(stored: dict) -> bytes:
    """A record's bytes in the store: JSON (never pickled)."""
    return json.dumps(stored, separators=(",", ":")).encode()


def read_record(payload: bytes | None) -> dict | None:
    """A stored record, or None when there is none or it is not one (reads as a miss)."""
    if payload is None:
        return None
    try:
        data = json.loads(payload)
        response, items = data["response"], data["input"]
        if not (isinstance(response, dict) and isinstance(response.get("id"), str)
                and isinstance(response.get("output"), list) and isinstance(items, list)):
            return None
        ITEMS.validate_python(items + response["output"])
    except (ValueError, KeyError, TypeError):  # (pydantic's ValidationError is a ValueError)
        return None
    return data


def history(stored: dict) -> list[dict]:
    """The items a response carries into one that names it as ``previous_response_id``:
    its input, then its output."""
    return [*stored["input"], *stored["response"]["output"]]


def input_items_page(stored: dict, after: str | None = None, limit: int = 20, order: str = "desc") -> dict:
    """``GET /v1/responses/{id}/input_items``: a page of the input a response answered."""
    return items_page(stored["input"], after, limit, order, "in this response")


def items_page(items: Sequence[dict], after: str | None, limit: int, order: str, where: str) -> dict:
    """A page of ``items`` as OpenAI lists them (``order`` ``desc`` is newest first;
    ``after`` an item id of the previous page; ``where`` names the list in an error)."""
    if order not in ("asc", "desc"):
        raise ApiError(400, "order must be 'asc' or 'desc'", "order")
    if not 1 <= limit <= 100:
        raise ApiError(400, "limit must be between 1 and 100", "limit")
    items = [listed(item) for item in items]
    if order == "desc":
        items.reverse()
    if after is not None:
        ids = [item.get("id") for item in items]
        if after not in ids:
            raise ApiError(400, f"after: no item {after!r} {where}", "after")
        items = items[ids.index(after) + 1:]
    page = items[:limit]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit}


def listed(item: dict) -> dict:
    """An item as OpenAI lists it: with its status, a message's text content as one part."""
    item = {**item, "status": item.get("status") or "completed"}
    if item.get("type") == "message" and isinstance(item.get("content"), str):
        part = {"type": "output_text", "text": item["content"], "annotations": []} if item["role"] == "assistant" \
            else {"type": "input_text", "text": item["content"]}
        return {**item, "content": [part]}
    return item


# ---------------------------------------------------------------------- the answer


def item_id(prefix: str) -> str:
    """An OpenAI-style id of a response or an item: ``resp_…``, ``msg_…``."""
    return f"{prefix}_{uuid.uuid4().hex[:24]}"
