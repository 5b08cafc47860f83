"""The parts of a :class:`~cluster.serving.request.GenerationRequest` that more than
one API asks for, each checked against its bounds: the sampling, the reasoning effort,
the tools and the tool choice, a JSON answer's schema, an image, the model's name.

Chat and completions (:mod:`cluster.serving.openai_api`) and the Responses API
(:mod:`cluster.serving.responses_api`) each validate their own schema once, then build
the request from these, passing the names their own parameters have: an error names
what the client sent (``max_output_tokens``, not ``max_tokens``). No I/O here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from cluster.serving.request import OPENAI_EFFORT
from cluster.serving.schema_checks import check_schema, strict_checks
from cluster.serving.validation import ApiError
from model.chat import ImagePart
from model.runtime.grammar import SchemaCheck
from model.runtime.sampling import SamplingParams, SamplingParamsError
from storage.keys import CacheRetention

# Bounds on what a request may ask the server to compile or scan (a 400 names the
# parameter): OpenAI's own where it documents one.
MAX_TOKENS_LIMIT = 1 << 20
COMPLETIONS_MAX_TOKENS = 16  # OpenAI's default answer length for /v1/completions
MAX_TOOLS = 128  # OpenAI's limit
MAX_STOPS, MAX_STOP_CHARS = 4, 256  # the stop strings are scanned on the decoder's thread every step
MAX_N = 16  # answers per request: each is a place in a decoder batch
MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True)
class Sampling:
    """The sampling a request asks for, as sent (None: left out). ``names``: what the
    request's API calls a parameter, where it differs (``max_tokens``: ``max_output_tokens``)."""

    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: Mapping[str, float] | None = None
    logprobs: int | None = None  # alternatives per token (None: no logprobs)
    names: tuple[tuple[str, str], ...] = ()  # (parameter, the API's name for it)

    def name(self, param: str) -> str:
        return dict(self.names).get(param, param)


def sampling(asked: Sampling, ceiling: int | None, vocab_size: int | None = None,
             default: int | None = None) -> SamplingParams:
    """The engine's :class:`SamplingParams` for ``asked``, or a 400 naming the parameter.

    ``ceiling``: the most tokens the server lets an answer have (None: the context's
    room); a request asking for more is a 400. Left out, ``max_tokens`` is ``default``
    (the API's own, as OpenAI's), or with none the ceiling: the request then
    :attr:`~cluster.serving.request.GenerationRequest.fills_context`, and
    :meth:`cluster.serving.prompts.Prompts.fit` cuts it to the room its prompt leaves."""
    param, limit = asked.name("max_tokens"), ceiling or MAX_TOKENS_LIMIT
    if asked.max_tokens is None:
        max_tokens = limit if default is None else min(default, limit)
    elif not 1 <= asked.max_tokens <= MAX_TOKENS_LIMIT:
        raise ApiError(400, f"{param} must be a positive integer", param)
    elif asked.max_tokens > limit:
        raise ApiError(400, f"{param} is too large: {asked.max_tokens}; this server allows at most {limit}", param)
    else:
        max_tokens = asked.max_tokens
    stop = asked.stop
    stop = () if stop is None else (stop,) if isinstance(stop, str) else tuple(stop)
    if not (all(stop) and len(stop) <= MAX_STOPS and all(len(text) <= MAX_STOP_CHARS for text in stop)):
        raise ApiError(400, f"stop must be a string or a list of up to {MAX_STOPS} non-empty strings of at most "
                            f"{MAX_STOP_CHARS} characters", "stop")
    try:
        return SamplingParams(
            temperature=1.0 if asked.temperature is None else float(asked.temperature),
            top_p=1.0 if asked.top_p is None else float(asked.top_p),
            seed=asked.seed, max_tokens=max_tokens, stop=stop,
            presence_penalty=float(asked.presence_penalty or 0),
            frequency_penalty=float(asked.frequency_penalty or 0),
            logit_bias=_logit_bias(asked.logit_bias, vocab_size), logprobs=asked.logprobs,
        )
    except SamplingParamsError as error:
        param = next((name for name in ("presence_penalty", "frequency_penalty", "logit_bias", "logprobs", "top_p",
                                        "temperature", "seed") if name in str(error)), None)
        raise ApiError(400, str(error), param if param is None else asked.name(param)) from None


def _logit_bias(bias: Mapping[str, float] | None, vocab_size: int | None) -> tuple[tuple[int, float], ...]:
    pairs = []
    for key, value in (bias or {}).items():
        if not key.isdigit() or (vocab_size is not None and int(key) >= vocab_size):
            raise ApiError(400, f"logit_bias: {key!r} is not a token id of this model's vocabulary (0 to "
                                f"{(vocab_size or 1) - 1})", "logit_bias")
        pairs.append((int(key), float(value)))
    return tuple(pairs)


