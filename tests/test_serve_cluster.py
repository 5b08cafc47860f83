"""The app on a Ray cluster of two raylets on this machine: prefill and decoder replicas and
an Engram shard on different raylets, requests served across them."""

from __future__ import annotations

import openai

import pytest
import ray
from ray import serve

from tests.serve_harness import running_app

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster():
    from ray.cluster_utils import Cluster

    from cluster.commands.serve import use_serve_environment
    from storage.redis_server import free_port

    port = free_port()
    use_serve_environment(port)  # before the raylets start: every Ray process runs with it
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 2, "resources": {"prefill_host": 1}, "object_store_memory": 128 << 20,
        "include_dashboard": False})
    try:
        worker = cluster.add_node(num_cpus=2, resources={"decoder_host": 1, "engram_host": 1},
                                  object_store_memory=128 << 20)
        yield cluster, cluster.head_node.node_id, worker.node_id, port
    finally:
        cluster.shutdown()


def test_pools_and_engram_shard_on_different_raylets(cluster, tmp_path):
    cluster, head, worker, port = cluster
    with running_app(tmp_path, address=cluster.address, port=port, decoder_resources={"decoder_host": 1},
                     prefill_resources={"prefill_host": 1},
                     engram_shards=1, engram_cpus=0.5, local_prefill_tokens=0) as (url, redis):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
        messages = [{"role": "user", "content": "for line in open(path):\n    print(line)\n" * 5}]
        first = client.chat.completions.create(model="deepseek-v4.1-small", messages=messages, max_tokens=6,
                                               temperature=0)
        assert first.usage.completion_tokens == 6
        decoder_node = serve.get_deployment_handle("DecoderPool", app_name="v41").node.remote().result()
        prefill_node = serve.get_deployment_handle("PrefillPool", app_name="v41").node.remote().result()
        holder = ray.get_actor("v41-engram", namespace="v41")
        shard_nodes = {p.node_id for p in ray.get(holder.placement.remote())}
        assert decoder_node == worker and prefill_node == head and shard_nodes == {worker}
        # The second turn's prefix lives on the decoder's node (it wrote it); the router
        # finds it in the Redis index; the prefill reads it from that node's store (node to
        # node) and the decoder from its own.
        # Sent with no pause: the decoder stored and indexed the conversation before its
        # last token went out.
        again = client.chat.completions.create(
            model="deepseek-v4.1-small", max_tokens=4, temperature=0,
            messages=messages + [{"role": "assistant", "content": first.choices[0].message.content},
                                 {"role": "user", "content": "again"}])
        assert again.usage.completion_tokens == 4
        # All of turn one came from the store: its chunks and the window state after them
        # (but the answer's last token, never fed), which the prefill read from the
        # decoder's node and the decoder from its own store.
        history = first.usage.prompt_tokens + first.usage.completion_tokens - 1
        assert again.usage.prompt_tokens_details.cached_tokens == history
        ray.kill(holder)
