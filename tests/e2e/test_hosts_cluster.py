"""The app across hosts (cluster/hosts.py): the README's several-machines recipe run as
written on network namespaces with their own addresses, a shaped link between them:
a Redis and the Ray head on the head host, a worker host joined with `ray start
--address`, `v41 serve --address` on the head; a client on the worker host calls the
head's address, and its returning turn finds the prefix the other host stored."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from cluster import hosts
from cluster.hosts import Hosts

pytestmark = [pytest.mark.e2e, pytest.mark.slow,
              pytest.mark.skipif(hosts.available() is not None, reason=str(hosts.available()))]
GOLDEN = os.path.join(os.path.dirname(__file__), "..", "golden", "A")
CLIENT = """
import json, sys, openai
client = openai.OpenAI(base_url=f"http://{sys.argv[1]}:8000/v1", api_key="unused", max_retries=0, timeout=120)
messages = [{"role": "user", "content": "def transfer(a, b, amount):\\n    a.balance -= amount\\n" * 6}]
one = client.chat.completions.create(model="deepseek-v4.1-small", messages=messages, max_tokens=8, temperature=0)
messages += [{"role": "assistant", "content": one.choices[0].message.content}, {"role": "user", "content": "and?"}]
raw = client.chat.completions.with_raw_response.create(model="deepseek-v4.1-small", messages=messages, max_tokens=8,
                                                       temperature=0)
two = raw.parse()
print(json.dumps({"one": one.usage.model_dump(), "two": two.usage.model_dump(),
                  "prefilled_by": raw.headers.get("x-v41-prefilled-by")}))
"""


def _serve_environment() -> dict[str, str]:
    """What `v41 serve --print-env` says to export on every node before `ray start`."""
    printed = subprocess.run(["v41", "serve", "--print-env", "--port", "8000"], capture_output=True, text=True,
                             check=True).stdout
    return dict(line.removeprefix("export ").split("=", 1) for line in printed.splitlines() if line.startswith("export"))


def test_the_app_across_hosts_answers_at_the_head_and_finds_a_prefix_stored_across_the_link(tmp_path):
    env = {**os.environ, **_serve_environment(), "RAY_AUTH_MODE": "disabled"}
    with Hosts(1, link_gbit=1.0, run=243) as cluster:
        head, worker = cluster.hosts

        def run(host, command, timeout=180):
            return subprocess.run(host.argv(command), capture_output=True, text=True, timeout=timeout, env=env,
                                  check=True)

        password = os.urandom(16).hex()
        (head.folder / "redis.pw").write_text(password + "\n")
        cluster.start(head, ["redis-server", "--bind", head.address, "--port", "6380", "--requirepass", password,
                             "--save", "", "--appendonly", "no", "--dir", str(head.folder)], stdout=subprocess.DEVNULL)
        run(head, ["ray", "start", "--head", f"--node-ip-address={head.address}", "--port=6379",
                   f"--temp-dir={head.folder}/ray", "--num-cpus=2", "--disable-usage-stats",
                   "--include-dashboard=false", "--resources", '{"prefill_host": 1}'])
        run(worker, ["ray", "start", f"--address={head.address}:6379", f"--node-ip-address={worker.address}",
                     f"--temp-dir={worker.folder}/ray", "--num-cpus=2", "--disable-usage-stats",
                     "--resources", '{"decoder_host": 1}'])
        config = head.folder / "app.yaml"
        config.write_text(f"model: {os.path.abspath(GOLDEN)}\nprefill_resources: {{prefill_host: 1}}\n"
                          "decoder_resources: {decoder_host: 1}\nchunk_tokens: 32\ncompiled_step: false\n"
                          f"max_answer_tokens: 64\nssd_dir: {cluster.folder}/ssd-{{node}}\n")
        log = head.folder / "serve.log"
        serve = cluster.start(head, ["v41", "serve", "--address", f"{head.address}:6379", "--redis-url",
                                     f"redis://{head.address}:6380/0", "--redis-password-file",
                                     str(head.folder / "redis.pw"), "--config", str(config), "--host", "0.0.0.0",
                                     "--port", "8000", "--insecure-no-auth"],
                              stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + 300
        while "v41 serving" not in log.read_text() and serve.poll() is None and time.monotonic() < deadline:
            time.sleep(1)
        assert "v41 serving" in log.read_text(), log.read_text()[-3000:]
        answer = None
        while answer is None and time.monotonic() < deadline:  # (the replicas start after the serving line)
            done = subprocess.run(worker.argv([sys.executable, "-c", CLIENT, head.address]), capture_output=True,
                                  text=True, env=env, timeout=240)
            if done.returncode == 0:
                import json

                answer = json.loads(done.stdout.strip().splitlines()[-1])
            else:
                time.sleep(2)
        assert answer is not None, (done.stderr[-2000:], log.read_text()[-2000:])
        one, two = answer["one"], answer["two"]
        assert one["prompt_tokens_details"]["cached_tokens"] == 0
        # Prefilled on the head host, decoded on the worker host: the returning turn reads
        # what the decoder stored on its host, every whole chunk of the first turn.
        assert two["prompt_tokens_details"]["cached_tokens"] >= (one["prompt_tokens"] // 32) * 32
        serve.send_signal(2)
        serve.wait(60)
    assert not [name for name in hosts.namespaces() if name.startswith("v41h-243-")]
    assert not (hosts.RUNS / "v41h-243").exists()