def top_logprobs(top: int | None, asked: bool) -> int | None:
    """Alternatives per token of an answer's logprobs (``asked``: logprobs were asked
    for; None: none), at most ``MAX_TOP_LOGPROBS``."""
    if top is not None and not 0 <= top <= MAX_TOP_LOGPROBS:
        raise ApiError(400, f"top_logprobs must be an integer in 0..{MAX_TOP_LOGPROBS}", "top_logprobs")
    return (top or 0) if asked else None


def answers(n: int | None) -> int:
    """How many answers to sample (``n``), 1 to ``MAX_N``."""
    n = 1 if n is None else n
    if not 1 <= n <= MAX_N:
        raise ApiError(400, f"n must be an integer in 1..{MAX_N}", "n")
    return n


def effort(name: str | None, param: str = "reasoning_effort") -> tuple[bool, int | None]:
    """(thinking, effort 1-100) for OpenAI's effort names (``param`` names the
    parameter); see :data:`cluster.serving.request.OPENAI_EFFORT`."""
    if name is None or name == "none":
        return False, None
    if name not in OPENAI_EFFORT:
        raise ApiError(400, f"unknown {param} {name!r}; use none, {', '.join(OPENAI_EFFORT)}", param)
    return True, OPENAI_EFFORT[name]


@dataclass(frozen=True)
class Tool:
    """A function tool as a request gives it; ``where``: its parameters' place in the
    request (``tools[2].function.parameters``), for an error."""

    name: str
    description: str | None
    parameters: dict[str, Any] | None
    strict: bool
    where: str


@dataclass(frozen=True)
class Tools:
    """The tools' ``function`` objects as the system block lists them (name,
    description, parameters: the released encoder's order), the tool choice ("auto",
    "none", "required", or "function" for ``name``), and the strict tools' checks."""

    functions: tuple[dict, ...] = ()
    choice: str = "auto"
    name: str | None = None
    checks: Mapping[str, SchemaCheck] = ()


def tools(given: Sequence[Tool], choice: str | None, named: str | None = None) -> Tools:
    """``choice``: "none", "auto", "required", "function" (a call of ``named``), or None
    (left out)."""
    functions = tuple({key: value for key, value in (("name", tool.name), ("description", tool.description),
                                                     ("parameters", tool.parameters)) if value is not None}
                      for tool in given)
    if len(functions) > MAX_TOOLS:
        raise ApiError(400, f"tools: {len(functions)} tools; the limit is {MAX_TOOLS}", "tools")
    for tool in given:
        check_schema(tool.parameters, "tools", tool.where)
    names = [function["name"] for function in functions]
    if len(set(names)) != len(names):
        raise ApiError(400, "tools: two tools have the same name", "tools")
    if choice is not None and not functions:
        raise ApiError(400, "tool_choice is set but no tools are given", "tool_choice")
    if choice == "function" and named not in names:
        raise ApiError(400, f"tool_choice names {named!r}, which is not among the tools", "tool_choice")
    checks = strict_checks((tool.name, tool.parameters) for tool in given if tool.strict)
    return Tools(functions, choice or "auto", named if choice == "function" else None, checks)


def json_answer(schema: dict[str, Any] | None, param: str, where: str) -> dict:
    """A JSON answer's ``{"schema": ...}`` (None: any JSON object), its schema bounded."""
    if schema is not None:
        check_schema(schema, param, where)
    return {"schema": schema}


def image_part(url: str, param: str, read_image: Callable[[str, tuple], tuple[int, Any]] | None, images: list,
               max_images: int) -> ImagePart:
    """An image of a message (``param``: where it is), read by ``read_image(url, the
    request's images read before it)`` -> (positions its span takes, the decoded image),
    or ValueError; None: this model reads no images. Added to ``images``."""
    if read_image is None:
        raise ApiError(400, f"{param}: this model reads no images", param)
    if len(images) >= max_images:
        raise ApiError(400, f"{param}: at most {max_images} images per request", param)
    try:
        length, image = read_image(url, tuple(image for _, image in images))
    except ValueError as error:
        raise ApiError(400, f"{param}: {error}", param) from None
    images.append((length, image))
    return ImagePart(length)


def check_model(model: str | None, model_name: str) -> None:
    if model is None:
        raise ApiError(400, "model is required", "model")
    if model != model_name:
        raise ApiError(404, f"The model `{model}` does not exist", "model", code="model_not_found")


def retention(asked: str | None) -> CacheRetention | None:
    """``prompt_cache_retention`` as asked (validated by the schema), None if not."""
    return None if asked is None else CacheRetention(asked)


def group(key: str | None) -> bytes | None:
    """``prompt_cache_key`` as sent (the router makes it its tenant's group)."""
    return None if key is None else key.encode()
