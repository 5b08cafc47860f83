"""A Responses API answer: its output items and the events that stream them.

:class:`ResponseBuilder` turns the chat answer's deltas (:class:`cluster.serving.chat_answer.ChatAnswer`)
into output items and the stream's events; the unstreamed response is the same
builder's final object. No I/O here.
"""

from __future__ import annotations

import json
import time

from cluster.serving.response_items import item_id
from cluster.serving.validation import ApiError


def usage(prompt_tokens: int, output_tokens: int, cached_tokens: int, reasoning_tokens: int, allowed: int) -> dict:
    """OpenAI's usage object. Every conversation is stored, so the prompt's tokens not
    read from the cache are the ones written to it (``cache_write_tokens``).
    ``max_output_tokens``: the most tokens the answer was allowed (the request's, or the
    room its prompt left in the context)."""
    return {"input_tokens": prompt_tokens,
            "input_tokens_details": {"cached_tokens": cached_tokens, "cache_write_tokens": prompt_tokens - cached_tokens},
            "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": prompt_tokens + output_tokens, "max_output_tokens": allowed}


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
                self._open = {"id": item_id("rs"), "type": "reasoning", "summary": [], "content": [],
                              "status": "in_progress"}
                part = {"type": "reasoning_text", "text": ""}
            else:
                self._open = {"id": item_id("msg"), "type": "message", "role": "assistant", "status": "in_progress",
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
        item = {"id": item_id("fc"), "type": "function_call", "call_id": call["id"], "name": function["name"],
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




def _copy(item: dict) -> dict:
    return {**item, "content": [dict(part) for part in item.get("content", ())]}


def sse(event: dict) -> bytes:
    """A Responses stream event: its type on the ``event:`` line, the event as data."""
    return f"event: {event['type']}\ndata: {json.dumps(event)}\n\n".encode()


def response_id() -> str:
    return item_id("resp")
