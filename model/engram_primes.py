"""The numbers of the Engram hash: bucket primes and look-back multipliers.

Both are pure functions of the config (:class:`model.engram.EngramLayout` builds
from them), and both must be exactly the release's: a different prime search or
multiplier draw addresses every row of a trained table wrongly.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

_MR_BASES = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37)


def _is_prime(n: int) -> bool:
    """Deterministic Miller-Rabin; exact for every n < 3.3e24 (these bases)."""
    if n < 2:
        return False
    for p in _MR_BASES:
        if n % p == 0:
            return n == p
    d, r = n - 1, 0
    while d % 2 == 0:
        d //= 2
        r += 1
    for a in _MR_BASES:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(r - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def find_primes(
    vocab_size: int, n_layers: int, max_ngram_size: int, n_heads: int
) -> tuple[tuple[tuple[int, ...], ...], ...]:
    """Bucket primes as ``[layer][ngram_size - 2][head]``.

    For every layer, every n-gram size and every head, the next prime is searched
    upward, strictly above ``vocab_size - 1`` (the search restarts there for each
    n-gram size) and skipping every prime already taken anywhere in the layout.
    """
    taken: set[int] = set()
    layers = []
    for _ in range(n_layers):
        per_ngram = []
        for _ in range(max_ngram_size - 1):
            heads, candidate = [], vocab_size - 1
            for _ in range(n_heads):
                candidate += 1
                while candidate in taken or not _is_prime(candidate):
                    candidate += 1
                taken.add(candidate)
                heads.append(candidate)
            per_ngram.append(tuple(heads))
        layers.append(tuple(per_ngram))
    return tuple(layers)


def hash_multipliers(
    layer_ids: Sequence[int], max_ngram_size: int, compressed_vocab_size: int
) -> tuple[tuple[int, ...], ...]:
    """``[layer][k]``: the odd multiplier of the k-th look-back (k = 0 is the current
    token).  Drawn from ``numpy.random.default_rng(10007 * layer_id)`` below
    ``bound = (int64 max // compressed_vocab_size) // 2`` and mapped to ``2 v + 1``,
    so ``compressed id * multiplier`` can never overflow int64."""
    bound = multiplier_bound(compressed_vocab_size)
    rows = []
    for layer_id in layer_ids:
        rng = np.random.default_rng(10007 * int(layer_id))
        draws = rng.integers(0, bound, size=(max_ngram_size,), dtype=np.int64)
        rows.append(tuple(int(v) * 2 + 1 for v in draws))
    return tuple(rows)


def multiplier_bound(compressed_vocab_size: int) -> int:
    """Exclusive upper bound of the raw draws behind :func:`hash_multipliers`."""
    return max(1, (np.iinfo(np.int64).max // compressed_vocab_size) // 2)
