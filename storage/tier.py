"""The interface every storage tier implements.

A tier holds verified byte payloads by ``ObjectKey``. Its contract is the same
whatever the medium: reads return the exact bytes that were put or None, never
wrong bytes and never an exception for missing, expired, torn or corrupt data;
writes never fail a request (a tier that cannot make room drops the write and
counts it). When a tier loses an object on its own (eviction, expiry, corruption,
garbage collection) it calls its ``on_drop`` callback, which the store uses to keep
the cluster-wide location index true.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence, Sized

from storage.keys import ObjectKey
from storage.policy import TierName

OnDrop = Callable[[ObjectKey], None]


def payload_size(payload: Sized) -> int:
    """The size ``payload`` stands for: its ``len``, asked of the object. (Typed ``Sized``,
    not ``bytes``, on purpose: code compiled by mypyc reads the length of a ``bytes``
    straight from the object, past the ``__len__`` of a subclass such as the retention
    lab's ``SizedPayload``.)"""
    return len(payload)


class Tier(abc.ABC):
    """One place objects live (host RAM, local SSD, Redis)."""

    name: TierName

    @abc.abstractmethod
    def contains(self, key: ObjectKey) -> bool:
        """Whether ``get`` would probably hit: an index look-up, no payload I/O, no verification."""

    @abc.abstractmethod
    def get(self, key: ObjectKey) -> bytes | None:
        """The verified payload, or None if missing, expired or corrupt (then removed).

        A hit counts as a use: it restarts the object's retention clock.
        """

    def get_many(self, keys: Sequence[ObjectKey]) -> list[bytes | None]:
        """``get`` for each key, in order; remote tiers override it to batch round trips."""
        return [self.get(key) for key in keys]

    @abc.abstractmethod
    def put(self, key: ObjectKey, payload: bytes) -> bool:
        """Store ``payload`` under ``key``; True if stored. Never raises for lack of space:
        it evicts by policy, and drops the write (returns False) if that is not enough.
        Putting a key already present keeps one copy and counts as a use."""

    @abc.abstractmethod
    def remove(self, key: ObjectKey) -> bool:
        """Delete the object; True if it was there. Removing a missing key is safe."""

    @abc.abstractmethod
    def gc(self) -> None:
        """Remove every object whose retention has run out, and any debris of failed writes."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release files and connections; the tier is unusable after."""


class LocalTier(Tier):
    """A tier on this node, whose contents the node republishes to the location index."""

    @abc.abstractmethod
    def entries(self) -> list[tuple[ObjectKey, float]]:
        """Every object held now, with the time its retention runs out."""

    @abc.abstractmethod
    def usage(self) -> tuple[int, int]:
        """(objects, bytes) held now."""
