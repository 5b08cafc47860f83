"""The inference engine: CED prefill, bounded replays, batched decode, over explicit caches.

What the pools run (the seed's "The encoder and the decoder", "When the cache
leaves the GPU"):

- :meth:`Engine.prefill` (prefill pool): the encoder half over a sequence's new
  tokens, extending every encoder window and long-range cache, plus the CED
  projection: the decoder's KV source builds its long-range entries for those tokens
  from the encoder's output. It returns a :class:`DecoderInput`, the decoder-input
  streams of the tokens the decoder must replay.
- :meth:`Engine.replay` (decoder pool): the decoder half over those tokens, which
  builds the decoder windows and gives the logits of the next token. With the bound
  on (Decoder SWA Bounded Replay) only the last ``sliding_window`` prompt tokens are
  replayed; with ``exact`` the whole prompt is, and the result equals the reference.
- :meth:`Engine.decode`: one step for a batch of sequences, each with one or more new
  tokens at its own position; every new token runs all layers and extends every cache.
- :meth:`Engine.verify` / :meth:`Engine.accept` (speculative decoding): a decode step
  whose tokens can be taken back. ``verify`` runs every sequence's anchor and guesses
  like ``decode`` but keeps what a rollback needs (windows are not trimmed yet, the
  pooling rows the step saw, the n-gram context); ``accept`` keeps the first ``n``
  tokens of the step and leaves the cache exactly as ``n`` tokens of plain decoding
  would (windows, pending pooling rows, compressed entries, indexer keys, n-gram
  context, length).
- :meth:`Engine.restore` (Encoder SWA Bounded Replay): when a conversation's window
  state has expired, rebuild the encoder windows from its long-range caches by
  rerunning the encoder on its last ``sliding_window`` tokens only.

Attention reads exactly the places it is allowed: for each query, its window (at
most ``sliding_window`` entries) and the ``index_topk`` long-range entries its
indexer picked, gathered from the cache; the indexer scans the keys (Reindex layers
only the candidate pool). Tokens of all sequences in a step are flattened into one
batch for projections, mHC, MoE and the attention itself; the cache reads (window
places, pooling, the indexer, the gathers) run once over the padded batch in steps of
a few tokens per sequence, and per sequence otherwise (long prompts).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from .. import mhc
from ..attention import candidate_entries, top_k
from ..config import AttentionMode
from ..engram import NgramContext, NgramHasher
from ..transformer import Block, Transformer
from .cache import SequenceCache, Window


def _rows_at(table: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``table[index]`` for a table [E, d] and an index of any shape, one row copy per
    index (``index_select``). Advanced indexing on CPU copies element by element: at a
    batch-16 step's sizes it was 3.5-7x slower, and a padded verify step spent more
    time in it than in its matmuls."""
    return table.index_select(0, index.reshape(-1)).view(*index.shape, table.shape[-1])


