"""Tool calling in the released V4.1 format (DSML): the schemas the system block lists,
the markup an assistant turn calls tools with, and a streaming parser of that markup.

The released encoder (``encoding/encoding.py`` shipped with the checkpoint; vLLM vendors
it as ``vllm/tokenizers/deepseek_v41_encoding.py``) renders, after the system prompt and a
blank line, a fixed "## Tools" text that lists each tool's ``function`` object as one line
of JSON (``json.dumps(function, ensure_ascii=False)``: default separators, keys in the
order given). An assistant turn that calls tools is its answer text (possibly empty), a
blank line, then one block holding every call of the turn, in order::

    <｜DSML｜ calls>
    <｜DSML｜ invoke name="get_weather">
    <｜DSML｜ parameter name="city" string="true">Paris</｜DSML｜ parameter>
    <｜DSML｜ parameter name="days" string="false">1</｜DSML｜ parameter>
    </｜DSML｜ invoke>
    </｜DSML｜ calls>

and the end-of-sentence token. A string argument is written as it is (``string="true"``),
any other value as JSON (``string="false"``). ``｜DSML｜`` is one special token in the
released vocabulary; the rest is plain text. Tool results join the next user turn as
``<tool_result>...</tool_result>`` blocks in the order of the calls (``model.chat``).

No I/O here, no Ray: pure functions and one small state machine.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

DSML = "｜DSML｜"  # U+FF5C on both sides: one token of the released vocabulary
CALLS_OPEN = f"<{DSML} calls>"
CALLS_CLOSE = f"</{DSML} calls>"
INVOKE_OPEN = f"<{DSML} invoke name="
INVOKE_CLOSE = f"</{DSML} invoke>"
PARAMETER_OPEN = f"<{DSML} parameter name="
PARAMETER_CLOSE = f"</{DSML} parameter>"
# What starts the calls of a turn in generated text: the blank line belongs to the
# format, not to the answer.
CALLS_MARKER = "\n\n" + CALLS_OPEN

# The released encoder's tools text, verbatim: the model was trained on this wording.
TOOLS_TEMPLATE = (
    "## Tools\n\n"
    "You have access to a set of tools to help answer the user's question. You can invoke tools by writing a "
    f'"{CALLS_OPEN}" block like the following:\n\n'
    f"{CALLS_OPEN}\n"
    f'{INVOKE_OPEN}"$TOOL_NAME">\n'
    f'{PARAMETER_OPEN}"$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE{PARAMETER_CLOSE}\n'
    "...\n"
    f"{INVOKE_CLOSE}\n"
    f'{INVOKE_OPEN}"$TOOL_NAME2">\n'
    "...\n"
    f"{INVOKE_CLOSE}\n"
    f"{CALLS_CLOSE}\n\n"
    'String parameters should be specified as is and set `string="true"`. For all other types (numbers, booleans, '
    'arrays, objects), pass the value in JSON format and set `string="false"`.\n\n'
    "If thinking_mode is enabled (triggered by <think>), you MUST output your complete reasoning inside "
    "<think>...</think> BEFORE any tool calls or final response.\n\n"
    "Otherwise, output directly after </think> with tool calls or final response.\n\n"
    "### Available Tool Schemas\n\n"
    "{schemas}\n\n"
    "You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.\n"
)


class ToolFormatError(ValueError):
    """A tool schema or tool call the format cannot express."""


@dataclass(frozen=True)
class ToolCall:
    """One call: the function's ``name``, its ``arguments`` as the JSON text of an object
    (as the OpenAI API carries them), and the call's ``id`` (never rendered: it only
    pairs a result with its call)."""

    name: str
    arguments: str
    id: str = ""


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def tools_text(functions: Sequence[dict]) -> str:
    """The tools part of the system block for these ``function`` objects (name,
    description, parameters, in the order the client gave their keys)."""
    if not functions:
        raise ToolFormatError("tools must list at least one function")
    return TOOLS_TEMPLATE.replace("{schemas}", "\n".join(_json(function) for function in functions))


def _arguments_object(arguments: str | dict) -> dict:
    """A call's arguments as an object: JSON text is decoded (twice if it holds JSON
    text again); anything but an object becomes ``{"arguments": value}`` (the released
    encoder's rule)."""
    value: Any = arguments
    for _ in range(2):
        if not isinstance(value, str):
            break
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            break
    return value if isinstance(value, dict) else {"arguments": arguments}


def calls_text(calls: Sequence[ToolCall]) -> str:
    """The block an assistant turn calls ``calls`` with, from the blank line before it
    to its close (the end-of-sentence token follows)."""
    invokes = []
    for call in calls:
        parameters = []
        for key, value in _arguments_object(call.arguments).items():
            is_text = isinstance(value, str)
            parameters.append(f'{PARAMETER_OPEN}"{key}" string="{"true" if is_text else "false"}">'
                              f"{value if is_text else _json(value)}{PARAMETER_CLOSE}")
        invokes.append("\n".join([f'{INVOKE_OPEN}"{call.name}">', *parameters, INVOKE_CLOSE]))
    return "\n".join([CALLS_MARKER, *invokes, CALLS_CLOSE])


def parse_invoke(text: str) -> ToolCall | None:
    """One ``<｜DSML｜ invoke ...>...</｜DSML｜ invoke>`` (whitespace around it allowed) as a
    call with a fresh id, or None if it is not well formed: a value marked
    ``string="false"`` that is not JSON, a repeated parameter name, text outside the tags."""
    text = text.strip()
    if not (text.startswith(INVOKE_OPEN + '"') and text.endswith(INVOKE_CLOSE)):
        return None
    head, _, body = text[len(INVOKE_OPEN) + 1: -len(INVOKE_CLOSE)].partition('">')
    if not head or '"' in head or not _:
        return None
    arguments: dict[str, Any] = {}
    rest = body.strip()
    while rest:
        if not rest.startswith(PARAMETER_OPEN + '"'):
            return None
        end = rest.find(PARAMETER_CLOSE)
        if end < 0:
            return None
        attributes, sep, value = rest[len(PARAMETER_OPEN) + 1: end].partition('">')
        name, _, flag = attributes.partition('" string="')
        if not sep or not name or '"' in name or flag not in ("true", "false") or name in arguments:
            return None
        if flag == "true":
            arguments[name] = value
        else:
            try:
                arguments[name] = json.loads(value)
            except json.JSONDecodeError:
                return None
        rest = rest[end + len(PARAMETER_CLOSE):].strip()
    return ToolCall(head, _json(arguments), new_call_id())


# ---------------------------------------------------------------------- streaming


@dataclass(frozen=True)
class Content:
    """Answer text to show now."""

    text: str


@dataclass(frozen=True)
class Called:
    """A whole call, the ``index``-th of the turn."""

    index: int
    call: ToolCall


class ToolCallStream:
    """Splits an answer's text, arriving in pieces, into answer text and tool calls.

    ``push(text)`` returns what became certain: answer text up to a possible start of
    the calls block (a piece that could begin ``\\n\\n<｜DSML｜ calls>`` waits for the
    next), and each call once its ``</｜DSML｜ invoke>`` arrived. ``finish()`` returns
    the rest: a block that did not parse (an unknown layout, a cut-off answer) is
    returned as answer text from where it stopped parsing, never dropped.
    """

    def __init__(self, accept: Callable[[ToolCall], bool] | None = None) -> None:
        """``accept(call)``: whether a well-formed call may be returned as one (a strict
        tool's arguments must follow its schema); a call it refuses, and the rest of
        the block, come back as answer text."""
        self._accept = accept
        self._pending = ""  # answer text that may begin the marker
        self._block: str | None = None  # the block's text not parsed yet (None: not in a block)
        self._calls: list[ToolCall] = []
        self._closed = False  # the block's close was seen: what follows is answer text again
        self._raw_after_failure = False  # the block stopped parsing: the rest is answer text

    @property
    def calls(self) -> list[ToolCall]:
        return list(self._calls)

    def push(self, text: str) -> list[Content | Called]:
        if self._block is None or self._raw_after_failure:
            return self._push_answer(text)
        self._block += text
        return self._drain_block()

    def _push_answer(self, text: str) -> list[Content | Called]:
        if self._raw_after_failure or self._closed:
            return [Content(text)] if text else []
        buffered = self._pending + text
        at = buffered.find(CALLS_MARKER)
        if at >= 0:
            self._pending, self._block = "", buffered[at + len(CALLS_MARKER):]
            events: list[Content | Called] = [Content(buffered[:at])] if at else []
            return events + self._drain_block()
        keep = _partial_suffix(buffered, CALLS_MARKER)
        self._pending = buffered[len(buffered) - keep:] if keep else ""
        ready = buffered[: len(buffered) - keep]
        return [Content(ready)] if ready else []

    def _drain_block(self) -> list[Content | Called]:
        events: list[Content | Called] = []
        while self._block is not None:
            body = self._block.lstrip()
            if body.startswith(CALLS_CLOSE):
                if not self._calls:  # an empty block is no call
                    events += self._fail()
                    break
                after = body[len(CALLS_CLOSE):]
                self._block, self._closed = None, True
                if after:
                    events.append(Content(after))
                break
            end = body.find(INVOKE_CLOSE)
            if end < 0:
                # Wait while it can still become an invoke or the block's close.
                if not (INVOKE_OPEN.startswith(body[: len(INVOKE_OPEN)]) or CALLS_CLOSE.startswith(body)):
                    events += self._fail()
                break
            call = parse_invoke(body[: end + len(INVOKE_CLOSE)])
            if call is None or (self._accept is not None and not self._accept(call)):
                events += self._fail()
                break
            self._calls.append(call)
            events.append(Called(len(self._calls) - 1, call))
            self._block = body[end + len(INVOKE_CLOSE):]
        return events

    def _fail(self) -> list[Content | Called]:
        """The block does not parse from here: what is left of it is answer text."""
        rest = self._block or ""
        if not self._calls:
            rest = CALLS_MARKER + rest
        self._block, self._raw_after_failure = None, True
        return [Content(rest)] if rest else []

    def finish(self) -> list[Content | Called]:
        """The end of the answer: whatever is still held back, as answer text; except a
        block cut off after a whole call inside the next tag (max tokens ran out in the
        next invoke's opening or in the close): its calls stand, and the start of a tag
        is not answer text. A call cut off after its opening tag comes back as text."""
        events: list[Content | Called] = []
        if self._pending:
            events.append(Content(self._pending))
            self._pending = ""
        if self._block is not None:
            rest = self._block.lstrip()
            if self._calls and (INVOKE_OPEN.startswith(rest) or CALLS_CLOSE.startswith(rest)):
                self._block = None
            else:
                events += self._fail()
        return events


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of ``text`` that is a proper start of ``marker``."""
    for size in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


def split_answer(pieces: Iterable[str], accept: Callable[[ToolCall], bool] | None = None
                 ) -> tuple[str, list[ToolCall]]:
    """A whole answer's text and calls (the non-streaming form of :class:`ToolCallStream`)."""
    stream, text = ToolCallStream(accept), []
    for piece in pieces:
        text += [event.text for event in stream.push(piece) if isinstance(event, Content)]
    text += [event.text for event in stream.finish() if isinstance(event, Content)]
    return "".join(text), stream.calls
