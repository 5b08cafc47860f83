"""OpenAI's Responses API (``POST /v1/responses``): its requests, parsed once into the
internal :class:`~cluster.serving.request.GenerationRequest`.

A Responses request is validated against its own schemas (a parameter this server does
not implement is refused by name), then built into the request the chat path answers
from the same parts (:mod:`cluster.serving.request_parts`): the same template, tools,
grammars and sampling, and the same cache reuse along a tool loop (a turn's reasoning,
text and calls sent back as input items render the ids it generated). Every error names
the Responses parameter at fault (``input[3]``, ``max_output_tokens``, ``text.format``).

Stored responses: with ``store`` (the default where the server keeps responses), the
router keeps each response with the input it answered (:func:`record`), in the node's
store; ``previous_response_id`` names one, whose input and output come before this
request's input (:func:`cluster.serving.response_items.history`). ``conversation`` names a
conversation (:mod:`cluster.serving.conversations_api`): its items come before the input,
and the input and the output join it. The answer's items and events are
:mod:`cluster.serving.responses_render`'s. No I/O here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from pydantic import Field, StrictBool

from cluster.serving import request_parts as parts
from cluster.serving.request import GenerationRequest
from cluster.serving.response_items import (
    TAGS,
    FunctionCallItem,
    FunctionCallOutputItem,
    InputText,
    Item,
    MessageItem,
    Metadata,
    OutputText,
    ReasoningItem,
    distinct,
    identified,
    stored_items,
)
from cluster.serving.responses_render import ResponseBuilder
from cluster.serving.validation import ApiError, Integer, Number, Retention, Schema, ToolName, validated
from model.chat import Message
from model.tools import ToolCall
from storage.keys import CacheRetention

LOGPROBS = "message.output_text.logprobs"  # the one ``include`` value: the answer text's logprobs


class _FunctionTool(Schema):
    type: Literal["function"]
    name: ToolName
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None  # the Responses API's default is true


class _NamedTool(Schema):
    type: Literal["function"]
    name: str


class _Format(Schema):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(default=None, min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: StrictBool | None = None


class _Text(Schema):
    format: _Format | None = None
    verbosity: Literal["medium"] | None = None  # the default; low / high are not a dial this model has


class _ConversationRef(Schema):
    id: str = Field(min_length=1)


class _Reasoning(Schema):
    effort: str | None = None
    summary: None = None  # the reasoning itself is returned (``content``), never a summary



class ResponsesRequest(Schema):
    """What this server implements of a Responses request. ``user`` and
    ``safety_identifier`` are accepted and unused (tags); ``metadata`` is returned as
    sent."""

    model: str | None = None
    input: str | list[Item]
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
    prompt_cache_key: str | None = Field(default=None, max_length=1024)
    prompt_cache_retention: Retention | None = None


@dataclass(frozen=True)
class ParsedResponses:
    """A Responses request as the chat path's :class:`GenerationRequest`, and what the
    response object repeats of it."""

    generation: GenerationRequest
    echo: dict
    logprobs: bool  # the answer text's logprobs were asked for (``include``)
    store: bool = False  # keep the response (:func:`record`)
    input_items: tuple[dict, ...] = ()  # what it answers: the previous response's items, then this input
    conversation: str | None = None  # the conversation it continues, which its input and output join
    new_items: tuple[dict, ...] = ()  # this request's input, as a conversation keeps it


    def builder(self, rid: str, model: str, retention: CacheRetention | None = None) -> ResponseBuilder:
        """The response's builder; ``retention``: how long its cache is kept (echoed as
        ``prompt_cache_retention``, as the tenant's allowance bounded what was asked)."""
        echo = {**self.echo, "prompt_cache_retention": None if retention is None else retention.value}
        return ResponseBuilder(rid, model, echo, self.logprobs, self.generation.thinking)


