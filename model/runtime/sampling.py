"""Token sampling: parameters, the batched sampler, and stop conditions.

``probabilities`` is the single definition of the distribution a request samples
from (temperature, then top-k, then top-p, renormalised); ``sample`` draws from
exactly that distribution, and speculative decoding's rejection sampler reads the
same function so that verification preserves the target distribution.

Reproducibility: each request owns a ``torch.Generator`` seeded from its seed and
consumes exactly one uniform number per sampled token (inverse-CDF sampling), so
its tokens do not depend on which other requests share the batch. Greedy rows
consume no randomness.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal, Sequence

import torch


class SamplingParamsError(ValueError):
    """A sampling parameter outside its valid range."""


_MAX_SEED = 2**63 - 1


@dataclass(frozen=True)
class SamplingParams:
    """How one request picks its tokens and when it stops.

    temperature: 0 means greedy (argmax, ties to the lowest id); otherwise logits are
        divided by it before softmax.
    top_p: keep the smallest set of most likely tokens whose mass is >= top_p (1 = off).
    top_k: keep the k most likely tokens (0 = off; ties broken towards lower ids).
    seed: seeds the request's generator; None draws a fresh nondeterministic seed.
    max_tokens: generated tokens at most (finish reason "length").
    stop_token_ids: ids that end generation (finish reason "stop"), besides EOS.
    stop: strings that end generation; the output text stops before them.
    presence_penalty, frequency_penalty: OpenAI's: a token's logit is lowered by
        ``presence`` once it was generated and by ``frequency`` times the number of
        times it was (in this request's output, not its prompt), in [-2, 2].
    logit_bias: (token id, bias in [-100, 100]) pairs added to the logits.
    logprobs: None, or how many most likely alternatives (0-20) to report with each
        token's log-probability (under the model's own distribution: the logits
        before penalties, bias, temperature and truncation).
    grammar: a Lark grammar (llguidance's dialect) the answer must follow
        (:mod:`model.runtime.grammar`); ``grammar_after``: the tokens that must come,
        in order, before it applies (``</think>`` when the model reasons first; the
        ``｜DSML｜`` that opens a calls block in ``auto``); empty: from the start.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    max_tokens: int = 256
    stop_token_ids: tuple[int, ...] = field(default=())
    stop: tuple[str, ...] = field(default=())
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = field(default=())
    logprobs: int | None = None
    grammar: str | None = None
    grammar_after: tuple[int, ...] = field(default=())

    def __post_init__(self) -> None:
        # Accept lists from JSON requests but store tuples: the object is frozen and hashable.
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        object.__setattr__(self, "grammar_after", tuple(self.grammar_after))
        object.__setattr__(self, "logit_bias", tuple((int(t), float(b)) for t, b in self.logit_bias))
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not -2 <= value <= 2:
                raise SamplingParamsError(f"{name} must be a number in [-2, 2], got {value!r}")
        for token_id, bias in self.logit_bias:
            if token_id < 0 or not -100 <= bias <= 100:
                raise SamplingParamsError(f"logit_bias maps token ids >= 0 to biases in [-100, 100], got "
                                          f"{token_id}: {bias}")
        if self.logprobs is not None and (not _is_int(self.logprobs) or not 0 <= self.logprobs <= 20):
            raise SamplingParamsError(f"logprobs must be an integer in 0..20, got {self.logprobs!r}")
        object.__setattr__(self, "stop", (self.stop,) if isinstance(self.stop, str) else tuple(self.stop))
        if not isinstance(self.temperature, (int, float)) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise SamplingParamsError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise SamplingParamsError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise SamplingParamsError(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed <= _MAX_SEED):
            raise SamplingParamsError(f"seed must be an integer in 0..2**63-1, got {self.seed!r}")
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise SamplingParamsError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        for token_id in self.stop_token_ids:
            if not _is_int(token_id) or token_id < 0:
                raise SamplingParamsError(f"stop token ids must be integers >= 0, got {token_id!r}")
        for text in self.stop:
            if not isinstance(text, str) or not text:
                raise SamplingParamsError(f"stop strings must be non-empty strings, got {text!r}")

    @property
    def greedy(self) -> bool:
        """Whether this request takes the argmax."""
        return self.temperature == 0

    @property
    def shapes_logits(self) -> bool:
        """Whether penalties or a bias change the logits before sampling."""
        return bool(self.presence_penalty or self.frequency_penalty or self.logit_bias)


def shape_logits(logits: torch.Tensor, params: SamplingParams, generated: Sequence[int],
                 continuation: Sequence[int] = ()) -> torch.Tensor:
    """``logits`` [n, V] with ``params``' bias and penalties applied: row ``j`` is the
    next token's after ``generated`` and the first ``j`` tokens of ``continuation``
    (the guesses a verify pass scores). The input is not changed."""
    if not params.shapes_logits:
        return logits
    logits = logits.float().clone()
    vocab = logits.shape[-1]
    if params.logit_bias:
        ids = torch.tensor([t for t, _ in params.logit_bias], device=logits.device)
        if int(ids.max()) >= vocab:
            raise SamplingParamsError(f"logit_bias names token {int(ids.max())}; the vocabulary has {vocab}")
        logits[:, ids] += torch.tensor([b for _, b in params.logit_bias], device=logits.device)
    if params.presence_penalty or params.frequency_penalty:
        counts = torch.zeros(vocab, device=logits.device)
        if generated:
            counts.index_add_(0, torch.tensor(list(generated), device=logits.device), torch.ones(len(generated)))
        for row in range(logits.shape[0]):
            if row:
                counts[continuation[row - 1]] += 1
            logits[row] -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).float()
    return logits


