"""The Engram table service: shard reader, client routing and faults, and the Ray actors.

The first part drives :class:`EngramShard` and :class:`EngramClient` in-process
(LocalTransport); the ``slow`` part starts a real Ray cluster of two raylets on this
machine, one of them offering the ``engram_host`` resource.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import signal
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from actors.engram_client import EngramClient, EngramServiceError, LocalTransport, dequantize_rows
from actors.engram_tables import EngramShard, ShardPlan, read_engram_tables
from model import formats

pytestmark = pytest.mark.unit

FP8_LAYERS = (1, 14)
FP8_ROWS = (5003, 4099)
HEAD_DIM = 64
N_COLS = 6


def _fp8_tables(seed: int = 0) -> dict[int, formats.Packed]:
    generator = torch.Generator().manual_seed(seed)
    return {
        layer: formats.ENGRAM_ROW.quantize(torch.randn(rows, HEAD_DIM, generator=generator) * 0.3)
        for layer, rows in zip(FP8_LAYERS, FP8_ROWS)
    }


@pytest.fixture(scope="module")
def fp8_checkpoint(tmp_path_factory) -> tuple[Path, dict[int, formats.Packed]]:
    """A released-layout checkpoint (no ``model.`` prefix) in two safetensors files with
    an index, holding FP8 Engram tables next to other tensors."""
    directory = tmp_path_factory.mktemp("engram_fp8")
    tables = _fp8_tables()
    files = {
        "model-00001-of-00002.safetensors": {
            "embed.weight": torch.randn(16, 8),
            "layers.1.engram.embed.weight": tables[1].data.view(torch.float8_e4m3fn),
            "layers.1.engram.embed.scale": tables[1].scales.view(torch.float8_e8m0fnu),
        },
        "model-00002-of-00002.safetensors": {
            "layers.14.engram.embed.scale": tables[14].scales.view(torch.float8_e8m0fnu),
            "layers.14.attn.wq_a.weight": torch.randn(8, 8),
            "layers.14.engram.embed.weight": tables[14].data.view(torch.float8_e4m3fn),
        },
    }
    weight_map = {}
    for name, tensors in files.items():
        save_file(tensors, directory / name)
        weight_map.update({key: name for key in tensors})
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return directory, tables


def _random_ids(batch_shape: tuple[int, ...], seed: int = 1) -> torch.Tensor:
    """Row ids ``[*batch_shape, n_tables, N_COLS]`` with plenty of duplicates."""
    generator = torch.Generator().manual_seed(seed)
    cols = []
    for rows in FP8_ROWS:
        hot = torch.randint(0, rows, (64,), generator=generator)  # repeated rows
        ids = torch.randint(0, rows, (*batch_shape, N_COLS), generator=generator)
        pick = torch.rand(ids.shape, generator=generator) < 0.5
        ids = torch.where(pick, hot[torch.randint(0, 64, ids.shape, generator=generator)], ids)
        ids.view(-1)[:2] = torch.tensor([0, rows - 1])  # both ends of the table
        cols.append(ids)
    return torch.stack(cols, dim=-2)


def _direct_rows(tables: dict[int, formats.Packed], ids: torch.Tensor) -> dict[int, torch.Tensor]:
    """What the in-process model holds: the loader dequantises the whole table, then indexes."""
    return {
        layer: formats.ENGRAM_ROW.dequantize(table)[ids[..., t, :]]
        for t, (layer, table) in enumerate(tables.items())
    }


def _local_client(plan: ShardPlan, replicas: int = 1, **kwargs) -> EngramClient:
    shards = [EngramShard(plan, s) for s in range(plan.n_shards)]
    return EngramClient(plan, LocalTransport([[shard.fetch] * replicas for shard in shards]), **kwargs)


# ---------------------------------------------------------------------------------
# In-process: the reader, the routing, the numbers
# ---------------------------------------------------------------------------------


def test_tables_are_located_from_headers(fp8_checkpoint):
    directory, tables = fp8_checkpoint
    found = read_engram_tables(directory, FP8_LAYERS)
    assert [t.layer_id for t in found] == list(FP8_LAYERS)
    for table, rows in zip(found, FP8_ROWS):
        assert table.is_fp8 and table.rows == rows and table.head_dim == HEAD_DIM
        assert table.scale.shape == (rows, HEAD_DIM // 32)
    assert Path(found[0].weight.path).name != Path(found[1].weight.path).name
    with pytest.raises(ValueError, match="no Engram table layers.7"):
        read_engram_tables(directory, (1, 7))


def test_fast_dequantisation_agrees_with_the_reference():
    """Every E4M3 byte under every UE8M0 scale byte (NaN codes included)."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    weight = codes.repeat(256, 1)  # [256 scales, 256 codes]
    scale = codes.view(256, 1).expand(256, 8).contiguous()  # [256, 256 / 32]
    expected = formats.ENGRAM_ROW.dequantize(formats.Packed(weight, scale))
    got = torch.from_numpy(dequantize_rows(weight.numpy(), scale.numpy()))
    assert torch.equal(got.isnan(), expected.isnan())
    assert torch.equal(got.nan_to_num(), expected.nan_to_num())


