"""A parsed request's prompt: its grammar checked, its tokens rendered, its images placed.

The chat template renders the messages; the answers this router returned lately are
remembered by their text (:meth:`Prompts.remember`), so that a returning turn that
sends one back re-renders the exact tokens the model generated, and its prefix stays
cached. Everything here is CPU work, run off the event loop.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict

from cluster.serving.chat_answer import ChatAnswer
from cluster.serving.images import ImageLimits, read_image
from cluster.serving.request import GenerationRequest
from cluster.serving.validation import ApiError
from model.runtime.grammar import GrammarCompiler, GrammarError

MEMO_TOKENS = 4 << 20  # the long messages' ids the template keeps (~50 MB with their texts)
MEMO_ANSWERS = 4096  # recent answers whose ids are remembered


def _answer_key(reasoning: str | None, content: str, calls) -> tuple:
    """What identifies an answer in a returning history: its reasoning, text and calls."""
    return reasoning, content, tuple((call.name, call.arguments) for call in calls)


class Prompts:
    """Renders requests for one model: ``tokenizer``, its ``vision`` config (None: it
    reads no images) and image token, within ``max_model_len`` tokens."""

    def __init__(self, tokenizer, vision, image_token_id: int | None, image_limits: ImageLimits, max_model_len: int):
        from model.chat import ChatTemplate

        self.tokenizer, self.vision, self.image_token_id = tokenizer, vision, image_token_id
        self.image_limits, self.max_model_len = image_limits, max_model_len
        self.template = ChatTemplate(tokenizer, memo_tokens=MEMO_TOKENS)
        self.think_end = tokenizer.special.think_end
        self.dsml = tokenizer.special.dsml  # a special token: its text is put back for the parser
        self.grammars: GrammarCompiler | None = None  # built at the first constrained request
        # Recent answers' exact token ids by their text.
        self.answers: OrderedDict[tuple, tuple[int, ...]] = OrderedDict()

    @property
    def image_reader(self):
        """What parsing reads an ``image_url`` with (None: this model reads no images)."""
        return self.read_image if self.vision is not None else None

    def read_image(self, url: str, earlier: tuple):
        """(the positions its span takes, the decoded image) of an ``image_url``;
        ``earlier``: the request's images before it (they share a budget of pixels)."""
        from model.vision import plan_image

        image = read_image(url, self.image_limits, sum(image.height * image.width for image in earlier))
        return plan_image(image.height, image.width, self.vision).num_tokens, image

    def prepare(self, request: GenerationRequest) -> tuple[GenerationRequest, list[int]]:
        """(the request with the grammar its answer must follow, the prompt's ids)."""
        request = self.constrain(request)
        return request, self.render(request)

    def constrain(self, request: GenerationRequest) -> GenerationRequest:
        """The request with the grammar its answer must follow (``GenerationRequest.grammar``),
        checked here so that a schema the engine cannot compile is a 400."""
        chosen = request.grammar(self.dsml, self.think_end)
        if chosen is None:
            return request
        grammar, after, param = chosen
        if self.grammars is None:
            self.grammars = GrammarCompiler(self.tokenizer.json, self.tokenizer.vocab_size, self.tokenizer.special.eos)
        try:
            self.grammars.check(grammar)
        except GrammarError as error:
            raise ApiError(400, f"{param}: the schema cannot be enforced: {error}", param) from None
        params = dataclasses.replace(request.params, grammar=grammar, grammar_after=after)
        return dataclasses.replace(request, params=params)

    def render(self, request: GenerationRequest) -> list[int]:
        """The prompt's ids: a completion's prompt, or the chat template's rendering of the
        messages (an answer sent back as it was returned renders its generated ids)."""
        self._bound(request)
        if request.prompt is not None:
            if isinstance(request.prompt, tuple):
                return list(request.prompt)
            return [self.tokenizer.special.bos] + self.tokenizer.encode(request.prompt)
        messages = []
        for message in request.messages:
            known = self.answers.get(_answer_key(message.reasoning, message.content, message.tool_calls)) \
                if message.role == "assistant" else None
            messages.append(dataclasses.replace(message, token_ids=known) if known else message)
        try:
            return self.template.render(messages, thinking=request.thinking, effort=request.effort,
                                        tools=request.tools)
        except ValueError as error:
            raise ApiError(400, str(error), request.prompt_param) from None

    def _bound(self, request: GenerationRequest) -> None:
        """A 400 before tokenising a prompt whose text is certainly longer than the
        context: no token spells more than ``max_token_bytes`` bytes (nor characters), so
        a text of C characters is at least C / max_token_bytes tokens."""
        if isinstance(request.prompt, tuple):
            return
        chars = len(request.prompt) if request.prompt is not None else \
            sum(len(message.content) + len(message.reasoning or "") for message in request.messages)
        least = chars // self.tokenizer.max_token_bytes + _answer_needs(request)
        if least > self.max_model_len:
            raise ApiError(400, f"this request needs at least {least} tokens; the context is {self.max_model_len}",
                           request.prompt_param, code="context_length_exceeded")

    def fit(self, request: GenerationRequest, tokens: list[int]) -> GenerationRequest:
        """The request with its answer's length fitted to the context: a 400 if the prompt
        and the answer's ``max_tokens`` exceed it; a request that asked no length
        (``fills_context``) may run to the context's end, at most its ceiling."""
        needs = len(tokens) + _answer_needs(request)
        if needs > self.max_model_len:
            raise ApiError(400, f"this request needs {needs} tokens; the context is {self.max_model_len}",
                           request.prompt_param, code="context_length_exceeded")
        room = self.max_model_len - len(tokens)
        if not request.fills_context or request.params.max_tokens <= room:
            return request
        return dataclasses.replace(request, params=dataclasses.replace(request.params, max_tokens=room))

    def images(self, request: GenerationRequest, tokens: list[int]) -> tuple:
        """Where each of the request's images sits in the rendered prompt (its image
        tokens, in order), as :class:`actors.state.PromptImage`; every image token of
        the prompt belongs to one."""
        from actors.state import PromptImage

        if self.image_token_id is None:
            return ()
        images, position = [], 0
        for length, image in request.images:
            start = tokens.index(self.image_token_id, position)
            images.append(PromptImage(start, length, image.pixels, image.digest))
            position = start + length
        spans = sum(length for length, _ in request.images)
        if tokens.count(self.image_token_id) != spans or any(
                tokens[i.start:i.start + i.length] != [self.image_token_id] * i.length for i in images):
            param = request.prompt_param
            raise ApiError(400, f"{param}: the image token (id {self.image_token_id}) stands only for the images "
                           "of image_url parts", param)
        return tuple(images)

    def new_answer(self, request: GenerationRequest) -> ChatAnswer:
        """An empty chat answer to ``request``, to push its tokens into."""
        return ChatAnswer(request, self.think_end, self.dsml, self.tokenizer.token_bytes)

    def remember(self, answer: ChatAnswer, tokens: list[int]) -> None:
        """Keep a chat answer's ids for the turn that sends it back."""
        self.answers[_answer_key(answer.reasoning, answer.content, answer.calls)] = tuple(tokens)
        while len(self.answers) > MEMO_ANSWERS:
            self.answers.popitem(last=False)


def _answer_needs(request: GenerationRequest) -> int:
    """The fewest tokens of context the request's answer needs: its ``max_tokens``, or
    one when it asked no length."""
    return 1 if request.fills_context else request.params.max_tokens