def token_logprobs(logits: torch.Tensor, token: int, top: int) -> tuple[float, tuple[tuple[int, float], ...]]:
    """The log-probability of ``token`` under ``logits`` [V] (the model's distribution)
    and the ``top`` most likely tokens with theirs (ties to the lower id)."""
    logp = logits.float().log_softmax(dim=-1)
    alternatives = ()
    if top:
        values, ids = logp.sort(descending=True, stable=True)
        alternatives = tuple(zip(ids[:top].tolist(), values[:top].tolist()))
    return float(logp[token]), alternatives


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def make_generator(params: SamplingParams, device: torch.device | str = "cpu") -> torch.Generator:
    """The request's private random stream on ``device`` (seeded from ``params.seed`` if set)."""
    generator = torch.Generator(device=device)
    if params.seed is None:
        generator.seed()
    else:
        generator.manual_seed(params.seed)
    return generator


def probabilities(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """The distribution each row is sampled from.

    logits: [B, V] float. Returns [B, V] float32 rows summing to 1: one-hot at the
    argmax for greedy rows; otherwise softmax(logits / temperature) restricted to the
    top-k tokens, then to the top-p nucleus of that, renormalised. Ties in the
    ranking are broken towards lower ids (stable sort), so top-k keeps exactly k.
    """
    if logits.dim() != 2 or logits.shape[0] != len(params):
        raise ValueError(f"logits must be [B, V] with B = {len(params)} rows, got {tuple(logits.shape)}")
    logits = logits.float()
    batch, vocab = logits.shape
    device = logits.device
    greedy = torch.tensor([p.greedy for p in params], device=device)
    # Greedy rows get temperature 1 so the division stays finite; their row is replaced below.
    temperature = torch.tensor([p.temperature if not p.greedy else 1.0 for p in params], device=device)
    top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params], device=device)
    top_p = torch.tensor([p.top_p for p in params], device=device)

    scaled = logits / temperature[:, None]
    sorted_logits, order = scaled.sort(dim=-1, descending=True, stable=True)  # [B, V]
    rank = torch.arange(vocab, device=device)
    sorted_logits = sorted_logits.masked_fill(rank[None, :] >= top_k[:, None], float("-inf"))
    sorted_probs = sorted_logits.softmax(dim=-1)
    # Keep a token while the mass strictly before it is < top_p: the smallest prefix
    # reaching top_p. The first token always survives.
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    # top_p = 1 must keep every token even where float32 cumsum reaches 1 early.
    keep = ((mass_before < top_p[:, None]) | (top_p[:, None] >= 1)) & (sorted_probs > 0)
    keep[:, 0] = True
    sorted_probs = torch.where(keep, sorted_probs, 0.0)
    sorted_probs = sorted_probs / sorted_probs.sum(dim=-1, keepdim=True)
    probs = torch.zeros_like(sorted_probs).scatter_(-1, order, sorted_probs)

    one_hot = torch.zeros(batch, vocab, device=device).scatter_(-1, logits.argmax(dim=-1, keepdim=True), 1.0)
    return torch.where(greedy[:, None], one_hot, probs)


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
) -> torch.Tensor:
    """Draw one token per row.

    logits: [B, V] float32; params and generators: one per row (a greedy row's
    generator may be None and is not advanced). Returns [B] int64.

    Greedy rows take ``argmax`` (ties to the lowest id). Other rows draw one uniform
    u from their generator and take the first token whose cumulative probability
    exceeds u (inverse CDF, in float64), so a zero-probability token is never drawn.
    """
    if len(generators) != len(params):
        raise ValueError(f"need one generator per row: {len(params)} params, {len(generators)} generators")
    probs = probabilities(logits, params)
    tokens = logits.argmax(dim=-1)
    sampled_rows = [row for row, p in enumerate(params) if not p.greedy]
    if not sampled_rows:
        return tokens
    uniforms = []
    for row in sampled_rows:
        generator = generators[row]
        if generator is None:
            raise ValueError(f"row {row} samples with temperature {params[row].temperature} but has no generator")
        uniforms.append(torch.rand((), generator=generator, device=generator.device, dtype=torch.float64))
    rows = torch.tensor(sampled_rows, device=logits.device)
    u = torch.stack(uniforms).to(logits.device)  # [S]
    cdf = probs[rows].double().cumsum(dim=-1)  # [S, V]
    drawn = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).squeeze(-1)
    tokens[rows] = drawn.clamp_(max=logits.shape[-1] - 1)
    return tokens


