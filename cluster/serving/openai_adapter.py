"""The chat and completions APIs as adapters: parse once (:mod:`cluster.serving.openai_api`),
render the answers (:mod:`cluster.serving.openai_render`), whole or streamed.

A request may ask for ``n`` answers: streamed, their chunks interleave as they come,
each with its choice's index; then the usage if asked, then ``[DONE]``. A replica that
fails mid-stream ends the stream with an error object.
"""

from __future__ import annotations

import asyncio
from abc import abstractmethod
from collections.abc import AsyncIterator

from cluster.serving import openai_render as render
from cluster.serving.adapter import Adapter, Exchange, Totals
from cluster.serving.answers import Answer
from cluster.serving.dispatcher import generation_failed
from cluster.serving.openai_api import parse_chat, parse_completion
from cluster.serving.request import GenerationRequest, new_id


class _OpenAIAdapter(Adapter):
    """What chat and completions share: the stream of ``n`` interleaved answers."""

    def stream(self, exchange: Exchange, answers: list[Answer]) -> AsyncIterator[bytes]:
        return self._events(exchange, answers)

    async def _events(self, exchange: Exchange, answers: list[Answer]) -> AsyncIterator[bytes]:
        chunks: asyncio.Queue = asyncio.Queue()

        async def pump(index: int, answer: Answer) -> None:
            try:
                async for chunk in self._chunks(exchange, index, answer):
                    await chunks.put(chunk)
            except Exception as error:  # noqa: BLE001 (passed on to the client below)
                await chunks.put(error)
            finally:
                await chunks.put(None)

        pumps = [asyncio.ensure_future(pump(i, answer)) for i, answer in enumerate(answers)]
        try:
            running, failed = len(pumps), None
            while running:
                item = await chunks.get()
                if item is None:
                    running -= 1
                elif isinstance(item, Exception):
                    failed = failed or item
                elif failed is None:
                    yield render.sse(item)
            if failed is not None:  # mid-stream failure: tell the client, end the stream
                self.record(self.endpoint, "503")
                yield render.sse(generation_failed(failed).body())
            else:
                totals = Totals.of(answers)
                if exchange.request.include_usage:
                    yield render.sse(self._usage_chunk(exchange.rid, render.usage(
                        totals.prompt, totals.generated, totals.cached, exchange.request.params.max_tokens)))
                await self.count_answered(exchange, totals)
            yield render.sse("[DONE]")
        finally:
            for task in pumps:
                task.cancel()

    @abstractmethod
    def _chunks(self, exchange: Exchange, index: int, answer: Answer) -> AsyncIterator[dict]:
        """One answer's chunks (choice ``index``)."""

    @abstractmethod
    def _usage_chunk(self, rid: str, usage: dict) -> dict:
        """The chunk that carries the request's usage (``stream_options.include_usage``)."""


class ChatAdapter(_OpenAIAdapter):
    """``POST /v1/chat/completions``."""

    endpoint = "chat"

    def parse(self, data: dict, history: list[dict]) -> tuple[GenerationRequest, None]:
        model = self.model
        return parse_chat(data, model.name, model.max_answer, model.vocab_size, model.read_image,
                          model.max_images), None

    def new_id(self) -> str:
        return new_id("chatcmpl")

    async def body(self, exchange: Exchange, answers: list[Answer]) -> dict:
        totals = Totals.of(answers, exchange.prompt_tokens)
        return render.chat_response(exchange.rid, self.model.name, [
            render.chat_choice(i, answer.content, answer.chat.reasoning, answer.finish_reason, answer.chat.calls,
                               answer.logprobs) for i, answer in enumerate(answers)],
            render.usage(totals.prompt, totals.generated, totals.cached,
                                                                     exchange.request.params.max_tokens))

    async def _chunks(self, exchange: Exchange, index: int, answer: Answer) -> AsyncIterator[dict]:
        # No content yet: an answer that is only calls keeps content null, as unstreamed.
        yield render.chat_chunk(exchange.rid, self.model.name, {"role": "assistant"}, None, index=index)
        async for step in answer.steps():
            for chunk in render.chat_chunks(exchange.rid, self.model.name, step.deltas, step.finish, index):
                yield chunk

    def _usage_chunk(self, rid: str, usage: dict) -> dict:
        return render.chat_chunk(rid, self.model.name, None, None, usage)


class CompletionsAdapter(_OpenAIAdapter):
    """``POST /v1/completions``."""

    endpoint = "completions"

    def parse(self, data: dict, history: list[dict]) -> tuple[GenerationRequest, None]:
        return parse_completion(data, self.model.name, self.model.max_answer, self.model.vocab_size), None

    def new_id(self) -> str:
        return new_id("cmpl")

    async def body(self, exchange: Exchange, answers: list[Answer]) -> dict:
        totals = Totals.of(answers, exchange.prompt_tokens)
        return render.completion_response(exchange.rid, self.model.name, [
            render.completion_choice(i, answer.content, answer.finish_reason, answer.logprobs)
            for i, answer in enumerate(answers)], render.usage(totals.prompt, totals.generated, totals.cached,
                                                                     exchange.request.params.max_tokens))

    async def _chunks(self, exchange: Exchange, index: int, answer: Answer) -> AsyncIterator[dict]:
        async for step in answer.steps():
            yield render.completion_chunk(exchange.rid, self.model.name, step.token.text, step.finish,
                                          logprobs=step.logprobs, index=index)

    def _usage_chunk(self, rid: str, usage: dict) -> dict:
        return render.completion_chunk(rid, self.model.name, None, None, usage)
