"""The chat and completions APIs' requests: their shapes, parsed once into the internal
:class:`~cluster.serving.request.GenerationRequest`.

Parsing validates a JSON body against pydantic schemas (:class:`ChatRequest`,
:class:`CompletionRequest`), or raises :class:`~cluster.serving.validation.ApiError`
with an HTTP status and an OpenAI error object naming the parameter; a parameter this
server does not implement is refused by name, never ignored. The answers' objects are
:mod:`cluster.serving.openai_render`'s. No I/O here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import Field, StrictBool

from cluster.serving import request_parts as parts
from cluster.serving.request import GenerationRequest
from cluster.serving.validation import ApiError, Integer, Number, Retention, Schema, ToolName, validated
from model.chat import Message
from model.tools import ToolCall


class _StreamOptions(Schema):
    include_usage: StrictBool = False


class _TextPart(Schema):
    type: Literal["text"]
    text: str


class _ImageUrl(Schema):
    url: str
    detail: Literal["auto"] | None = None  # "low" / "high": one resolution rule here (the processor's)


class _ImagePart(Schema):
    type: Literal["image_url"]
    image_url: _ImageUrl




class _Function(Schema):
    name: ToolName
    description: str | None = None
    parameters: dict[str, Any] | None = None
    # A strict tool's calls follow its schema: by grammar when a call is forced; with
    # "auto", a call whose arguments do not is returned as text, never as a call.
    strict: StrictBool | None = None


class _Tool(Schema):
    type: Literal["function"]
    function: _Function


class _CalledFunction(Schema):
    name: str = Field(min_length=1)
    arguments: str


class _ToolCallIn(Schema):
    id: str
    type: Literal["function"]
    function: _CalledFunction


class _NamedChoice(Schema):
    class _Name(Schema):
        name: str

    type: Literal["function"]
    function: _Name


class _JsonSchema(Schema):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: StrictBool | None = None


class _ResponseFormat(Schema):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: _JsonSchema | None = None


class _Message(Schema):
    role: str
    content: str | list[Annotated[_TextPart | _ImagePart, Field(discriminator="type")]] | None = None
    reasoning_content: str | None = None
    tool_calls: list[_ToolCallIn] | None = None
    tool_call_id: str | None = None


class _Request(Schema):
    """What chat and completions requests share. ``user`` is accepted and unused
    (OpenAI's end-user tag)."""

    model: str | None = None
    max_tokens: Integer | None = None
    max_completion_tokens: Integer | None = None
    temperature: Number | None = None
    top_p: Number | None = None
    seed: Integer | None = None
    stop: str | list[str] | None = None
    stream: StrictBool = False
    stream_options: _StreamOptions | None = None
    n: Integer | None = None
    presence_penalty: Number | None = None
    frequency_penalty: Number | None = None
    logit_bias: dict[str, Number] | None = None
    user: str | None = None
    prompt_cache_retention: Retention | None = None
    prompt_cache_key: str | None = Field(default=None, max_length=1024)


class ChatRequest(_Request):
    messages: list[_Message] = Field(min_length=1)
    reasoning_effort: str | None = None
    logprobs: StrictBool | None = None
    top_logprobs: Integer | None = None
    tools: list[_Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | _NamedChoice | None = None
    parallel_tool_calls: StrictBool | None = None
    response_format: _ResponseFormat | None = None


class CompletionRequest(_Request):
    prompt: str | list[Integer]
    echo: Literal[False] | None = None
    best_of: Literal[1] | None = None
    suffix: None = None
    logprobs: Integer | None = None



def _max_tokens(request: _Request) -> int | None:
    return request.max_completion_tokens if request.max_completion_tokens is not None else request.max_tokens


def _sampling(request: _Request, ceiling: int | None, vocab_size: int | None, logprobs: int | None,
              default: int | None = None):
    names = (("max_tokens", "max_completion_tokens"),) if request.max_completion_tokens is not None else ()
    return parts.sampling(parts.Sampling(
        _max_tokens(request), request.temperature, request.top_p, request.seed, request.stop,
        request.presence_penalty, request.frequency_penalty, request.logit_bias, logprobs, names), ceiling,
        vocab_size, default)


def parse_chat(data: dict, model_name: str, ceiling: int | None, vocab_size: int | None = None,
               read_image: Callable[[str, tuple], tuple[int, Any]] | None = None,
               max_images: int = 0) -> GenerationRequest:
    """``read_image(url, the request's images decoded before it)`` -> (positions the
    image's span takes, the decoded image), or ValueError; None: this model reads no
    images."""
    request = validated(ChatRequest, data)
    parts.check_model(request.model, model_name)
    images: list = []
    messages = tuple(_message(i, message, read_image, images, max_images) for i, message in enumerate(request.messages))
    thinking, effort = parts.effort(request.reasoning_effort)
    tools = _tools(request)
    if request.top_logprobs is not None and not request.logprobs:
        raise ApiError(400, "top_logprobs needs logprobs: true", "top_logprobs")
    logprobs = parts.top_logprobs(request.top_logprobs, bool(request.logprobs))
    options = request.stream_options
    return GenerationRequest(model_name, _sampling(request, ceiling, vocab_size, logprobs), request.stream,
                             bool(options is not None and options.include_usage), messages=messages,
                             thinking=thinking, effort=effort, tools=tools.functions, tool_choice=tools.choice,
                             tool_name=tools.name, tool_checks=tools.checks,
                             parallel_tool_calls=request.parallel_tool_calls is not False,
                             response_format=_response_format(request), n=parts.answers(request.n),
                             images=tuple(images), fills_context=_max_tokens(request) is None,
                             cache_retention=parts.retention(request.prompt_cache_retention),
                             cache_group=parts.group(request.prompt_cache_key))


def _message(i: int, message: _Message, read_image, images: list, max_images: int) -> Message:
    """Chat message ``i`` (its images read, in order, into ``images``)."""
    content = message.content
    pieces: tuple = ()
    if isinstance(content, list):
        if any(isinstance(part, _ImagePart) for part in content):
            pieces = tuple(part.text if isinstance(part, _TextPart) else parts.image_part(
                part.image_url.url, f"messages[{i}].content[{j}].image_url", read_image, images, max_images)
                for j, part in enumerate(content))
        content = "".join(part.text for part in content if isinstance(part, _TextPart))
    calls = tuple(ToolCall(call.function.name, call.function.arguments, call.id) for call in message.tool_calls or ())
    try:
        return Message(message.role, content or "", reasoning=message.reasoning_content, tool_calls=calls,
                       tool_call_id=message.tool_call_id, parts=pieces)
    except ValueError as error:
        raise ApiError(400, f"messages[{i}]: {error}", "messages") from None


def _tools(request: ChatRequest) -> parts.Tools:
    choice, named = request.tool_choice, None
    if isinstance(choice, _NamedChoice):
        choice, named = "function", choice.function.name
    given = [parts.Tool(tool.function.name, tool.function.description, tool.function.parameters,
                        bool(tool.function.strict), f"tools[{i}].function.parameters")
             for i, tool in enumerate(request.tools or ())]
    return parts.tools(given, choice, named)


def _response_format(request: ChatRequest) -> dict | None:
    """{"schema": ...} for a JSON answer (None: any JSON object), None for text."""
    form = request.response_format
    if form is None or form.type == "text":
        return None
    if form.type == "json_object":
        return parts.json_answer(None, "response_format", "")
    if form.json_schema is None:
        raise ApiError(400, "response_format.json_schema is required with type json_schema", "response_format")
    schema = form.json_schema.schema_ if form.json_schema.schema_ is not None else {}
    return parts.json_answer(schema, "response_format", "response_format.json_schema.schema")


def parse_completion(data: dict, model_name: str, ceiling: int | None, vocab_size: int) -> GenerationRequest:
    request = validated(CompletionRequest, data)
    parts.check_model(request.model, model_name)
    prompt = request.prompt
    if isinstance(prompt, list):
        if not prompt or not all(0 <= t < vocab_size for t in prompt):
            raise ApiError(400, f"prompt token ids must be a non-empty list in [0, {vocab_size})", "prompt")
        prompt = tuple(prompt)
    elif not prompt:
        raise ApiError(400, "prompt must be a non-empty string or a list of token ids", "prompt")
    if request.logprobs is not None and not 0 <= request.logprobs <= 5:
        raise ApiError(400, "logprobs must be an integer in 0..5", "logprobs")
    options = request.stream_options
    return GenerationRequest(model_name, _sampling(request, ceiling, vocab_size, request.logprobs,
                                                   parts.COMPLETIONS_MAX_TOKENS),
                             request.stream, bool(options is not None and options.include_usage), prompt=prompt,
                             n=parts.answers(request.n), prompt_param="prompt",
                             cache_retention=parts.retention(request.prompt_cache_retention),
                             cache_group=parts.group(request.prompt_cache_key))
