"""The internal request: what every API's adapter parses a request into.

A :class:`GenerationRequest` is what the router renders, plans, dispatches and answers,
whichever API it came from (chat, completions, Responses). Its ``prompt_param`` and
``format_param`` name the request's own parameters, so that an error found after parsing
(a prompt too long for the context, a schema the engine cannot enforce) names what the
client sent. No I/O here.
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field

from cluster.serving.validation import ApiError
from model.chat import EFFORT_LEVELS, Message
from model.runtime.grammar import SchemaCheck
from model.runtime.sampling import SamplingParams
from storage.keys import CacheRetention


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
    # No answer length asked (chat, Responses): each answer may run to the context's end,
    # at most the server's ceiling (``params.max_tokens`` until the prompt's length is known).
    fills_context: bool = False
    images: tuple = ()  # (span positions, decoded image) of the messages' image parts, in order
    # What the request's API calls its prompt and its JSON answer's format (errors name them).
    prompt_param: str = "messages"
    format_param: str = "response_format"
    # How long its conversation's cache may be kept (``prompt_cache_retention``; None: not
    # asked). The router bounds it by the tenant's allowance: then never None.
    cache_retention: CacheRetention | None = None
    # Requests that share a long prefix (``prompt_cache_key``, as sent; the router makes it
    # the tenant's own group, a digest): routed together while nothing of it is cached.
    cache_group: bytes | None = None

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
        - ``response_format``: the answer is JSON of its schema; beside tools under
          ``tool_choice`` auto, JSON or a calls block (as OpenAI's: the format is the
          answer's when the model calls no tool);
        - ``tool_choice`` auto: the answer is free until the model opens a calls block;
          from its ``｜DSML｜`` token on, the block follows the grammar of a forced call
          (a call the model begins always parses, names a listed tool, has arguments of
          its schema, and is the only one when ``parallel_tool_calls`` is false). That
          needs the markup's token (``dsml``): with an older tokenizer auto is free, and
          ``parallel_tool_calls: false`` or a JSON answer beside tools is a 400.

        With thinking on, each starts after ``</think>`` (``think_end``): the reasoning is free."""
        from model.runtime.grammar import json_grammar, json_or_calls_grammar, tool_call_grammar

        reasoning = (think_end,) if self.thinking else ()
        if self.forces_calls:
            return tool_call_grammar(self.tools, self.tool_name, self.parallel_tool_calls, dsml), reasoning, "tools"
        if self.response_format is not None and not self.parses_calls:
            return json_grammar(self.response_format["schema"]), reasoning, self.format_param
        if not self.parses_calls:
            return None
        if dsml is None:
            if not self.parallel_tool_calls or self.response_format is not None:
                param = "parallel_tool_calls" if self.response_format is None else self.format_param
                raise ApiError(400, f"{param} beside tools needs tool_choice 'required' or a named function with "
                                    "this tokenizer (it has no ｜DSML｜ token to start a grammar at)", param)
            return None
        if self.response_format is not None:
            return (json_or_calls_grammar(self.response_format["schema"], self.tools, self.parallel_tool_calls, dsml),
                    reasoning, self.format_param)
        return (tool_call_grammar(self.tools, None, self.parallel_tool_calls, dsml, opened=True),
                (*reasoning, dsml), "tools")


# OpenAI's reasoning_effort names on V4.1's dial (1-100). The released encoder names three
# points, low = 50, high = 75, max = 100; OpenAI's other names sit between and below them:
# minimal is half of low, medium midway from low to high, xhigh the top. "none" turns
# thinking off, as does leaving the parameter out.
OPENAI_EFFORT = {**EFFORT_LEVELS, "minimal": EFFORT_LEVELS["low"] // 2,
                 "medium": (EFFORT_LEVELS["low"] + EFFORT_LEVELS["high"]) // 2, "xhigh": EFFORT_LEVELS["max"]}



def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"

