"""Constrained decoding: a request's answer follows a grammar, token by token.

A request that must answer in JSON (``response_format``) or must call a tool
(``tool_choice`` required or named) carries a grammar (Lark syntax, as llguidance reads
it) in its :class:`model.runtime.sampling.SamplingParams`. Its :class:`Constraint` holds
an llguidance matcher: before each token is sampled, the tokens that cannot continue the
grammar get logit -inf; the sampled token advances the matcher. Once the grammar is
complete, only the end-of-sentence token is allowed.

A grammar may start later than the first token (``after``: tokens that must come first,
in order). With thinking on, it governs the answer, not the reasoning: it starts after
``</think>``. With ``tool_choice`` auto the answer is free until the model opens a calls
block; from its ``｜DSML｜`` token on, the block follows the tools' grammar as a forced call
does (``tool_call_grammar(..., opened=True)``), so a call the model begins always parses.

DSpark verification: :meth:`Constraint.masks_along` gives the mask at the anchor and
after each guess (advancing the matcher along the guesses, then rolling it back); a
guess outside the grammar has probability 0 under the masked target, so it is rejected
like any other wrong guess, and the tokens kept are then fed as usual.

llguidance over xgrammar (both measured on this vocabulary, a JSON schema answer of 55
tokens, 2-core EPYC): mask p50 6.6 us / mean 32 us against 2.5 / 4.4 us, both under
0.2% of a decode step; llguidance needs no other package, xgrammar pulls triton and
transformers.

No I/O here, no Ray.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from functools import lru_cache

import llguidance
import torch

from ..tools import CALLS_CLOSE, CALLS_MARKER, DSML, INVOKE_CLOSE, INVOKE_OPEN, PARAMETER_CLOSE, PARAMETER_OPEN


class GrammarError(ValueError):
    """A grammar (or the schema it came from) that the engine cannot compile."""


def _literal(text: str, dsml_token: int | None) -> str:
    """``text`` as a Lark string; ``｜DSML｜`` as its special token where it is one."""
    if dsml_token is None:
        return json.dumps(text, ensure_ascii=False)
    pieces = []
    for index, part in enumerate(text.split(DSML)):
        if index:
            pieces.append(f"<[{dsml_token}]>")
        if part:
            pieces.append(json.dumps(part, ensure_ascii=False))
    return f"({' '.join(pieces)})"


# JSON is written as ``json.dumps`` writes it (", " and ": ", no other whitespace): the
# layout the model saw (the tool schemas and calls are written so), and no room for a
# model that emits whitespace forever.
_JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _with_layout(schema: dict) -> dict:
    return {**schema, "x-guidance": {**_JSON_LAYOUT, **schema.get("x-guidance", {})}}


def _json_value(schema: dict | None) -> str:
    """One JSON value of ``schema`` (None: any JSON object), as a Lark expression."""
    schema = {"type": "object"} if schema is None else schema
    return f"%json{json.dumps(_with_layout(schema), ensure_ascii=False)}"


def json_grammar(schema: dict | None) -> str:
    """An answer that is one JSON value of ``schema`` (None: any JSON object)."""
    return f"start: {_json_value(schema)}\n"


def json_or_calls_grammar(schema: dict | None, tools: Sequence[dict], parallel: bool, dsml_token: int) -> str:
    """An answer that is JSON of ``schema`` or a calls block of ``tools`` (``tool_choice``
    auto beside a JSON answer): its first token decides which (``{`` or ``[`` against the
    block's blank line)."""
    return (f"start: answer | calls\nanswer: {_json_value(schema)}\n"
            + tool_call_grammar(tools, None, parallel, dsml_token, rule="calls"))


def tool_call_grammar(tools: Sequence[dict], name: str | None = None, parallel: bool = True,
                      dsml_token: int | None = None, opened: bool = False, rule: str = "start") -> str:
    """An answer that is a DSML calls block (:mod:`model.tools`) of one call (or, with
    ``parallel``, one or more) of ``name`` (None: any of ``tools``). Each call's
    parameters are those of its schema, in the schema's order, the required ones
    present; a string parameter is written as it is, any other as JSON of its schema.
    A tool without a ``properties`` schema takes any parameters. ``opened``: the block
    after its first ``｜DSML｜`` token (the trigger of a call in ``auto``; needs the token).
    ``rule``: the name of the block's rule (``start``: the whole answer)."""
    chosen = [tool for tool in tools if name is None or tool["name"] == name]
    if not chosen:
        raise GrammarError(f"no tool named {name!r}")
    if opened and dsml_token is None:
        raise GrammarError("an opened calls block needs the ｜DSML｜ token")
    def lit(text: str) -> str:
        return _literal(text, dsml_token)

    invoke = " | ".join(f"invoke_{i}" for i in range(len(chosen)))
    # Every literal is its own lexeme and llguidance lexes greedily: no literal may be a
    # prefix of another that can come at the same point ("\n" then "</...", never "\n</...").
    newline = lit("\n")
    more = f"({newline} invoke)*" if parallel else ""
    marker = CALLS_MARKER + "\n"
    if opened:
        marker = marker.partition(DSML)[2]
    rules = [f"{rule}: {lit(marker)} invoke {more} {newline} {lit(CALLS_CLOSE)}",
             f"invoke: {invoke}"]
    for i, tool in enumerate(chosen):
        parameters = tool.get("parameters") or {}
        properties = parameters.get("properties")
        required = set(parameters.get("required") or ())
        head = lit(f'{INVOKE_OPEN}"{tool["name"]}">\n')
        if properties is None:
            body = f"(any_parameter {lit(chr(10))})*"
        else:
            items = []
            for j, (key, schema) in enumerate(properties.items()):
                line = f"p_{i}_{j}"
                items.append(f"{line} {lit(chr(10))}" if key in required else f"({line} {lit(chr(10))})?")
                rules += _parameter_rules(line, key, schema if isinstance(schema, dict) else {}, lit, dsml_token)
            body = " ".join(items)
        rules.append(f"invoke_{i}: {head} {body} {lit(INVOKE_CLOSE)}")
    if any((tool.get("parameters") or {}).get("properties") is None for tool in chosen):
        rules += _parameter_rules("any_parameter", None, {}, lit, dsml_token)
    return "\n".join(rules) + "\n"


_AS_TEXT, _AS_JSON = ' string="true">', ' string="false">'


def _parameter_rules(rule: str, key: str | None, schema: dict, lit, dsml_token: int | None) -> list[str]:
    """Rules for one parameter line (``key`` None: any name, any value)."""
    rules = []
    if key is None:
        name = f'{lit(PARAMETER_OPEN + chr(34))} NAME "\\""'
        rules.append("NAME: /[A-Za-z0-9_.\\-]+/")
    else:
        name = lit(f'{PARAMETER_OPEN}"{key}"')
    close = lit(PARAMETER_CLOSE)
    # A string as is: anything up to the close tag, within the schema's length bounds.
    low, high = schema.get("minLength", 0), schema.get("maxLength")
    length = "*" if not low and high is None else f"{{{int(low)},{'' if high is None else int(high)}}}"
    if dsml_token is None:
        free_text = f"{rule}_text[suffix={close}]: /(?s:.{length})/"
    else:
        # A lexeme's suffix is text, and ｜DSML｜ is a token: the text runs in chunks up to
        # each "</", and the one the token follows closes it. Length bounds hold for a
        # value without "</" (one chunk); a value without bounds may contain it.
        before, _, after = PARAMETER_CLOSE.partition(DSML)
        chunks = f"{rule}_chunk" if length != "*" else f"{rule}_chunk+"
        free_text = (f"{rule}_text: {chunks} <[{dsml_token}]> {json.dumps(after)}\n"
                     f"{rule}_chunk[suffix={json.dumps(before)}]: /(?s:.{length})/")
    as_text = f"{rule}_s: {name} {lit(_AS_TEXT)} {rule}_text"
    as_json = f"{rule}_j: {name} {lit(_AS_JSON)} %json{json.dumps(_with_layout(schema), ensure_ascii=False)} {close}"
    kind = schema.get("type")
    choices = schema.get("enum")
    if choices and all(isinstance(choice, str) for choice in choices):  # one of these strings, as is
        values = " | ".join(lit(choice) for choice in choices)
        rules += [f"{rule}: {rule}_s", f"{rule}_s: {name} {lit(_AS_TEXT)} ({values}) {close}"]
    elif kind == "string":
        rules += [f"{rule}: {rule}_s", as_text, free_text]
    elif kind is not None:
        rules += [f"{rule}: {rule}_j", as_json]
    else:  # no type, or several: a string as is, anything else as JSON
        rules += [f"{rule}: {rule}_s | {rule}_j", as_text, free_text, as_json]
    return rules


class Constraint:
    """One request's position in its grammar (see the module docstring)."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int, grammar_vocab: int,
                 after: Sequence[int] = (), eos_token: int | None = None):
        """``vocab_size``: the logits' width; ``grammar_vocab``: the tokenizer's;
        ``after``: the tokens that must come, in order, before the grammar starts."""
        self.matcher, self.vocab_size, self.eos_token = matcher, vocab_size, eos_token
        self.after = tuple(after)
        self.seen = 0  # how many of ``after`` have come
        # One bit a token, 32 to a word (llguidance's layout). (Not through llguidance.torch:
        # that module compiles a kernel at import, which loads dynamo and inductor, seconds
        # in every process that imports this one.)
        self._bitmask = torch.full(((grammar_vocab + 31) // 32,), -1, dtype=torch.int32)
        self._saved: int | None = None  # ``seen`` before a look-ahead (None: none running)
        self._tentative = 0  # tokens a look-ahead consumed

    @property
    def active(self) -> bool:
        """Whether the grammar governs the next token."""
        return self.seen == len(self.after)

    def _wait(self, token: int) -> None:
        if token == self.after[self.seen]:
            self.seen += 1

    def mask(self) -> torch.Tensor | None:
        """bool [vocab]: the tokens allowed next (None: not constrained yet)."""
        if not self.active:
            return None
        self.matcher.unsafe_compute_mask_ptr(self._bitmask.data_ptr(), self._bitmask.numel() * 4)
        allowed = ((self._bitmask[:, None] >> torch.arange(32, dtype=torch.int32)) & 1).bool().flatten()
        out = torch.zeros(self.vocab_size, dtype=torch.bool)
        width = min(self.vocab_size, allowed.shape[0])
        out[:width] = allowed[:width]
        return out

    def advance(self, token: int) -> None:
        """The request took ``token`` (sampled under :meth:`mask`)."""
        if not self.active:
            self._wait(token)
            return
        if not self.matcher.consume_token(token):
            raise GrammarError(f"token {token} is outside the grammar: {self.matcher.get_error()}")

    def masks_along(self, guesses: Sequence[int]) -> list[torch.Tensor | None]:
        """The mask at the anchor and after each guess while the guesses stay inside
        the grammar (fewer rows than ``len(guesses) + 1`` when one leaves it); the
        matcher ends where it began."""
        masks = [self.mask()]
        try:
            for guess in guesses:
                if not self.try_advance(guess, masks[-1]):
                    break
                masks.append(self.mask())
        finally:
            self.rewind()
        return masks

    def try_advance(self, token: int, mask: torch.Tensor | None = None) -> bool:
        """Advance by ``token`` for a look-ahead (undone by :meth:`rewind`); False, and
        no move, if it is outside the grammar. ``mask``: :meth:`mask` here, if known."""
        if self._saved is None:
            self._saved, self._tentative = self.seen, 0
        if not self.active:
            self._wait(token)
            return True
        if mask is not None and not bool(mask[token]):
            return False
        if token == self.eos_token:
            # The end: nothing follows it to look at, and llguidance does not roll a
            # matcher back out of its stopped state correctly (seen with 1.9).
            return mask is not None or bool(self.mask()[token])
        if not self.matcher.consume_token(token):
            return False
        self._tentative += 1
        return True

    def rewind(self) -> None:
        """Undo every :meth:`try_advance` since the last rewind."""
        if self._saved is not None:
            if self._tentative:
                self.matcher.rollback(self._tentative)
            self.seen, self._saved, self._tentative = self._saved, None, 0


def apply_masks(logits: torch.Tensor, masks: Sequence[torch.Tensor | None]) -> torch.Tensor:
    """``logits`` [n, V] with row ``j``'s disallowed tokens at -inf (rows past the
    masks: everything disallowed but what the last mask allows; they are never used)."""
    if all(mask is None for mask in masks):
        return logits
    logits = logits.float().clone()
    for row in range(logits.shape[0]):
        mask = masks[min(row, len(masks) - 1)]
        if mask is not None:
            logits[row, ~mask[: logits.shape[1]]] = float("-inf")
    return logits


class GrammarCompiler:
    """Compiles grammars for one vocabulary (the tokenizer's byte tables are built once:
    ~20 ms here for 4K tokens, about a second for the released 129K)."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token: int):
        self.vocab_size, self.eos_token = vocab_size, eos_token
        self.tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=eos_token)

    def check(self, grammar: str) -> None:
        """Raise :class:`GrammarError` if ``grammar`` does not compile."""
        failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(_compiled(grammar), self.tokenizer)
        if failed:
            raise GrammarError("; ".join(message.strip() for message in messages) or "invalid grammar")

    def constraint(self, grammar: str, vocab_size: int, after: Sequence[int] = ()) -> Constraint:
        """A fresh position at the start of ``grammar``, for logits ``vocab_size`` wide,
        that starts after the tokens ``after`` (in order)."""
        matcher = llguidance.LLMatcher(self.tokenizer, _compiled(grammar))
        if matcher.is_error():
            raise GrammarError(matcher.get_error())
        return Constraint(matcher, vocab_size, self.tokenizer.vocab_size, after, self.eos_token)


class SchemaCheck:
    """Whether a JSON text is a value of a JSON schema, decided by the engine that makes
    answers follow schemas, fed the text byte by byte (llguidance's byte vocabulary):
    linear in the text whatever the schema's ``pattern``s (a backtracking regex engine
    runs for ever on a pattern such as ``(a+)+$`` and an answer that ``logit_bias`` can
    steer), and a ``$ref`` outside the schema is an error, never a fetch. The schema is
    compiled once; each check runs on a copy of the compiled matcher."""

    def __init__(self, schema: dict):
        try:
            grammar = llguidance.grammar_from("json_schema", json.dumps(schema, ensure_ascii=False))
            self._start = llguidance.LLMatcher(_byte_vocabulary(), grammar, log_level=0)
        except (ValueError, RuntimeError, TypeError) as error:
            raise GrammarError(str(error)) from None
        if self._start.is_error():
            raise GrammarError(self._start.get_error())

    def accepts(self, text: str) -> bool:
        matcher = self._start.deep_copy()
        return matcher.consume_tokens(list(text.encode("utf-8"))) and matcher.is_accepting()


@lru_cache(maxsize=1)
def _byte_vocabulary() -> llguidance.LLTokenizer:
    """llguidance's vocabulary of one token per byte (token id = the byte's value)."""
    return llguidance.LLTokenizer("byte")


@lru_cache(maxsize=256)
def _compiled(grammar: str) -> str:
    try:
        return llguidance.grammar_from("lark", grammar)
    except (ValueError, RuntimeError) as error:
        raise GrammarError(str(error)) from None