@pytest.mark.parametrize("n_shards", [1, 3])
def test_rows_equal_direct_indexing(fp8_checkpoint, n_shards):
    directory, tables = fp8_checkpoint
    plan = ShardPlan.even(read_engram_tables(directory, FP8_LAYERS), n_shards)
    client = _local_client(plan)
    for shape in [(257,), (2, 33)]:
        ids = _random_ids(shape, seed=len(shape) + n_shards)
        lookup = client.start(ids)
        rows, raw = lookup.rows(), lookup.raw()
        assert lookup.n_unique_rows < ids.numel()  # duplicates were fetched once
        for t, (layer, expected) in enumerate(_direct_rows(tables, ids).items()):
            assert rows[layer].dtype == torch.float32 and rows[layer].shape == (*shape, N_COLS, HEAD_DIM)
            assert torch.equal(rows[layer], expected)
            assert torch.equal(raw[layer].weight, tables[layer].data[ids[..., t, :]])
            assert torch.equal(raw[layer].scale, tables[layer].scales[ids[..., t, :]])


def test_one_deduplicated_request_per_shard(fp8_checkpoint):
    directory, _ = fp8_checkpoint
    plan = ShardPlan.even(read_engram_tables(directory, FP8_LAYERS), 4)
    shards = [EngramShard(plan, s) for s in range(4)]
    asked: list[tuple[int, list[list[int]]]] = []

    def recording(shard):
        def fetch(request):
            asked.append((shard.shard, [ids.tolist() for ids in request.local_ids]))
            return shard.fetch(request)

        return fetch

    client = EngramClient(plan, LocalTransport([[recording(s)] for s in shards]))
    # Every id in the first quarter of each table, many times over: only shard 0 is asked.
    ids = torch.stack([torch.tensor([[3, 3, 5, 3, 5, 9]] * 10), torch.tensor([[7] * 6] * 10)], dim=-2)
    client.start(ids).rows()
    assert asked == [(0, [[3, 5, 9], [7]])]


def test_empty_prompt_and_bad_ids(fp8_checkpoint):
    directory, _ = fp8_checkpoint
    plan = ShardPlan.even(read_engram_tables(directory, FP8_LAYERS), 2)
    client = _local_client(plan)
    rows = client.start(torch.zeros(0, 2, N_COLS, dtype=torch.long)).rows()
    assert {k: tuple(v.shape) for k, v in rows.items()} == {1: (0, N_COLS, HEAD_DIM), 14: (0, N_COLS, HEAD_DIM)}
    bad = torch.zeros(4, 2, N_COLS, dtype=torch.long)
    bad[2, 1, 0] = FP8_ROWS[1]
    with pytest.raises(ValueError, match=r"Engram layer 14: row ids must lie in \[0, 4099\)"):
        client.start(bad)
    with pytest.raises(ValueError, match="engram_ids must be integer"):
        client.start(torch.zeros(4, 3, N_COLS, dtype=torch.long))


