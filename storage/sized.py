"""The payload of the retention lab's scale mode: a size and nothing else.

A module of its own, always plain Python: code compiled by mypyc (``cluster.lab.native``)
cannot subclass ``bytes``, and it reads a ``bytes`` length past a subclass's ``__len__``
(``storage.tier.payload_size`` asks the object instead).
"""

from __future__ import annotations


class SizedPayload(bytes):
    """A payload that is only its size: empty bytes whose ``len`` is the size it stands
    for. What the retention lab's scale mode stores (``SizedSsdTier``; ``RamTier``
    holds it as it is)."""

    size: int

    def __new__(cls, size: int) -> SizedPayload:
        payload = super().__new__(cls)
        payload.size = size
        return payload

    def __len__(self) -> int:
        return self.size

    def __repr__(self) -> str:
        return f"SizedPayload({self.size})"