@dataclass(frozen=True)
class _Layout:
    """The N tokens of a step whose cache reads are batched over its b sequences.

    The indexer scores each sequence's queries against that sequence's keys, shared
    by its tokens: queries laid out [b, n], each sequence's tokens from its row's start
    (when the sequences feed different counts, a verify of each one's own number of
    guesses, the rows' tails are padding). Everything after the scores is per token:
    [N, ...], so a padded slot costs only its share of the scoring."""

    owner: torch.Tensor  # [N]: each token's sequence
    slots: torch.Tensor | None  # [N]: each token's place in [b * n]; None when every sequence feeds n
    b: int
    n: int

    @classmethod
    def of(cls, counts: Sequence[int], device: torch.device) -> _Layout:
        b, n = len(counts), max(counts)
        owner = torch.arange(b, device=device).repeat_interleave(torch.tensor(counts, device=device))
        slots = None if min(counts) == n else torch.cat(
            [torch.arange(i * n, i * n + m, device=device) for i, m in enumerate(counts)])
        return cls(owner, slots, b, n)

    def padded(self, rows: torch.Tensor) -> torch.Tensor:
        """Per-token rows [N, ...] as [b, n, ...]: each token at its slot, zeros elsewhere."""
        if self.slots is None:
            return rows.view(self.b, self.n, *rows.shape[1:])
        out = rows.new_zeros(self.b * self.n, *rows.shape[1:])
        return out.index_put_((self.slots,), rows).view(self.b, self.n, *rows.shape[1:])

    def tokens(self, rows: torch.Tensor) -> torch.Tensor:
        """Rows laid out [b, n, ...] as the tokens' [N, ...] (padding dropped)."""
        rows = rows.flatten(0, 1)
        return rows if self.slots is None else rows.index_select(0, self.slots)

    def each(self, rows: torch.Tensor) -> torch.Tensor:
        """Per-sequence rows [b, ...] as each token's sequence's row [N, ...]."""
        if self.slots is None:  # a view when each sequence feeds one token
            return rows[:, None].expand(self.b, self.n, *rows.shape[1:]).flatten(0, 1)
        return rows.index_select(0, self.owner)

    def rows_at(self, table: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """``table[owner[i], index[i]]`` for each token i: a table [b, E, d] per sequence
        and an index [N, ...] -> [N, ..., d]."""
        offsets = (self.owner * table.shape[1]).view(-1, *[1] * (index.dim() - 1))
        return _rows_at(table.flatten(0, 1), index + offsets)


def _padded(rows: list[torch.Tensor]) -> torch.Tensor:
    """Row lists [n_i, d] as one [b, max n_i, d] tensor, zero-padded (one list: a view)."""
    return rows[0][None] if len(rows) == 1 else torch.nn.utils.rnn.pad_sequence(rows, batch_first=True)


@dataclass
class DecoderInput:
    """The decoder-input streams of the tokens the decoder will (re)play.

    ``positions`` [n] absolute, ``streams`` [n, hc, D] and ``pre`` [n, hc] are the
    encoder's output (the mHC streams after the last encoder layer and the mix its
    last site chose), ``token_ids`` [n] the tokens; ``engram_ids`` [n, layers, cols]
    their Engram row ids (hashed with their true look-back, which a replay of the
    tail alone could not see), for Engram layers in the decoder half; ``None`` when
    the model has no Engram layers.
    """

    positions: torch.Tensor
    streams: torch.Tensor
    pre: torch.Tensor
    token_ids: torch.Tensor
    engram_ids: torch.Tensor | None = None

    def tail(self, n: int) -> "DecoderInput":
        return DecoderInput(*(None if t is None else t[-n:] for t in self._fields()))

    def compact(self) -> "DecoderInput":
        """The same inputs in tensors of their own size: a :meth:`tail` is a view, and a
        pickled view carries all of the storage under it."""
        return DecoderInput(*(None if t is None else t.clone() for t in self._fields()))

    def then(self, later: "DecoderInput") -> "DecoderInput":
        """These tokens followed by ``later`` ones (e.g. a restored tail, then a new turn)."""
        if int(self.positions[-1]) + 1 != int(later.positions[0]):
            raise ValueError("decoder inputs are not contiguous")
        if (self.engram_ids is None) != (later.engram_ids is None):
            raise ValueError("decoder inputs disagree on Engram row ids")
        return DecoderInput(*(None if a is None else torch.cat((a, b))
                              for a, b in zip(self._fields(), later._fields())))

    def _fields(self) -> tuple:
        return self.positions, self.streams, self.pre, self.token_ids, self.engram_ids


@dataclass(frozen=True)
class ImageSpan:
    """An image in a prompt: its span (start marker, rows of image tokens each ended by
    a newline marker, end marker) at absolute positions ``start .. start + length``,
    every one holding the model's image token id. ``embed()`` returns the span's input
    embeddings [length, D] (the vision tower's output); the engine calls it only when
    it encodes some of the span's positions, so a span read from the store costs no
    tower run."""

    start: int
    length: int
    embed: Callable[[], torch.Tensor]


@dataclass
class Tap:
    """Collects the residual streams entering some layers during a step.

    ``layers`` are backbone layer indices (the DSpark targets); after a ``replay``,
    ``decode`` or ``verify`` given this tap, ``streams[i]`` holds the streams
    [N, hc, D] entering layer ``i`` for the step's flat batch (sequences in batch
    order, each sequence's tokens in order).
    """

    layers: tuple[int, ...]
    streams: dict[int, torch.Tensor] = field(default_factory=dict)

    def features(self, lo: int = 0, hi: int | None = None) -> torch.Tensor:
        """Rows ``[lo, hi)`` as [n, len(layers), hc, D], in the order of ``layers``."""
        return torch.stack([self.streams[i][lo:hi] for i in self.layers], dim=1)


@dataclass
class Rewind:
    """What :meth:`Engine.accept` needs to take back the tokens of a :meth:`Engine.verify` step.

    ``length``: the cache length before the step; ``n_tokens``: the tokens the step fed;
    ``ngram``: the n-gram context before the step; ``pooling[src]``: the hidden states
    [n, D] and positions [n] the KV source ``src`` pooled from (its pending rows, then
    the step's), from which the pending group of any accepted prefix is cut.
    """

    length: int
    n_tokens: int
    token_ids: torch.Tensor
    ngram: NgramContext | None
    pooling: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)


@dataclass
class _Segment:
    """New tokens of one sequence inside a flat batch: rows ``[lo, hi)``, at the
    consecutive ``positions`` from ``first``.

    With ``rewind`` set (a verify step) the windows keep the rows a rollback may need
    and the pooling rows are recorded there.
    """

    cache: SequenceCache
    positions: torch.Tensor
    lo: int
    hi: int
    rewind: Rewind | None = None
    first: int = field(init=False)

    def __post_init__(self) -> None:
        self.first = int(self.positions[0]) if len(self.positions) else self.cache.length


