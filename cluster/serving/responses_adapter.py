"""The Responses API as an adapter: parse once (:mod:`cluster.serving.responses_api`),
render the answer as a response object or its stream of events
(:mod:`cluster.serving.responses_render`), and keep it.

A request may continue a stored response (``previous_response_id``) or a conversation
(``conversation``): their items are read before it is parsed. A finished response is
kept (when asked to) and joins its conversation before the client has the whole
answer: the client may send the next turn naming it the moment it has it. Also here:
the stored responses' routes (``GET``/``DELETE /v1/responses/{id}``, its input items).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence

from cluster.serving import response_items
from cluster.serving.adapter import Adapter, Exchange, Totals
from cluster.serving.answers import Answer
from cluster.serving.conversations_adapter import Conversations
from cluster.serving.conversations_api import with_items
from cluster.serving.dispatcher import generation_failed
from cluster.serving.records import Records, with_cache
from cluster.serving.request import GenerationRequest
from cluster.serving.responses_api import ParsedResponses, conversation_named, parse_responses, record as kept_record
from cluster.serving.responses_render import response_id, sse, usage
from cluster.serving.validation import ApiError
from storage.keys import ObjectKey


class ResponsesAdapter(Adapter):
    """``POST /v1/responses``, and the stored responses. ``keeps``: this server keeps
    responses and conversations (``store_responses``)."""

    endpoint = "responses"

    def __init__(self, model, count, record, records: Records, conversations: Conversations, keeps: bool):
        super().__init__(model, count, record)
        self.records, self.conversations, self.keeps = records, conversations, keeps

    async def history(self, data: dict) -> list[dict]:
        """The items a request continues: those of the response it names as
        ``previous_response_id``, or of the ``conversation`` it names (none when it names
        neither, or the server keeps none: parsing refuses that)."""
        if not isinstance(data, dict) or not self.keeps:
            return []
        previous = data.get("previous_response_id")
        if isinstance(previous, str) and previous:
            return response_items.history(await self.stored(previous, "previous_response_id"))
        cid = conversation_named(data)
        return [] if cid is None else (await self.conversations.get(cid, "conversation"))["items"]

    def parse(self, data: dict, history: list[dict]) -> tuple[GenerationRequest, ParsedResponses]:
        model = self.model
        parsed = parse_responses(data, model.name, model.max_answer, model.vocab_size, model.read_image,
                                 model.max_images, keeps=self.keeps, history=history)
        return parsed.generation, parsed

    def new_id(self) -> str:
        return response_id()

    async def body(self, exchange: Exchange, answers: list[Answer]) -> dict:
        answer, totals = answers[0], Totals.of(answers, exchange.prompt_tokens)
        builder = exchange.parsed.builder(exchange.rid, self.model.name, exchange.request.cache_retention)
        builder.push(answer.deltas)
        response = builder.finish(answer.finish_reason, usage(totals.prompt, totals.generated, totals.cached,
                                                              answer.chat.reasoning_tokens,
                                                              exchange.request.params.max_tokens))[-1]["response"]
        await self.answered(exchange.parsed, response, exchange.cache_of(answer))
        return response

    def stream(self, exchange: Exchange, answers: list[Answer]) -> AsyncIterator[bytes]:
        return self._events(exchange, answers[0])

    async def _events(self, exchange: Exchange, answer: Answer) -> AsyncIterator[bytes]:
        """The response's events as the answer's tokens come (``response.failed`` if the
        decoder fails under it)."""
        parsed: ParsedResponses = exchange.parsed
        builder = parsed.builder(exchange.rid, self.model.name, exchange.request.cache_retention)
        finish = "stop"
        for item in builder.start():
            yield sse(item)
        try:
            async for step in answer.steps():
                for item in builder.push(step.deltas):
                    yield sse(item)
                finish = step.finish or finish
        except Exception as error:  # noqa: BLE001 (passed on to the client)
            self.record(self.endpoint, "503")
            failed = builder.failed(generation_failed(error))
            await self.answered(parsed, failed["response"], joins=False)
            yield sse(failed)
            return
        totals = Totals.of([answer])
        # Counted and kept before the last event: a client may close the stream once it
        # has it, and send the next turn naming it.
        await self.count_answered(exchange, totals)
        events = builder.finish(finish, usage(totals.prompt, totals.generated, totals.cached,
                                              answer.chat.reasoning_tokens, exchange.request.params.max_tokens))
        try:
            await self.answered(parsed, events[-1]["response"], exchange.cache_of(answer))
        except ApiError as error:  # its conversation could not take it: the response failed
            events[-1] = builder.failed(error)
        for item in events:
            yield sse(item)

    async def answered(self, parsed: ParsedResponses, response: dict, cache: Sequence[ObjectKey] = (),
                       joins: bool = True) -> None:
        """Keep a finished response (when asked to), and add its input and output to the
        conversation it names (unless it failed: ``joins``), before the client has the
        whole answer; a conversation that cannot take it is an :class:`ApiError`. Both
        records name ``cache``, the store's objects of the conversation so far (deleting
        the record deletes them)."""
        if parsed.store:
            await self.records.keep_response(response["id"], with_cache(kept_record(parsed, response), cache))
        if joins and parsed.conversation is not None:
            joined = [*parsed.new_items, *response["output"]]
            await self.conversations.change(parsed.conversation,
                                            lambda kept: with_cache(with_items(kept, joined, "input"), cache))

    async def stored(self, rid: str, param: str | None = None) -> dict:
        """A stored response's record; a 404 (or, for ``param``, a 400 naming it) if no node has it."""
        found = await self.records.response(rid) if self.keeps else None
        if found is None:
            if param is not None:
                raise ApiError(400, f"{param}: no stored response has id {rid!r} (it was not stored, was "
                                    "deleted, or its retention ran out)", param, code="previous_response_not_found")
            raise ApiError(404, f"No response found with id {rid!r}", code="not_found")
        return found

    async def input_items(self, rid: str, after: str | None, limit: int, order: str) -> dict:
        return response_items.input_items_page(await self.stored(rid), after, limit, order)

    async def delete(self, rid: str) -> dict:
        await self.records.forget_response(rid, await self.stored(rid))
        return {"id": rid, "object": "response", "deleted": True}
