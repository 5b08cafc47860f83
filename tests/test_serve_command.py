"""`v41 serve`: starts Redis, Ray and the app on the shipped small model (with DSpark
speculation in the decoder pool), serves, and stops all of it on SIGINT."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from storage.redis_server import free_port

pytestmark = pytest.mark.slow

SMALL = Path(__file__).resolve().parent.parent / "configs" / "small"


def _plain_greedy(prompt: list[int], n: int) -> str:
    """The same request in-process, without speculation (bounded replay, as served)."""
    from model.runtime.engine import Engine
    from model.loader import load_hasher, load_model, load_tokenizer

    config, model = load_model(SMALL)
    engine = Engine(model, load_hasher(SMALL, config))
    cache = engine.new_cache()
    tokens = [int(engine.replay(cache, engine.prefill(cache, prompt)).argmax())]
    while len(tokens) < n:
        tokens.append(int(engine.decode([(cache, [tokens[-1]])])[0][-1].argmax()))
    return load_tokenizer(SMALL).decode(tokens)


def test_serve_command_starts_serves_and_stops_everything(tmp_path):
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "cluster.cli", "serve", "--port", str(port), "--cache-dir", str(tmp_path / "cache")],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        deadline = time.time() + 240
        line = ""
        while "serving" not in line:
            assert time.time() < deadline and process.poll() is None, "v41 serve did not come up"
            line = process.stdout.readline()
        assert f"http://127.0.0.1:{port}/v1" in line
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=30) as response:
            assert json.loads(response.read())["status"] == "ok"
        # A greedy completion through the speculative decoder equals plain decoding.
        prompt = list(range(300, 360))
        body = json.dumps({"model": "deepseek-v4.1-small", "prompt": prompt, "max_tokens": 24,
                           "temperature": 0}).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                         headers={"content-type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as response:
            answer = json.loads(response.read())
        assert answer["usage"]["completion_tokens"] == 24
        assert answer["choices"][0]["text"] == _plain_greedy(prompt, 24)
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=90) == 0
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    # Everything it started is gone: no process of its session is left.
    leftover = subprocess.run(["pgrep", "-s", str(process.pid)], capture_output=True, text=True).stdout.split()
    assert leftover == []
