"""The app's health: which parts the cache and the pools depend on are down.

``/health`` and Serve's periodic check of the router read :meth:`PartsHealth.problems`:
one line per problem (Redis not answering, a node's store down, a pool without a replica
running), kept for a second; the parts' gauges are refreshed with every check.
"""

from __future__ import annotations

import asyncio
import time

NO_REPLICA = "pool: no replica running"  # a /health problem line that makes it 503


class PartsHealth:
    """The problems of the app's parts. ``pools``: (name, Serve handle) of the prefill
    and decoder pools; ``link``: the Redis link (None without Redis); ``lost``: lines
    on hosts lost or cut off (:meth:`cluster.serving.liveness.NodeLiveness.problems`)."""

    def __init__(self, pools: tuple[tuple[str, object], ...], link, metrics, lost=list):
        self.pools, self.link, self.metrics, self.lost = pools, link, metrics, lost
        self._last: tuple[float, list[str]] | None = None
        self.pools_ready = False  # every pool has had a replica running (then "starting" is over)

    def report(self, problems: list[str]) -> tuple[int, dict]:
        """(HTTP status, body) of ``/health``: ``{"status": "ok"}``; ``"degraded"`` with the
        problems while a part the cache depends on (Redis, a node's store) is down (it
        serves either way); ``"starting"`` (HTTP 503) while the prefill or decoder pool
        has no replica running yet (a first start with ``compiled_step`` builds the
        step's packages for minutes: requests sent then wait for it), and 503
        ``"degraded"`` while one has none running later."""
        if any(NO_REPLICA in problem for problem in problems):
            return 503, {"status": "degraded" if self.pools_ready else "starting", "problems": problems}
        return 200, {"status": "degraded" if problems else "ok", "problems": problems}

    async def problems(self) -> list[str]:
        now = time.monotonic()
        # A second-old answer serves, unless it had a pool without a replica: a starting
        # pool's first replica must show at once (`v41 serve` says ready as it runs).
        if self._last is not None and now - self._last[0] < 1.0 and self.pools_ready:
            return self._last[1]
        from actors.health import store_problems

        checks = [store_problems(), asyncio.to_thread(self._pool_problems)]
        if self.link is not None:
            checks.append(asyncio.to_thread(self._redis_problem))
        found = [problem for problems in await asyncio.gather(*checks) for problem in problems] + self.lost()
        self._last = (time.monotonic(), found)
        self.pools_ready |= not any(NO_REPLICA in problem for problem in found)
        self.metrics.parts(redis_up=not any(p.startswith("redis") for p in found),
                           stores_down=sum(p.startswith("store") for p in found))
        return found

    def _pool_problems(self) -> list[str]:
        """One line per pool (prefill, decoder) without a replica running, from Serve's
        controller; none when the controller does not answer (not the pools' problem)."""
        from ray import serve

        try:
            deployments = serve.status().applications[self.pools[0][1].app_name].deployments
        except Exception:  # noqa: BLE001 (a busy or restarting controller)
            return []
        problems = []
        for pool, handle in self.pools:
            overview = deployments.get(handle.deployment_name)
            if overview is None:
                continue
            states = {str(getattr(state, "value", state)): n for state, n in overview.replica_states.items()}
            if not states.get("RUNNING"):
                detail = ", ".join(f"{n} {state.lower()}" for state, n in sorted(states.items()) if n) or "none"
                problems.append(f"{pool} {NO_REPLICA} ({detail}); requests wait for it")
        return problems

    def _redis_problem(self) -> list[str]:
        try:
            self.link.client.ping()
            return []
        except Exception as error:  # noqa: BLE001 (any failure means the same)
            return [f"redis: not answering ({type(error).__name__}); serving without the cluster index"]