def test_start_returns_before_any_answer(fp8_checkpoint):
    directory, tables = fp8_checkpoint
    plan = ShardPlan.even(read_engram_tables(directory, FP8_LAYERS), 2)
    shards = [EngramShard(plan, s) for s in range(2)]
    gate = threading.Event()

    def gated(shard):
        return lambda request: gate.wait(10) and shard.fetch(request)

    client = EngramClient(plan, LocalTransport([[gated(s)] for s in shards]), timeout_s=10)
    ids = _random_ids((40,))
    lookup = client.start(ids)  # would block forever if start() waited for the shards
    gate.set()
    assert all(torch.equal(a, b) for a, b in zip(lookup.rows().values(), _direct_rows(tables, ids).values()))


def test_prepare_makes_the_same_rows_in_the_background_and_survives_pickling(fp8_checkpoint):
    directory, tables = fp8_checkpoint
    plan = ShardPlan.even(read_engram_tables(directory, FP8_LAYERS), 2)
    shards = [EngramShard(plan, s) for s in range(2)]
    gate = threading.Event()
    client = EngramClient(plan, LocalTransport([[lambda r, s=s: gate.wait(10) and s.fetch(r)] for s in shards]),
                          timeout_s=10)
    ids = _random_ids((3, 41))
    lookup = client.start(ids)
    # The router hands it to a prefill replica (copy runs the same __getstate__ /
    # __setstate__ as pickling; this local transport's thread pool is not picklable).
    moved = copy.copy(lookup.prepare())
    assert lookup.prepare() is lookup and not lookup._ready.done()  # still waiting for the shards
    gate.set()
    expected = _direct_rows(tables, ids)
    for got in (lookup.rows(), moved.prepare().rows(), moved.rows()):
        assert all(torch.equal(a, b) for a, b in zip(got.values(), expected.values()))
    assert all(torch.equal(a.weight, tables[layer].data[ids[..., t, :]])
               for t, (layer, a) in enumerate(lookup.raw().items()))

    def broken(request):
        raise OSError("disk gone")

    failing = EngramClient(plan, LocalTransport([[broken], [shards[1].fetch]]), retries=0).start(ids).prepare()
    with pytest.raises(EngramServiceError, match="OSError: disk gone"):
        failing.rows()


def test_slow_replica_falls_over_and_silent_shard_raises(fp8_checkpoint):
    directory, tables = fp8_checkpoint
    plan = ShardPlan.even(read_engram_tables(directory, FP8_LAYERS), 2)
    shards = [EngramShard(plan, s) for s in range(2)]
    release = threading.Event()

    def silent(request):
        release.wait(30)
        raise RuntimeError("answered too late")

    ids = _random_ids((50,))
    try:
        # Replica 0 of shard 0 never answers in time: replica 1 does.
        client = EngramClient(
            plan, LocalTransport([[silent, shards[0].fetch], [shards[1].fetch] * 2]), timeout_s=0.3, retries=1
        )
        for _ in range(2):  # both round-robin turns
            rows = client.start(ids).rows()
            assert all(torch.equal(a, b) for a, b in zip(rows.values(), _direct_rows(tables, ids).values()))
        # Every replica of shard 0 silent: a clear error, never zeros.
        client = EngramClient(plan, LocalTransport([[silent, silent], [shards[1].fetch] * 2]), timeout_s=0.3)
        with pytest.raises(EngramServiceError, match=r"Engram shard 0 of 2 \(layer 1 rows \[0, 2501\).*no answer within 0.3 s"):
            client.start(ids).rows()
    finally:
        release.set()


def test_failing_shard_is_retried_then_reported(fp8_checkpoint):
    directory, tables = fp8_checkpoint
    plan = ShardPlan.even(read_engram_tables(directory, FP8_LAYERS), 1)
    shard = EngramShard(plan, 0)
    calls = []

    def flaky(request):
        calls.append(1)
        if len(calls) == 1:
            raise OSError("transient read error")
        return shard.fetch(request)

    ids = _random_ids((30,))
    rows = EngramClient(plan, LocalTransport([[flaky]]), retries=1).start(ids).rows()
    assert len(calls) == 2
    assert all(torch.equal(a, b) for a, b in zip(rows.values(), _direct_rows(tables, ids).values()))

    def broken(request):
        raise OSError("disk gone")

    with pytest.raises(EngramServiceError, match="replica 0: OSError: disk gone; replica 0: OSError: disk gone"):
        EngramClient(plan, LocalTransport([[broken]]), retries=1).start(ids).rows()


