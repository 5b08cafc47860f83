"""Where the engine's attention reads its keys: places gathered from each sequence's caches.

Attention reads exactly the places it is allowed: for each new token, its window (at
most ``sliding_window`` entries) and the ``index_topk`` long-range entries its
indexer picked, gathered from the cache; the indexer scans the keys (Reindex layers
only the candidate pool). Tokens of all sequences in a step are flattened into one
batch for the projections and the attention itself (:class:`CachedKeys`, the
engine's :class:`~model.transformer.Keys`); the cache reads (window places, pooling,
the indexer, the gathers) run once over the padded batch in steps of a few tokens per
sequence (:class:`Layout`), and per sequence otherwise (long prompts). Where the
batch's windows are kept side by side and slide together (every layer's window of a
sequence holds the same positions: :meth:`~model.runtime.batch_slab.BatchSlab.lockstep`),
a step's window writes and reads are worked out once, not at every layer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ..attention import attend_each
from ..config import AttentionMode
from ..selection import candidate_entries, select_entries
from ..transformer import Block, Transformer
from .batch_layout import LayerKeys, Layout, LongRangeRows, padded_cat, padded_rows, rows_at
from .batch_slab import BatchSlab, WindowStep
from .cache import Window
from .long_range import Segment, pool_groups


@dataclass
class CachedKeys:
    """The engine's :class:`~model.transformer.Keys` for one step: the new tokens of
    ``segments``, flat at ``positions`` [N], read each sequence's caches.

    ``batched``: the cache reads run once over the padded batch (:meth:`_batch_keys`),
    else per sequence (:meth:`_sequence_keys`). ``compiled`` (a
    :class:`model.runtime.compiled.CompiledBlocks`) runs the per-token work where it
    takes the step's tokens. Prefill scores the indexer's queries ``query_chunk`` at a
    time. ``slab``: where a batched step of several sequences keeps their caches side
    by side (:mod:`model.runtime.batch_slab`; None: each in buffers of its own).
    """

    model: Transformer
    compiled: object | None
    segments: list[Segment]
    positions: torch.Tensor
    batched: bool
    window: int
    query_chunk: int
    slab: BatchSlab | None = None
    # This step's indexer picks (and, batched, the padded rows of each KV source): per
    # sequence, or one map for the whole batch when its cache reads are batched.
    picks: dict | list[dict] = field(init=False)
    rotary: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)  # cos and sin, per kind

    def __post_init__(self) -> None:
        self.picks = {} if self.batched else [{} for _ in self.segments]
        self.counts = [s.hi - s.lo for s in self.segments]
        if not self.batched or len(self.segments) < 2:
            self.slab = None
        self.slab_rows = self.slab.admit([s.cache for s in self.segments]) if self.slab is not None else []

    def attend(self, block: Block, x: torch.Tensor) -> torch.Tensor:
        """One layer's attention over the flat batch, eager: x [N, D] -> [N, D]. The
        per-token work (projections, rotary, the attention itself) runs once over every
        sequence's tokens; what reads a sequence's caches runs once over the batch or
        per sequence (:meth:`read`). (A compiled step runs the per-token work in its
        own functions around :meth:`read`: :class:`model.runtime.compiled.CompiledBlocks`.)"""
        attn = block.attn
        cos, sin = self.rotary_at(block)
        q, q_residual = attn.queries(x[None], cos, sin)
        window_rows = self.window_rows(block).encode(attn.window_raw(x[None], cos, sin)[0])
        keys, mask = self.read(block, x, q_residual, window_rows, None).joined()
        chunk = self.query_chunk
        return attn.output(torch.cat([
            attend_each(q[0, i : i + chunk], keys[i : i + chunk], mask[i : i + chunk], attn.attn_sink, attn.scaling)
            for i in range(0, len(self.positions), chunk)
        ])[None], cos, sin)[0]

    def rotary_at(self, block: Block) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [1, N, rd] of ``block``'s rotary kind at the step's positions (made
        once a step for each kind)."""
        rope = block.plan.rope
        if rope not in self.rotary:
            self.rotary[rope] = self.model.rotary[rope](self.positions[None])
        return self.rotary[rope]

    def window_rows(self, block: Block):
        """The first sequence's window rows at ``block``'s layer (every sequence's are in
        the same format): what encodes the step's new rows."""
        return self._window(block.plan.index, self.segments[0]).rows

    def read(self, block: Block, x: torch.Tensor, q_residual: torch.Tensor,
             window_rows: tuple[torch.Tensor, torch.Tensor],
             index_query: tuple[torch.Tensor, torch.Tensor] | None) -> LayerKeys:
        """Every cache read of one layer's attention: the step's new window rows
        (``window_rows``: bytes [N, row bytes] and values [N, hd], every sequence's,
        encoded at once) appended to each sequence's window, then each token's keys
        (:meth:`_batch_keys` or :meth:`_sequence_keys`). The
        windows are trimmed to ``sliding_window`` rows after (the keys are already read:
        a trim only moves a window's start). ``x`` [N, D] the layer's normalised input;
        ``q_residual`` and ``index_query`` as the queries' projection gave them."""
        plan, segments = block.plan, self.segments
        cos, sin = self.rotary_at(block)
        step = self._lockstep()
        if step is not None:
            return self._lockstep_keys(block, step, x, q_residual, cos, sin, window_rows, index_query)
        windows = [self._window(plan.index, segment) for segment in segments]
        place, rows = ("window", plan.index), [window.rows for window in windows]
        seated = self.slab is not None and self.slab.seat(place, rows, self.slab_rows)
        if seated:
            self.slab.append(place, rows, self.slab_rows, self.counts, window_rows)
        else:
            window_bytes, window_values = window_rows
            for segment, window in zip(segments, windows):
                window.rows.append_encoded(window_bytes[segment.lo : segment.hi],
                                           window_values[segment.lo : segment.hi])
        if self.batched:
            keys = self._batch_keys(block, windows, x, q_residual, cos, sin, index_query, seated)
        else:
            keys = self._sequence_keys(block, windows, x, q_residual, cos, sin, index_query)
        for segment, window in zip(segments, windows):
            excess = window.rows.n - self.window
            if excess > 0 and segment.rewind is None:  # a verify step's windows are trimmed by accept
                window.rows.drop_front(excess)
                window.start += excess
        return keys

    def _lockstep(self) -> WindowStep | None:
        """The step's window reads and writes when its sequences' windows move in
        lockstep in the slab (:meth:`BatchSlab.lockstep`, found at the step's first read)."""
        if self.slab is None:
            return None
        if "lockstep" not in self.picks:
            segments = self.segments
            self.picks["lockstep"] = self.slab.lockstep(
                [s.cache for s in segments], self.slab_rows, self.counts, [s.first for s in segments], self.window,
                [s.rewind is None for s in segments])  # (a verify step's windows are trimmed by accept)
        return self.picks["lockstep"]

    def _lockstep_keys(self, block: Block, step: WindowStep, x: torch.Tensor, q_residual: torch.Tensor,
                       cos: torch.Tensor, sin: torch.Tensor, window_rows: tuple[torch.Tensor, torch.Tensor],
                       index_query: tuple[torch.Tensor, torch.Tensor] | None) -> LayerKeys:
        """:meth:`read` of one layer in a lockstep ``step``: its windows' new rows written
        and read with the step's index tensors, then each window's rows counted and
        trimmed in one pass (no per-sequence work but that)."""
        layer = block.plan.index
        self.slab.write_windows(layer, step, window_rows)
        keys = self._long_range_keys(block, self._window_keys(step.firsts, step.lengths,
                                                              lambda places: self.slab.read_lockstep(layer, step)),
                                     x, q_residual, cos, sin, index_query)
        for segment, m, trim in zip(self.segments, step.counts, step.trims):
            window = segment.cache.windows[layer]
            window.rows.extend(m)
            if trim:
                window.rows.drop_front(trim)
                window.start += trim
        return keys

    @staticmethod
    def _window(layer: int, segment: Segment) -> Window:
        """The sequence's window at ``layer`` (a new one where it has none), which must
        end where the segment's tokens start."""
        window = segment.cache.windows[layer]
        if window is None:
            window = segment.cache.new_window(layer, segment.first)
        if window.end != segment.first:
            raise ValueError(f"layer {layer}: window ends at {window.end}, tokens start at {segment.first}")
        return window

    def _batch_keys(self, block: Block, windows: list[Window], x: torch.Tensor, q_residual: torch.Tensor,
                    cos: torch.Tensor, sin: torch.Tensor, index_query: tuple[torch.Tensor, torch.Tensor] | None,
                    seated: bool = False) -> LayerKeys:
        """:meth:`_sequence_keys` for ``b`` sequences of at most ``n`` tokens each, in a
        fixed number of tensor ops however many sequences there are: the step's tokens'
        keys (their :class:`Layout` in ``picks``, made once per step).

        Each sequence's window rows that any of its queries may read are one slice of
        its window; the slices are padded to the longest sequence, and each token
        reads its own sequence's rows; so are the long-range entries and indexer keys
        of each KV source (:class:`LongRangeRows`, once per step, in ``picks``). Padding
        is masked, so each query attends to the places the per-sequence path gives it
        (in another order where sequences are padded: equal to float rounding).
        ``seated``: the windows are in the step's slab, which reads them all at once."""
        layer = block.plan.index
        firsts = [max(w.start, s.first - self.window + 1) for s, w in zip(self.segments, windows)]
        lengths = [w.end - first for w, first in zip(windows, firsts)]
        if seated:
            def read(places: torch.Tensor) -> torch.Tensor:
                return self.slab.read_windows(layer, windows, self.slab_rows, firsts, lengths, places)
        else:
            def read(places: torch.Tensor) -> torch.Tensor:
                return padded_rows([w.rows.values[first - w.start :] for w, first in zip(windows, firsts)])
        return self._long_range_keys(block, self._window_keys(firsts, lengths, read), x, q_residual, cos, sin,
                                     index_query)

    def _layout(self) -> Layout:
        """The step's :class:`Layout` (made once a step)."""
        if "layout" not in self.picks:
            self.picks["layout"] = Layout.of(self.counts, self.positions.device)
        return self.picks["layout"]

    def _window_keys(self, firsts: list[int], lengths: list[int],
                     read: Callable[[torch.Tensor], torch.Tensor]) -> LayerKeys:
        """Each token's window part of a batched step: its sequence's window rows from
        position ``firsts[i]`` on, ``lengths[i]`` of them, as ``read(places)`` gives them
        padded [b, T, hd] (places = ``arange(T)``), and its mask over them."""
        layout = self._layout()
        places, mask = self._window_mask(layout, firsts, lengths)
        return LayerKeys(layout.each(read(places)), mask)  # [N, Tw, hd]

    def _long_range_keys(self, block: Block, window_keys: LayerKeys, x: torch.Tensor, q_residual: torch.Tensor,
                         cos: torch.Tensor, sin: torch.Tensor,
                         index_query: tuple[torch.Tensor, torch.Tensor] | None) -> LayerKeys:
        """``window_keys`` and, past a Window layer, each token's picked entries of a
        batched step: a Full layer pools its groups first, a layer that runs an indexer
        picks (``index_query`` as in :meth:`_batch_pick`)."""
        plan, state, layout = block.plan, self.picks, self._layout()
        if plan.mode is AttentionMode.WINDOW:
            return window_keys
        source = plan.kv_source
        if plan.mode is AttentionMode.FULL:
            state["seated", source] = self._seat_long_range(source)
            pool_groups(self.model, self.compiled, block, self.segments, x,
                        self.slab if state["seated", source] else None, self.slab_rows)
        if ("rows", source) not in state:  # after the source's own layer added this step's groups
            state["rows", source] = self._long_range_rows(source, layout, state.get(("seated", source), False))
        rows: LongRangeRows = state["rows", source]
        if plan.runs_indexer:
            state[plan.index] = self._batch_pick(block, rows, x, q_residual, cos, sin, index_query)
        index, valid = state[plan.index_source]  # [N, k]
        return window_keys._replace(picked=layout.rows_at(rows.entries, index, rows.row), picked_valid=valid)

    def _window_mask(self, layout: Layout, firsts: list[int], lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The window places ``arange(T)`` and each token's mask over them [N, T], for
        windows read from position ``firsts[i]`` on, ``lengths[i]`` rows: made once a
        step for each such span (a sequence's windows span the same positions at every
        layer but where one was rebuilt)."""
        key = ("window", tuple(firsts), tuple(lengths))
        if key not in self.picks:
            places = torch.arange(max(lengths), device=self.positions.device)
            first, length = layout.each(torch.tensor([firsts, lengths], device=places.device).T).unbind(1)
            delta = (self.positions - first)[:, None] - places
            self.picks[key] = places, (delta >= 0) & (delta < self.window) & (places < length[:, None])
        return self.picks[key]

    def _seat_long_range(self, source: int) -> bool:
        """Seat every sequence's entries and keys of KV ``source`` in the slab (before
        its layer pools this step's groups into them); whether both are there."""
        if self.slab is None:
            return False
        caches = [s.cache for s in self.segments]
        return (self.slab.seat(("entries", source), [c.entries[source] for c in caches], self.slab_rows)
                and self.slab.seat(("keys", source), [c.keys[source] for c in caches], self.slab_rows))

    def _long_range_rows(self, source: int, layout: Layout, seated: bool) -> LongRangeRows:
        """KV ``source``'s rows for this step: the slab's buffers where they are seated
        there, else every sequence's rows padded."""
        caches = [s.cache for s in self.segments]
        if not seated:
            entries = padded_rows([c.entries[source].values for c in caches])
            keys = padded_rows([c.keys[source].values for c in caches])
            return LongRangeRows(entries, keys, layout.owner, keys)
        entries, keys = self.slab.table(("entries", source)), self.slab.table(("keys", source))
        width = max(c.keys[source].n for c in caches)
        slots = torch.tensor(self.slab_rows, device=keys.device)
        in_order = self.slab_rows == list(range(len(caches)))
        scored = keys[: len(caches), :width] if in_order else keys[:, :width].index_select(0, slots)
        return LongRangeRows(entries, keys, layout.each(slots), scored)

    def _batch_pick(self, block: Block, rows: LongRangeRows, x: torch.Tensor, q_residual: torch.Tensor,
                    cos: torch.Tensor, sin: torch.Tensor, index_query: tuple[torch.Tensor, torch.Tensor] | None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`_pick` over the batch (``picks["layout"]``) and its source's ``rows``;
        returns (entry indices [N, k], valid [N, k]). ``index_query``: the indexer's
        per-token half (:meth:`~model.attention.Indexer.query`) when the compiled step
        computed it."""
        plan, config, indexer = block.plan, self.model.config, block.attn.indexer
        state, positions = self.picks, self.positions
        layout = state["layout"]
        k = min(config.index_topk, rows.scored.shape[1])
        if k == 0:
            empty = torch.zeros(len(positions), 0, dtype=torch.long, device=x.device)
            return empty, empty.bool()
        q, weights = index_query or indexer.query(x[None], q_residual, cos, sin)  # [1, N, H, d], [1, N, H]
        n_visible = (positions + 1) // plan.compress_ratio
        if self._compiled_pick(plan, layout, rows.scored.shape[1]):
            if plan.candidate_source is not None:
                return self.compiled.repick(plan.index, q, weights, rows.keys, rows.row, *state["candidates"],
                                            n_visible, k)
            if not plan.is_candidate_source:
                return self.compiled.pick(plan.index, layout.padded(q[0]), layout.padded(weights[0]), rows.scored,
                                          layout.padded(n_visible), k)
            # Keys padded to whole candidate blocks (the padding is never visible), so the
            # compiled code has no width-dependent branch; the pool is then clamped as the
            # eager one is (candidate_entries).
            width, block = rows.scored.shape[1], config.candidate_block_size
            index, valid, entries, listed = self.compiled.pick(
                plan.index, layout.padded(q[0]), layout.padded(weights[0]),
                F.pad(rows.scored, (0, 0, 0, -width % block)), layout.padded(n_visible), k,
                config.candidate_topk_blocks, block)
            state["candidates"] = (entries.clamp_max(width - 1), listed & (entries < width))
            return index, valid
        if plan.candidate_source is not None:  # a Reindex layer: each token scores its own candidates
            pool = state["candidates"]
            scores = indexer.score(q, weights, layout.rows_at(rows.keys, pool[0], rows.row)[None])[0]
        else:  # every token of a sequence against its keys: laid out [b, n]
            scores = layout.tokens(indexer.score(layout.padded(q[0]), layout.padded(weights[0]), rows.scored))
            pool = None
        chosen = select_entries(scores, n_visible, k, plan, config, pool, candidate_entries)
        if chosen.pool is not None:
            state["candidates"] = chosen.pool
        return chosen.index, chosen.valid

    def _compiled_pick(self, plan, layout: Layout, width: int) -> bool:
        """Whether a batched pick runs compiled (:meth:`~model.runtime.compiled.CompiledBlocks.pick`):
        in a compiled step, every sequence feeding as many tokens, over at least
        ``index_topk`` keys (``width``), and a candidate source's and a Reindex layer's
        over at least a whole pool (fewer keys list a shorter pool)."""
        config = self.model.config
        least = config.index_topk
        if plan.is_candidate_source or plan.candidate_source is not None:  # a whole pool (the packages' shape)
            least = max(least, config.candidate_pool)
        return (self.compiled is not None and self.compiled.handles(len(self.positions)) and layout.slots is None
                and width >= least)

    def _sequence_keys(self, block: Block, windows: list[Window], x: torch.Tensor, q_residual: torch.Tensor,
                       cos: torch.Tensor, sin: torch.Tensor, index_query: tuple[torch.Tensor, torch.Tensor] | None
                       ) -> LayerKeys:
        """Every token's keys, sequence by sequence (each sequence's new window rows
        already in its window); each part is padded to the widest sequence's with masked
        keys. ``index_query`` as in :meth:`_batch_pick`."""
        keys = []
        for segment, window, segment_picks in zip(self.segments, windows, self.picks):
            part = slice(segment.lo, segment.hi)
            keys.append(self._keys(block, segment, window, x, q_residual[:, part], cos[:, part], sin[:, part],
                                   segment_picks, None if index_query is None else tuple(t[:, part] for t in index_query)))
        if len(keys) == 1:
            return keys[0]
        return LayerKeys(*(None if parts[0] is None else padded_cat(parts) for parts in zip(*keys)))

    def _keys(self, block: Block, segment: Segment, window: Window, x: torch.Tensor, q_residual: torch.Tensor,
              cos: torch.Tensor, sin: torch.Tensor, picks: dict,
              index_query: tuple[torch.Tensor, torch.Tensor] | None) -> LayerKeys:
        """One sequence's keys at one layer, its new rows already in its ``window``: for
        its n tokens, the window places of each query [n, W, hd] and, past a Window
        layer, the long-range entries its indexer picks [n, k, hd]. ``x`` is the whole
        batch's [N, D]; the rest this sequence's."""
        plan, cache, positions = block.plan, segment.cache, segment.positions
        # Window places of each query: positions p - W + 1 .. p, where cached.
        offsets = torch.arange(self.window, device=x.device) - (self.window - 1)
        win_index = positions[:, None] + offsets[None] - window.start  # [n, W]
        window_keys = LayerKeys(rows_at(window.rows.values, win_index.clamp_min(0)), win_index >= 0)
        if plan.mode is AttentionMode.WINDOW:
            return window_keys
        if plan.mode is AttentionMode.FULL:
            pool_groups(self.model, self.compiled, block, [segment], x)
        if plan.runs_indexer:
            picks[plan.index] = self._pick(block, cache, x[segment.lo : segment.hi], q_residual, cos, sin, positions,
                                           picks, index_query)
        index, valid = picks[plan.index_source]
        return window_keys._replace(picked=rows_at(cache.entries[plan.kv_source].values, index), picked_valid=valid)

    def _pick(self, block: Block, cache, x, q_residual, cos, sin, positions, picks,
              index_query: tuple[torch.Tensor, torch.Tensor] | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The indexer of one layer over one sequence: (entry indices [n, k], valid [n, k]).

        Queries are scored in chunks, so prefill never holds an [n, heads, T] tensor.
        The candidate source lists its pool in ``picks``; a Reindex layer gathers and
        scores only those candidates. ``index_query``: the indexer's per-token half
        for these tokens, when the compiled step computed it.
        """
        plan, config = block.plan, self.model.config
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
                scores = block.attn.indexer.score(*query, rows_at(keys, pool[0])[None])[0]  # [c, P]
            chosen = select_entries(scores, n_visible[lo:hi], k, plan, config, pool, candidate_entries)
            indices.append(chosen.index)
            valid.append(chosen.valid)
            if chosen.pool is not None:
                pools.append(chosen.pool)
        if pools:
            picks["candidates"] = tuple(torch.cat(parts) for parts in zip(*pools))
        return torch.cat(indices), torch.cat(valid)

