"""An answer as its tokens arrive, in the shapes the APIs return: a chat answer's
reasoning, text, tool calls and logprobs (:class:`ChatAnswer`, whose deltas the chat and
Responses renderers stream), and a completion's legacy logprobs
(:class:`CompletionLogprobs`). No I/O here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from cluster.serving.request import GenerationRequest
from cluster.serving.schema_checks import strict_calls
from model.tools import DSML, Content, ToolCall, ToolCallStream


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

