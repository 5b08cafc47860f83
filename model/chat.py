"""Tokenizer and chat format of DeepSeek V4.1.

``ChatTemplate`` turns a list of ``Message`` into prompt token ids, with the
vocabulary of :class:`model.tokenizer.Tokenizer`.

The released V4.1 format (DeepSeek's ``encoding/encoding.py`` shipped with the
checkpoint; vLLM vendors it as ``vllm/tokenizers/deepseek_v41_encoding.py``) is::

    <｜begin▁of▁sentence｜>[<｜System｜>][Reasoning Effort: N (...)\\n\\n][system]
    <｜User｜>question<｜Assistant｜><think>reasoning</think>answer<｜end▁of▁sentence｜>
    <｜User｜>question<｜Assistant｜><think>                 (thinking on)

Tool results have no role of their own: they join the user turn as
``<tool_result>...</tool_result>`` blocks, blocks separated by a blank line.
The effort line exists only in thinking mode; effort is 1..100 or low/high/max
(50/75/100), default high.

Deliberate deviations, all so that a conversation's earlier rendering plus the
tokens the model generated is an exact token prefix of the next turn's rendering
(the KV store shares cache chunks only along exact prefixes):

1. Earlier turns keep their reasoning. The released encoder drops the reasoning
   of assistant turns before the last user message and renders them as
   ``<｜Assistant｜></think>answer``, which rewrites tokens that are already in
   the cache. Here every assistant turn is ``<｜Assistant｜><think>reasoning
   </think>answer<｜end▁of▁sentence｜>`` (the released encoder's
   ``drop_thinking=False`` layout).
2. Thinking off ends the prompt with ``<｜Assistant｜><think></think>`` (the
   released encoder writes ``<｜Assistant｜></think>``). With this choice an
   assistant turn reads the same whether it was produced with thinking on and
   empty reasoning or with thinking off, so a conversation may switch thinking
   per turn without rewriting its history. The golden prompts in
   ``tests/golden/A/inputs.json`` use this spelling.
3. A turn may carry the exact ids the model generated (``Message.token_ids``);
   they are rendered verbatim because the model's tokenization of its own answer
   need not be the canonical BPE of the answer text.

What still changes the whole prompt from its first tokens: a different system
message, a different effort, or switching thinking on/off (the effort line is
rendered only in thinking mode). That is a cache miss, never a wrong answer.

Tools (:mod:`model.tools`): the tool schemas follow the system prompt and a blank line
in the system block (with no system message, an empty one: ``<｜System｜>`` + the effort
line + ``\n\n## Tools...``, as vLLM renders it); an assistant turn's calls follow its
answer as one DSML block, then the end-of-sentence token; tool results join the next
user turn in the order of the calls they answer (by ``tool_call_id``). Reasoning is kept
in every turn, as the released encoder does whenever tools are given. ``developer``
messages are system messages (OpenAI's newer name for them; the released encoder has
no such role).

Images: a user turn's :class:`ImagePart` is rendered in place as as many image tokens
(``<｜deepseek_image｜>``) as the image's span takes, as the released processor expands
each image placeholder; the engine puts the span's embeddings there.

Not implemented: the internal task tokens. ``<｜System｜>`` is used only when the tokenizer has it
as one token; otherwise the system block follows the BOS unmarked (V3 layout)
and mid-conversation system messages are rejected.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

from model.tokenizer import SYSTEM_TOKEN, ChatFormatError, EncodeMemo, Tokenizer
from model.tools import DSML, ToolCall, calls_text, tools_text


# The API's named levels, as the seed and the released encoder define them.
EFFORT_LEVELS = {"low": 50, "high": 75, "max": 100}
DEFAULT_EFFORT = "high"
# The line the model saw during RL; its wording is part of the prompt format.
_EFFORT_LINE = "Reasoning Effort: {effort} (range 1-100, the higher the value, the more thorough the reasoning)\n\n"
_TOOL_RESULT = "<tool_result>{content}</tool_result>"
_PART_SEPARATOR = "\n\n"

ROLES = ("system", "developer", "user", "assistant", "tool")


@dataclass(frozen=True)
class ImagePart:
    """An image inside a user turn: rendered as ``length`` image tokens (the positions
    its span takes: :func:`model.vision.num_image_tokens` of its plan)."""

    length: int


@dataclass(frozen=True)
class Message:
    """One turn of a conversation.

    role: "system", "developer" (the same), "user", "assistant" or "tool" (a tool
        result; it joins the user turn it belongs to).
    content: the text of the turn (for an assistant: the answer after ``</think>``).
    tool_calls: assistant only: the tools the turn called (rendered after ``content``).
    tool_call_id: tool only: the call this result answers (orders the results).
    reasoning: assistant only. A string (possibly empty) marks a turn produced with
        thinking on; None a turn produced with thinking off.
    token_ids: assistant only, optional. The ids the model generated after the
        generation prompt, verbatim (with thinking on they include ``</think>``).
        When given they are rendered instead of ``reasoning``/``content``, which
        then serve display only. An end-of-sentence id is appended if missing.
    parts: user only, optional: the turn's texts and images (:class:`ImagePart`) in
        order; ``content`` is then its texts joined (display only).
    """

    role: str
    content: str = ""
    reasoning: str | None = None
    token_ids: tuple[int, ...] | None = None
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None
    parts: tuple[str | ImagePart, ...] = ()

    def __post_init__(self) -> None:
        if self.parts:
            if self.role != "user":
                raise ChatFormatError(f"only user turns carry images, not {self.role!r}")
            parts = _joined(self.parts)
            object.__setattr__(self, "parts", parts)
            object.__setattr__(self, "content", "".join(p for p in parts if isinstance(p, str)))
        if self.role not in ROLES:
            raise ChatFormatError(f"unknown role {self.role!r}; expected one of {', '.join(ROLES)}")
        if not isinstance(self.content, str):
            raise ChatFormatError(f"{self.role} content must be a string, got {type(self.content).__name__}")
        if self.role != "assistant" and (self.reasoning is not None or self.token_ids is not None or self.tool_calls):
            raise ChatFormatError(f"only assistant turns carry reasoning, token_ids or tool_calls, not {self.role!r}")
        if self.role != "tool" and self.tool_call_id is not None:
            raise ChatFormatError(f"only tool results carry a tool_call_id, not {self.role!r}")
        object.__setattr__(self, "tool_calls", tuple(self.tool_calls))
        if self.token_ids is not None:
            object.__setattr__(self, "token_ids", tuple(int(i) for i in self.token_ids))


def resolve_effort(effort: int | str | None) -> int:
    """The numeric effort 1..100 for an int, a named level, or None (the default, high)."""
    if effort is None:
        effort = DEFAULT_EFFORT
    if isinstance(effort, str):
        if effort not in EFFORT_LEVELS:
            raise ChatFormatError(f"unknown reasoning effort {effort!r}; use 1-100 or one of {', '.join(EFFORT_LEVELS)}")
        return EFFORT_LEVELS[effort]
    # bool is an int subclass; True as an effort is a caller bug, not effort 1.
    if isinstance(effort, bool) or not isinstance(effort, int) or not 1 <= effort <= 100:
        raise ChatFormatError(f"reasoning effort must be an integer in 1..100 or a named level, got {effort!r}")
    return effort


# A rendered prompt is a list of segments: a special-token id (int), plain text
# (str) encoded on its own, or ids taken verbatim (tuple). Special tokens split
# BPE, so encoding the text segments separately equals encoding the whole.
Segment = int | str | tuple[int, ...]


class ChatTemplate:
    """Renders conversations into the (prefix-stable) V4.1 prompt format; see the module docstring.

    With ``memo_tokens``, remembers the ids of long texts it encoded (up to that many
    tokens in all): the next turn of a conversation tokenises only what is new.
    """

    def __init__(self, tokenizer: Tokenizer, memo_tokens: int = 0):
        self.tokenizer = tokenizer
        self._encode = EncodeMemo(tokenizer, memo_tokens).encode if memo_tokens > 0 else tokenizer.encode

    def render(
        self,
        messages: Sequence[Message],
        *,
        thinking: bool = False,
        effort: int | str | None = None,
        add_generation_prompt: bool = True,
        tools: Sequence[dict] = (),
    ) -> list[int]:
        """Prompt ids for ``messages``.

        thinking: whether the model should reason before answering; also decides
            whether the ``Reasoning Effort`` line is rendered.
        effort: 1..100 or "low"/"high"/"max"; validated always, used only with thinking.
        add_generation_prompt: end with the assistant header (the conversation must
            then end with a user, tool or mid-conversation system turn).
        tools: the ``function`` objects of the tools the model may call (their
            schemas join the system block).

        Prefix property: if ``ids = render(msgs)`` and the model generated ``out``,
        then ``ids + out`` is a prefix of ``render(msgs + [assistant, user])`` when the
        assistant message carries ``out`` as ``token_ids`` (or text that re-encodes to
        ``out``) and thinking/effort/system are unchanged.
        """
        ids: list[int] = []
        for segment in self._segments(messages, thinking, effort, add_generation_prompt, tools):
            if isinstance(segment, int):
                ids.append(segment)
            elif isinstance(segment, str):
                ids.extend(self._encode(segment))
            else:
                ids.extend(segment)
        return ids

    def render_text(
        self,
        messages: Sequence[Message],
        *,
        thinking: bool = False,
        effort: int | str | None = None,
        add_generation_prompt: bool = True,
        tools: Sequence[dict] = (),
    ) -> str:
        """The prompt as text (for logs and debugging); same arguments as ``render``."""
        parts = []
        for segment in self._segments(messages, thinking, effort, add_generation_prompt, tools):
            if isinstance(segment, int):
                parts.append(self.tokenizer.decode([segment]))
            elif isinstance(segment, str):
                parts.append(segment)
            else:
                parts.append(self.tokenizer.decode(segment))
        return "".join(parts)

    def _segments(
        self, messages: Sequence[Message], thinking: bool, effort: int | str | None, add_generation_prompt: bool,
        tools: Sequence[dict] = (),
    ) -> Iterable[Segment]:
        sp = self.tokenizer.special
        effort_value = resolve_effort(effort)
        turns = _merge_user_turns(_check_messages(messages))
        _check_turn_order(turns, add_generation_prompt, has_system_token=sp.system is not None)

        yield sp.bos
        leading_system = turns[0][0] == "system"
        if leading_system or thinking or tools:
            if sp.system is not None:
                yield sp.system
            if thinking:
                yield _EFFORT_LINE.format(effort=effort_value)
            if leading_system:
                yield turns[0][1].content
                turns = turns[1:]
            if tools:
                yield from self._markup(_PART_SEPARATOR + tools_text(tools))

        for index, (role, message) in enumerate(turns):
            if role == "system":
                # Mid-conversation system turn (only reachable with a <｜System｜> token).
                yield sp.system
                yield message.content
            elif role == "user":
                yield sp.user
                for part in message.parts or (message.content,):
                    yield (sp.image,) * part.length if isinstance(part, ImagePart) else part
            else:
                yield from self._assistant(message)
            next_is_assistant = index + 1 < len(turns) and turns[index + 1][0] == "assistant"
            is_last = index + 1 == len(turns)
            if role != "assistant" and next_is_assistant:
                yield sp.assistant
            elif is_last and add_generation_prompt:
                yield sp.assistant
                yield sp.think_start
                if not thinking:
                    yield sp.think_end

    def _assistant(self, message: Message) -> Iterable[Segment]:
        sp = self.tokenizer.special
        # The header <｜Assistant｜> was emitted after the preceding turn.
        yield sp.think_start
        if message.reasoning is None:
            # Produced with thinking off: the prompt ended in <think></think>.
            yield sp.think_end
        if message.token_ids is not None:
            yield message.token_ids
            if not message.token_ids or message.token_ids[-1] != sp.eos:
                yield sp.eos
            return
        if message.reasoning is not None:
            yield message.reasoning
            yield sp.think_end
        yield message.content
        if message.tool_calls:
            yield from self._markup(calls_text(message.tool_calls))
        yield sp.eos

    def _markup(self, text: str) -> Iterable[Segment]:
        """Text holding the tool-call markup: ``｜DSML｜`` as its token where the
        vocabulary has one (the released one does), else as text."""
        dsml = self.tokenizer.special.dsml
        if dsml is None:
            yield text
            return
        for index, part in enumerate(text.split(DSML)):
            if index:
                yield dsml
            if part:
                yield part


def _check_messages(messages: Sequence[Message]) -> Sequence[Message]:
    if not messages:
        raise ChatFormatError("a conversation needs at least one message")
    for index, message in enumerate(messages):
        if not isinstance(message, Message):
            raise ChatFormatError(f"message {index} is a {type(message).__name__}, not a Message")
    return messages


def _merge_user_turns(messages: Sequence[Message]) -> list[tuple[str, Message]]:
    """Group messages into turns: consecutive user and tool messages become one user turn.

    Parts of a merged turn are separated by a blank line, tool results wrapped in
    ``<tool_result>`` (the released encoder's layout). A system message at index 0
    stays the leading system block; later ones are mid-conversation system turns.
    """
    turns: list[tuple[str, Message]] = []
    for message in _results_in_call_order(messages):
        if message.role in ("user", "tool"):
            if message.role == "tool":
                parts: tuple[str | ImagePart, ...] = (_TOOL_RESULT.format(content=message.content),)
            else:
                parts = message.parts or (message.content,)
            if turns and turns[-1][0] == "user":
                parts = (*(turns[-1][1].parts or (turns[-1][1].content,)), _PART_SEPARATOR, *parts)
            merged = Message("user", parts=parts) if any(isinstance(p, ImagePart) for p in parts) \
                else Message("user", "".join(parts))
            if turns and turns[-1][0] == "user":
                turns[-1] = ("user", merged)
            else:
                turns.append(("user", merged))
        else:
            role = "system" if message.role == "developer" else message.role
            turns.append((role, message))
    return turns


def _joined(parts: Sequence[str | ImagePart]) -> tuple[str | ImagePart, ...]:
    """Adjacent texts as one (each text is tokenised as a whole), empty texts dropped."""
    out: list[str | ImagePart] = []
    for part in parts:
        if isinstance(part, str):
            if not part:
                continue
            if out and isinstance(out[-1], str):
                out[-1] += part
                continue
        elif not (isinstance(part, ImagePart) and part.length > 0):
            raise ChatFormatError(f"a user turn's parts are texts and images, got {part!r}")
        out.append(part)
    return tuple(out)


def _results_in_call_order(messages: Sequence[Message]) -> list[Message]:
    """Each run of consecutive tool results sorted by the position of its
    ``tool_call_id`` among the calls of the assistant turn before it (an unknown id
    counts as the first; ties keep their order), as the released encoder does."""
    ordered: list[Message] = []
    calls: list[str] = []
    run: list[Message] = []
    for message in [*messages, None]:
        if message is not None and message.role == "tool":
            run.append(message)
            continue
        if run:
            ordered += sorted(run, key=lambda m: calls.index(m.tool_call_id) if m.tool_call_id in calls else 0)
            run = []
        if message is not None:
            if message.role == "assistant":
                calls = [call.id for call in message.tool_calls]
            ordered.append(message)
    return ordered


def _check_turn_order(turns: list[tuple[str, Message]], add_generation_prompt: bool, has_system_token: bool) -> None:
    for index, (role, _) in enumerate(turns):
        if role == "system" and index > 0 and not has_system_token:
            raise ChatFormatError(
                f"system message at position {index}: this tokenizer has no {SYSTEM_TOKEN} token, "
                "so only a leading system message is supported"
            )
        if role == "assistant" and (index == 0 or turns[index - 1][0] not in ("user", "system")):
            raise ChatFormatError(f"assistant turn {index} must follow a user, tool or system turn")
        if role == "assistant" and index == 1 and turns[0][0] == "system":
            raise ChatFormatError("the first assistant turn must follow a user turn, not the leading system message")
    last_role = turns[-1][0]
    if add_generation_prompt and (last_role == "assistant" or len(turns) == 1 and last_role == "system"):
        raise ChatFormatError(
            "a generation prompt needs the conversation to end with a user or tool message "
            f"(it ends with {'an assistant turn' if last_role == 'assistant' else 'only a system message'})"
        )
