"""The router's stored records: Responses API responses and Conversations API conversations.

A record is JSON in the tiered store (:mod:`storage`), under a key made from its id
and its owner, the tenant that asks (:data:`cluster.serving.tenants.OWNER`; another
tenant's id names another key, so it reads as unknown): written to this node's store actor and
indexed in Redis, so any node's router finds it (its own store first, then the nodes
the index names).

- A response never changes once written. The router answers a next turn naming one it
  wrote lately from memory (:class:`RecentRecords`) and stores it
  while the client reads the answer; a delete waits for a pending store.
- A record names the cached objects of its conversation (``"cache"``: the chunks and
  window states its prompt and answer left in the store, but those of a prefix shared
  between tenants): deleting the record deletes them too, on every node that holds one.
- A conversation changes (items are added and deleted, its metadata replaced), so it is
  never read from memory. Every change is a new version: read the newest copy, change
  it, write it to this node's store, remove the older copies other nodes hold. Changes
  to one conversation take turns: a lock in this router, and one in Redis across
  routers (while Redis is up; without it, two nodes changing one conversation at the
  same instant keep the later write).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Sequence

from cluster.serving import conversations_api
from cluster.serving.response_items import encoded, read_record
from cluster.serving.tenants import OWNER
from cluster.serving.validation import ApiError
from storage.keys import Kind, ObjectKey, conversation_key, response_key

logger = logging.getLogger(__name__)

LOCK_S = 30.0  # a conversation's Redis lock expires after this (a router that died holding it)
LOCK_WAIT_S = 10.0  # a change waits this long for another router's, then is a 409


def with_cache(record: dict, keys: Sequence[ObjectKey]) -> dict:
    """``record`` naming ``keys`` too, among the cached objects of its conversation."""
    named = [*record.get("cache", ()), *([int(key.kind), key.hex] for key in keys)]
    return {**record, "cache": [list(pair) for pair in dict.fromkeys(tuple(pair) for pair in named)]}


def cache_names(record: dict) -> list[ObjectKey]:
    """The cached objects a record names (what is not a name is skipped: a record is data)."""
    names = []
    for pair in record.get("cache", ()) if isinstance(record.get("cache"), list) else ():
        try:
            names.append(ObjectKey.from_hex(Kind(pair[0]), pair[1]))
        except (TypeError, ValueError, IndexError, KeyError):
            continue
    return names


def _mine(record_id: str) -> tuple[str, str]:
    """A record's id in this router's memory: with its owner's name."""
    return OWNER.get(), record_id