def parse_responses(data: dict, model_name: str, ceiling: int | None, vocab_size: int | None = None,
                    read_image: Callable[[str, tuple], tuple[int, Any]] | None = None,
                    max_images: int = 0, keeps: bool = False, history: Sequence[dict] = ()) -> ParsedResponses:
    """The request, or an :class:`ApiError` naming the Responses parameter at fault.

    ``keeps``: the server keeps responses (``store`` defaults to true, and
    ``previous_response_id`` or ``conversation`` may name one); ``history``: the items of
    the response or conversation it names (:func:`cluster.serving.response_items.history`,
    or the conversation's items), read by the caller. ``read_image`` as for
    :func:`cluster.serving.openai_api.parse_chat`."""
    request = validated(ResponsesRequest, data, tags=TAGS)
    _check_kept(request, keeps)
    conversation = conversation_named(data)
    earlier = stored_items(history, "conversation" if conversation else "previous_response_id")
    if request.background:
        raise ApiError(400, "background: responses run in the foreground here (leave it out)", "background")
    logprobs = LOGPROBS in (request.include or ())
    if request.top_logprobs is not None and not logprobs:
        raise ApiError(400, f"top_logprobs needs include: [{LOGPROBS!r}]", "top_logprobs")
    images: list = []
    messages = _Messages(read_image, images, max_images).build(request, earlier)
    generation = _generation(request, messages, model_name, ceiling, vocab_size, logprobs, tuple(images))
    store = keeps and request.store is not False
    echo = {"instructions": request.instructions, "max_output_tokens": request.max_output_tokens,
            "metadata": request.metadata or {}, "parallel_tool_calls": generation.parallel_tool_calls,
            "temperature": request.temperature, "top_p": request.top_p, "top_logprobs": request.top_logprobs,
            "tool_choice": data.get("tool_choice") or "auto", "tools": data.get("tools") or [],
            "text": {"format": (data.get("text") or {}).get("format") or {"type": "text"}},
            "reasoning": {"effort": request.reasoning.effort if request.reasoning else None, "summary": None},
            "store": store, "background": False, "truncation": "disabled",
            "previous_response_id": request.previous_response_id,
            "conversation": {"id": conversation} if conversation else None}
    new_items = identified(data["input"], request.input)
    distinct(new_items, history, "input")
    return ParsedResponses(generation, echo, logprobs, store, (*history, *new_items) if store else (),
                           conversation, tuple(new_items) if conversation else ())


def _check_kept(request: ResponsesRequest, keeps: bool) -> None:
    """What a request may ask of stored responses and conversations (``keeps``: the server keeps them)."""
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


def _generation(request: ResponsesRequest, messages: tuple[Message, ...], model_name: str, ceiling: int | None,
                vocab_size: int | None, logprobs: bool, images: tuple) -> GenerationRequest:
    parts.check_model(request.model, model_name)
    thinking, effort = parts.effort(request.reasoning.effort if request.reasoning else None, "reasoning.effort")
    choice, named = request.tool_choice, None
    if isinstance(choice, _NamedTool):
        choice, named = "function", choice.name
    tools = parts.tools([parts.Tool(tool.name, tool.description, tool.parameters, tool.strict is not False,
                                    f"tools[{i}].parameters") for i, tool in enumerate(request.tools or ())],
                        choice, named)
    response_format = _response_format(request)
    sampling = parts.sampling(parts.Sampling(
        request.max_output_tokens, request.temperature, request.top_p,
        logprobs=parts.top_logprobs(request.top_logprobs, logprobs),
        names=(("max_tokens", "max_output_tokens"), ("logprobs", "include"))), ceiling, vocab_size)
    return GenerationRequest(model_name, sampling, request.stream, False, messages=messages, thinking=thinking,
                             effort=effort, tools=tools.functions, tool_choice=tools.choice, tool_name=tools.name,
                             tool_checks=tools.checks, parallel_tool_calls=request.parallel_tool_calls is not False,
                             response_format=response_format, images=images, prompt_param="input",
                             format_param="text.format", fills_context=request.max_output_tokens is None,
                             cache_retention=parts.retention(request.prompt_cache_retention),
                             cache_group=parts.group(request.prompt_cache_key))


def _response_format(request: ResponsesRequest) -> dict | None:
    """``text.format``: {"schema": ...} for a JSON answer (None: any JSON object), None for text."""
    form = request.text.format if request.text is not None else None
    if form is None:
        return None
    extra = sorted(form.model_dump(exclude_unset=True, by_alias=True).keys() - {"type"})
    if form.type != "json_schema" and extra:
        raise ApiError(400, f"text.format: only type json_schema takes {', '.join(extra)}", "text.format")
    if form.type == "text":
        return None
    if form.type == "json_schema" and form.name is None:
        raise ApiError(400, "text.format.name is required with type json_schema", "text.format")
    if form.type == "json_object":
        return parts.json_answer(None, "text.format", "")
    return parts.json_answer(form.schema_ if form.schema_ is not None else {}, "text.format", "text.format.schema")


