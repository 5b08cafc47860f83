"""The Conversations API's routes (``/v1/conversations``): each reads or changes a
conversation's record (:mod:`cluster.serving.records`) by the rules of
:mod:`cluster.serving.conversations_api`, and returns the body to answer with (or
raises an :class:`~cluster.serving.validation.ApiError`)."""

from __future__ import annotations

from collections.abc import Callable

from cluster.serving import conversations_api as api
from cluster.serving.records import Records
from cluster.serving.validation import ApiError


def _no_include(include: list[str] | None) -> None:
    if include:
        raise ApiError(400, "include: no extra item fields are kept here (leave it out)", "include")


class Conversations:
    """The conversations of one router's ``records``."""

    def __init__(self, records: Records):
        self.records = records

    async def get(self, cid: str, param: str | None = None) -> dict:
        """A conversation's record; a 404 (or, for ``param``, a 400 naming it) if there is none."""
        found = await self.records.conversation(cid)
        if found is None:
            raise api.not_found(cid, param)
        return found

    async def change(self, cid: str, change: Callable[[dict], dict]) -> dict:
        """Apply ``change`` (a record to its next version) to a conversation; a 404 if there is none."""
        record = await self.records.change_conversation(cid, change)
        if record is None:
            raise api.not_found(cid)
        return record

    async def create(self, data: dict) -> dict:
        record = api.created(data)
        await self.records.write_conversation(record)
        return record["conversation"]

    async def retrieve(self, cid: str) -> dict:
        return (await self.get(cid))["conversation"]

    async def update(self, cid: str, data: dict) -> dict:
        return (await self.change(cid, lambda record: api.updated(record, data)))["conversation"]

    async def delete(self, cid: str) -> dict:
        if not await self.records.forget_conversation(cid):
            raise api.not_found(cid)
        return api.deleted(cid)

    async def add_items(self, cid: str, data: dict, include: list[str] | None) -> dict:
        _no_include(include)
        items = api.new_items(data)
        await self.change(cid, lambda record: api.with_items(record, items))
        return api.added(items)

    async def items(self, cid: str, after: str | None, limit: int, order: str, include: list[str] | None) -> dict:
        _no_include(include)
        return api.page(await self.get(cid), after, limit, order)

    async def item(self, cid: str, item_id: str, include: list[str] | None) -> dict:
        _no_include(include)
        return api.item(await self.get(cid), item_id)

    async def delete_item(self, cid: str, item_id: str) -> dict:
        return (await self.change(cid, lambda record: api.without_item(record, item_id)))["conversation"]
