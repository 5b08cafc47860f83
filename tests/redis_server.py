"""A real redis-server for tests: started on a free port, stopped at teardown.

Use it with ``from tests.redis_server import redis_server`` in a test module. The
fixture yields a ``storage.redis_server.RedisServer``: ``.url`` to connect (it carries
the server's random password: a client without it is refused), ``.kill()`` to crash it
and ``.start()`` to bring it back, empty, on the same port with the same password.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from storage.redis_server import RedisServer


@pytest.fixture
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(data_dir=tmp_path_factory.mktemp("redis"))
    server.start()
    try:
        yield server
    finally:
        server.close()
        assert not server.running