def conversation_named(data: dict) -> str | None:
    """The id of the conversation a Responses request names (a string, or an object
    with its id), read before the request is parsed; None if it names none."""
    named = data.get("conversation") if isinstance(data, dict) else None
    named = named.get("id") if isinstance(named, dict) else named
    return named if isinstance(named, str) and named else None


@dataclass
class _Turn:
    """An assistant turn being gathered from consecutive items (``where``: its first)."""

    where: str
    content: str = ""
    reasoning: str | None = None
    calls: list[ToolCall] = field(default_factory=list)

    def message(self) -> Message:
        return _message(self.where, "assistant", self.content, reasoning=self.reasoning, tool_calls=tuple(self.calls))


class _Messages:
    """The chat turns a request's input means, after ``earlier`` (the items of the
    response or conversation it continues); its images are read, in order, into ``images``."""

    def __init__(self, read_image, images: list, max_images: int):
        self.read_image, self.images, self.max_images = read_image, images, max_images

    def build(self, request: ResponsesRequest, earlier: Sequence[Item] = ()) -> tuple[Message, ...]:
        """An assistant turn is one message: the reasoning, text and calls of consecutive
        assistant items (a reasoning item after text or calls begins the next turn). A
        call's output must follow the call."""
        built: list[Message | _Turn] = []
        if request.instructions is not None:
            built.append(_message("instructions", "system", request.instructions))
        if isinstance(request.input, str):
            items = [(MessageItem(role="user", content=request.input), "input")]
        else:
            items = [(item, f"input[{index}]") for index, item in enumerate(request.input)]
        turn: _Turn | None = None  # the assistant turn being gathered
        called: set[str] = set()
        for item, where in [*((item, "previous_response_id") for item in earlier), *items]:
            assistant = isinstance(item, FunctionCallItem | ReasoningItem) or (
                isinstance(item, MessageItem) and item.role == "assistant")
            if not assistant:
                turn = None
            elif turn is None or (isinstance(item, ReasoningItem) and (turn.content or turn.calls)):
                if turn is not None:
                    raise ApiError(400, f"{where}: a reasoning item begins an assistant turn, and the turn before it "
                                        "has had no user message or function_call_output since", "input")
                turn = _Turn(where)
                built.append(turn)
            if isinstance(item, ReasoningItem):
                turn.reasoning = (turn.reasoning or "") + "".join(part.text for part in item.content or ())
            elif isinstance(item, FunctionCallItem):
                called.add(item.call_id)
                turn.calls.append(ToolCall(item.name, item.arguments, item.call_id))
            elif isinstance(item, FunctionCallOutputItem):
                if item.call_id not in called:
                    raise ApiError(400, f"{where}: no function_call before it has call_id {item.call_id!r}", "input")
                output = item.output if isinstance(item.output, str) else "".join(part.text for part in item.output)
                built.append(_message(where, "tool", output, tool_call_id=item.call_id))
            elif item.role == "assistant":
                turn.content += _text(item, where)
            else:
                built.append(self._said(item, where))
        return tuple(entry.message() if isinstance(entry, _Turn) else entry for entry in built)

    def _said(self, item: MessageItem, where: str) -> Message:
        """A user, system or developer message: its text, and its images in place."""
        if isinstance(item.content, str):
            return _message(where, item.role, item.content)
        pieces: tuple = ()
        for j, part in enumerate(item.content):
            if isinstance(part, OutputText):
                raise ApiError(400, f"{where}.content[{j}]: output_text belongs to assistant messages", "input")
        if any(not isinstance(part, InputText) for part in item.content):
            pieces = tuple(part.text if isinstance(part, InputText) else parts.image_part(
                part.image_url, f"{where}.content[{j}].image_url", self.read_image, self.images, self.max_images)
                for j, part in enumerate(item.content))
        text = "".join(part.text for part in item.content if isinstance(part, InputText))
        return _message(where, item.role, text, parts=pieces)


def _message(where: str, role: str, content: str, **fields) -> Message:
    try:
        return Message(role, content, **fields)
    except ValueError as error:
        raise ApiError(400, f"{where}: {error}", "input") from None


def _text(item: MessageItem, where: str) -> str:
    if isinstance(item.content, str):
        return item.content
    if any(not isinstance(part, OutputText) for part in item.content):
        raise ApiError(400, f"{where}.content: an assistant message holds output_text parts", "input")
    return "".join(part.text for part in item.content)


def record(parsed: ParsedResponses, response: dict) -> dict:
    """What the store keeps of a finished response: the response object and the input
    it answered (the previous response's items included)."""
    return {"response": response, "input": list(parsed.input_items)}
