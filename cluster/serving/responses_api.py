"""OpenAI's Responses API (``POST /v1/responses``) on the chat path.

A Responses request is validated against its own schemas (a parameter this server does
not implement is refused by name, as in :mod:`cluster.serving.openai_api`), then written as the
chat request it means and parsed by :func:`cluster.serving.openai_api.parse_chat`: the same
template, tools, grammars and sampling, and the same cache reuse along a tool loop (a
turn's reasoning, text and calls sent back as input items render the ids it generated).
An error that parsing finds is reported in the Responses request's terms (``input[3]``,
not ``messages[4]``).

:class:`ResponseBuilder` turns the chat answer's deltas into output items and the
stream's events; the unstreamed response is the same builder's final object.

Stored responses: with ``store`` (the default where the server keeps responses), the
router keeps each response with the input it answered (:func:`record`), in the node's
store; ``previous_response_id`` names one, whose input and output come before this
request's input (:func:`history`). ``conversation`` names a conversation
(:mod:`cluster.serving.conversations_api`): its items come before the input, and the input and
the output join it. No I/O here: the router reads and writes the records
(:mod:`cluster.serving.records`).
"""

from __future__ import annotations

import json
import re
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, StrictBool, StringConstraints, Tag, TypeAdapter, ValidationError

from cluster.serving.openai_api import (
    ApiError,
    GenerationRequest,
    Integer,
    Number,
    ToolName,
    _Schema,
    _validated,
    parse_chat,
)

LOGPROBS = "message.output_text.logprobs"  # the one ``include`` value: the answer text's logprobs


class _InputText(_Schema):
    type: Literal["input_text"]
    text: str


class _InputImage(_Schema):
    type: Literal["input_image"]
    image_url: str
    detail: Literal["auto"] | None = None  # "low" / "high": one resolution rule here (the processor's)


class _OutputText(_Schema):
    """An earlier answer's text, as this server returned it (``annotations`` and
    ``logprobs`` are read back and dropped: they do not change the conversation)."""

    type: Literal["output_text"]
    text: str
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


_Status = Literal["in_progress", "completed", "incomplete"]
_Part = Annotated[_InputText | _InputImage | _OutputText, Field(discriminator="type")]


class _MessageItem(_Schema):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[_Part]
    id: str | None = None
    status: _Status | None = None


class _FunctionCallItem(_Schema):
    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    arguments: str
    id: str | None = None
    status: _Status | None = None


class _FunctionCallOutputItem(_Schema):
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: str | list[_InputText]
    id: str | None = None
    status: _Status | None = None


class _ReasoningText(_Schema):
    type: Literal["reasoning_text"]
    text: str


class _SummaryText(_Schema):
    type: Literal["summary_text"]
    text: str


class _ReasoningItem(_Schema):
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
_Item = Annotated[
    Annotated[_MessageItem, Tag("message")] | Annotated[_FunctionCallItem, Tag("function_call")]
    | Annotated[_FunctionCallOutputItem, Tag("function_call_output")] | Annotated[_ReasoningItem, Tag("reasoning")],
    Discriminator(_item_type, custom_error_type="item_type",
                  custom_error_message=f"an input item's type must be one of {', '.join(_ITEM_TYPES)}"),
]


_TAGS = (*_ITEM_TYPES, "input_text", "input_image", "output_text")  # type tags a location names after an index
_ITEMS = TypeAdapter(list[_Item])


class _FunctionTool(_Schema):
    type: Literal["function"]
    name: ToolName
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None  # the Responses API's default is true


class _NamedTool(_Schema):
    type: Literal["function"]
    name: str


