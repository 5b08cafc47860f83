"""The OpenAI-compatible request and response shapes, validated by hand.

Parsing turns a JSON body into a typed :class:`GenerationRequest` or raises
:class:`ApiError` with an HTTP status and an OpenAI error object; formatting turns
generated text into completion objects and streaming chunks. No I/O here.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass

from model.chat import Message, resolve_effort
from model.runtime.sampling import SamplingParams, SamplingParamsError


class ApiError(Exception):
    """A request the API refuses: ``status`` (4xx) and an OpenAI error body."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = status, message, param, kind, code

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


_MAX_TOKENS_LIMIT = 1 << 20


def parse_json(body: bytes) -> dict:
    try:
        data = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ApiError(400, f"request body is not valid JSON: {error}") from None
    if not isinstance(data, dict):
        raise ApiError(400, "request body must be a JSON object")
    return data


def _sampling(data: dict, default_max: int) -> SamplingParams:
    if data.get("n", 1) != 1:
        raise ApiError(400, "only n=1 is supported", "n")
    max_tokens = data.get("max_completion_tokens", data.get("max_tokens", default_max))
    if max_tokens is None:
        max_tokens = default_max
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or not 1 <= max_tokens <= _MAX_TOKENS_LIMIT:
        raise ApiError(400, "max_tokens must be a positive integer", "max_tokens")
    stop = data.get("stop")
    if stop is None:
        stop = ()
    elif isinstance(stop, str):
        stop = (stop,)
    elif isinstance(stop, list) and all(isinstance(s, str) and s for s in stop) and len(stop) <= 4:
        stop = tuple(stop)
    else:
        raise ApiError(400, "stop must be a string or a list of up to 4 non-empty strings", "stop")
    temperature = data.get("temperature", 1.0)
    top_p = data.get("top_p", 1.0)
    seed = data.get("seed")
    for name, value in (("temperature", temperature), ("top_p", top_p)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise ApiError(400, f"{name} must be a number", name)
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise ApiError(400, "seed must be an integer", "seed")
    try:
        return SamplingParams(
            temperature=1.0 if temperature is None else float(temperature),
            top_p=1.0 if top_p is None else float(top_p),
            seed=seed, max_tokens=max_tokens, stop=stop,
        )
    except SamplingParamsError as error:
        raise ApiError(400, str(error)) from None


def _stream_flags(data: dict) -> tuple[bool, bool]:
    stream = data.get("stream", False)
    if not isinstance(stream, bool):
        raise ApiError(400, "stream must be a boolean", "stream")
    options = data.get("stream_options") or {}
    if not isinstance(options, dict):
        raise ApiError(400, "stream_options must be an object", "stream_options")
    return stream, bool(options.get("include_usage", False))


def parse_chat(data: dict, model_name: str, default_max: int) -> GenerationRequest:
    _check_model(data, model_name)
    raw = data.get("messages")
    if not isinstance(raw, list) or not raw:
        raise ApiError(400, "messages must be a non-empty list", "messages")
    messages = []
    for i, message in enumerate(raw):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ApiError(400, f"messages[{i}] must be an object with a role", "messages")
        content = message.get("content", "")
        if isinstance(content, list):  # content parts: text only for now
            texts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise ApiError(400, f"messages[{i}]: only text content parts are supported", "messages")
                texts.append(part["text"])
            content = "".join(texts)
        if content is None:
            content = ""
        if not isinstance(content, str):
            raise ApiError(400, f"messages[{i}].content must be a string", "messages")
        reasoning = message.get("reasoning_content")
        try:
            messages.append(Message(message["role"], content, reasoning=reasoning if isinstance(reasoning, str) else None))
        except ValueError as error:
            raise ApiError(400, f"messages[{i}]: {error}", "messages") from None
    effort = data.get("reasoning_effort")
    thinking = effort is not None
    if thinking:
        try:
            effort = resolve_effort(effort)
        except ValueError as error:
            raise ApiError(400, str(error), "reasoning_effort") from None
    stream, include_usage = _stream_flags(data)
    return GenerationRequest(model_name, _sampling(data, default_max), stream, include_usage,
                             messages=tuple(messages), thinking=thinking, effort=effort)


def parse_completion(data: dict, model_name: str, default_max: int, vocab_size: int) -> GenerationRequest:
    _check_model(data, model_name)
    prompt = data.get("prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        if not all(0 <= t < vocab_size for t in prompt):
            raise ApiError(400, f"prompt token ids must be in [0, {vocab_size})", "prompt")
        prompt = tuple(prompt)
    elif not isinstance(prompt, str) or not prompt:
        raise ApiError(400, "prompt must be a non-empty string or a list of token ids", "prompt")
    if data.get("echo") or data.get("logprobs") or data.get("best_of", 1) != 1 or data.get("suffix"):
        raise ApiError(400, "echo, logprobs, best_of and suffix are not supported")
    stream, include_usage = _stream_flags(data)
    return GenerationRequest(model_name, _sampling(data, default_max), stream, include_usage, prompt=prompt)


def _check_model(data: dict, model_name: str) -> None:
    model = data.get("model")
    if not isinstance(model, str):
        raise ApiError(400, "model is required", "model")
    if model != model_name:
        raise ApiError(404, f"The model `{model}` does not exist", "model", code="model_not_found")


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def chat_response(rid: str, model: str, content: str, reasoning: str | None, finish: str, usage_: dict) -> dict:
    message = {"role": "assistant", "content": content}
    if reasoning is not None:
        message["reasoning_content"] = reasoning
    return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": message, "finish_reason": finish}], "usage": usage_}


def completion_response(rid: str, model: str, text: str, finish: str, usage_: dict) -> dict:
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "text": text, "finish_reason": finish, "logprobs": None}], "usage": usage_}


def chat_chunk(rid: str, model: str, delta: dict, finish: str | None, usage_: dict | None = None) -> dict:
    chunk = {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()), "model": model,
             "choices": [{"index": 0, "delta": delta, "finish_reason": finish}] if delta is not None else []}
    if usage_ is not None:
        chunk["usage"] = usage_
    return chunk


def completion_chunk(rid: str, model: str, text: str | None, finish: str | None, usage_: dict | None = None) -> dict:
    chunk = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
             "choices": [{"index": 0, "text": text, "finish_reason": finish, "logprobs": None}] if text is not None
             else []}
    if usage_ is not None:
        chunk["usage"] = usage_
    return chunk


def sse(payload: dict | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload)
    return f"data: {data}\n\n".encode()
