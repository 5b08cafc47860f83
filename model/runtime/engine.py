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

Every path runs the one block loop (:func:`model.transformer.run_blocks`) over a flat
batch, the tokens of all sequences in a step one after the other, for projections,
mHC, MoE and the attention itself; attention reads each sequence's caches
(:class:`model.runtime.gather.CachedKeys`) and a KV source pools the groups its tokens
complete (:mod:`model.runtime.long_range`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .. import mhc
from ..engram import NgramContext, NgramHasher
from ..transformer import EngramRows, Tap, Transformer, engram_rows_of, run_blocks
from .cache import SequenceCache
from .engram_ids import EngramIds
from .gather import CachedKeys
from .batch_slab import BatchSlab
from .inputs import DecoderInput, ImageSpan
from .long_range import Rewind, Segment, pool_groups
from .weight_layout import store_input_major


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
        store_input_major(model)  # (model.runtime.weight_layout: its few-row products read the weights as kept)
        self.image_token_id = image_token_id
        self.engram_ids = EngramIds(model, hasher, image_token_id)
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
        # Where the caches of sequences that step together are kept (model.runtime.batch_slab).
        self.slab = BatchSlab(self.window, self.BATCHED_TOKENS, self.BATCHED_BYTES)
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
            self.prefill(cache, _filler(self.compiled.max_tokens))
            return
        caches = [self.new_cache() for _ in range(2)]
        # one with fewer keys than its indexers pick, one with more (the compiled picks)
        config = self.config
        picked = max(config.index_topk, config.candidate_pool)
        long = picked * max(config.compress_ratios or (1,)) + 1
        for cache, prompt in zip(caches, ([3, 4, 5], _filler(long))):
            self.replay(cache, self.prefill(cache, prompt))
        self.decode([(caches[0], [6])])
        self.decode([(cache, [7]) for cache in caches])
        self.decode([(caches[1], _filler(self.compiled.max_tokens))])

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
        image_mask = self.engram_ids.image_mask(ids)
        x = self._embeddings(ids, start, image_mask, images)
        hash_ids = self.engram_ids.of_new(cache, ids, image_mask)
        pending_rows = engram_rows
        rows: dict[int, torch.Tensor] | None = None
        outputs = []
        chunk = self.prefill_chunk
        if self.compiled is not None and image_mask is None:
            chunk = min(chunk, self.compiled.max_tokens)
        for lo in range(0, len(token_ids), chunk):
            hi = min(len(token_ids), lo + chunk)
            streams, pre = self.model.streams_of(x[lo:hi])
            segment = [Segment(cache, positions[lo:hi], 0, hi - lo)]
            mask = None if image_mask is None else image_mask[lo:hi]

            def chunk_rows() -> dict[int, torch.Tensor]:
                nonlocal rows
                if rows is None:
                    rows = pending_rows() if pending_rows is not None else self.engram_ids.rows(hash_ids)
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
        return self.engram_ids.context_after(token_ids)

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
        segments = [Segment(cache, inputs.positions, 0, len(inputs.positions))]
        layers = range(self.decoder_start, self.config.num_hidden_layers)
        rows = self.engram_ids.rows(inputs.engram_ids[None], self._decoder_engram) if self._decoder_engram else {}
        streams, pre = self._run(segments, inputs.streams, inputs.pre, layers, rows, tap,
                                 self.engram_ids.image_mask(inputs.token_ids))
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
        segments, ids = [], []
        lo = 0
        for cache, tokens in batch:
            t = torch.tensor(tokens, dtype=torch.long, device=device)
            positions = torch.arange(cache.length, cache.length + len(tokens), device=device)
            rewind = Rewind(cache.length, len(tokens), t, cache.ngram) if rewindable else None
            segments.append(Segment(cache, positions, lo, lo + len(tokens), rewind))
            ids.append(t)
            lo += len(tokens)
        flat_ids = torch.cat(ids)
        flat_rows = self.engram_ids.rows(self.engram_ids.of_step([cache for cache, _ in batch], ids))
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
        hash_ids = self.engram_ids.of_tail(token_ids, start)
        image_mask = self.engram_ids.image_mask(ids)
        streams, pre = self.model.streams_of(self._embeddings(ids, start, image_mask, images))
        segments = [Segment(cache, positions, 0, len(ids))]
        streams, pre = self._run(segments, streams, pre, range(self.decoder_start), self.engram_ids.rows(hash_ids),
                                 image_mask=image_mask)
        return DecoderInput(positions, streams, pre, ids, None if hash_ids is None else hash_ids[0])

    # ------------------------------------------------------------------ layers
    def _run(self, segments: list[Segment], streams, pre, layers: range, rows: EngramRows,
             tap: Tap | None = None, image_mask: torch.Tensor | None = None):
        """Blocks ``layers`` over the flat batch: streams [N, hc, D], pre [N, hc].

        ``rows`` maps Engram layers to their rows [N, cols, hd], or is a thunk that
        returns that map, called only when the first Engram layer is reached.
        ``image_mask`` [N]: the image positions (None: none).
        """
        positions = segments[0].positions if len(segments) == 1 else torch.cat([s.positions for s in segments])
        keys = CachedKeys(self.model, self.compiled, segments, positions, self._batched(segments), self.window,
                          self.query_chunk, self.slab)
        compiled = self.compiled is not None and image_mask is None and self.compiled.handles(streams.shape[0])
        return run_blocks([self.model.layers[i] for i in layers], streams, pre, keys, rows, image_mask, tap,
                          self.compiled if compiled else None)

    def _project_decoder_memory(self, segments, streams, pre, rows, image_mask: torch.Tensor | None = None) -> None:
        """The CED projection: the decoder's KV source pools the encoder output."""
        if self.decoder_start >= self.config.num_hidden_layers:
            return
        block = self.model.layers[self.decoder_start]
        if block.plan.is_kv_source:
            if block.engram is not None:
                streams = block.engram(streams, engram_rows_of(block, rows), None if image_mask is None else ~image_mask)
            x = block.attn_norm(mhc.collapse(streams, pre))
            pool_groups(self.model, self.compiled, block, segments, x)

    def _batched(self, segments: list[Segment]) -> bool:
        """Whether a step's cache reads run once over the batch (:class:`CachedKeys`):
        every sequence feeds a few tokens (decode, a verify of each one's guesses, short
        replays), and the long-range rows padded to the longest sequence stay small.
        Otherwise they run per sequence."""
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


def _filler(n: int) -> list[int]:
    """``n`` ordinary token ids for the warm-up's throwaway steps: 8..71, past the shipped
    configs' special and image token ids (a prompt holding an image token needs its
    image)."""
    return [8 + i % 64 for i in range(n)]
