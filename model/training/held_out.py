"""The held-out loss: fixed windows of the held-out token stream, the mean next-token
loss of a model over them, and that loss in bits per byte of text (comparable across
tokenizers)."""

from __future__ import annotations

import math

import torch

from model import training
from model.training.batches import engram_ids


def held_out_rows(held_stream, seq_len: int, n: int) -> torch.Tensor:
    """``n`` evenly spaced held-out windows of ``seq_len + 1`` tokens (fixed)."""
    n = max(1, min(n, (len(held_stream) - 1) // (seq_len + 1)))
    step = (len(held_stream) - seq_len - 1) // n
    return torch.stack([torch.as_tensor(held_stream[i * step : i * step + seq_len + 1]) for i in range(n)])


def evaluate(model, hasher, rows: torch.Tensor, batch: int, reference: bool = False) -> float:
    """Mean next-token loss over ``rows`` (the training forward with no replay, or the
    reference forward)."""
    total = 0.0
    with torch.no_grad():
        for lo in range(0, rows.shape[0], batch):
            ids = rows[lo : lo + batch]
            engram = engram_ids(hasher, ids)
            logits = model(ids, engram) if reference else training.train_forward(model, ids, engram).logits
            total += float(training.lm_loss(logits, ids)) * ids.shape[0]
    return total / rows.shape[0]


def bits_per_byte(loss: float, rows: torch.Tensor, tokenizer) -> float:
    """A mean next-token loss over ``rows`` (nats/token) as bits per byte of the
    predicted text (special tokens count no bytes)."""
    targets = rows[:, 1:]
    n_bytes = sum(len(tokenizer.decode(row, skip_special_tokens=True).encode("utf-8")) for row in targets.tolist())
    return loss * targets.numel() / max(1, n_bytes) / math.log(2)