# ---------------------------------------------------------------------------------
# The golden checkpoint: same rows, same logits
# ---------------------------------------------------------------------------------


def _golden_engram_ids(golden_hasher, golden_prompts, index: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.tensor([golden_prompts[index]])
    engram_ids, _ = golden_hasher.hash_ids(ids)
    return ids, engram_ids


def _assert_same_logits_with(model, client, ids, engram_ids, monkeypatch) -> None:
    """The reference forward with rows from ``client`` gives bit-identical logits."""
    expected = model(ids, engram_ids)
    fetched = []

    def from_service(engram_ids):
        fetched.append(client.start(engram_ids).rows())
        return fetched[-1]

    monkeypatch.setattr(model, "engram_rows", from_service)
    try:
        logits = model(ids, engram_ids)
    finally:
        monkeypatch.undo()
    assert fetched and torch.equal(logits, expected)


def test_golden_rows_and_logits_identical(golden_dir, golden_model, golden_hasher, golden_prompts, monkeypatch):
    config, model = golden_model
    plan = ShardPlan.even(read_engram_tables(golden_dir, config.text.engram_layer_ids), 2)
    client = _local_client(plan, hasher=golden_hasher)
    for index in range(len(golden_prompts)):
        ids, engram_ids = _golden_engram_ids(golden_hasher, golden_prompts, index)
        lookup, _ = client.start_tokens(ids)
        rows, expected = lookup.rows(), model.engram_rows(engram_ids)
        assert rows.keys() == expected.keys()
        assert all(torch.equal(rows[k], expected[k]) for k in rows)
    _assert_same_logits_with(model, client, ids, engram_ids, monkeypatch)


def test_engine_prefill_same_with_service(golden_dir, golden_model, golden_hasher, golden_prompts):
    from model.runtime.engine import Engine

    config, model = golden_model
    engine = Engine(model, golden_hasher)
    client = _local_client(ShardPlan.even(read_engram_tables(golden_dir, config.text.engram_layer_ids), 2))
    prompt = golden_prompts[1]
    head, tail = prompt[:97], prompt[97:]  # the second chunk's n-grams reach into the first
    plain, served = engine.new_cache(), engine.new_cache()
    for chunk in (head, tail):
        expected = engine.prefill(plain, chunk)
        engram_ids, _ = golden_hasher.hash_ids(torch.tensor([chunk]), served.ngram)
        got = engine.prefill(served, chunk, engram_rows=client.start(engram_ids[0]).rows)
        assert torch.equal(got.streams, expected.streams) and torch.equal(got.pre, expected.pre)


# ---------------------------------------------------------------------------------
# Ray: two raylets on this machine, one offering the Engram resource
# ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def two_raylets():
    """A head raylet without the Engram resource and an Engram host raylet (every
    port picked by the OS: the GCS port defaults to 0 in ``Cluster``)."""
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 1,
            "object_store_memory": 100 * 1024**2,
            "include_dashboard": False,
        },
    )
    try:
        engram_node = cluster.add_node(num_cpus=1, resources={"engram_host": 8}, object_store_memory=100 * 1024**2)
        ray.init(address=cluster.address, logging_level="ERROR")
        cluster.wait_for_nodes()
        yield ray, cluster.head_node.node_id, engram_node.node_id
    finally:
        ray.shutdown()
        cluster.shutdown()


def _launch(directory, layer_ids, **overrides):
    from actors.engram import EngramService, EngramServiceConfig

    settings = {"n_shards": 2, "replicas": 1, "num_cpus": 0, "timeout_s": 20.0, "ready_timeout_s": 60.0}
    settings.update(overrides)
    return EngramService.launch(EngramServiceConfig(checkpoint=str(directory), **settings), layer_ids)


