"""The chat and completions APIs' objects: responses, choices, streamed chunks, usage,
and the server-sent events that carry them. No I/O here.
"""

from __future__ import annotations

import json
import time
from typing import Any

from cluster.serving.chat_answer import tool_call_json
from model.tools import ToolCall


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int, allowed: int) -> dict:
    """OpenAI's usage object, and ``max_completion_tokens``: the most tokens each answer
    was allowed (the request's, or the room its prompt left in the context)."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
        "max_completion_tokens": allowed,
    }



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
