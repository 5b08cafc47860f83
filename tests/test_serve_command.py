"""`v41 serve`: starts Redis, Ray and the app, serves, and stops all of it on SIGINT."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

from storage.redis_server import free_port

pytestmark = pytest.mark.slow


def test_serve_command_starts_serves_and_stops_everything(tmp_path):
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "cluster.cli", "serve", "--model", "tests/golden/A", "--port", str(port),
         "--cache-dir", str(tmp_path / "cache")],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        deadline = time.time() + 240
        line = ""
        while "serving" not in line:
            assert time.time() < deadline and process.poll() is None, "v41 serve did not come up"
            line = process.stdout.readline()
        assert f"http://127.0.0.1:{port}/v1" in line
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=30) as response:
            assert response.read() == b"ok"
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=90) == 0
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    # Everything it started is gone: no process of its session is left.
    leftover = subprocess.run(["pgrep", "-s", str(process.pid)], capture_output=True, text=True).stdout.split()
    assert leftover == []
