"""OpenAI's Conversations API (``/v1/conversations``): a conversation's items, kept.

A conversation is a list of items (what a Responses request takes as input: messages,
function calls and their outputs, reasoning) and metadata. Clients add items
(``POST /v1/conversations/{id}/items``, 20 at a time) and delete them, or name the
conversation in a Responses request (``conversation``): its items come before the
request's input, and the input and the answer's output join it after the answer.

Its record is JSON (never pickled) in the tiered store, like a stored response: RAM,
then SSD and the Redis index for ``response_retention_hours`` after its last use. Each
change writes a new ``version``; the router reads the newest copy any node holds
(:mod:`cluster.serving.records`). No I/O here.
"""

from __future__ import annotations

import json
import time

from pydantic import Field

from cluster.serving.response_items import (
    ITEMS,
    TAGS,
    Item,
    Metadata,
    distinct,
    identified,
    item_id,
    items_page,
    listed,
)
from cluster.serving.validation import ApiError, Schema, validated

MAX_NEW_ITEMS = 20  # items one request may add (OpenAI's limit)
# Items one conversation holds: each change rewrites the conversation's record whole.
MAX_ITEMS = 10_000



class ConversationCreate(Schema):
    """``POST /v1/conversations``. ``safety_identifier`` is accepted and unused (a tag)."""

    items: list[Item] | None = Field(default=None, max_length=MAX_NEW_ITEMS)
    metadata: Metadata | None = None
    safety_identifier: str | None = None


class ConversationUpdate(Schema):
    """``POST /v1/conversations/{id}``: its metadata, replaced."""

    metadata: Metadata | None


class ItemsCreate(Schema):
    """``POST /v1/conversations/{id}/items``."""

    items: list[Item] = Field(min_length=1, max_length=MAX_NEW_ITEMS)


def conversation_id() -> str:
    return item_id("conv")


def created(data: dict, now: float | None = None) -> dict:
    """A new conversation's record, or a 400 naming the parameter at fault."""
    request = validated(ConversationCreate, data, tags=TAGS)
    conversation = {"id": conversation_id(), "object": "conversation",
                    "created_at": int(time.time() if now is None else now), "metadata": request.metadata or {}}
    items = identified(data["items"], request.items) if request.items else []
    distinct(items, [], "items")
    return {"conversation": conversation, "version": 1, "items": items}


def updated(record: dict, data: dict) -> dict:
    """The record with the metadata of an update request."""
    request = validated(ConversationUpdate, data)
    return _changed(record, conversation={**record["conversation"], "metadata": request.metadata or {}})


def new_items(data: dict) -> list[dict]:
    """The items of an items-create request, each with an id."""
    request = validated(ItemsCreate, data, tags=TAGS)
    return identified(data["items"], request.items)


def with_items(record: dict, items: list[dict], param: str = "items") -> dict:
    """The conversation with ``items`` added; a 400 naming ``param`` if one has the id
    of an item it holds."""
    distinct(items, record["items"], param)
    if len(record["items"]) + len(items) > MAX_ITEMS:
        raise ApiError(400, f"{param}: the conversation holds {len(record['items'])} items; with these it would "
                            f"hold more than {MAX_ITEMS}", param)
    return _changed(record, items=[*record["items"], *items])


def without_item(record: dict, item_id: str) -> dict:
    item(record, item_id)  # (a 404 if it has none)
    return _changed(record, items=[entry for entry in record["items"] if entry.get("id") != item_id])


def _changed(record: dict, **fields) -> dict:
    return {**record, **fields, "version": record["version"] + 1}


def item(record: dict, item_id: str) -> dict:
    """One item as OpenAI lists it, or a 404."""
    for entry in record["items"]:
        if entry.get("id") == item_id:
            return listed(entry)
    raise ApiError(404, f"No item found with id {item_id!r} in conversation {record['conversation']['id']!r}",
                   code="not_found")


def page(record: dict, after: str | None = None, limit: int = 20, order: str = "desc") -> dict:
    """``GET /v1/conversations/{id}/items``: newest first unless ``order`` is ``asc``."""
    return items_page(record["items"], after, limit, order, "in this conversation")


def added(items: list[dict]) -> dict:
    """What ``POST .../items`` answers: the items it added, in order."""
    shown = [listed(entry) for entry in items]
    return {"object": "list", "data": shown, "first_id": shown[0]["id"], "last_id": shown[-1]["id"],
            "has_more": False}


def deleted(cid: str) -> dict:
    return {"id": cid, "object": "conversation.deleted", "deleted": True}


def read(payload: bytes | None, cid: str) -> dict | None:
    """A stored conversation ``cid``, or None when there is none or the bytes are not
    one (reads as a miss)."""
    if payload is None:
        return None
    try:
        data = json.loads(payload)
        conversation, items, version = data["conversation"], data["items"], data["version"]
        if not (isinstance(conversation, dict) and conversation.get("id") == cid
                and isinstance(conversation.get("metadata"), dict) and isinstance(conversation.get("created_at"), int)
                and isinstance(items, list) and type(version) is int and version >= 1):
            return None
        ITEMS.validate_python(items)
    except (ValueError, KeyError, TypeError):  # (pydantic's ValidationError is a ValueError)
        return None
    return data


def not_found(cid: str, param: str | None = None) -> ApiError:
    """A conversation nobody holds: a 404, or as a request's ``param`` a 400 naming it."""
    if param is not None:
        return ApiError(400, f"{param}: no conversation has id {cid!r} (it was deleted, or its retention ran out)",
                        param, code="conversation_not_found")
    return ApiError(404, f"No conversation found with id {cid!r}", code="not_found")
