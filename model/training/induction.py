"""The induction curriculum: random-token rows ``<bos> x x`` that teach a model to copy.

A model trained on code alone never learns to copy a token it has not seen in that
context (an *induction head*: attend to the token after the earlier occurrence of the
current one), so a tool call cannot copy an argument out of the question. Random tokens
leave nothing else to learn, and a small alphabet first (``INDUCTION_ALPHABETS``, widened
when every probe of :meth:`Repeats.accuracy` passes ``INDUCTION_PASS``) gives the heads a
signal before the full vocabulary does. ``v41 train-small`` runs the curriculum;
``v41 train-tools`` keeps its last stage in the mix so that the copying stays.
"""

from __future__ import annotations

import torch

from model import training
from model.training.batches import engram_ids
from model.training.corpus import BOS, SPECIAL_TOKENS

# Alphabets the repeated tokens are drawn from, widened when the model repeats
# INDUCTION_PASS of the tokens at every probe length (None: every ordinary token);
# repeat lengths drawn per step.
INDUCTION_ALPHABETS = (64, 256, 1024, None)
INDUCTION_LENGTHS = (6, 48)
INDUCTION_PROBES = (10, 20, 40)
INDUCTION_PASS = 0.8


class Repeats:
    """Rows ``<bos> x x`` of ``L`` distinct random tokens ``x`` repeated, the loss on the
    second copy after its first token (the first copy and its first token are
    unpredictable). Distinct, so that the token after the one earlier occurrence of the
    current token is always right: with repeats in ``x`` (64 tokens, L = 40) plain
    induction is ambiguous and the task asks for more than the heads."""

    def __init__(self, vocab_size: int, stage: int = 0):
        self.vocab_size, self.stage = vocab_size, stage

    @property
    def final(self) -> bool:
        return self.stage == len(INDUCTION_ALPHABETS) - 1

    def alphabet(self, stage: int | None = None) -> int:
        """How many token ids (from the first ordinary one) rows draw from."""
        size = INDUCTION_ALPHABETS[self.stage if stage is None else stage]
        ordinary = self.vocab_size - len(SPECIAL_TOKENS)
        return ordinary if size is None else min(size, ordinary)

    def sample(self, rows: int, generator: torch.Generator, length: int | None = None,
               stage: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids [rows, 2L + 1], loss weights [rows, 2L + 1]); ``L`` drawn from
        ``INDUCTION_LENGTHS`` unless given."""
        if length is None:
            length = int(torch.randint(INDUCTION_LENGTHS[0], INDUCTION_LENGTHS[1] + 1, (), generator=generator))
        alphabet = self.alphabet(stage)
        if length <= alphabet:  # distinct tokens: each has one earlier occurrence to copy from
            x = torch.rand((rows, alphabet), generator=generator).argsort(dim=1)[:, :length]
        else:
            x = torch.randint(0, alphabet, (rows, length), generator=generator)
        x = x + len(SPECIAL_TOKENS)
        ids = torch.cat([torch.full((rows, 1), BOS), x, x], dim=1)
        weights = torch.zeros(ids.shape)
        weights[:, length + 2 :] = 1.0
        return ids, weights

    def train_loss(self, model, hasher, rows: int, generator: torch.Generator, quantize_weights: bool = True):
        """(the masked loss of ``rows`` fresh rows, their training forward's output)."""
        ids, weights = self.sample(rows, generator)
        result = training.train_forward(model, ids, engram_ids(hasher, ids), quantize_weights=quantize_weights)
        return training.masked_lm_loss(result.logits, ids, weights), result

    def accuracy(self, model, hasher, seed: int, stage: int | None = None, rows: int = 16,
                 reference: bool = False, lengths: tuple[int, ...] = INDUCTION_PROBES) -> list[float]:
        """Greedy next-token accuracy on the weighted positions, per probe length (of
        ``INDUCTION_PROBES`` unless given; its own generator: probing leaves the training
        RNG alone)."""
        generator = torch.Generator().manual_seed(seed)
        was_training = model.training
        model.eval()
        out = []
        with torch.no_grad():
            for length in lengths:
                ids, weights = self.sample(rows, generator, length, stage)
                engram = engram_ids(hasher, ids)
                logits = model(ids, engram) if reference else training.train_forward(model, ids, engram).logits
                right = (logits[:, :-1].argmax(-1) == ids[:, 1:]).float() * weights[:, 1:]
                out.append(round(float(right.sum() / weights[:, 1:].sum()), 3))
        model.train(was_training)
        return out

    def update(self, accuracies: list[float]) -> bool:
        """Widen the alphabet if every probe passed; True when it did."""
        if self.final or min(accuracies) < INDUCTION_PASS:
            return False
        self.stage += 1
        return True
