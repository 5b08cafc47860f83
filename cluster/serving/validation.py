"""A request body, checked: JSON within bounds, then a pydantic schema, with every
mistake a 400 naming the parameter (:class:`ApiError`, OpenAI's error object).

The schemas of every API (chat, completions, Responses, conversations) derive from
:class:`Schema`: a parameter this server does not implement is refused by name, never
ignored. No I/O here.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError


class ApiError(Exception):
    """A request the API refuses: ``status`` (4xx) and an OpenAI error body."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = status, message, param, kind, code
        self.headers = headers  # HTTP headers of the answer (Retry-After on a 429)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


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


def _number(value: Any) -> Any:
    if isinstance(value, (bool, str)):
        raise ValueError("must be a number")
    return value


Number = Annotated[float, BeforeValidator(_number)]
Integer = Annotated[int, Field(strict=True)]
# ``prompt_cache_retention``: OpenAI's two values and this project's 72 hours (storage.keys.CacheRetention).
Retention = Literal["in_memory", "24h", "72h"]


class Schema(BaseModel):
    # A parameter this server does not implement is refused by name, never ignored.
    model_config = ConfigDict(extra="forbid", protected_namespaces=())


# A tool's name, as OpenAI limits it (chat's and the Responses API's tools alike).
ToolName = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")]


def validated(schema: type[Schema], data: dict, tags: tuple[str, ...] = ("text", "image_url")) -> Schema:
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