class _Format(_Schema):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(default=None, min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: StrictBool | None = None


class _Text(_Schema):
    format: _Format | None = None
    verbosity: Literal["medium"] | None = None  # the default; low / high are not a dial this model has


class _ConversationRef(_Schema):
    id: str = Field(min_length=1)


class _Reasoning(_Schema):
    effort: str | None = None
    summary: None = None  # the reasoning itself is returned (``content``), never a summary


# A response's or a conversation's metadata, as OpenAI bounds it: 16 pairs, keys of at
# most 64 characters, values of at most 512.
Metadata = Annotated[dict[Annotated[str, StringConstraints(max_length=64)],
                          Annotated[str, StringConstraints(max_length=512)]], Field(max_length=16)]


class ResponsesRequest(_Schema):
    """What this server implements of a Responses request. ``user``,
    ``safety_identifier`` and ``prompt_cache_key`` are accepted and unused (tags;
    every prompt's prefix is cached and routed to its cache anyway); ``metadata`` is
    returned as sent."""

    model: str | None = None
    input: str | list[_Item]
    instructions: str | None = None
    tools: list[_FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | _NamedTool | None = None
    parallel_tool_calls: StrictBool | None = None
    text: _Text | None = None
    reasoning: _Reasoning | None = None
    max_output_tokens: Integer | None = None
    temperature: Number | None = None
    top_p: Number | None = None
    top_logprobs: Integer | None = None
    include: list[Literal["message.output_text.logprobs"]] | None = None
    stream: StrictBool = False
    store: StrictBool | None = None
    previous_response_id: str | None = Field(default=None, min_length=1)
    conversation: Annotated[str, Field(min_length=1)] | _ConversationRef | None = None
    background: StrictBool | None = None
    truncation: Literal["disabled"] | None = None
    metadata: Metadata | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None


@dataclass(frozen=True)
class ParsedResponses:
    """A Responses request as the chat path's :class:`GenerationRequest`, and what the
    response object repeats of it."""

    generation: GenerationRequest
    echo: dict
    logprobs: bool  # the answer text's logprobs were asked for (``include``)
    origins: tuple[str, ...]  # where each chat message came from: "instructions", "input[3]", ...
    store: bool = False  # keep the response (:func:`record`)
    input_items: tuple[dict, ...] = ()  # what it answers: the previous response's items, then this input
    conversation: str | None = None  # the conversation it continues, which its input and output join
    new_items: tuple[dict, ...] = ()  # this request's input, as a conversation keeps it

    def renamed(self, error: ApiError) -> ApiError:
        return renamed(error, self.origins)

    def builder(self, rid: str, model: str) -> ResponseBuilder:
        return ResponseBuilder(rid, model, self.echo, self.logprobs, self.generation.thinking)


# What a chat request's parameter is called in a Responses request.
_PARAMS = {"max_tokens": "max_output_tokens", "max_completion_tokens": "max_output_tokens",
           "response_format": "text.format", "reasoning_effort": "reasoning.effort", "logprobs": "include",
           "messages": "input"}
# Chat parameters named in a chat error's message ("messages" only where a message
# begins with it: elsewhere it may be a client's string).
_CHAT_NAMES = re.compile(r"\b(?:max_completion_tokens|max_tokens|response_format|reasoning_effort)\b|^messages\b(?!\[)")


def parse_responses(data: dict, model_name: str, default_max: int, vocab_size: int | None = None,
                    read_image: Callable[[str], tuple[int, Any]] | None = None,
                    max_images: int = 0, keeps: bool = False, history: Sequence[dict] = ()) -> ParsedResponses:
    """The request, or an :class:`ApiError` naming the Responses parameter at fault.

    ``keeps``: the server keeps responses (``store`` defaults to true, and
    ``previous_response_id`` or ``conversation`` may name one); ``history``: the items of
    the response or conversation it names (:func:`history`, or the conversation's
    items), read by the caller."""
    request = _validated(ResponsesRequest, data, tags=_TAGS)
    if not keeps and request.store:
        raise ApiError(400, "store: this server keeps no responses (send store: false or leave it out, and send "
                            "the whole conversation as input each turn)", "store")
    for name in ("previous_response_id", "conversation"):
        if not keeps and getattr(request, name) is not None:
            raise ApiError(400, f"{name}: this server keeps no responses or conversations (send the whole "
                                "conversation as input each turn)", name)
    if request.conversation is not None and request.previous_response_id is not None:
        raise ApiError(400, "conversation: cannot be used with previous_response_id (name one of them)",
                       "conversation")
    conversation = conversation_named(data)
    earlier = _stored_items(history, "conversation" if conversation else "previous_response_id")
    if request.background:
        raise ApiError(400, "background: responses run in the foreground here (leave it out)", "background")
    effort = request.reasoning.effort if request.reasoning else None
    if request.top_logprobs is not None and LOGPROBS not in (request.include or ()):
        raise ApiError(400, f"top_logprobs needs include: [{LOGPROBS!r}]", "top_logprobs")
    messages, origins = _messages(request, earlier)
    chat = {"model": request.model, "messages": messages, "stream": request.stream,
            **{key: value for key, value in (
                ("max_completion_tokens", request.max_output_tokens), ("temperature", request.temperature),
                ("top_p", request.top_p), ("parallel_tool_calls", request.parallel_tool_calls),
                ("tools", _tools(request)), ("tool_choice", _tool_choice(request)),
                ("response_format", _response_format(request)),
                ("reasoning_effort", effort)) if value is not None}}
    store = keeps and request.store is not False
    logprobs = LOGPROBS in (request.include or ())
    if logprobs:
        chat.update(logprobs=True, top_logprobs=request.top_logprobs or 0)
    try:
        generation = parse_chat(chat, model_name, default_max, vocab_size, read_image, max_images)
    except ApiError as error:
        raise renamed(error, origins) from None
    echo = {"instructions": request.instructions, "max_output_tokens": request.max_output_tokens,
            "metadata": request.metadata or {}, "parallel_tool_calls": generation.parallel_tool_calls,
            "temperature": request.temperature, "top_p": request.top_p, "top_logprobs": request.top_logprobs,
            "tool_choice": data.get("tool_choice") or "auto", "tools": data.get("tools") or [],
            "text": {"format": (data.get("text") or {}).get("format") or {"type": "text"}},
            "reasoning": {"effort": effort, "summary": None},
            "store": store, "background": False, "truncation": "disabled",
            "previous_response_id": request.previous_response_id,
            "conversation": {"id": conversation} if conversation else None}
    new_items = identified(data["input"], request.input)
    distinct(new_items, history, "input")
    return ParsedResponses(generation, echo, logprobs, tuple(origins), store, (*history, *new_items) if store else (),
                           conversation, tuple(new_items) if conversation else ())


def conversation_named(data: dict) -> str | None:
    """The id of the conversation a Responses request names (a string, or an object
    with its id), read before the request is parsed; None if it names none."""
    named = data.get("conversation") if isinstance(data, dict) else None
    named = named.get("id") if isinstance(named, dict) else named
    return named if isinstance(named, str) and named else None


def renamed(error: ApiError, origins: Sequence[str]) -> ApiError:
    """A chat path's error in the Responses request's terms: ``messages[i]`` becomes the
    input item (or ``instructions``) it came from."""
    def place(match: re.Match) -> str:
        index = int(match.group(1))
        return origins[index] if index < len(origins) else "input"

    message = _CHAT_NAMES.sub(lambda match: _PARAMS[match.group(0)], re.sub(r"messages\[(\d+)\]", place,
                                                                            error.message))
    param = error.param
    if param is not None:
        param = re.sub(r"messages\[(\d+)\]", place, param)
        param = _PARAMS.get(param, param)
    return ApiError(error.status, message, param, error.kind, error.code, error.headers)


def _messages(request: ResponsesRequest, earlier: Sequence[_Item] = ()) -> tuple[list[dict], list[str]]:
    """The chat messages the input means (after ``earlier``: the items of the previous
    response), and where each came from. An assistant turn is one message: the
    reasoning, text and calls of consecutive assistant items (a reasoning item after
    text or calls begins the next turn). A call's output must follow the call."""
    messages: list[dict] = []
    origins: list[str] = []
    if request.instructions is not None:
        messages.append({"role": "system", "content": request.instructions})
        origins.append("instructions")
    if isinstance(request.input, str):
        items = [(_MessageItem(role="user", content=request.input), "input")]
    else:
        items = [(item, f"input[{index}]") for index, item in enumerate(request.input)]
    turn: dict | None = None  # the assistant turn being gathered
    called: set[str] = set()
    for item, where in [*((item, "previous_response_id") for item in earlier), *items]:
        assistant = isinstance(item, _FunctionCallItem | _ReasoningItem) or (
            isinstance(item, _MessageItem) and item.role == "assistant")
        if not assistant:
            turn = None
        elif turn is None or (isinstance(item, _ReasoningItem) and (turn.get("content") or turn.get("tool_calls"))):
            if turn is not None:
                raise ApiError(400, f"{where}: a reasoning item begins an assistant turn, and the turn before it has "
                                    "had no user message or function_call_output since", "input")
            turn = {"role": "assistant", "content": ""}
            messages.append(turn)
            origins.append(where)
        if isinstance(item, _ReasoningItem):
            turn["reasoning_content"] = (turn.get("reasoning_content") or "") + "".join(
                part.text for part in item.content or ())
        elif isinstance(item, _FunctionCallItem):
            called.add(item.call_id)
            turn.setdefault("tool_calls", []).append(
                {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}})
        elif isinstance(item, _FunctionCallOutputItem):
            if item.call_id not in called:
                raise ApiError(400, f"{where}: no function_call before it has call_id {item.call_id!r}", "input")
            output = item.output if isinstance(item.output, str) else "".join(part.text for part in item.output)
            messages.append({"role": "tool", "content": output, "tool_call_id": item.call_id})
            origins.append(where)
        elif item.role == "assistant":
            turn["content"] += _text(item, where)
        else:
            messages.append({"role": item.role, "content": _content(item, where)})
            origins.append(where)
    return messages, origins


def _text(item: _MessageItem, where: str) -> str:
    if isinstance(item.content, str):
        return item.content
    if any(not isinstance(part, _OutputText) for part in item.content):
        raise ApiError(400, f"{where}.content: an assistant message holds output_text parts", "input")
    return "".join(part.text for part in item.content)


def _content(item: _MessageItem, where: str) -> str | list[dict]:
    if isinstance(item.content, str):
        return item.content
    parts = []
    for j, part in enumerate(item.content):
        if isinstance(part, _OutputText):
            raise ApiError(400, f"{where}.content[{j}]: output_text belongs to assistant messages", "input")
        parts.append({"type": "text", "text": part.text} if isinstance(part, _InputText) else
                     {"type": "image_url", "image_url": {"url": part.image_url,
                                                         **({"detail": part.detail} if part.detail else {})}})
    return parts


def _tools(request: ResponsesRequest) -> list[dict] | None:
    if request.tools is None:
        return None
    return [{"type": "function", "function": {
        "name": tool.name, **({"description": tool.description} if tool.description is not None else {}),
        **({"parameters": tool.parameters} if tool.parameters is not None else {}),
        "strict": tool.strict is not False}} for tool in request.tools]


def _tool_choice(request: ResponsesRequest) -> str | dict | None:
    choice = request.tool_choice
    if isinstance(choice, _NamedTool):
        return {"type": "function", "function": {"name": choice.name}}
    return choice


def _response_format(request: ResponsesRequest) -> dict | None:
    form = request.text.format if request.text is not None else None
    if form is None:
        return None
    extra = sorted(form.model_dump(exclude_unset=True, by_alias=True).keys() - {"type"})
    if form.type != "json_schema" and extra:
        raise ApiError(400, f"text.format: only type json_schema takes {', '.join(extra)}", "text.format")
    if form.type == "text":
        return None
    if form.type == "json_object":
        return {"type": "json_object"}
    if form.name is None:
        raise ApiError(400, "text.format.name is required with type json_schema", "text.format")
    schema = {"name": form.name, **{key: value for key, value in (
        ("description", form.description), ("schema", form.schema_), ("strict", form.strict)) if value is not None}}
    return {"type": "json_schema", "json_schema": schema}


# ---------------------------------------------------------------------- stored responses

_ID_PREFIX = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}


