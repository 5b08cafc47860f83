"""The OpenAI-compatible request and response shapes.

Parsing validates a JSON body against pydantic schemas (:class:`ChatRequest`,
:class:`CompletionRequest`) and turns it into a typed :class:`GenerationRequest`, or
raises :class:`ApiError` with an HTTP status and an OpenAI error object naming the
parameter; a parameter this server does not implement is refused by name, never
ignored. Formatting turns generated text into completion objects and streaming
chunks. No I/O here.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, StrictBool, ValidationError

from model.chat import EFFORT_LEVELS, ImagePart, Message
from model.runtime.grammar import SchemaCheck
from model.runtime.sampling import SamplingParams, SamplingParamsError
from model.tools import DSML, Content, ToolCall, ToolCallStream


class ApiError(Exception):
    """A request the API refuses: ``status`` (4xx) and an OpenAI error body."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = status, message, param, kind, code
        self.headers = headers  # HTTP headers of the answer (Retry-After on a 429)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class GenerationRequest:
    """A validated request: either chat ``messages`` or a raw ``prompt`` (text or ids)."""

    model: str
    params: SamplingParams
    stream: bool
    include_usage: bool
    messages: tuple[Message, ...] = ()
    prompt: str | tuple[int, ...] | None = None
    thinking: bool = False
    effort: int | None = None
    tools: tuple[dict, ...] = ()  # the ``function`` objects the model may call
    # "auto" (the answer's calls are parsed), "none" (they are not), "required" (the
    # answer is calls, by grammar), or "function" (a call of ``tool_name``, by grammar).
    tool_choice: str = "auto"
    tool_name: str | None = None
    # The strict tools (whose calls must follow their schema), each with its compiled check.
    tool_checks: Mapping[str, SchemaCheck] = field(default_factory=dict)
    parallel_tool_calls: bool = True
    # None, or the JSON the answer must be: {"schema": ...} (None: any object).
    response_format: dict | None = None
    n: int = 1  # answers to sample, sharing one prefill of the prompt
    images: tuple = ()  # (span positions, decoded image) of the messages' image parts, in order

    def samples(self) -> list[SamplingParams]:
        """Each answer's sampling: with a seed, answer i takes seed + i."""
        seed = self.params.seed
        return [dataclasses.replace(self.params, seed=None if seed is None else (seed + i) % (1 << 63))
                for i in range(self.n)]

    @property
    def strict_tools(self) -> frozenset[str]:
        return frozenset(self.tool_checks)

    @property
    def parses_calls(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"

    @property
    def forces_calls(self) -> bool:
        return self.tool_choice in ("required", "function")

    def grammar(self, dsml: int | None, think_end: int | None) -> tuple[str, tuple[int, ...], str] | None:
        """(grammar, the tokens it starts after, the parameter it enforces) for the
        answer, or None when the answer is free:

        - ``tool_choice`` required or named: the answer is a calls block;
        - ``response_format``: the answer is JSON of its schema;
        - ``tool_choice`` auto: the answer is free until the model opens a calls block;
          from its ``｜DSML｜`` token on, the block follows the grammar of a forced call
          (a call the model begins always parses, names a listed tool, has arguments of
          its schema, and is the only one when ``parallel_tool_calls`` is false). That
          needs the markup's token (``dsml``): with an older tokenizer auto is free, and
          ``parallel_tool_calls: false`` is a 400.

        With thinking on, each starts after ``</think>`` (``think_end``): the reasoning is free."""
        from model.runtime.grammar import json_grammar, tool_call_grammar

        reasoning = (think_end,) if self.thinking else ()
        if self.forces_calls:
            return tool_call_grammar(self.tools, self.tool_name, self.parallel_tool_calls, dsml), reasoning, "tools"
        if self.response_format is not None:
            return json_grammar(self.response_format["schema"]), reasoning, "response_format"
        if not self.parses_calls:
            return None
        if dsml is None:
            if not self.parallel_tool_calls:
                raise ApiError(400, "parallel_tool_calls: false needs tool_choice 'required' or a named function "
                                    "with this tokenizer (it has no ｜DSML｜ token to start a grammar at)",
                               "parallel_tool_calls")
            return None
        return (tool_call_grammar(self.tools, None, self.parallel_tool_calls, dsml, opened=True),
                (*reasoning, dsml), "tools")


# OpenAI's reasoning_effort names on V4.1's dial (1-100). The released encoder names three
# points, low = 50, high = 75, max = 100; OpenAI's other names sit between and below them:
# minimal is half of low, medium midway from low to high, xhigh the top. "none" turns
# thinking off, as does leaving the parameter out.
OPENAI_EFFORT = {**EFFORT_LEVELS, "minimal": EFFORT_LEVELS["low"] // 2,
                 "medium": (EFFORT_LEVELS["low"] + EFFORT_LEVELS["high"]) // 2, "xhigh": EFFORT_LEVELS["max"]}


_MAX_TOKENS_LIMIT = 1 << 20

# Bounds on what a request may ask the server to compile or scan (a 400 names the
# parameter): OpenAI's own where it documents one.
MAX_TOOLS = 128  # OpenAI's limit
MAX_SCHEMA_BYTES = 64 << 10  # one tool's parameters, or a response format's schema, as JSON
MAX_STOPS, MAX_STOP_CHARS = 4, 256  # the stop strings are scanned on the decoder's thread every step


MAX_JSON_DEPTH = 64  # a chat request nests 5 deep; the limit only stops abuse


def parse_json(body: bytes) -> dict:
    """A request body as a JSON object, or an ApiError: not JSON, nested deeper than
    ``MAX_JSON_DEPTH``, or holding a string that is not Unicode text (a lone surrogate
    such as ``"\\ud800"`` is valid JSON but no character, and no tokenizer takes it)."""
    try:
        data = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ApiError(400, f"request body is not valid JSON: {error}") from None
    except RecursionError:
        raise ApiError(400, f"request body is nested deeper than {MAX_JSON_DEPTH} levels") from None
    if not isinstance(data, dict):
        raise ApiError(400, "request body must be a JSON object")
    _check_values(data)
    return data


def _check_values(data: dict) -> None:
    """Depth and text checks over the parsed body, iteratively (no recursion to exhaust)."""
    stack: list[tuple[Any, int, str]] = [(data, 1, "")]
    while stack:
        value, depth, where = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise ApiError(400, f"request body is nested deeper than {MAX_JSON_DEPTH} levels", where or None)
        if isinstance(value, dict):
            for key, item in value.items():
                _check_text(key, where)
                stack.append((item, depth + 1, f"{where}.{key}" if where else key))
        elif isinstance(value, list):
            stack.extend((item, depth + 1, f"{where}[{i}]") for i, item in enumerate(value))
        elif isinstance(value, str):
            _check_text(value, where)


def _check_text(value: str, where: str) -> None:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as error:
        raise ApiError(400, f"{where or 'a key'}: not valid Unicode text ({error.reason} at character "
                            f"{error.start})", where or None) from None


# ---------------------------------------------------------------------- request schemas


def _number(value: Any) -> Any:
    if isinstance(value, (bool, str)):
        raise ValueError("must be a number")
    return value


Number = Annotated[float, BeforeValidator(_number)]
Integer = Annotated[int, Field(strict=True)]


class _Schema(BaseModel):
    # A parameter this server does not implement is refused by name, never ignored.
    model_config = ConfigDict(extra="forbid", protected_namespaces=())


class _StreamOptions(_Schema):
    include_usage: StrictBool = False


class _TextPart(_Schema):
    type: Literal["text"]
    text: str


class _ImageUrl(_Schema):
    url: str
    detail: Literal["auto"] | None = None  # "low" / "high": one resolution rule here (the processor's)


class _ImagePart(_Schema):
    type: Literal["image_url"]
    image_url: _ImageUrl


# A tool's name, as OpenAI limits it (chat's and the Responses API's tools alike).
ToolName = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")]


class _Function(_Schema):
    name: ToolName
    description: str | None = None
    parameters: dict[str, Any] | None = None
    # A strict tool's calls follow its schema: by grammar when a call is forced; with
    # "auto", a call whose arguments do not is returned as text, never as a call.
    strict: StrictBool | None = None


class _Tool(_Schema):
    type: Literal["function"]
    function: _Function


class _CalledFunction(_Schema):
    name: str = Field(min_length=1)
    arguments: str


class _ToolCallIn(_Schema):
    id: str
    type: Literal["function"]
    function: _CalledFunction


class _NamedChoice(_Schema):
    class _Name(_Schema):
        name: str

    type: Literal["function"]
    function: _Name


class _JsonSchema(_Schema):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: StrictBool | None = None


class _ResponseFormat(_Schema):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: _JsonSchema | None = None


class _Message(_Schema):
    role: str
    content: str | list[Annotated[_TextPart | _ImagePart, Field(discriminator="type")]] | None = None
    reasoning_content: str | None = None
    tool_calls: list[_ToolCallIn] | None = None
    tool_call_id: str | None = None


class _Request(_Schema):
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


def _validated(schema: type[_Schema], data: dict, tags: tuple[str, ...] = ("text", "image_url")) -> _Schema:
    """``data`` as ``schema``, or the first mistake as a 400 naming its parameter.
    ``tags``: the type tags of a list's items (a location names them after the index)."""
    try:
        return schema.model_validate(data)
    except ValidationError as error:
        # The deepest mistake: of a union (content as a string, or a list of parts),
        # the member the client meant got furthest.
        first = max(error.errors(), key=lambda e: len(e["loc"]))
        # Drop the union members pydantic names in a location ("str", "list[...]", ...).
        loc = [str(part) for part in first["loc"] if not _union_member(str(part))]
        # A content part's type tag follows its index: messages[0].content[1].image_url.url
        loc = [part for i, part in enumerate(loc) if not (i and loc[i - 1].isdigit() and part in tags
                                                            and i + 1 < len(loc))]
        param = loc[0] if loc else None
        where = "".join(f"[{part}]" if part.isdigit() else f".{part}" for part in loc).lstrip(".")
        if first["type"] == "extra_forbidden":
            raise ApiError(400, f"{where} is not supported by this server", param) from None
        if param in ("echo", "best_of", "suffix"):
            raise ApiError(400, f"{param} is not supported by this server (only its default)", param) from None
        message = first["msg"].removeprefix("Value error, ")
        raise ApiError(400, f"{where or 'request'}: {message}", param) from None


def _union_member(part: str) -> bool:
    return part in ("str", "int", "float", "bool", "none") or part.startswith(("list[", "dict[", "function-", "literal["))


def _logit_bias(request: _Request, vocab_size: int | None) -> tuple[tuple[int, float], ...]:
    bias = []
    for key, value in (request.logit_bias or {}).items():
        if not key.isdigit() or (vocab_size is not None and int(key) >= vocab_size):
            raise ApiError(400, f"logit_bias: {key!r} is not a token id of this model's vocabulary (0 to "
                                f"{(vocab_size or 1) - 1})", "logit_bias")
        bias.append((int(key), float(value)))
    return tuple(bias)


def _logprobs(request: _Request) -> int | None:
    """How many alternatives per token (None: no logprobs): chat's ``logprobs`` +
    ``top_logprobs`` (0-20), completions' ``logprobs`` (0-5)."""
    if isinstance(request, ChatRequest):
        if request.top_logprobs is not None and not request.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        if request.top_logprobs is not None and not 0 <= request.top_logprobs <= 20:
            raise ApiError(400, "top_logprobs must be an integer in 0..20", "top_logprobs")
        return (request.top_logprobs or 0) if request.logprobs else None
    if request.logprobs is not None and not 0 <= request.logprobs <= 5:
        raise ApiError(400, "logprobs must be an integer in 0..5", "logprobs")
    return request.logprobs


def _sampling(request: _Request, default_max: int, vocab_size: int | None = None) -> SamplingParams:
    max_tokens = request.max_completion_tokens if request.max_completion_tokens is not None else request.max_tokens
    max_tokens = default_max if max_tokens is None else max_tokens
    if not 1 <= max_tokens <= _MAX_TOKENS_LIMIT:
        raise ApiError(400, "max_tokens must be a positive integer", "max_tokens")
    stop = request.stop
    stop = () if stop is None else (stop,) if isinstance(stop, str) else tuple(stop)
    if not (all(stop) and len(stop) <= MAX_STOPS and all(len(text) <= MAX_STOP_CHARS for text in stop)):
        raise ApiError(400, f"stop must be a string or a list of up to {MAX_STOPS} non-empty strings of at most "
                            f"{MAX_STOP_CHARS} characters", "stop")
    try:
        return SamplingParams(
            temperature=1.0 if request.temperature is None else float(request.temperature),
            top_p=1.0 if request.top_p is None else float(request.top_p),
            seed=request.seed, max_tokens=max_tokens, stop=stop,
            presence_penalty=float(request.presence_penalty or 0),
            frequency_penalty=float(request.frequency_penalty or 0),
            logit_bias=_logit_bias(request, vocab_size), logprobs=_logprobs(request),
        )
    except SamplingParamsError as error:
        param = next((name for name in ("presence_penalty", "frequency_penalty", "logit_bias", "logprobs", "top_p",
                                        "temperature", "seed") if name in str(error)), None)
        raise ApiError(400, str(error), param) from None


MAX_N = 16  # answers per request: each is a place in a decoder batch


def _n(request: _Request) -> int:
    n = 1 if request.n is None else request.n
    if not 1 <= n <= MAX_N:
        raise ApiError(400, f"n must be an integer in 1..{MAX_N}", "n")
    return n


def _stream_flags(request: _Request) -> tuple[bool, bool]:
    options = request.stream_options
    return request.stream, bool(options is not None and options.include_usage)


def parse_chat(data: dict, model_name: str, default_max: int, vocab_size: int | None = None,
               read_image: Callable[[str, tuple], tuple[int, Any]] | None = None,
               max_images: int = 0) -> GenerationRequest:
    """``read_image(url, the request's images decoded before it)`` -> (positions the
    image's span takes, the decoded image), or ValueError; None: this model reads no
    images."""
    request = _validated(ChatRequest, data)
    _check_model(request, model_name)
    messages, images = [], []
    for i, message in enumerate(request.messages):
        content = message.content
        parts: tuple = ()
        if isinstance(content, list):
            if any(isinstance(part, _ImagePart) for part in content):
                parts = tuple(part.text if isinstance(part, _TextPart)
                              else _image_part(part, f"messages[{i}].content[{j}]", read_image, images, max_images)
                              for j, part in enumerate(content))
            content = "".join(part.text for part in content if isinstance(part, _TextPart))
        calls = tuple(ToolCall(call.function.name, call.function.arguments, call.id)
                      for call in message.tool_calls or ())
        try:
            messages.append(Message(message.role, content or "", reasoning=message.reasoning_content,
                                    tool_calls=calls, tool_call_id=message.tool_call_id, parts=parts))
        except ValueError as error:
            raise ApiError(400, f"messages[{i}]: {error}", "messages") from None
    thinking, effort = _effort(request.reasoning_effort)
    tools, choice, name = _tools(request)
    response_format = _response_format(request, choice)
    stream, include_usage = _stream_flags(request)
    return GenerationRequest(model_name, _sampling(request, default_max, vocab_size), stream, include_usage,
                             messages=tuple(messages), thinking=thinking, effort=effort, tools=tools,
                             tool_choice=choice, tool_name=name, tool_checks=_tool_checks(request),
                             parallel_tool_calls=request.parallel_tool_calls is not False,
                             response_format=response_format, n=_n(request), images=tuple(images))


def _image_part(part: _ImagePart, where: str, read_image, images: list, max_images: int) -> ImagePart:
    param = f"{where}.image_url"
    if read_image is None:
        raise ApiError(400, f"{param}: this model reads no images", param)
    if len(images) >= max_images:
        raise ApiError(400, f"{param}: at most {max_images} images per request", param)
    try:
        length, image = read_image(part.image_url.url, tuple(image for _, image in images))
    except ValueError as error:
        raise ApiError(400, f"{param}: {error}", param) from None
    images.append((length, image))
    return ImagePart(length)


def _response_format(request: ChatRequest, choice: str) -> dict | None:
    """{"schema": ...} for a JSON answer (None: any JSON object), None for text."""
    form = request.response_format
    if form is None or form.type == "text":
        return None
    if request.tools and choice != "none":
        raise ApiError(400, "response_format: a JSON answer and tool calls exclude each other; set tool_choice "
                            "to 'none' or leave out response_format", "response_format")
    if form.type == "json_object":
        return {"schema": None}
    if form.json_schema is None:
        raise ApiError(400, "response_format.json_schema is required with type json_schema", "response_format")
    schema = form.json_schema.schema_ if form.json_schema.schema_ is not None else {}
    check_schema(schema, "response_format", "response_format.json_schema.schema")
    return {"schema": schema}


def check_schema(schema: Any, param: str, where: str) -> None:
    """A JSON schema a request gives (``where`` in it), bounded: at most
    ``MAX_SCHEMA_BYTES`` as JSON, and every reference in it local (``#...``). Nothing a
    schema names is ever retrieved: a ``$ref`` to a URL or a file is a 400 naming it."""
    size = len(json.dumps(schema, ensure_ascii=False).encode("utf-8"))
    if size > MAX_SCHEMA_BYTES:
        raise ApiError(400, f"{where}: the schema is {size} bytes as JSON; the limit is {MAX_SCHEMA_BYTES}", param)
    for path, reference in _references(schema, where):
        if not (isinstance(reference, str) and reference.startswith("#")):
            raise ApiError(400, f"{path}: {reference!r} is not a reference inside the schema ('#...'); this server "
                                "retrieves nothing a request names", param)


_REFERENCES = ("$ref", "$dynamicRef", "$recursiveRef")


def _references(schema: Any, where: str) -> Iterator[tuple[str, Any]]:
    """(location, value) of each reference keyword in ``schema``, iteratively."""
    stack = [(schema, where)]
    while stack:
        value, path = stack.pop()
        if isinstance(value, dict):
            for key, item in value.items():
                if key in _REFERENCES:
                    yield f"{path}.{key}", item
                stack.append((item, f"{path}.{key}"))
        elif isinstance(value, list):
            stack.extend((item, f"{path}[{i}]") for i, item in enumerate(value))


def _effort(name: str | None) -> tuple[bool, int | None]:
    """(thinking, effort 1-100) for OpenAI's ``reasoning_effort``; see OPENAI_EFFORT."""
    if name is None or name == "none":
        return False, None
    if name not in OPENAI_EFFORT:
        raise ApiError(400, f"unknown reasoning_effort {name!r}; use none, {', '.join(OPENAI_EFFORT)}",
                       "reasoning_effort")
    return True, OPENAI_EFFORT[name]


def _tools(request: ChatRequest) -> tuple[tuple[dict, ...], str, str | None]:
    """The tools' ``function`` objects as the system block lists them (name, description,
    parameters: the released encoder's order), the tool choice, and the named tool."""
    functions = tuple({key: value for key, value in (("name", tool.function.name),
                                                     ("description", tool.function.description),
                                                     ("parameters", tool.function.parameters)) if value is not None}
                      for tool in request.tools or ())
    if len(functions) > MAX_TOOLS:
        raise ApiError(400, f"tools: {len(functions)} tools; the limit is {MAX_TOOLS}", "tools")
    for i, function in enumerate(functions):
        check_schema(function.get("parameters"), "tools", f"tools[{i}].function.parameters")
    names = [function["name"] for function in functions]
    if len(set(names)) != len(names):
        raise ApiError(400, "tools: two tools have the same name", "tools")
    choice, name = request.tool_choice or "auto", None
    if request.tool_choice is not None and not functions:
        raise ApiError(400, "tool_choice is set but no tools are given", "tool_choice")
    if isinstance(choice, _NamedChoice):
        choice, name = "function", choice.function.name
        if name not in names:
            raise ApiError(400, f"tool_choice names {name!r}, which is not among the tools", "tool_choice")
    return functions, choice, name


def _tool_checks(request: ChatRequest) -> dict[str, SchemaCheck]:
    """Each strict tool's schema, checked and compiled for checking its calls
    (:func:`strict_calls`)."""
    checks = {}
    for tool in request.tools or ():
        if tool.function.strict:
            try:
                checks[tool.function.name] = _schema_check(json.dumps(tool.function.parameters or {}, sort_keys=True))
            except ValueError as error:
                raise ApiError(400, f"tools: the parameters of strict tool {tool.function.name!r} are not a JSON "
                                    f"schema this server can enforce: {error}", "tools") from None
    return checks


@functools.lru_cache(maxsize=512)
def _schema_check(schema_json: str) -> SchemaCheck:
    """A schema checked to be one (against its metaschema, which jsonschema bundles) and
    compiled (ValueError if either fails). Kept: an agent sends the same tools every
    turn, and six of them take ~3 ms to compile."""
    import jsonschema

    schema = json.loads(schema_json)
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as error:
        raise ValueError(error.message) from None
    return SchemaCheck(schema)  # (a GrammarError is a ValueError)


def parse_completion(data: dict, model_name: str, default_max: int, vocab_size: int) -> GenerationRequest:
    request = _validated(CompletionRequest, data)
    _check_model(request, model_name)
    prompt = request.prompt
    if isinstance(prompt, list):
        if not prompt or not all(0 <= t < vocab_size for t in prompt):
            raise ApiError(400, f"prompt token ids must be a non-empty list in [0, {vocab_size})", "prompt")
        prompt = tuple(prompt)
    elif not prompt:
        raise ApiError(400, "prompt must be a non-empty string or a list of token ids", "prompt")
    stream, include_usage = _stream_flags(request)
    return GenerationRequest(model_name, _sampling(request, default_max, vocab_size), stream, include_usage,
                             prompt=prompt, n=_n(request))


def _check_model(request: _Request, model_name: str) -> None:
    if request.model is None:
        raise ApiError(400, "model is required", "model")
    if request.model != model_name:
        raise ApiError(404, f"The model `{request.model}` does not exist", "model", code="model_not_found")


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def strict_calls(tools: Sequence[dict], checks: Mapping[str, SchemaCheck]) -> Callable[[ToolCall], bool] | None:
    """Whether a parsed call may be returned as a call: a strict tool's arguments must
    follow its parameters' schema (a forced call follows it by construction, an
    ``auto`` one is checked here, by :class:`SchemaCheck`), and the tool must exist."""
    if not checks:
        return None
    names = {tool["name"] for tool in tools}

    def accept(call: ToolCall) -> bool:
        if call.name not in names:
            return False
        check = checks.get(call.name)
        return check is None or check.accepts(call.arguments)

    return accept


class ChatAnswer:
    """A chat answer as its tokens arrive: reasoning (up to ``</think>`` when thinking),
    answer text, and, when the request has tools and lets the model call them, the
    calls (:class:`model.tools.ToolCallStream`). ``push`` returns the stream deltas that
    became certain; the non-streaming response reads the totals."""

    def __init__(self, request: GenerationRequest, think_end: int, dsml: int | None,
                 token_bytes: Callable[[int], bytes] | None = None):
        """``token_bytes(id)``: a token's bytes, for logprobs."""
        self.think_end, self.dsml, self.token_bytes = think_end, dsml, token_bytes
        self.in_thinking = request.thinking
        self.reasoning_tokens = 0  # the reasoning's tokens, </think> included
        self._reasoning: list[str] | None = [] if request.thinking else None
        self._content: list[str] = []
        self._calls = ToolCallStream(strict_calls(request.tools, request.tool_checks)) \
            if request.parses_calls else None
        self.logprobs: list[dict] | None = [] if request.params.logprobs is not None else None
        self._unsent: list[dict] = []  # logprobs of tokens whose text is not out yet

    def push(self, token_id: int, text: str, logprob: float | None = None,
             top: Sequence[tuple[int, float]] = ()) -> list[dict]:
        """One generated token (its text from the detokenizer; its logprobs if asked
        for: the answer's tokens carry them, the reasoning's do not)."""
        if self.in_thinking:
            self.reasoning_tokens += 1
            if token_id == self.think_end:
                self.in_thinking = False
                return []
            self._reasoning.append(text)
            return [{"reasoning_content": text}] if text else []
        if self.logprobs is not None and logprob is not None:
            entry = {**self._token(token_id, logprob), "top_logprobs": [self._token(t, lp) for t, lp in top]}
            self.logprobs.append(entry)
            self._unsent.append(entry)
        if token_id == self.dsml and self.dsml is not None:
            text = DSML  # a special token: the detokenizer skips it
        if self._calls is None:
            self._content.append(text)
            return self._with_logprobs([{"content": text}] if text else [])
        return self._with_logprobs(self._deltas(self._calls.push(text)))

    def finish(self) -> list[dict]:
        """Deltas for whatever was held back (the answer ended)."""
        deltas = self._deltas(self._calls.finish()) if self._calls is not None else []
        return self._with_logprobs(deltas or ([{}] if self._unsent else []))

    def _token(self, token_id: int, logprob: float) -> dict:
        raw = self.token_bytes(token_id) if self.token_bytes is not None else b""
        return {"token": raw.decode("utf-8", errors="replace"), "logprob": logprob, "bytes": list(raw)}

    def _with_logprobs(self, deltas: list[dict]) -> list[dict]:
        """The logprobs not sent yet ride on the first delta (held-back text: later)."""
        if deltas and self._unsent:
            deltas[0] = {**deltas[0], "logprobs": {"content": self._unsent}}
            self._unsent = []
        return deltas

    def _deltas(self, events) -> list[dict]:
        deltas = []
        for event in events:
            if isinstance(event, Content):
                self._content.append(event.text)
                if event.text:
                    deltas.append({"content": event.text})
            else:
                deltas.append({"tool_calls": [tool_call_json(event.call, event.index)]})
        return deltas

    @property
    def reasoning(self) -> str | None:
        return "".join(self._reasoning) if self._reasoning is not None else None

    @property
    def content(self) -> str:
        return "".join(self._content)

    @property
    def calls(self) -> list[ToolCall]:
        return self._calls.calls if self._calls is not None else []

    def finish_reason(self, finish: str) -> str:
        """OpenAI's reason: a turn that stopped after calling tools ends in ``tool_calls``."""
        return "tool_calls" if finish == "stop" and self.calls else finish


def tool_call_json(call: ToolCall, index: int | None = None) -> dict:
    """A call as OpenAI writes it (with ``index``: as a streamed delta)."""
    body = {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
    return body if index is None else {"index": index, **body}


def chat_choice(index: int, content: str, reasoning: str | None, finish: str, calls: list[ToolCall] = (),
                logprobs: list[dict] | None = None) -> dict:
    message: dict[str, Any] = {"role": "assistant", "content": content if content or not calls else None}
    if reasoning is not None:
        message["reasoning_content"] = reasoning
    if calls:
        message["tool_calls"] = [tool_call_json(call) for call in calls]
    return {"index": index, "message": message, "finish_reason": finish,
            "logprobs": {"content": logprobs, "refusal": None} if logprobs is not None else None}


def chat_response(rid: str, model: str, choices: list[dict], usage_: dict) -> dict:
    return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": choices, "usage": usage_}


class CompletionLogprobs:
    """The completions API's (legacy) logprobs: per token its text, logprob, the top
    alternatives as {text: logprob}, and its offset in the returned text."""

    def __init__(self, token_bytes: Callable[[int], bytes]):
        self.token_bytes = token_bytes
        self.offset = 0

    def entry(self, token_id: int, text: str, logprob: float, top: Sequence[tuple[int, float]]) -> dict:
        """One token's logprobs (``text``: what it added to the returned text)."""
        def spell(token: int) -> str:
            return self.token_bytes(token).decode("utf-8", errors="replace")

        entry = {"tokens": [spell(token_id)], "token_logprobs": [logprob],
                 "top_logprobs": [{spell(t): lp for t, lp in top}], "text_offset": [self.offset]}
        self.offset += len(text)
        return entry

    @staticmethod
    def merge(entries: list[dict]) -> dict:
        return {key: [value for entry in entries for value in entry[key]]
                for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}


def completion_choice(index: int, text: str, finish: str, logprobs: dict | None = None) -> dict:
    return {"index": index, "text": text, "finish_reason": finish, "logprobs": logprobs}


def completion_response(rid: str, model: str, choices: list[dict], usage_: dict) -> dict:
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": choices, "usage": usage_}


def chat_chunk(rid: str, model: str, delta: dict, finish: str | None, usage_: dict | None = None,
               index: int = 0) -> dict:
    """A streamed chat chunk of answer ``index``; a ``logprobs`` key of ``delta`` goes to its choice."""
    choices = []
    if delta is not None:
        delta = dict(delta)
        logprobs = delta.pop("logprobs", None)
        choices = [{"index": index, "delta": delta, "finish_reason": finish, "logprobs": logprobs}]
    chunk = {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()), "model": model,
             "choices": choices}
    if usage_ is not None:
        chunk["usage"] = usage_
    return chunk


def chat_chunks(rid: str, model: str, deltas: list[dict], finish: str | None, index: int = 0) -> list[dict]:
    """The chunks for one token's ``deltas``, the finish reason on the last (alone if
    the token added nothing)."""
    if finish and not deltas:
        deltas = [{}]
    return [chat_chunk(rid, model, delta, finish if i == len(deltas) - 1 else None, index=index)
            for i, delta in enumerate(deltas)]


def completion_chunk(rid: str, model: str, text: str | None, finish: str | None, usage_: dict | None = None,
                     logprobs: dict | None = None, index: int = 0) -> dict:
    chunk = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
             "choices": [completion_choice(index, text, finish, logprobs)] if text is not None else []}
    if usage_ is not None:
        chunk["usage"] = usage_
    return chunk


def sse(payload: dict | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload)
    return f"data: {data}\n\n".encode()