class RecentRecords:
    """The records of the latest stored responses by (owner, id), up to ``capacity``
    bytes of their JSON, least recently used out first."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._records: OrderedDict[tuple[str, str], tuple[dict, int]] = OrderedDict()
        self._bytes = 0

    def put(self, rid: tuple[str, str], stored: dict, size: int) -> None:
        self.pop(rid)
        self._records[rid] = (stored, size)
        self._bytes += size
        while self._bytes > self.capacity:
            self._bytes -= self._records.popitem(last=False)[1][1]

    def get(self, rid: tuple[str, str]) -> dict | None:
        found = self._records.get(rid)
        if found is None:
            return None
        self._records.move_to_end(rid)
        return found[0]

    def pop(self, rid: tuple[str, str]) -> None:
        found = self._records.pop(rid, None)
        if found is not None:
            self._bytes -= found[1]

    def __len__(self) -> int:
        return len(self._records)


class Records:
    """Stored responses and conversations, read and written for one router.

    ``node_store``: this node's store actor (a :class:`~actors.store.RemoteStore`),
    made on first use (it raises :class:`ray.exceptions.RayError` while Ray cannot give
    it); ``peer_store``: another node's, by node id; ``here``: this node's id; ``index``,
    ``link``: the Redis location index and its link (None without Redis)."""

    def __init__(self, node_store: Callable, peer_store: Callable, here: Callable[[], str], index=None, link=None,
                 memory_bytes: int = 64 << 20, forgotten: Callable[[list[ObjectKey]], None] | None = None) -> None:
        """``forgotten(keys)``: told of the cached objects a deleted record took with it."""
        self._make_store, self._peer_store, self._here, self._forgotten = node_store, peer_store, here, forgotten
        self.index, self.link = index, link
        self._store = None
        # Responses this router wrote lately: a next turn naming one reads it here.
        self.kept = RecentRecords(memory_bytes)
        self._keeping: dict[str, asyncio.Task] = {}  # responses whose store has not answered yet
        self._turns: dict[str, list] = {}  # conversations being changed here

    async def node_store(self):
        """This node's store actor, or None while Ray cannot give it (then only the
        responses kept in memory are read, and no conversation is)."""
        if self._store is None:
            from ray.exceptions import RayError

            try:
                self._store = await asyncio.to_thread(self._make_store)
            except RayError as error:
                logger.warning("no store actor on this node for stored responses and conversations: %s", error)
        return self._store

    def _peers(self, key: ObjectKey) -> list:
        """The store actors of the other nodes the cluster index says hold ``key``."""
        return self._holders([key])

    def _holders(self, keys: Sequence[ObjectKey]) -> list:
        """The store actors of the other nodes the cluster index says hold any of ``keys``."""
        import ray

        from storage.index import SHARED_NODE

        located = self.index.locate(list(keys), time.time()) if self.index is not None else None
        nodes = {location.node_id for locations in (located or []) for location in locations} - {
            self._here(), SHARED_NODE}
        try:
            return [peer for peer in map(self._peer_store, sorted(nodes)) if peer is not None]
        except ray.exceptions.RayError:  # Ray in trouble: the stores it cannot reach hold nothing
            return []

    @staticmethod
    async def _get(store, key: ObjectKey) -> bytes | None:
        return None if store is None else (await asyncio.to_thread(store.get_many, [key]))[0]

    async def _remove_from(self, stores: list, key: ObjectKey) -> None:
        await asyncio.gather(*(asyncio.to_thread(store.remove, key) for store in stores if store is not None))

    # ------------------------------------------------------------------ responses
    async def response(self, rid: str) -> dict | None:
        """A stored response's record: the ones kept in memory, then this node's store,
        then the nodes the cluster index says hold it; None if none has it."""
        found = self.kept.get(_mine(rid))
        if found is not None:
            return found
        key = response_key(rid, OWNER.get())
        if (found := read_record(await self._get(await self.node_store(), key))) is not None:
            return found
        for peer in await asyncio.to_thread(self._peers, key):
            if (found := read_record(await self._get(peer, key))) is not None:
                return found
        return None

    async def keep_response(self, rid: str, stored: dict) -> None:
        """Keep a response's record in memory, and store and index it in this node's
        store while the client gets the answer."""
        payload, mine, key = encoded(stored), _mine(rid), response_key(rid, OWNER.get())
        self.kept.put(mine, stored, len(payload))
        store = await self.node_store()
        if store is None:
            return

        async def put() -> None:
            try:
                if not await store.put_now([(key, payload)]):
                    logger.warning("response %s: the store did not confirm it in time", rid)
            finally:
                self._keeping.pop(mine, None)

        self._keeping[mine] = asyncio.ensure_future(put())

    async def forget_response(self, rid: str, record: dict) -> None:
        """Delete a stored response (``record``, as read) from memory, this node's store
        and every other that holds it, and the cached objects it names."""
        key, mine = response_key(rid, OWNER.get()), _mine(rid)
        self.kept.pop(mine)
        if mine in self._keeping:  # (its store must not land after the delete)
            await self._keeping[mine]
        await self._remove_from([await self.node_store(), *await asyncio.to_thread(self._peers, key)], key)
        await self.forget_cache(cache_names(record))

    async def forget_cache(self, keys: list[ObjectKey]) -> None:
        """Delete cached objects from this node's store and every other the index says
        holds one of them (a conversation's chunks and window states: "forget me")."""
        if not keys:
            return
        stores = [await self.node_store(), *await asyncio.to_thread(self._holders, keys)]
        await asyncio.gather(*(asyncio.to_thread(store.remove_many, keys) for store in stores if store is not None))
        if self._forgotten is not None:
            self._forgotten(keys)

    # ------------------------------------------------------------------ conversations
    async def _copies(self, cid: str) -> tuple[dict | None, list]:
        """The newest copy of a conversation any node holds (None: there is none), and
        the store actors of the other nodes that hold one."""
        key = conversation_key(cid, OWNER.get())
        local, peers = await asyncio.gather(self._get(await self.node_store(), key),
                                            asyncio.to_thread(self._peers, key))
        copies = [local, *await asyncio.gather(*(self._get(peer, key) for peer in peers))]
        records = [record for payload in copies if (record := conversations_api.read(payload, cid)) is not None]
        return max(records, key=lambda record: record["version"], default=None), peers

    async def conversation(self, cid: str) -> dict | None:
        return (await self._copies(cid))[0]

    async def change_conversation(self, cid: str, change: Callable[[dict], dict]) -> dict | None:
        """Apply ``change`` (a record to its next version) to the newest version of a
        conversation, in its turn, and store the result; None if there is none."""
        async with self._turn(cid):
            record, peers = await self._copies(cid)
            if record is None:
                return None
            record = change(record)
            await self.write_conversation(record, peers)
        return record

    async def write_conversation(self, record: dict, stale: Sequence = ()) -> None:
        """Store a conversation's version in this node's store, then remove the older
        copies of the ``stale`` stores (other nodes'); a 503 if this node's store does
        not take it."""
        cid, store = record["conversation"]["id"], await self.node_store()
        key = conversation_key(cid, OWNER.get())
        # (put_now is False when Redis did not take the index entry: the store holds it all the same)
        if store is None or (not await store.put_now([(key, encoded(record))])
                             and (conversations_api.read(await self._get(store, key), cid) or {}).get("version")
                             != record["version"]):
            raise ApiError(503, "the conversation store is unavailable; retry shortly", kind="server_error",
                           code="store_unavailable")
        await self._remove_from(list(stale), key)

    async def forget_conversation(self, cid: str) -> bool:
        """Delete a conversation everywhere, in its turn, and the cached objects it names;
        False if there is none."""
        async with self._turn(cid):
            record, peers = await self._copies(cid)
            if record is not None:
                await self._remove_from([await self.node_store(), *peers], conversation_key(cid, OWNER.get()))
        if record is not None:
            await self.forget_cache(cache_names(record))
        return record is not None

    @contextlib.asynccontextmanager
    async def _turn(self, cid: str) -> AsyncIterator[None]:
        """Hold a conversation while it changes: this router's other changes to it wait,
        and (while Redis is up) other routers' too; a 409 after ``LOCK_WAIT_S``."""
        mine = _mine(cid)
        entry = self._turns.setdefault(mine, [asyncio.Lock(), 0])  # (the lock, requests using it)
        entry[1] += 1
        try:
            async with entry[0]:
                lock = self._redis_lock(cid)
                # (None: Redis is away, and this router's lock is the only one)
                held = None if lock is None else await asyncio.to_thread(self.link.run, lambda _: lock.acquire())
                if held is False:
                    raise ApiError(409, f"conversation {cid!r} is being changed by another request; retry",
                                   "conversation", code="conversation_locked")
                try:
                    yield
                finally:
                    if held:
                        await asyncio.to_thread(self.link.run, lambda _: lock.release())
        finally:
            entry[1] -= 1
            if not entry[1]:
                del self._turns[mine]

    def _redis_lock(self, cid: str):
        if self.link is None or not self.link.up:
            return None
        name = self.link.key("conversation-turn", conversation_key(cid, OWNER.get()).hex)
        return self.link.client.lock(name, timeout=LOCK_S, blocking_timeout=LOCK_WAIT_S, thread_local=False,
                                     sleep=0.01)
