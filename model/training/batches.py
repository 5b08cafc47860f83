"""Training rows of the corpus: stream windows, chat-formatted completions, copy chats,
the bounded replays they are trained under, and padding of ragged rows.

The pretraining mix (``v41 train-small``) and the replay of it that keeps a fine-tune
from forgetting (``v41 train-tools``) draw their rows here, from a torch generator, so
that a run with the same seed sees the same rows.
"""

from __future__ import annotations

import torch

from model.training import ReplayStarts
from model.training.corpus import ASSISTANT, BOS, EOS, THINK, THINK_END, USER


class Batches:
    """Training sequences: random windows of the token stream (``<bos> file <eos>`` per
    file), and with probability ``chat`` a chat-formatted completion (user: a few lines
    of a file; assistant: the lines that follow), so that ``v41 generate --prompt``
    continues code; and with probability ``copy`` a copy chat (user: ``Repeat:`` and a
    few lines; assistant: the same lines), which teaches retrieval from 5 to ~120 tokens
    back, past the sliding window (the tool fine-tune uses it: a call copies its
    arguments from the question)."""

    def __init__(self, stream, files: list[str], tokenizer, seq_len: int, chat: float = 0.1, copy: float = 0.0):
        self.stream, self.files, self.tokenizer = stream, files, tokenizer
        self.seq_len, self.chat, self.copy = seq_len, chat, copy

    def sample(self, batch: int, generator: torch.Generator) -> torch.Tensor:
        """[batch, seq_len + 1] token ids."""
        rows = []
        for _ in range(batch):
            row = None
            u = float(torch.rand((), generator=generator))
            if u < self.chat:
                row = self._chat_row(generator)
            elif u < self.chat + self.copy:
                row = self._copy_row(generator)
            if row is None:
                start = int(torch.randint(0, len(self.stream) - self.seq_len - 1, (), generator=generator))
                row = self.stream[start : start + self.seq_len + 1]
            rows.append(torch.as_tensor(row, dtype=torch.long))
        return torch.stack(rows)

    def _chat_row(self, generator):
        text = self.files[int(torch.randint(0, len(self.files), (), generator=generator))]
        lines = text.split("\n")
        if len(lines) < 8:
            return None
        i = int(torch.randint(0, len(lines) - 4, (), generator=generator))
        k = int(torch.randint(1, 5, (), generator=generator))
        user = "\n".join(lines[i : i + k])
        rest = "\n" + "\n".join(lines[i + k :])
        user_ids = self.tokenizer.encode(user, add_special_tokens=False).ids[: self.seq_len // 2]
        head = [BOS, USER, *user_ids, ASSISTANT, THINK, THINK_END]
        body = self.tokenizer.encode(rest, add_special_tokens=False).ids + [EOS]
        row = (head + body)[: self.seq_len + 1]
        return row if len(row) == self.seq_len + 1 else None

    def _copy_row(self, generator):
        """``<bos><User>Repeat: lines<Assistant><think></think> lines<eos>`` then the
        stream, to the row length. The copied text: 1-3 lines, cut at 4-120 tokens."""
        text = self.files[int(torch.randint(0, len(self.files), (), generator=generator))]
        lines = [line for line in text.split("\n") if line.strip()]
        if len(lines) < 4:
            return None
        i = int(torch.randint(0, len(lines) - 3, (), generator=generator))
        k = int(torch.randint(1, 4, (), generator=generator))
        cap = int(torch.randint(4, 121, (), generator=generator))
        copied = "\n".join(lines[i : i + k]).strip()
        shown = self.tokenizer.encode(" " + copied, add_special_tokens=False).ids[:cap]
        # Half the time the copy drops the leading space (" zip" -> "zip"), as a tool
        # call's argument does after '">'.
        spaced = float(torch.rand((), generator=generator)) < 0.5
        said = self.tokenizer.encode(self.tokenizer.decode(shown)[0 if spaced else 1 :], add_special_tokens=False).ids
        row = [BOS, USER, *self.tokenizer.encode("Repeat:", add_special_tokens=False).ids, *shown,
               ASSISTANT, THINK, THINK_END, *said, EOS]
        if len(row) > self.seq_len + 1:
            return None
        start = int(torch.randint(0, len(self.stream) - self.seq_len - 1, (), generator=generator))
        return row + self.stream[start : start + self.seq_len + 1 - len(row)].tolist()


def replay_starts(batch: int, seq_len: int, window: int, generator: torch.Generator, p_decoder: float = 0.25,
                  p_encoder: float = 0.1) -> ReplayStarts:
    """Per sequence: no replay, a decoder replay, or an encoder (+ decoder) replay from a
    random start ``s`` in ``[window, seq_len - window // 2]``."""
    starts = ReplayStarts.none(batch, seq_len)
    for b in range(batch):
        u = float(torch.rand((), generator=generator))
        s = int(torch.randint(window, max(window + 1, seq_len - window // 2), (), generator=generator))
        if u < p_encoder:
            starts.encoder[b] = starts.decoder[b] = s
        elif u < p_encoder + p_decoder:
            starts.decoder[b] = s
    return starts


def engram_ids(hasher, ids: torch.Tensor) -> torch.Tensor | None:
    """The Engram rows of ``ids`` (None for a model without Engram)."""
    return hasher.hash_ids(ids)[0] if hasher is not None else None


def pad_rows(rows: list[tuple[list[int], list[float]]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, per-position loss weights) of ragged rows, padded to the longest."""
    length = max(len(ids) for ids, _ in rows)
    ids = torch.full((len(rows), length), pad, dtype=torch.long)
    weights = torch.zeros((len(rows), length))
    for i, (row, row_weights) in enumerate(rows):
        ids[i, : len(row)] = torch.as_tensor(row)
        weights[i, : len(row)] = torch.as_tensor(row_weights)
    return ids, weights
