"""The app most end-to-end modules test: the golden model on the session's shared Serve
runtime (tests/serve_harness.py), exact replay, deployed once per module. A module that
needs other settings defines its own ``app``."""

from __future__ import annotations

import pytest

from tests.serve_harness import sdk_client


@pytest.fixture(scope="module")
def app(serve_runtime, tmp_path_factory):
    """The app's URL."""
    # (answers of up to 300 tokens: a forced call of random weights may run that long)
    with serve_runtime.app(tmp_path_factory.mktemp("serve"), exact_replay=True, max_answer_tokens=300) as (url, _redis):
        yield url


@pytest.fixture(scope="module")
def client(app):
    """An OpenAI SDK client of ``app``."""
    return sdk_client(app)