def identified(raw: str | list, items: str | list[_Item]) -> list[dict]:
    """This request's input as stored: the items as sent, each with an id (an input
    string is one user message)."""
    if isinstance(raw, str):
        return [{"id": _id("msg"), "type": "message", "role": "user", "content": raw}]
    return [{**sent, "id": sent.get("id") or _id(_ID_PREFIX[item.type]), "type": item.type}
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


def _stored_items(history: Sequence[dict], param: str) -> list[_Item]:
    try:
        return _ITEMS.validate_python(list(history))
    except ValidationError:  # checked when read: a record written by another version
        what = param.removeprefix("previous_").removesuffix("_id")  # response, conversation
        raise ApiError(400, f"{param}: that {what}'s items cannot be read by this server", param,
                       code=f"{param.removesuffix('_id')}_not_found") from None


def record(parsed: ParsedResponses, response: dict) -> dict:
    """What the store keeps of a finished response: the response object and the input
    it answered (the previous response's items included)."""
    return {"response": response, "input": list(parsed.input_items)}


def encoded(stored: dict) -> bytes:
    """A record's bytes in the store: JSON (never pickled)."""
    return json.dumps(stored, separators=(",", ":")).encode()


class RecentRecords:
    """The records of the latest stored responses by id, up to ``capacity`` bytes of
    their JSON, least recently used out first."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._records: OrderedDict[str, tuple[dict, int]] = OrderedDict()
        self._bytes = 0

    def put(self, rid: str, stored: dict, size: int) -> None:
        self.pop(rid)
        self._records[rid] = (stored, size)
        self._bytes += size
        while self._bytes > self.capacity:
            self._bytes -= self._records.popitem(last=False)[1][1]

    def get(self, rid: str) -> dict | None:
        found = self._records.get(rid)
        if found is None:
            return None
        self._records.move_to_end(rid)
        return found[0]

    def pop(self, rid: str) -> None:
        found = self._records.pop(rid, None)
        if found is not None:
            self._bytes -= found[1]

    def __len__(self) -> int:
        return len(self._records)


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
        _ITEMS.validate_python(items + response["output"])
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


def usage(prompt_tokens: int, output_tokens: int, cached_tokens: int, reasoning_tokens: int) -> dict:
    """OpenAI's usage object. Every conversation is stored, so the prompt's tokens not
    read from the cache are the ones written to it (``cache_write_tokens``)."""
    return {"input_tokens": prompt_tokens,
            "input_tokens_details": {"cached_tokens": cached_tokens, "cache_write_tokens": prompt_tokens - cached_tokens},
            "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": prompt_tokens + output_tokens}


class ResponseBuilder:
    """A response's output items from the chat answer's deltas (``reasoning_content``,
    ``content`` with its ``logprobs``, ``tool_calls``), and the stream events that
    build them: an item is added when its first delta comes, and done when another
    kind begins or the answer ends. Text after a calls block is a second message.

    With thinking on, the output begins with a reasoning item, empty if the model closed
    its reasoning at once: sent back as input, it marks the turn as one that thought, so
    the turn renders as it was generated (and its cached ids are reused)."""

    def __init__(self, rid: str, model: str, echo: dict, logprobs: bool = False, thinking: bool = False):
        self.rid, self.model, self.echo, self.logprobs = rid, model, echo, logprobs
        self._unreasoned = thinking  # thinking on, and no reasoning item yet
        self.created = int(time.time())
        self.output: list[dict] = []
        self._open: dict | None = None  # the item receiving deltas
        self._sequence = 0

    def response(self, status: str = "in_progress", usage_: dict | None = None,
                 incomplete: str | None = None) -> dict:
        return {"id": self.rid, "object": "response", "created_at": self.created, "status": status,
                "model": self.model, "output": [dict(item) for item in self.output], "error": None,
                "incomplete_details": {"reason": incomplete} if incomplete else None, "usage": usage_, **self.echo}

    def start(self) -> list[dict]:
        return [self._event("response.created", response=self.response()),
                self._event("response.in_progress", response=self.response())]

    def push(self, deltas: list[dict]) -> list[dict]:
        events: list[dict] = []
        for delta in deltas:
            if self._unreasoned and not delta.get("reasoning_content") and (
                    delta.get("content") or delta.get("tool_calls")):
                events += self._text("reasoning", "", [])
            if delta.get("reasoning_content"):
                events += self._text("reasoning", delta["reasoning_content"], [])
            # A token's logprobs belong to the text it wrote (held-back text releases them
            # late, alone); those of a calls block's markup have no place in the output.
            if delta.get("content") or (set(delta) == {"logprobs"} and self._open and self._open["type"] == "message"):
                entries = (delta.get("logprobs") or {}).get("content") or [] if self.logprobs else []
                events += self._text("message", delta.get("content") or "", entries)
            for call in delta.get("tool_calls", ()):
                events += self._call(call)
        return events

    def finish(self, finish: str, usage_: dict) -> list[dict]:
        """The events that close the answer: ``response.completed``, or
        ``response.incomplete`` when it ran out of ``max_output_tokens``."""
        status = "incomplete" if finish == "length" else "completed"
        events = self._text("reasoning", "", []) if self._unreasoned else []
        events += self._close(status)
        incomplete = "max_output_tokens" if status == "incomplete" else None
        return events + [self._event(f"response.{status}", response=self.response(status, usage_, incomplete))]

    def failed(self, error: ApiError) -> dict:
        body = {**self.response("failed"), "error": {"code": error.code or "server_error", "message": error.message}}
        return self._event("response.failed", response=body)

    def _event(self, kind: str, **fields) -> dict:
        event = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return event

    def _text(self, kind: str, text: str, entries: list[dict]) -> list[dict]:
        events = []
        if self._open is None or self._open["type"] != kind:
            events += self._close("completed")
            if kind == "reasoning":
                self._unreasoned = False
                self._open = {"id": _id("rs"), "type": "reasoning", "summary": [], "content": [],
                              "status": "in_progress"}
                part = {"type": "reasoning_text", "text": ""}
            else:
                self._open = {"id": _id("msg"), "type": "message", "role": "assistant", "status": "in_progress",
                              "content": []}
                part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            self.output.append(self._open)
            events += [self._event("response.output_item.added", output_index=len(self.output) - 1,
                                   item=_copy(self._open)),
                       self._event("response.content_part.added", item_id=self._open["id"],
                                   output_index=len(self.output) - 1, content_index=0, part=dict(part))]
            self._open["content"] = [part]
        part = self._open["content"][0]
        part["text"] += text
        where = {"item_id": self._open["id"], "output_index": len(self.output) - 1, "content_index": 0}
        if kind == "reasoning":
            return events + [self._event("response.reasoning_text.delta", **where, delta=text)]
        part["logprobs"] += entries
        return events + [self._event("response.output_text.delta", **where, delta=text, logprobs=entries)]

    def _call(self, call: dict) -> list[dict]:
        events = self._close("completed")
        function = call["function"]
        item = {"id": _id("fc"), "type": "function_call", "call_id": call["id"], "name": function["name"],
                "arguments": "", "status": "in_progress"}
        self.output.append(item)
        index = len(self.output) - 1
        events.append(self._event("response.output_item.added", output_index=index, item=dict(item)))
        events.append(self._event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                                  delta=function["arguments"]))
        item.update(arguments=function["arguments"], status="completed")
        events.append(self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                  name=item["name"], arguments=item["arguments"]))
        events.append(self._event("response.output_item.done", output_index=index, item=dict(item)))
        return events

    def _close(self, status: str) -> list[dict]:
        item, self._open = self._open, None
        if item is None:
            return []
        index, part = len(self.output) - 1, item["content"][0]  # the open item is the last
        where = {"item_id": item["id"], "output_index": index, "content_index": 0}
        item["status"] = status
        if item["type"] == "reasoning":
            done = self._event("response.reasoning_text.done", **where, text=part["text"])
        else:
            done = self._event("response.output_text.done", **where, text=part["text"], logprobs=part["logprobs"])
        return [done, self._event("response.content_part.done", **where, part=dict(part)),
                self._event("response.output_item.done", output_index=index, item=_copy(item))]


def _id(prefix: str) -> str:
    """An OpenAI-style id of a response or an output item: ``resp_…``, ``msg_…``."""
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


def _copy(item: dict) -> dict:
    return {**item, "content": [dict(part) for part in item.get("content", ())]}


def sse(event: dict) -> bytes:
    """A Responses stream event: its type on the ``event:`` line, the event as data."""
    return f"event: {event['type']}\ndata: {json.dumps(event)}\n\n".encode()


def response_id() -> str:
    return _id("resp")
