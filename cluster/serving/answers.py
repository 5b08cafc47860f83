"""One answer, read from its decoder stream once, token by token.

Every API's answer, streamed or not, is read here: :meth:`Answer.steps` yields what each
:class:`actors.events.Token` adds in the API's terms (a chat answer's deltas, a
completion's text and logprobs), up to the answer's last token (never waiting for the
stream to close: the stream goes on to say when the conversation is stored, which the
planner follows). What the first token said of the trip, and the answer's totals, are
read from the :class:`Answer` afterwards.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from actors.events import Admission, Token
from cluster.serving.chat_answer import ChatAnswer, CompletionLogprobs
from cluster.serving.request import GenerationRequest
from storage.keys import ObjectKey


@dataclass(frozen=True)
class Step:
    """What one token adds to an answer: a chat answer's ``deltas`` (at the last token,
    with what was held back), a completion's ``logprobs`` entry (None: not asked for),
    and at the last token the API's ``finish`` reason (else None)."""

    token: Token
    deltas: list[dict]
    logprobs: dict | None
    finish: str | None


class Answer:
    """One answer to ``request``: ``first`` (its first token, already read) and the rest
    of ``stream``. ``chat``: the chat answer its tokens are pushed into (None for a
    completion, whose text is the tokens' text); ``token_bytes`` spells a completion's
    logprobs; ``ended(answer, last token)`` runs at the last token, before its step
    is yielded (the client may send the next turn the moment it has it).
    ``start``: when the request came (``time.perf_counter``)."""

    def __init__(self, first: Token, stream, request: GenerationRequest, chat: ChatAnswer | None,
                 token_bytes: Callable[[int], bytes], ended: Callable[[Answer, Token], None], start: float):
        self.first, self.stream, self.request, self.chat, self.ended, self.start = \
            first, stream, request, chat, ended, start
        self.admission: Admission = first.admission
        self.completion = CompletionLogprobs(token_bytes) \
            if chat is None and request.params.logprobs is not None else None
        self.tokens: list[int] = []
        self.text: list[str] = []  # a completion's
        self.entries: list[dict] = []  # a completion's logprobs
        self.deltas: list[dict] = []  # a chat answer's, all of them
        self.finish = "stop"  # the decoder's finish reason
        self.ttft: float | None = None
        self.timeline: dict[str, float] = {}  # the trip's marks: the replicas', first_token, stored
        self.stored: tuple[ObjectKey, ...] = ()  # the names of what the decoder stores of it (its last token says)

    async def steps(self) -> AsyncIterator[Step]:
        """Each token's :class:`Step`, the first token's included."""
        token = self.first
        self.ttft = time.perf_counter() - self.start
        self.timeline = {**self.admission.timeline, "first_token": time.time()}
        while True:
            last = token.finish_reason is not None
            if last:
                self.finish = token.finish_reason
                if token.storing is not None:  # a turn that continues it waits for its store
                    self.timeline["stored"] = time.time()
                    self.stored = token.storing.conversation.keys
            step = self._push(token, last)
            if last:
                self.ended(self, token)
                yield step
                return
            yield step
            token = await anext(self.stream, None)
            if token is None:  # (the replica ended the stream without a last token)
                return

    async def read(self) -> Answer:
        """The whole answer (unstreamed)."""
        async for _ in self.steps():
            pass
        return self

    def _push(self, token: Token, last: bool) -> Step:
        self.tokens.append(token.token_id)
        if self.chat is None:
            self.text.append(token.text)
            entry = None
            if self.completion is not None and token.logprob is not None:
                entry = self.completion.entry(token.token_id, token.text, token.logprob, token.top_logprobs)
                self.entries.append(entry)
            return Step(token, [], entry, self.finish if last else None)
        deltas = self.chat.push(token.token_id, token.text, token.logprob, token.top_logprobs)
        if last:
            deltas += self.chat.finish()
        self.deltas += deltas
        return Step(token, deltas, None, self.chat.finish_reason(self.finish) if last else None)

    @property
    def content(self) -> str:
        return self.chat.content if self.chat is not None else "".join(self.text)

    @property
    def finish_reason(self) -> str:
        """The API's finish reason (a chat turn that called tools ends in ``tool_calls``)."""
        return self.chat.finish_reason(self.finish) if self.chat is not None else self.finish

    @property
    def logprobs(self):
        """The answer's logprobs as its API returns them (None: not asked for)."""
        if self.chat is not None:
            return self.chat.logprobs
        return CompletionLogprobs.merge(self.entries) if self.completion is not None else None