@pytest.mark.slow
@pytest.mark.integration
def test_service_on_engram_host_matches_tables(two_raylets, fp8_checkpoint, golden_dir, golden_model, golden_hasher,
                                               golden_prompts, monkeypatch):
    ray, head_id, engram_id = two_raylets
    directory, tables = fp8_checkpoint
    service = _launch(directory, FP8_LAYERS, replicas=2)
    golden = _launch(golden_dir, None)
    try:
        placements = service.placement() + golden.placement()
        assert len(placements) == 6
        assert {p.node_id for p in placements} == {engram_id} != {head_id}
        assert sorted((p.shard, p.replica) for p in service.placement()) == [(0, 0), (0, 1), (1, 0), (1, 1)]

        client = service.client()
        for seed in range(3):  # round-robin over both replicas of each shard
            ids = _random_ids((300,), seed=seed)
            rows, raw = client.start(ids).rows(), client.start(ids).raw()
            for t, (layer, expected) in enumerate(_direct_rows(tables, ids).items()):
                assert torch.equal(rows[layer], expected)
                assert torch.equal(raw[layer].weight, tables[layer].data[ids[..., t, :]])

        # A lookup started here (the router) is finished in another worker (a prefill actor).
        @ray.remote(num_cpus=0)
        def finish(lookup):
            return lookup.rows()

        ids = _random_ids((2, 40), seed=7)
        handed = ray.get(finish.remote(client.start(ids)), timeout=60)
        assert all(torch.equal(a, b) for a, b in zip(handed.values(), _direct_rows(tables, ids).values()))

        config, model = golden_model
        golden_client = golden.client(hasher=golden_hasher)
        ids, engram_ids = _golden_engram_ids(golden_hasher, golden_prompts, 2)
        rows = golden_client.start(engram_ids).rows()
        assert all(torch.equal(rows[k], v) for k, v in model.engram_rows(engram_ids).items())
        _assert_same_logits_with(model, golden_client, ids, engram_ids, monkeypatch)
    finally:
        service.shutdown()
        golden.shutdown()


@pytest.mark.slow
@pytest.mark.integration
def test_dead_shard_restarts_and_silent_shard_times_out(two_raylets, fp8_checkpoint):
    ray, _, _ = two_raylets
    directory, tables = fp8_checkpoint
    service = _launch(directory, FP8_LAYERS, replicas=1, timeout_s=30.0)
    try:
        client = service.client()
        ids = _random_ids((200,), seed=3)
        before = {(p.shard, p.replica): p.pid for p in service.placement()}
        ray.kill(service.actors[1][0], no_restart=False)
        rows = client.start(ids).rows()  # shard 1 comes back under Ray's max_restarts
        assert all(torch.equal(a, b) for a, b in zip(rows.values(), _direct_rows(tables, ids).values()))
        after = {(p.shard, p.replica): p.pid for p in service.placement()}
        assert after[(1, 0)] != before[(1, 0)] and after[(0, 0)] == before[(0, 0)]

        fast = service.client(timeout_s=1.0)
        with _stopped(after[(0, 0)]):  # a shard process that hangs (SIGSTOP)
            with pytest.raises(EngramServiceError, match=r"Engram shard 0 of 2 .*replica 0: no answer within 1 s"):
                fast.start(ids).rows()
    finally:
        service.shutdown()


@pytest.mark.slow
@pytest.mark.integration
def test_silent_replica_falls_over_to_the_other(two_raylets, fp8_checkpoint):
    ray, _, _ = two_raylets
    directory, tables = fp8_checkpoint
    service = _launch(directory, FP8_LAYERS, n_shards=1, replicas=2, timeout_s=1.0)
    try:
        silent = next(p.pid for p in service.placement() if p.replica == 0)
        client = service.client()
        ids = _random_ids((100,), seed=5)
        with _stopped(silent):
            for _ in range(2):  # the silent replica is first on one of the two turns
                rows = client.start(ids).rows()
                assert all(torch.equal(a, b) for a, b in zip(rows.values(), _direct_rows(tables, ids).values()))
    finally:
        service.shutdown()


@contextlib.contextmanager
def _stopped(pid: int):
    """A process stopped (SIGSTOP) for the duration: alive, holding its connections, silent."""
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


@pytest.mark.slow
@pytest.mark.integration
def test_launch_without_engram_hosts_is_a_clear_error(two_raylets, fp8_checkpoint):
    from actors.engram import EngramServiceError

    directory, _ = fp8_checkpoint
    with pytest.raises(EngramServiceError, match="needs 2 of resource 'gpu_less_host'.*offers 0"):
        _launch(directory, FP8_LAYERS, resource="gpu_less_host")