class Engine:
    """Runs a :class:`Transformer` over :class:`SequenceCache` objects. No I/O, no Ray."""

    def __init__(self, model: Transformer, hasher: NgramHasher | None, bounded_replay: bool = True,
                 query_chunk: int = 128, prefill_chunk: int = 1024, compiled: bool | str = False,
                 image_token_id: int | None = None, restore_windows: int | None = 1):
        """``restore_windows``: how many windows of tokens :meth:`restore` reruns (the
        Encoder SWA Bounded Replay; the seed's is one); None: as many as rebuild the
        windows exactly (:attr:`exact_restore_tokens`).
        ``compiled``: steps of few tokens (decode, verify, short replays) run each
        block's per-token work compiled (:mod:`model.runtime.compiled`): ``True`` or
        ``"aot"`` built ahead of time by AOTInductor, ``"jit"`` by ``torch.compile``.
        ``image_token_id`` (a model that reads images): positions holding it are image
        positions: their embeddings come from an :class:`ImageSpan`, the MoE routers use
        their image bias there, Engram's gate is shut there and its n-grams never cross
        them."""
        self.model, self.hasher, self.bounded_replay = model, hasher, bounded_replay
        self.image_token_id = image_token_id
        self.compiled = None
        if compiled:
            from model.runtime.compiled import CompiledBlocks

            self.compiled = CompiledBlocks(model, mode="aot" if compiled is True else compiled)
        self.config = model.config
        self.query_chunk, self.prefill_chunk = query_chunk, prefill_chunk
        self.decoder_start = self.config.decoder_start
        self.window = self.config.sliding_window
        if restore_windows is not None and restore_windows < 1:
            raise ValueError(f"restore_windows must be at least 1, not {restore_windows}")
        self.restore_windows = restore_windows
        self._ratios = {plan.index: plan.compress_ratio for plan in self.config.layer_plans()}
        # Engram layers the decoder's replay runs: their rows come from the inputs' row ids.
        self._decoder_engram = tuple(i for i in self.config.engram_layer_ids if i >= self.decoder_start)

    def warm_compiled(self) -> None:
        """Compile the layer step for one token, for several, and for as many as it takes
        (the MoE's other form), with long-range groups completing: throwaway decodes of
        one sequence, of two, and of the most tokens a compiled step runs, so that no
        request pays for it. An encoder-only model (a prefill replica's) warms the
        prefill's chunks the same way."""
        if self.model.encoder_only:
            cache = self.new_cache()
            self.prefill(cache, [3, 4, 5])
            self.prefill(cache, [6])
            self.prefill(cache, [8 + i % 64 for i in range(self.compiled.max_tokens)])
            return
        caches = [self.new_cache() for _ in range(2)]
        for cache in caches:
            self.replay(cache, self.prefill(cache, [3, 4, 5]))
        self.decode([(caches[0], [6])])
        self.decode([(cache, [7]) for cache in caches])
        self.decode([(caches[1], [8 + i % 64 for i in range(self.compiled.max_tokens)])])

    def new_cache(self) -> SequenceCache:
        device = self.model.embed.weight.device
        cache = SequenceCache.empty(self.config, device)
        if self.hasher is not None:
            cache.ngram = self.hasher.empty_context(1, device)
        return cache

    # ------------------------------------------------------------------ pools
    @torch.no_grad()
    def prefill(self, cache: SequenceCache, token_ids: list[int], engram_rows=None,
                images: Sequence[ImageSpan] = ()) -> DecoderInput:
        """Encoder half over ``token_ids`` (positions ``cache.length`` on) + CED projection.

        Long prompts run in chunks of ``prefill_chunk`` tokens (the caches carry over
        between chunks exactly); a compiled engine's in chunks its compiled step takes,
        so that they run through the compiled blocks (a prompt without images; faster
        than the eager blocks over longer chunks: docs/performance.md).
        ``engram_rows`` is an optional thunk returning, per Engram layer, rows
        [n, cols, head_dim] for these tokens (a remote table service); it is called
        right before the first Engram layer. Without it the model's tables are read.
        ``images``: the spans of the prompt's images (those that do not reach these
        tokens are not embedded).
        """
        device = self.model.embed.weight.device
        ids = torch.tensor(token_ids, dtype=torch.long, device=device)
        start = cache.length
        positions = torch.arange(start, start + len(token_ids), device=device)
        image_mask = self._image_mask(ids)
        x = self._embeddings(ids, start, image_mask, images)
        hash_ids = self._hash(cache, ids, image_mask)
        pending_rows = engram_rows
        rows: dict[int, torch.Tensor] | None = None
        outputs = []
        chunk = self.prefill_chunk
        if self.compiled is not None and image_mask is None:
            chunk = min(chunk, self.compiled.max_tokens)
        for lo in range(0, len(token_ids), chunk):
            hi = min(len(token_ids), lo + chunk)
            streams, pre = self.model.streams_of(x[lo:hi])
            segment = [_Segment(cache, positions[lo:hi], 0, hi - lo)]
            mask = None if image_mask is None else image_mask[lo:hi]

            def chunk_rows() -> dict[int, torch.Tensor]:
                nonlocal rows
                if rows is None:
                    rows = pending_rows() if pending_rows is not None else self._table_rows(hash_ids)
                return {layer: r[lo:hi] for layer, r in rows.items()}

            streams, pre = self._run(segment, streams, pre, range(self.decoder_start), chunk_rows, image_mask=mask)
            self._project_decoder_memory(segment, streams, pre, chunk_rows, mask)
            cache.length = start + hi
            outputs.append((streams, pre))
        return DecoderInput(positions, torch.cat([o[0] for o in outputs]), torch.cat([o[1] for o in outputs]), ids,
                            None if hash_ids is None else hash_ids[0])

    def ngram_context(self, token_ids: list[int]) -> NgramContext | None:
        """The n-gram context after ``token_ids`` (a cache loaded from the store goes on
        hashing from it); None without Engram."""
        if self.hasher is None:
            return None
        ids = torch.tensor(token_ids, dtype=torch.long, device=self.model.embed.weight.device)
        return self._hash_ids(ids, None, self._image_mask(ids))[1]

    def _image_mask(self, ids: torch.Tensor) -> torch.Tensor | None:
        """True at image positions of ``ids`` [n]; None when there are none."""
        if self.image_token_id is None:
            return None
        mask = ids == self.image_token_id
        return mask if bool(mask.any()) else None

    def _embeddings(self, ids: torch.Tensor, start: int, image_mask: torch.Tensor | None,
                    images: Sequence[ImageSpan]) -> torch.Tensor:
        """Input embeddings [n, D] of tokens at ``start ..``: the token table's, and the
        image spans' at image positions (every image position needs its span)."""
        x = self.model.embed(ids)
        covered = torch.zeros(len(ids), dtype=torch.bool, device=ids.device)
        for span in images:
            lo, hi = max(span.start, start), min(span.start + span.length, start + len(ids))
            if lo < hi:
                embeddings = span.embed()
                if embeddings.shape[0] != span.length:
                    raise ValueError(f"an image span of {span.length} positions got {embeddings.shape[0]} embeddings")
                x[lo - start:hi - start] = embeddings[lo - span.start:hi - span.start].to(x.dtype)
                covered[lo - start:hi - start] = True
        expected = torch.zeros_like(covered) if image_mask is None else image_mask
        if not torch.equal(covered, expected):
            raise ValueError("image spans and image token positions disagree")
        return x

    @torch.no_grad()
    def replay(self, cache: SequenceCache, inputs: DecoderInput, exact: bool | None = None,
               tap: Tap | None = None) -> torch.Tensor:
        """Decoder half over the prompt tail; returns the next token's logits [V].

        The decoder windows continue where they end; a missing window starts at the
        first replayed position. Bounded (default): the last ``sliding_window`` tokens.
        A ``tap`` on decoder layers records their input streams for the replayed tokens
        (positions ``cache.length - n ..``, ``n`` = rows recorded).
        """
        continuing = self._decoder_continues(cache, inputs)
        inputs = self.replayed(cache, inputs, exact)
        if not continuing:
            for i in range(self.decoder_start, self.config.num_hidden_layers):
                cache.windows[i] = None
        segments = [_Segment(cache, inputs.positions, 0, len(inputs.positions))]
        layers = range(self.decoder_start, self.config.num_hidden_layers)
        rows = self._table_rows(inputs.engram_ids[None], self._decoder_engram) if self._decoder_engram else {}
        streams, pre = self._run(segments, inputs.streams, inputs.pre, layers, rows, tap,
                                 self._image_mask(inputs.token_ids))
        return self.model.head(streams[-1:], pre[-1:])[0]

    def replayed(self, cache: SequenceCache, inputs: DecoderInput, exact: bool | None = None) -> DecoderInput:
        """The part of ``inputs`` that :meth:`replay` runs: all of it when the decoder
        windows continue where they end or the replay is exact, else its last window
        (Decoder SWA Bounded Replay). What a prefill hands the decoder: the streams of
        the tokens before it would never be read."""
        exact = not self.bounded_replay if exact is None else exact
        if exact or self._decoder_continues(cache, inputs) or len(inputs.positions) <= self.window:
            return inputs
        return inputs.tail(self.window)

    def _decoder_continues(self, cache: SequenceCache, inputs: DecoderInput) -> bool:
        windows = [cache.windows[i] for i in range(self.decoder_start, self.config.num_hidden_layers)]
        return bool(windows) and all(w is not None for w in windows) and windows[0].end == int(inputs.positions[0])

    @torch.no_grad()
    def decode(self, batch: list[tuple[SequenceCache, list[int]]], tap: Tap | None = None) -> list[torch.Tensor]:
        """One step: every sequence's new tokens through all layers; logits [n_i, V] each."""
        return self._step(batch, tap, rewindable=False)[0]

    @torch.no_grad()
    def verify(self, batch: list[tuple[SequenceCache, list[int]]],
               tap: Tap | None = None) -> tuple[list[torch.Tensor], list[Rewind]]:
        """A decode step that can be taken back: logits [n_i, V] and a :class:`Rewind` per
        sequence. Every cache must then go through :meth:`accept` before its next step."""
        return self._step(batch, tap, rewindable=True)

    def accept(self, cache: SequenceCache, rewind: Rewind, n: int) -> None:
        """Keep the first ``n`` (1 .. ``rewind.n_tokens``) tokens of a :meth:`verify` step.

        Afterwards the cache is what ``n`` tokens of :meth:`decode` would have left:
        positions past ``rewind.length + n`` leave the windows, the entries and the
        keys; each KV source's pending rows are the kept positions after its last
        whole group; the n-gram context is advanced over the kept tokens only.
        """
        if not 1 <= n <= rewind.n_tokens:
            raise ValueError(f"accept {n} of {rewind.n_tokens} tokens")
        length = rewind.length + n
        for window in cache.windows:
            if window is None:
                continue
            window.rows.truncate(length - window.start)
            excess = window.rows.n - self.window
            if excess > 0:
                window.rows.drop_front(excess)
                window.start += excess
        for source, (rows, positions) in rewind.pooling.items():
            ratio = self._ratios[source]
            groups = length // ratio
            cache.entries[source].truncate(groups)
            cache.keys[source].truncate(groups)
            cache.pending[source] = rows[(positions >= groups * ratio) & (positions < length)]
        if self.hasher is not None:
            _, cache.ngram = self.hasher.hash_ids(rewind.token_ids[None, :n], rewind.ngram)
        cache.length = length

    def _step(self, batch, tap, rewindable: bool):
        device = self.model.embed.weight.device
        segments, ids, rows = [], [], []
        lo = 0
        for cache, tokens in batch:
            t = torch.tensor(tokens, dtype=torch.long, device=device)
            positions = torch.arange(cache.length, cache.length + len(tokens), device=device)
            rewind = Rewind(cache.length, len(tokens), t, cache.ngram) if rewindable else None
            segments.append(_Segment(cache, positions, lo, lo + len(tokens), rewind))
            ids.append(t)
            rows.append(self._table_rows(self._hash(cache, t)))
            lo += len(tokens)
        flat_ids = torch.cat(ids)
        flat_rows = {layer: torch.cat([r[layer] for r in rows]) for layer in (rows[0] if rows else {})}
        streams, pre = self.model.embed_streams(flat_ids[None])
        streams, pre = self._run(segments, streams[0], pre[0], range(self.config.num_hidden_layers), flat_rows, tap)
        for segment in segments:
            segment.cache.length += segment.hi - segment.lo
        logits = self.model.head(streams, pre)
        return [logits[s.lo : s.hi] for s in segments], [s.rewind for s in segments]

    @property
    def exact_restore_tokens(self) -> int:
        """Tokens a rebuild of expired windows reruns to be exact: each layer's window
        reads the window of the layer below, so the last window of the top layer
        reaches back one window per layer (the seed's 40 x 128 = 5,120 for the release)."""
        return self.config.num_hidden_layers * self.window

    @torch.no_grad()
    def restore(self, cache: SequenceCache, token_ids: list[int], images: Sequence[ImageSpan] = ()) -> DecoderInput:
        """Encoder SWA Bounded Replay: rebuild expired encoder windows of a sequence.

        ``cache`` holds the long-range state of ``token_ids`` (the whole sequence so
        far, ``cache.length`` tokens) but no windows; the encoder reruns on the last
        ``restore_windows`` windows of tokens only, starting from empty windows (the
        first of them see a cold window; the last ones are warmed by those before).
        Returns their decoder-input streams (the decoder windows are rebuilt by
        :meth:`replay`: an exact replay of all of them rebuilds the decoder windows
        exactly when the restore is exact).
        """
        if len(token_ids) != cache.length:
            raise ValueError(f"{len(token_ids)} tokens for a cache of {cache.length}")
        span = self.exact_restore_tokens if self.restore_windows is None else self.restore_windows * self.window
        start = max(0, cache.length - span)
        for i in range(self.config.num_hidden_layers):
            cache.windows[i] = None
        device = self.model.embed.weight.device
        ids = torch.tensor(token_ids[start:], dtype=torch.long, device=device)
        positions = torch.arange(start, cache.length, device=device)
        hash_ids = self._lookback_ids(token_ids, start)
        image_mask = self._image_mask(ids)
        streams, pre = self.model.streams_of(self._embeddings(ids, start, image_mask, images))
        segments = [_Segment(cache, positions, 0, len(ids))]
        streams, pre = self._run(segments, streams, pre, range(self.decoder_start), self._table_rows(hash_ids),
                                 image_mask=image_mask)
        return DecoderInput(positions, streams, pre, ids, None if hash_ids is None else hash_ids[0])

    # ------------------------------------------------------------------ layers
    def _run(self, segments: list[_Segment], streams, pre, layers: range, rows, tap: Tap | None = None,
             image_mask: torch.Tensor | None = None):
        """Blocks ``layers`` over the flat batch: streams [N, hc, D], pre [N, hc].

        ``rows`` maps Engram layers to their rows [N, cols, hd], or is a thunk that
        returns that map, called only when the first Engram layer is reached.
        ``image_mask`` [N]: the image positions (None: none).
        """
        # This step's indexer picks (and, batched, the padded rows of each KV source): per
        # sequence, or one map for the whole batch when its cache reads are batched.
        picks: dict | list[dict] = {} if self._batched(segments) else [{} for _ in segments]
        positions = segments[0].positions if len(segments) == 1 else torch.cat([s.positions for s in segments])
        rotary: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # the step's cos and sin, per rotary kind
        compiled = self.compiled is not None and image_mask is None and self.compiled.handles(streams.shape[0])
        run_block = self.compiled if compiled else None
        for index in layers:
            block = self.model.layers[index]
            if tap is not None and index in tap.layers:
                tap.streams[index] = streams
            def attend(x, block=block):
                if block.plan.rope not in rotary:
                    rotary[block.plan.rope] = self.model.rotary[block.plan.rope](positions[None])
                return self._attention(block, segments, x, picks, positions, *rotary[block.plan.rope])

            if run_block is not None:
                streams, pre = run_block(block, streams, pre, attend, self._rows_of(block, rows))
            else:
                streams, pre = block(streams, pre, attend, self._rows_of(block, rows), image_mask)
        return streams, pre

    @staticmethod
    def _rows_of(block: Block, rows) -> torch.Tensor | None:
        """A block's Engram rows from ``rows`` (a map, or a thunk that returns one)."""
        if block.engram is None:
            return None
        return (rows() if callable(rows) else rows)[block.plan.index]

    def _project_decoder_memory(self, segments, streams, pre, rows, image_mask: torch.Tensor | None = None) -> None:
        """The CED projection: the decoder's KV source pools the encoder output."""
        if self.decoder_start >= self.config.num_hidden_layers:
            return
        block = self.model.layers[self.decoder_start]
        if block.plan.is_kv_source:
            if block.engram is not None:
                streams = block.engram(streams, self._rows_of(block, rows), None if image_mask is None else ~image_mask)
            x = block.attn_norm(mhc.collapse(streams, pre))
            self._compress(block, segments, x)

    def _compress(self, block: Block, segments: list[_Segment], x: torch.Tensor) -> None:
        """Extend a KV source's long-range entries and indexer keys with the complete
        groups of every sequence's new rows ``x[lo:hi]`` (x [N, D]).

        Positions already covered by stored entries are skipped (so replays never
        rewrite long-range state); the incomplete group's hidden states stay pending.
        A verify step records the rows pooled from in its rewind, for :meth:`accept`.
        The groups of all sequences are pooled in one call, one group per row.
        """
        source, ratio = block.plan.index, block.plan.compress_ratio
        groups, owners = [], []
        for segment in segments:
            cache = segment.cache
            pending, covered = cache.pending[source], cache.entries[source].n * ratio
            if pending.shape[0]:
                if segment.first != covered + pending.shape[0]:
                    raise ValueError(f"layer {source}: tokens start at {segment.first}, "
                                     f"pending rows end at {covered + pending.shape[0]}")
                rows = torch.cat((pending, x[segment.lo : segment.hi]))
                row_pos = torch.arange(covered, covered + rows.shape[0], device=x.device)
            else:
                skip = min(max(0, covered - segment.first), segment.hi - segment.lo)
                rows, row_pos = x[segment.lo + skip : segment.hi], segment.positions[skip:]
                if rows.shape[0] and segment.first + skip != covered:
                    raise ValueError(f"layer {source}: pooling group starts at {segment.first + skip}, "
                                     f"expected {covered}")
            if segment.rewind is not None:
                segment.rewind.pooling[source] = (rows, row_pos)
            whole = rows.shape[0] // ratio * ratio
            if whole:
                groups.append((rows[:whole], row_pos[:whole]))
                owners.append((cache, whole // ratio))
            cache.pending[source] = rows[whole:]
        if not groups:
            return
        if len(groups) == 1:
            rows, row_pos = groups[0][0][None], groups[0][1][None]
        else:
            rows = torch.cat([g[0] for g in groups]).unflatten(0, (-1, ratio))
            row_pos = torch.cat([g[1] for g in groups]).view(-1, ratio)
        # Row by row, so encoding every sequence's rows at once gives each its own bytes.
        entry_store, key_store = owners[0][0].entries[source], owners[0][0].keys[source]
        if self.compiled is not None and self.compiled.handles(rows.shape[0] * rows.shape[1]):
            cos, sin = self.model.rotary["compress"](row_pos[:, ::ratio])
            entry_rows, key_rows = self.compiled.pool_groups(block.attn, rows, cos, sin, entry_store, key_store)
        else:
            new_entries, new_keys = block.attn.compress(rows, row_pos, self.model.rotary["compress"])
            entry_rows, key_rows = entry_store.encode(new_entries.flatten(0, 1)), key_store.encode(new_keys.flatten(0, 1))
        lo = 0
        for cache, n_groups in owners:
            cache.entries[source].append_encoded(*(t[lo : lo + n_groups] for t in entry_rows))
            cache.keys[source].append_encoded(*(t[lo : lo + n_groups] for t in key_rows))
            lo += n_groups

    def _batched(self, segments: list[_Segment]) -> bool:
        """Whether a step's cache reads run once over the batch (:meth:`_batch_keys`):
        every sequence feeds a few tokens (decode, a verify of each one's guesses, short
        replays), and the long-range rows padded to the longest sequence stay small.
        Otherwise they run per sequence (:meth:`_sequence_keys`)."""
        n = max(s.hi - s.lo for s in segments)
        if not n <= self.BATCHED_TOKENS or any(s.hi == s.lo for s in segments):
            return False
        if len(segments) == 1:  # nothing to pad: the caches' own rows are read in place
            return True
        longest = {source: max(s.cache.entries[source].n for s in segments) + n for source in segments[0].cache.entries}
        width = self.config.head_dim + self.config.index_head_dim
        return 4 * width * len(segments) * sum(longest.values()) <= self.BATCHED_BYTES

    BATCHED_TOKENS = 16
    """The most tokens a sequence may feed in a step whose cache reads are batched."""
    BATCHED_BYTES = 64 << 20
    """The most bytes the padded long-range rows of a batched step may take."""

    def _attention(self, block: Block, segments: list[_Segment], x: torch.Tensor, picks: dict | list[dict],
                   positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """One layer's attention over the flat batch: x [N, D] at ``positions`` [N] (cos
        and sin: their rotary angles) -> [N, D]. The per-token work (projections,
        rotary, the attention itself) runs once over every sequence's tokens; what
        reads a sequence's caches runs once over the batch (``picks`` a map) or per
        sequence (a list of maps)."""
        plan, attn = block.plan, block.attn
        windows = []
        for segment in segments:
            window = segment.cache.windows[plan.index]
            if window is None:
                window = segment.cache.new_window(plan.index, segment.first)
            if window.end != segment.first:
                raise ValueError(f"layer {plan.index}: window ends at {window.end}, tokens start at {segment.first}")
            windows.append(window)
        # Every sequence's new window rows quantised at once (row by row: the same bytes).
        fast = self.compiled if self.compiled is not None and self.compiled.handles(len(positions)) else None
        if fast is not None:
            q, q_residual, window_bytes, window_values, index_query = fast.attention_in(attn, windows[0].rows, x,
                                                                                          cos, sin)
        else:
            q, q_residual = attn.queries(x[None], cos, sin)
            window_bytes, window_values = windows[0].rows.encode(attn.window_raw(x[None], cos, sin)[0])
            index_query = None
        for segment, window in zip(segments, windows):
            window.rows.append_encoded(window_bytes[segment.lo : segment.hi], window_values[segment.lo : segment.hi])
        if isinstance(picks, dict):
            keys, mask = self._batch_keys(block, segments, windows, x, q_residual, cos, sin, picks, index_query,
                                          positions)
        else:
            keys, mask = self._sequence_keys(block, segments, windows, x, q_residual, cos, sin, picks, index_query)
        if fast is not None:
            out = fast.attention_out(attn, q, keys, mask, cos, sin)
        else:
            out = attn.output(torch.cat([
                attn.attend(q[0, i : i + self.query_chunk, None], keys[i : i + self.query_chunk],
                            mask[i : i + self.query_chunk, None])[:, 0]
                for i in range(0, len(positions), self.query_chunk)
            ])[None], cos, sin)[0]
        for segment, window in zip(segments, windows):
            excess = window.rows.n - self.window
            if excess > 0 and segment.rewind is None:  # a verify step's windows are trimmed by accept
                window.rows.drop_front(excess)
                window.start += excess
        return out

    def _batch_keys(self, block: Block, segments: list[_Segment], windows: list[Window], x: torch.Tensor,
                    q_residual: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, state: dict,
                    index_query: tuple[torch.Tensor, torch.Tensor] | None, positions: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`_sequence_keys` for ``b`` sequences of at most ``n`` tokens each, in a
        fixed number of tensor ops however many sequences there are: (keys [N, T, hd],
        mask [N, T]) for the step's tokens at ``positions`` [N] (their :class:`_Layout`
        in ``state``, made once per step).

        Each sequence's window rows that any of its queries may read are one slice of
        its window; the slices, and the long-range entries and indexer keys of each KV
        source (once per step, in ``state``), are padded to the longest sequence, and
        each token reads its own sequence's rows. Padding is masked, so each query
        attends to the places the per-sequence path gives it (in another order where
        sequences are padded: equal to float rounding)."""
        plan, device = block.plan, x.device
        if "layout" not in state:
            state["layout"] = _Layout.of([s.hi - s.lo for s in segments], device)
        layout: _Layout = state["layout"]
        firsts = [max(w.start, s.first - self.window + 1) for s, w in zip(segments, windows)]
        views = [w.rows.values[first - w.start :] for w, first in zip(windows, firsts)]
        window_keys = _padded(views)  # [b, Tw, hd]
        places = torch.arange(window_keys.shape[1], device=device)
        delta = (positions - layout.each(torch.tensor(firsts, device=device)))[:, None] - places
        mask = (delta >= 0) & (delta < self.window)  # [N, Tw]
        if layout.b > 1:
            lengths = torch.tensor([v.shape[0] for v in views], device=device)
            mask &= places < layout.each(lengths)[:, None]
        keys = layout.each(window_keys)  # [N, Tw, hd]
        if plan.mode is not AttentionMode.WINDOW:
            if plan.mode is AttentionMode.FULL:
                self._compress(block, segments, x)
            source = plan.kv_source
            if ("rows", source) not in state:  # after the source's own layer added this step's groups
                state["rows", source] = (_padded([s.cache.entries[source].values for s in segments]),
                                         _padded([s.cache.keys[source].values for s in segments]))
            entries, index_keys = state["rows", source]
            if plan.runs_indexer:
                state[plan.index] = self._batch_pick(block, index_keys, x, q_residual, cos, sin, positions, state,
                                                     index_query)
            index, valid = state[plan.index_source]  # [N, k]
            keys = torch.cat((keys, layout.rows_at(entries, index)), dim=1)
            mask = torch.cat((mask, valid), dim=1)
        return keys, mask

    def _batch_pick(self, block: Block, keys: torch.Tensor, x: torch.Tensor, q_residual: torch.Tensor,
                    cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor, state: dict,
                    index_query: tuple[torch.Tensor, torch.Tensor] | None) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`_pick` over the batch (``state["layout"]``): ``keys`` [b, E, d] per
        sequence, ``positions`` [N]; returns (entry indices [N, k], valid [N, k]).
        ``index_query``: the indexer's per-token half
        (:meth:`~model.attention.Indexer.query`) when the compiled step computed it."""
        plan, config, indexer, layout = block.plan, self.config, block.attn.indexer, state["layout"]
        k = min(config.index_topk, keys.shape[1])
        if k == 0:
            empty = torch.zeros(len(positions), 0, dtype=torch.long, device=x.device)
            return empty, empty.bool()
        q, weights = index_query or indexer.query(x[None], q_residual, cos, sin)  # [1, N, H, d], [1, N, H]
        if plan.candidate_source is not None:  # a Reindex layer: each token scores its own candidates
            pool = state["candidates"]
            scores = indexer.score(q, weights, layout.rows_at(keys, pool[0])[None])[0]
        else:  # every token of a sequence against its keys: laid out [b, n]
            scores = layout.tokens(indexer.score(layout.padded(q[0]), layout.padded(weights[0]), keys))
            pool = None
        top, valid, candidates = self._indexer_top(block, scores, (positions + 1) // plan.compress_ratio, k, pool)
        if candidates is not None:
            state["candidates"] = candidates
        return top, valid

    def _indexer_top(self, block: Block, scores: torch.Tensor, n_visible: torch.Tensor, k: int,
                     pool: tuple[torch.Tensor, torch.Tensor] | None
                     ) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
        """The indexer's choice from its ``scores`` [..., T] of queries that see the
        entries below ``n_visible`` [...] (the rest are not yet complete): (entry
        indices [..., k], valid [..., k], the pool a candidate source lists for the
        Reindex layers after it, else None). A Reindex layer's scores are of its
        candidates only, ``pool`` (entries [..., P], valid [..., P])."""
        plan, config = block.plan, self.config
        if pool is not None:
            entries, pool_valid = pool
            pool_valid = pool_valid & (entries < n_visible[..., None])  # the newest block is partial
            scores = scores.masked_fill(~pool_valid, float("-inf"))
            listed = None
        else:
            visible = torch.arange(scores.shape[-1], device=scores.device) < n_visible[..., None]
            scores = scores.masked_fill(~visible, float("-inf"))
            listed = candidate_entries(scores, n_visible, config.candidate_topk_blocks,
                                       config.candidate_block_size) if plan.is_candidate_source else None
        top, values = top_k(scores, k)
        return (top if pool is None else pool[0].gather(-1, top)), values > float("-inf"), listed

    def _sequence_keys(self, block: Block, segments: list[_Segment], windows: list[Window], x: torch.Tensor,
                       q_residual: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, picks: list[dict],
                       index_query: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Every token's keys [N, T, hd] and mask [N, T], sequence by sequence (each
        sequence's new window rows already in its window); sequences short of top-k
        entries are padded with masked keys. ``index_query`` as in :meth:`_batch_pick`."""
        keys, masks = [], []
        for segment, window, segment_picks in zip(segments, windows, picks):
            part = slice(segment.lo, segment.hi)
            segment_keys, mask = self._keys(block, segment, window, x, q_residual[:, part], cos[:, part],
                                            sin[:, part], segment_picks,
                                            None if index_query is None else tuple(t[:, part] for t in index_query))
            keys.append(segment_keys)
            masks.append(mask)
        if len(keys) == 1:
            return keys[0], masks[0]
        width = max(k.shape[1] for k in keys)
        keys = [F.pad(k, (0, 0, 0, width - k.shape[1])) for k in keys]
        masks = [F.pad(m, (0, width - m.shape[1])) for m in masks]
        return torch.cat(keys), torch.cat(masks)

    def _keys(self, block: Block, segment: _Segment, window: Window, x: torch.Tensor, q_residual: torch.Tensor,
              cos: torch.Tensor, sin: torch.Tensor, picks: dict,
              index_query: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """One sequence's keys at one layer, its new rows already in its ``window``:
        (keys [n, W + k, hd], mask [n, W + k]) for its n tokens, the window places of
        each query and, past a Window layer, the long-range entries its indexer picks.
        ``x`` is the whole batch's [N, D]; the rest this sequence's."""
        plan, cache, positions = block.plan, segment.cache, segment.positions
        # Window places of each query: positions p - W + 1 .. p, where cached.
        offsets = torch.arange(self.window, device=x.device) - (self.window - 1)
        win_index = positions[:, None] + offsets[None] - window.start  # [n, W]
        mask = win_index >= 0
        keys = _rows_at(window.rows.values, win_index.clamp_min(0))  # [n, W, hd]
        if plan.mode is not AttentionMode.WINDOW:
            if plan.mode is AttentionMode.FULL:
                self._compress(block, [segment], x)
            entries = cache.entries[plan.kv_source].values
            if plan.runs_indexer:
                picks[plan.index] = self._pick(block, cache, x[segment.lo : segment.hi], q_residual, cos, sin,
                                               positions, picks, index_query)
            index, valid = picks[plan.index_source]
            keys = torch.cat((keys, _rows_at(entries, index)), dim=1)  # [n, W + k, hd]
            mask = torch.cat((mask, valid), dim=1)
        return keys, mask

    def _pick(self, block: Block, cache, x, q_residual, cos, sin, positions, picks,
              index_query: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The indexer of one layer over one sequence: (entry indices [n, k], valid [n, k]).

        Queries are scored in chunks, so prefill never holds an [n, heads, T] tensor.
        The candidate source lists its pool in ``picks``; a Reindex layer gathers and
        scores only those candidates. ``index_query``: the indexer's per-token half
        for these tokens, when the compiled step computed it.
        """
        plan, config = block.plan, self.config
        keys = cache.keys[plan.kv_source].values
        n, n_entries = len(positions), keys.shape[0]
        k = min(config.index_topk, n_entries)
        if k == 0:
            empty = torch.zeros(n, 0, dtype=torch.long, device=x.device)
            return empty, empty.bool()
        n_visible = (positions + 1) // plan.compress_ratio  # [n]
        indices, valid, pools = [], [], []
        step = self.query_chunk
        for lo in range(0, n, step):
            hi = min(n, lo + step)
            if index_query is None:
                query = block.attn.indexer.query(x[None, lo:hi], q_residual[:, lo:hi], cos[:, lo:hi], sin[:, lo:hi])
            else:
                query = tuple(t[:, lo:hi] for t in index_query)
            if plan.candidate_source is None:
                pool, scores = None, block.attn.indexer.score(*query, keys[None])[0]  # [c, E]
            else:  # a Reindex layer: its candidates only
                pool = tuple(t[lo:hi] for t in picks["candidates"])
                scores = block.attn.indexer.score(*query, _rows_at(keys, pool[0])[None])[0]  # [c, P]
            top, chunk_valid, listed = self._indexer_top(block, scores, n_visible[lo:hi], k, pool)
            indices.append(top)
            valid.append(chunk_valid)
            if listed is not None:
                pools.append(listed)
        if pools:
            picks["candidates"] = tuple(torch.cat(parts) for parts in zip(*pools))
        return torch.cat(indices), torch.cat(valid)

    # ------------------------------------------------------------------ Engram rows
    def _hash(self, cache: SequenceCache, ids: torch.Tensor, image_mask: torch.Tensor | None = None
              ) -> torch.Tensor | None:
        """Engram row ids [n, layers, cols] of new tokens (no n-gram reaches across an
        image position); advances the n-gram context."""
        if self.hasher is None:
            return None
        hash_ids, cache.ngram = self._hash_ids(ids, cache.ngram, image_mask)
        return hash_ids

    def _hash_ids(self, ids: torch.Tensor, context: NgramContext | None,
                  image_mask: torch.Tensor | None) -> tuple[torch.Tensor, NgramContext]:
        """The hasher over ``ids`` [n] from ``context``, no n-gram across an image
        position (``image_mask``; None: there are none)."""
        return self.hasher.hash_ids(ids[None], context, token_mask=None if image_mask is None else ~image_mask[None])

    def _table_rows(self, hash_ids: torch.Tensor | None, layers: tuple[int, ...] | None = None) -> dict[int, torch.Tensor]:
        """Rows [n, cols, hd] per Engram layer (``layers``, default all) from the model's
        in-process tables, for row ids [1, n, layers, cols]."""
        if hash_ids is None:
            return {}
        return {layer: rows[0] for layer, rows in self.model.engram_rows(hash_ids, layers).items()}

    def _lookback_ids(self, token_ids: list[int], start: int) -> torch.Tensor | None:
        """Engram row ids [1, n, layers, cols] of tokens ``start..``, with their true n-gram look-back."""
        if self.hasher is None:
            return None
        back = max(0, start - (self.hasher.max_ngram_size - 1))
        ids = torch.tensor(token_ids[back:], dtype=torch.long, device=self.model.embed.weight.device)
        return self._hash_ids(ids, None, self._image_mask(ids))[0][:, start - back :]
