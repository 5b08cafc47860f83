"""The JSON schemas a request gives (a tool's parameters, a JSON answer's format),
bounded and checked before anything is compiled from them, and the checks that keep a
strict tool's calls to its schema.

Nothing a schema names is ever retrieved: a ``$ref`` is local (``#...``) or a 400.
No I/O here.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

from cluster.serving.validation import ApiError
from model.runtime.grammar import SchemaCheck
from model.tools import ToolCall

MAX_SCHEMA_BYTES = 64 << 10  # one tool's parameters, or a response format's schema, as JSON


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



def strict_checks(tools: Iterable[tuple[str, dict | None]]) -> dict[str, SchemaCheck]:
    """Each strict tool's schema (``(name, parameters)``), checked and compiled for
    checking its calls (:func:`strict_calls`); a 400 naming ``tools`` if one cannot be."""
    checks = {}
    for name, parameters in tools:
        try:
            checks[name] = _schema_check(json.dumps(parameters or {}, sort_keys=True))
        except ValueError as error:
            raise ApiError(400, f"tools: the parameters of strict tool {name!r} are not a JSON schema this server "
                                f"can enforce: {error}", "tools") from None
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
