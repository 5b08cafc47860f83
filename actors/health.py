"""Is every node's store answering? (The router's ``/health`` asks.)"""

from __future__ import annotations

import asyncio
import time

from ray.exceptions import ActorUnavailableError, RayError

from actors.store import store_actors


async def store_problems(namespace: str = "v41", timeout_s: float = 2.0) -> list[str]:
    """One line per store actor on a live node that does not answer within
    ``timeout_s`` (restarting, hung, or dead); nodes without a store are not asked.

    An "unavailable" answer is asked again until the timeout: a process whose handle
    still points at a store's previous incarnation gets one such error on its first
    call after Ray restarted the store, and a live store is not a problem."""
    handles = await asyncio.to_thread(store_actors, namespace)

    async def ask(node_id: str, handle) -> str | None:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                left = max(0.0, deadline - time.monotonic())
                await asyncio.wait_for(asyncio.wrap_future(handle.pid.remote().future()), left)
                return None
            except TimeoutError:
                return f"store on node {node_id[:12]}: not answering within {timeout_s:g} s (restarting?)"
            except ActorUnavailableError:
                if time.monotonic() + 0.1 < deadline:
                    await asyncio.sleep(0.1)
                    continue
                return f"store on node {node_id[:12]}: unavailable for {timeout_s:g} s (restarting?)"
            except RayError as error:
                return f"store on node {node_id[:12]}: {type(error).__name__}"

    answers = await asyncio.gather(*(ask(node_id, handle) for node_id, handle in handles.items()))
    return [answer for answer in answers if answer is not None]
