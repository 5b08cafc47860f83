"""`v41 serve`: starts Redis, Ray and the app on the shipped small model (with DSpark
speculation in the decoder pool), serves, and stops all of it on SIGINT."""

from __future__ import annotations

import contextlib
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
from tests.serve_harness import one_process_greedy

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

SMALL = Path(__file__).resolve().parents[2] / "configs" / "small"
GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "A"


@contextlib.contextmanager
def _serving(port: int, tmp_path, *extra: str):
    """`v41 serve` up (yields the line with its URL); on the way out SIGINT, a clean
    exit, and nothing of it left running."""
    process = _start(port, tmp_path, *extra)
    try:
        yield _wait_serving(process)
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=90) == 0
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    _nothing_left(process)


def test_serve_command_starts_serves_and_stops_everything(tmp_path):
    port = free_port()
    prompt = list(range(300, 360))
    body = json.dumps({"model": "deepseek-v4.1-small", "prompt": prompt, "max_tokens": 24,
                       "temperature": 0}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                     headers={"content-type": "application/json"})
    # (the eager step: the compiled one's first start on this model builds for minutes)
    with _serving(port, tmp_path, "--no-compiled-step") as line:
        assert f"http://127.0.0.1:{port}/v1 (eager step;" in line
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=30) as response:
            assert json.loads(response.read())["status"] == "ok"
        # A greedy completion through the speculative decoder equals plain decoding.
        with urllib.request.urlopen(request, timeout=120) as response:
            answer = json.loads(response.read())
        assert answer["usage"]["completion_tokens"] == 24
        assert answer["choices"][0]["text"] == one_process_greedy(SMALL, prompt, 24)
    # Started again at once on the same port (the old connections' sockets linger on it),
    # with no step named: the compiled one (the golden model's packages, which
    # tests/integration/test_compiled.py builds too: built once, by whichever is first).
    with _serving(port, tmp_path, "--model", str(GOLDEN)) as line:
        assert "(compiled step;" in line
        with urllib.request.urlopen(request, timeout=120) as response:
            assert json.loads(response.read())["usage"]["completion_tokens"] == 24


@pytest.mark.parametrize("started", ["gcs_server", "ServeController"], ids=["ray-starting", "app-deploying"])
def test_a_signal_while_starting_stops_everything_started(tmp_path, started):
    """SIGTERM as soon as the session has a ``started`` process: Ray's first (ray.init
    has begun), or Serve's controller (Ray is up, the app is deploying). ray.init takes
    seconds and begins by setting a SIGTERM handler that exits: a SIGTERM then unwound it
    half-way (exit code 15) and left the Ray processes it had started running; it now
    waits until Ray is up. Either way, a clean exit and nothing left."""
    process = _start(free_port(), tmp_path, "--no-compiled-step")
    try:
        deadline = time.time() + 120
        while not subprocess.run(["pgrep", "-s", str(process.pid), "-f", started], capture_output=True,
                                 check=False).stdout:
            assert time.time() < deadline and process.poll() is None
            time.sleep(0.05)
        process.send_signal(signal.SIGTERM)
        code = process.wait(timeout=90)
        output = process.stdout.read()
        assert code == 0 and "stopped while starting" in output, (code, output[-3000:])
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    _nothing_left(process)


def test_a_signal_while_the_compiled_step_builds_stops_everything_and_keeps_no_half_package(tmp_path, monkeypatch):
    """Ctrl-C during a first start's build (minutes): a clean stop, not an eager start
    (the stop used to be an Exception, which the build's fallback would have caught);
    no package, finished or partial, is left in the cache."""
    cache = tmp_path / "aot"
    monkeypatch.setenv("V41_AOT_CACHE", str(cache))  # a cold cache: the first package builds
    process = _start(free_port(), tmp_path, "--model", str(GOLDEN))
    try:
        lines = [""]
        while "building the compiled step's packages" not in lines[-1]:
            assert process.poll() is None, lines
            lines.append(process.stdout.readline())
        time.sleep(2)  # (inside the first build)
        process.send_signal(signal.SIGINT)
        code = process.wait(timeout=90)
        output = process.stdout.read()
        assert code == 0 and "stopped while starting" in output and "eager" not in output, (code, output[-3000:])
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    _nothing_left(process)
    assert all(path.suffix == ".lock" for path in cache.iterdir())


def _start(port: int, tmp_path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "cluster.cli", "serve", "--port", str(port), "--cache-dir", str(tmp_path / "cache"),
         *extra], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def _wait_serving(process: subprocess.Popen) -> str:
    """The line announcing the URL (the only URL it prints: not Serve's proxy's). (A
    compiled step's first start builds its packages first: minutes on a loaded machine.)"""
    deadline = time.time() + 480
    lines = [""]
    while "serving" not in lines[-1]:
        assert time.time() < deadline and process.poll() is None, "v41 serve did not come up"
        lines.append(process.stdout.readline())
    assert not any("ready at" in line for line in lines), lines
    return lines[-1]


def _nothing_left(process: subprocess.Popen) -> None:
    """Everything it started is gone: no process of its session is left (Redis included)."""
    time.sleep(1)
    leftover = subprocess.run(["pgrep", "-s", str(process.pid)], capture_output=True, text=True).stdout.split()
    assert leftover == []