FinishReason = Literal["stop", "length"]


@dataclass(frozen=True)
class StopUpdate:
    """What one generated token changed.

    text: output text that may be released now (never part of a stop string).
    finish_reason: None while generation continues.
    """

    text: str
    finish_reason: FinishReason | None = None


class StopChecker:
    """Decides when a request ends and which text it may stream.

    Feed every generated id with the text piece the incremental detokenizer
    released for it. Text that could be the beginning of a stop string is held back
    until it can no longer complete one, so a stop string spanning several tokens
    never leaks to the client. On a stop string the output ends right before it; on
    a stop token (EOS or ``params.stop_token_ids``) the token's own text is dropped.
    When ``max_tokens`` is reached the held-back text is released and the reason is
    "length". Stop conditions are checked before the length limit.
    """

    def __init__(self, params: SamplingParams, eos_token_ids: Sequence[int] = ()):
        self._params = params
        self._stop_ids = frozenset(params.stop_token_ids) | frozenset(eos_token_ids)
        self._held = ""
        self._count = 0
        self.output_text = ""
        self.finish_reason: FinishReason | None = None

    def feed(self, token_id: int, text: str) -> StopUpdate:
        """Account for one generated token; raises RuntimeError after the request finished."""
        if self.finish_reason is not None:
            raise RuntimeError("the request already finished")
        self._count += 1
        if token_id in self._stop_ids:
            return self._finish(self._held, "stop")
        self._held += text
        match = self._first_stop_string()
        if match is not None:
            return self._finish(self._held[:match], "stop")
        if self._count >= self._params.max_tokens:
            return self._finish(self._held, "length")
        keep = self._partial_stop_suffix()
        released, self._held = self._held[: len(self._held) - keep], self._held[len(self._held) - keep :]
        self.output_text += released
        return StopUpdate(released)

    def _finish(self, released: str, reason: FinishReason) -> StopUpdate:
        self._held = ""
        self.output_text += released
        self.finish_reason = reason
        return StopUpdate(released, reason)

    def _first_stop_string(self) -> int | None:
        # Any match spanning released text would have been held back, so searching
        # the held text is enough.
        positions = [pos for stop in self._params.stop if (pos := self._held.find(stop)) >= 0]
        return min(positions) if positions else None

    def _partial_stop_suffix(self) -> int:
        """Length of the longest suffix of the held text that is a proper prefix of a stop string."""
        longest = 0
        for stop in self._params.stop:
            for length in range(min(len(stop) - 1, len(self._held)), longest, -1):
                if self._held.endswith(stop[:length]):
                    longest = length
                    break
        return longest
