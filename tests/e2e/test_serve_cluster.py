"""The app on a Ray cluster of two raylets on this machine: prefill and decoder replicas and
an Engram shard on different raylets, requests served across them, and a stored response
read from the other raylet's store."""

from __future__ import annotations

import json

import openai
import pytest
import ray
from ray import serve

from tests.serve_harness import running_app

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


@pytest.fixture(scope="module")
def cluster():
    from ray.cluster_utils import Cluster

    from cluster.serving.local import use_serve_environment
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
        # Sent with no pause: the decoder stored and indexed the conversation before its
        # last token went out, and kept its cache (actors/resident.py): the router sends
        # the turn back to it, which encodes only the new message.
        turn_one = messages + [{"role": "assistant", "content": first.choices[0].message.content}]
        history = first.usage.prompt_tokens + first.usage.completion_tokens - 1  # the last token was never fed
        again = client.chat.completions.with_raw_response.create(
            model="deepseek-v4.1-small", max_tokens=4, temperature=0,
            messages=turn_one + [{"role": "user", "content": "again"}])
        assert again.headers["x-v41-prefilled-by"] == "resident"
        assert again.parse().usage.completion_tokens == 4
        assert again.parse().usage.prompt_tokens_details.cached_tokens == history
        # A branch from turn one (its kept cache went on with the turn above): the router
        # finds turn one in the Redis index, on the decoder's node; the prefill, on the
        # other raylet, reads it from that node's store (node to node), and the decoder
        # from its own.
        branch = client.chat.completions.with_raw_response.create(
            model="deepseek-v4.1-small", max_tokens=4, temperature=0,
            messages=turn_one + [{"role": "user", "content": "or else"}])
        assert branch.headers["x-v41-prefilled-by"] == "pool"
        assert int(branch.headers["x-v41-moved-bytes"]) > 0
        assert branch.parse().usage.prompt_tokens_details.cached_tokens == history

        # A stored response held by the other raylet's store (as if a router there had
        # kept it): the router finds it through the Redis index, reads it from that
        # node, continues it and deletes it there.
        from storage.keys import response_key

        router = next(actor["Address"]["NodeID"] for actor in ray._private.state.actors().values()
                      if actor["State"] == "ALIVE" and actor["ActorClassName"].endswith(":Router"))
        elsewhere = worker if router == head else head
        store = ray.get_actor(f"v41-store-{elsewhere}", namespace="v41")  # (both pools' nodes have one)
        stored = {"response": {"id": "resp_elsewhere", "object": "response", "created_at": 0, "status": "completed",
                               "model": "deepseek-v4.1-small", "output": [{
                                   "id": "msg_2", "type": "message", "role": "assistant", "status": "completed",
                                   "content": [{"type": "output_text", "text": "ok", "annotations": []}]}]},
                  "input": [{"id": "msg_1", "type": "message", "role": "user", "content": messages[0]["content"]}]}
        key = response_key("resp_elsewhere")
        assert ray.get(store.put_indexed.remote([(key, json.dumps(stored).encode())]))
        assert client.responses.retrieve("resp_elsewhere").output_text == "ok"
        continued = client.responses.create(model="deepseek-v4.1-small", previous_response_id="resp_elsewhere",
                                            input="again", max_output_tokens=2, temperature=0)
        assert continued.usage.input_tokens > first.usage.prompt_tokens
        client.responses.delete("resp_elsewhere")
        assert ray.get(store.get_many.remote([key])) == [None]

        # A conversation held by the other raylet's store: the router changes it (a new
        # version in its own node's store) and removes the older copy there; a stale copy
        # that reappears there (a node that missed the change) loses to the newer version.
        from storage.keys import conversation_key

        talk = {"conversation": {"id": "conv_elsewhere", "object": "conversation", "created_at": 0, "metadata": {}},
                "version": 1, "items": [{"id": "msg_1", "type": "message", "role": "user", "content": "hi"}]}
        key = conversation_key("conv_elsewhere")
        assert ray.get(store.put_indexed.remote([(key, json.dumps(talk).encode())]))
        client.conversations.items.create("conv_elsewhere", items=[{"role": "user", "content": "again"}])
        assert ray.get(store.get_many.remote([key])) == [None]
        assert ray.get(store.put_indexed.remote([(key, json.dumps(talk).encode())]))
        listed = client.conversations.items.list("conv_elsewhere", order="asc").data
        assert [item.id for item in listed][0] == "msg_1" and listed[1].content[0].text == "again"
        client.conversations.delete("conv_elsewhere")
        assert ray.get(store.get_many.remote([key])) == [None]
        with pytest.raises(openai.NotFoundError):
            client.conversations.retrieve("conv_elsewhere")
        ray.kill(holder)

