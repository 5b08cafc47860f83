"""The app across hosts (cluster/hosts.py): the README's several-machines recipe run as
written on network namespaces with their own addresses, a shaped link between them:
a Redis and the Ray head on the head host, a worker host joined with `ray start
--address`, `v41 serve --address` on the head; a client on the worker host calls the
head's address, and its returning turn finds the prefix the other host stored."""

from __future__ import annotations

import json
import os

import pytest

from cluster import hosts
from cluster.hosts import Hosts
from cluster.hosts_app import HostsApp

pytestmark = [pytest.mark.e2e, pytest.mark.slow,
              pytest.mark.skipif(hosts.available() is not None, reason=str(hosts.available()))]
GOLDEN = os.path.join(os.path.dirname(__file__), "..", "golden", "A")
CLIENT = """
import json, sys, openai
client = openai.OpenAI(base_url=sys.argv[1] + "/v1", api_key="unused", max_retries=0, timeout=120)
messages = [{"role": "user", "content": "def transfer(a, b, amount):\\n    a.balance -= amount\\n" * 6}]
one = client.chat.completions.create(model="deepseek-v4.1-small", messages=messages, max_tokens=8, temperature=0)
messages += [{"role": "assistant", "content": one.choices[0].message.content}, {"role": "user", "content": "and?"}]
raw = client.chat.completions.with_raw_response.create(model="deepseek-v4.1-small", messages=messages, max_tokens=8,
                                                       temperature=0)
two = raw.parse()
print(json.dumps({"one": one.usage.model_dump(), "two": two.usage.model_dump(),
                  "prefilled_by": raw.headers.get("x-v41-prefilled-by")}))
"""


def test_the_app_across_hosts_answers_at_the_head_and_finds_a_prefix_stored_across_the_link():
    config = (f"model: {os.path.abspath(GOLDEN)}\nprefill_resources: {{prefill_host: 1}}\n"
              "decoder_resources: {decoder_host: 1}\nchunk_tokens: 32\ncompiled_step: false\n"
              "max_answer_tokens: 64\nssd_dir: {run}/ssd-{node}\n")
    with Hosts(1, link_gbit=1.0, run=243) as cluster:
        app = HostsApp(cluster, config, worker_resources=[{"decoder_host": 1}])
        try:
            app.start()
            done = app.client(cluster.workers[0], CLIENT)  # a client on the worker host
            assert done.returncode == 0, (done.stderr[-2000:], app.log[-2000:])
        finally:
            app.stop()
    answer = json.loads(done.stdout.strip().splitlines()[-1])
    one, two = answer["one"], answer["two"]
    assert one["prompt_tokens_details"]["cached_tokens"] == 0
    # Prefilled on the head host, decoded on the worker host: the returning turn reads
    # what the decoder stored on its host, every whole chunk of the first turn.
    assert two["prompt_tokens_details"]["cached_tokens"] >= (one["prompt_tokens"] // 32) * 32
    assert not [name for name in hosts.namespaces() if name.startswith("v41h-243-")]
    assert not (hosts.RUNS / "v41h-243").exists()
