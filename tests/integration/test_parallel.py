"""Expert parallelism: one replica split over 2 and 4 CPU processes (gloo) computes
what one process computes, bit for bit (the exchange keeps every expert's rows and
every sum in the one-process order, and the workers run as many threads as the lead);
a lost worker fails the step cleanly, and a split server comes back whole. (What the
released config's split holds per worker: tests/unit/test_cli_model.py.)"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import torch

from actors.expert_workers import LocalExpertWorkers
from model.parallel import ExpertShard, ParallelSpec
from model.runtime.engine import Engine
from model.runtime.parallel import ExpertParallelMoE, WorkerLost

pytestmark = pytest.mark.integration

GOLDEN = Path(__file__).parents[1] / "golden" / "A"


def test_shard_holds_its_experts_and_the_lead_everything_else():
    lead, other = ExpertShard(0, 4, 8), ExpertShard(3, 4, 8)
    assert list(lead.experts) == [0, 1] and list(other.experts) == [6, 7] and lead.owner(5) == 2
    assert lead.holds("layers.3.ffn.experts.1.w2.weight") and not lead.holds("layers.3.ffn.experts.6.w2.scale")
    assert other.holds("layers.3.ffn.experts.7.w1.scale") and not other.holds("layers.3.ffn.experts.5.w1.weight")
    for name in ("layers.3.ffn.shared_experts.w1.weight", "layers.0.attn.wq_a.weight", "mtp.0.ffn.experts.7.w1.weight"):
        assert lead.holds(name) and not other.holds(name)  # the drafter stays whole on the lead
    with pytest.raises(ValueError, match="do not split evenly"):
        ExpertShard(0, 3, 8)


def test_a_worker_reads_only_its_share_of_the_checkpoint(golden_model, tensor_reads):
    from model import loader

    read = tensor_reads
    _, whole = golden_model
    experts = loader.load_experts(GOLDEN, ExpertShard(1, 2, 8))
    assert read and all(".ffn.experts." in name and int(name.split(".")[-3]) >= 4 for name in read)
    assert len(read) == 8 * 4 * 3  # 8 layers, 4 experts, 3 matrices (stored unquantised in this checkpoint)
    for layer, table in experts.items():
        assert sorted(table.keys(), key=int) == ["4", "5", "6", "7"]
        assert torch.equal(table["6"].w2.weight, whole.layers[layer].ffn.experts[6].w2.weight)
    read.clear()
    lead = loader.load_checkpoint(GOLDEN, shard=ExpertShard(0, 2, 8))
    assert not any(".ffn.experts." in name and int(name.split(".")[-3]) >= 4 for name in read)
    assert list(lead.backbone.layers[0].ffn.experts.keys()) == ["0", "1", "2", "3"]


def test_parallel_spec_parses_and_refuses_tensor_parallelism():
    assert ParallelSpec.parse("experts=8") == ParallelSpec(8, 1)
    with pytest.raises(ValueError, match="tensor parallelism is not built"):
        ParallelSpec.parse("experts=8,tensor=2")
    with pytest.raises(ValueError, match="experts=N"):
        ParallelSpec.parse("expert=8")


def _run_everything(model, hasher):
    """Logits of a prefill + bounded replay, three batched decode steps of two sequences,
    and a speculative verify step (then accept 2 of its 3 tokens and decode once more)."""
    engine = Engine(model, hasher)
    caches = [engine.new_cache(), engine.new_cache()]
    prompts = [list(range(5, 305)), list(range(40, 140))]
    out = [engine.replay(c, engine.prefill(c, p)) for c, p in zip(caches, prompts)]
    tokens = [int(o.argmax()) for o in out]
    for _ in range(3):
        step = engine.decode([(c, [t]) for c, t in zip(caches, tokens)])
        out += [s[-1] for s in step]
        tokens = [int(s[-1].argmax()) for s in step]
    logits, rewinds = engine.verify([(caches[0], [tokens[0], 7, 9]), (caches[1], [tokens[1]])])
    out += list(logits)
    engine.accept(caches[0], rewinds[0], 2)
    engine.accept(caches[1], rewinds[1], 1)
    out += [s[-1] for s in engine.decode([(c, [11]) for c in caches])]
    return torch.cat([o.reshape(-1) for o in out])


@pytest.fixture(scope="module")
def one_process(golden_model, golden_hasher):
    return _run_everything(golden_model[1], golden_hasher)


@pytest.mark.parametrize("workers", [2, 4])
def test_split_decoder_replica_equals_one_process(workers, golden_hasher, one_process):
    with LocalExpertWorkers(GOLDEN, workers) as (checkpoint, _):
        moes = [b.ffn for b in checkpoint.backbone.layers if isinstance(b.ffn, ExpertParallelMoE)]
        assert len(moes) == len(checkpoint.backbone.layers)
        assert all(len(m.experts) == 8 // workers for m in moes)  # the lead holds only its share
        split = _run_everything(checkpoint.backbone, golden_hasher)
    assert torch.equal(split, one_process)


def test_split_prefill_replica_equals_one_process(golden_dir, golden_hasher):
    from model.loader import load_model

    _, model = load_model(golden_dir)
    model.keep_encoder_only()
    prompt = list(range(3, 203))
    expected = Engine(model, golden_hasher).prefill(Engine(model, golden_hasher).new_cache(), prompt)
    with LocalExpertWorkers(GOLDEN, 2, drop_decoder=True) as (checkpoint, _):
        engine = Engine(checkpoint.backbone, golden_hasher)
        got = engine.prefill(engine.new_cache(), prompt)
    assert torch.equal(got.streams, expected.streams) and torch.equal(got.pre, expected.pre)


def test_a_lost_worker_fails_the_step_and_every_later_one(golden_hasher):
    workers = LocalExpertWorkers(GOLDEN, 2)
    with workers as (checkpoint, link):
        engine = Engine(checkpoint.backbone, golden_hasher)
        cache = engine.new_cache()
        engine.replay(cache, engine.prefill(cache, list(range(5, 100))))
        os.kill(workers.processes[0].pid, signal.SIGKILL)
        started = time.monotonic()
        with pytest.raises(WorkerLost):
            engine.decode([(cache, [5])])
        assert time.monotonic() - started < 10  # a closed connection, not a timeout
        with pytest.raises(WorkerLost):  # a new sequence too: the replica is done
            engine.prefill(engine.new_cache(), [1, 2, 3])
        assert link.broken



@pytest.mark.slow
@pytest.mark.e2e
def test_split_server_answers_as_one_process_and_comes_back_after_a_lost_worker(serve_runtime, tmp_path):
    import openai
    import ray
    from ray.util import list_named_actors

    from actors.expert_workers import WORKER_PREFIX
    from tests.serve_harness import one_process_greedy, replica_actor_name, wait_until

    prompts = [list(range(300, 500)), list(range(600, 800)), list(range(900, 1100))]  # past local_prefill_tokens
    expected = [one_process_greedy(GOLDEN, p, 12) for p in prompts]
    with serve_runtime.app(tmp_path, decoder_parallel={"experts": 2}, prefill_parallel={"experts": 2}) as (url, _):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)

        def complete(prompt):
            return client.completions.create(model="deepseek-v4.1-small", prompt=prompt, max_tokens=12,
                                             temperature=0).choices[0].text

        assert complete(prompts[0]) == expected[0]
        workers = [a["name"] for a in list_named_actors(all_namespaces=True) if a["name"].startswith(WORKER_PREFIX)]
        assert len(workers) == 2  # one per split replica: the prefill's and the decoder's
        decoder_lead = ray.get_actor(replica_actor_name("DecoderPool"), namespace="serve")
        lead_pid = ray.get(decoder_lead.__ray_call__.remote(lambda replica: os.getpid()))
        worker = ray.get_actor(f"{WORKER_PREFIX}{lead_pid}-1", namespace="v41")
        os.kill(ray.get(worker.pid.remote()), signal.SIGKILL)
        with pytest.raises(openai.APIStatusError) as failed:
            complete(prompts[1])
        assert failed.value.status_code == 503 and "WorkerLost" in failed.value.body["message"]

        answers = []

        def answered() -> bool:
            try:
                answers.append(complete(prompts[2]))
                return True
            except openai.APIStatusError as error:
                assert error.status_code == 503
                return False

        wait_until(answered, timeout=90, what="the replica's restart")
        assert answers == [expected[2]]
        new_workers = [a["name"] for a in list_named_actors(all_namespaces=True) if a["name"].startswith(WORKER_PREFIX)]
        assert len(new_workers) == 2 and f"{WORKER_PREFIX}{lead_pid}-1" not in new_workers
