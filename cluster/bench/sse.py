"""Reading an OpenAI server-sent event stream (an aiohttp response), for the benches."""

from __future__ import annotations

import json


async def sse_chunks(response):
    """The JSON chunks of the stream, in order (``[DONE]`` and blank lines left out)."""
    async for raw in response.content:
        line = raw.decode().strip()
        if line.startswith("data: ") and line != "data: [DONE]":
            yield json.loads(line[6:])
