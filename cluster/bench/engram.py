"""`v41 bench engram`: the Engram service's lookups and the prefill it feeds.

In one run, on one machine:

1. Tables: two Engram tables of ``--rows`` rows x 256 FP8 values (+ 8 UE8M0 scale
   bytes per row) are written in the released layout to a temporary checkpoint, for
   the small config (``configs/tiny`` with ``engram_head_dim`` 256 and an
   ``engram_vocab_size`` that gives those rows), so lookups are real memory traffic.
2. Memory-bandwidth reference: a large in-memory copy, and a direct row gather
   (numpy fancy indexing of the memory-mapped FP8 table, the best a shard can do).
3. Lookups: for prompts of ``--sizes`` tokens (random ids, hashed by the model's
   hasher), the service (``--shards`` actors on a local Ray cluster) is asked for the
   rows, stored bytes in token order (``lookup.raw()``). Reported: p50/p99 latency
   from ``start`` to the last byte, row ids served per second (``S x layers x cols``
   / p50) and GB/s of unique stored rows moved (what the shards read and ship).
4. Prefill: the engine's prefill of a ``--prefill-tokens`` prompt with the model's
   in-process tables (float32, as the loader dequantises them) against the service
   with the lookup started at arrival (``client.start(...).prepare()`` then
   ``engine.prefill(..., engram_rows=lookup.rows)``), alternating ``--reps`` times;
   reported: the median of the paired ratios and how long the prefill waited for
   the rows; the two must give bit-identical encoder outputs.

Only the Engram tables are on disk; the rest of the small model is random weights in
memory (identical for both sides). ``--json`` prints ``prefetch_prefill_ratio``
(service + prefetch over in-process) and ``rows_per_s`` (largest prompt) among others.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from cluster.bench import suite
from model import formats
from model.config import ModelConfig, TextConfig
from model.engram import EngramLayout, NgramHasher
from model.engram_primes import find_primes

_DEFAULT_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "tiny"
_HEAD_DIM = 256
_REPS_BY_SIZE = {1024: 20, 4096: 10, 16384: 5, 65536: 3}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", type=Path, default=_DEFAULT_CONFIG, help="small config directory (default configs/tiny)")
    parser.add_argument("--rows", type=int, default=2_000_000, help="rows per Engram table, about (default 2,000,000)")
    parser.add_argument("--sizes", default="1024,4096,16384,65536", help="prompt sizes in tokens, comma-separated")
    parser.add_argument("--shards", type=int, default=2, help="shard actors (default 2)")
    parser.add_argument("--prefill-tokens", type=int, default=3072, help="prompt of the prefill comparison (default 3072)")
    parser.add_argument("--reps", type=int, default=9, help="timed prefills of each side, alternating (default 9)")
    parser.add_argument("--address", default=None, help="an existing Ray cluster (default: start a local one)")
    parser.add_argument("--hosts", type=int, default=0, choices=(0, 2),
                        help="2: the shards on an Engram host of their own across a shaped link, this bench on "
                             "a head host (namespace hosts, root: cluster/hosts.py)")
    parser.add_argument("--link-gbit", type=float, default=1.0, help="with --hosts: the link's bandwidth")


@dataclass(frozen=True)
class LookupRow:
    """Lookups of one prompt size: latency percentiles and throughput at p50."""

    tokens: int
    row_ids: int
    unique_rows: int
    p50_ms: float
    p99_ms: float
    rows_per_s: float
    gb_per_s: float
    direct_gather_ms: float


def _bench_config(config_dir: Path, rows: int) -> TextConfig:
    """The small config with 256-wide Engram rows and ~``rows`` rows per table."""
    text = ModelConfig.load(config_dir).text
    if not text.engram_layer_ids:
        raise ValueError(f"{config_dir} has no Engram layers")
    n_cols = (text.engram_max_ngram_size - 1) * text.engram_n_heads
    vocab = max(text.engram_compressed_vocab_size + 1, rows // n_cols)
    primes = find_primes(vocab, len(text.engram_layer_ids), text.engram_max_ngram_size, text.engram_n_heads)
    sizes = tuple(sum(p for per_ngram in layer for p in per_ngram) for layer in primes)
    return dataclasses.replace(text, engram_head_dim=_HEAD_DIM, engram_vocab_size=vocab, engram_num_embeddings=sizes)


def _random_fp8_table(rows: int, rng: np.random.Generator) -> formats.Packed:
    """Random E4M3 bytes (never the NaN codes 0x7F / 0xFF) and UE8M0 scales 2^-9..2^-1.

    A block of ``2^17`` random rows repeats down the table: the content does not change
    the memory traffic, and drawing gigabytes of random bytes would dominate the run."""
    period = min(rows, 1 << 17)
    codes = rng.integers(0, 254, size=(period, _HEAD_DIM), dtype=np.uint8)
    codes += codes >= 0x7F  # 0..126, 128..254
    scales = rng.integers(118, 127, size=(period, _HEAD_DIM // 32), dtype=np.uint8)
    repeat = -(-rows // period)
    return formats.Packed(
        torch.from_numpy(np.tile(codes, (repeat, 1))[:rows]), torch.from_numpy(np.tile(scales, (repeat, 1))[:rows])
    )


def _write_tables(directory: Path, text: TextConfig) -> dict[int, formats.Packed]:
    """The Engram tables in the released layout (``layers.L.engram.embed.*``)."""
    rng = np.random.default_rng(0)
    tables = {layer: _random_fp8_table(rows, rng) for layer, rows in zip(text.engram_layer_ids, text.engram_num_embeddings)}
    tensors = {}
    for layer, table in tables.items():
        tensors[f"layers.{layer}.engram.embed.weight"] = table.data.view(torch.float8_e4m3fn)
        tensors[f"layers.{layer}.engram.embed.scale"] = table.scales.view(torch.float8_e8m0fnu)
    save_file(tensors, directory / "model.safetensors")
    (directory / "config.json").write_text(json.dumps({"text_config": text.to_dict()}))
    return tables


def _model_with_tables(text: TextConfig, tables: dict[int, formats.Packed]):
    """The small model with random weights and, as its in-process Engram tables, the
    written tables dequantised to float32 (what ``load_model`` holds; the fast
    dequantisation is tested equal to ``ENGRAM_ROW``)."""
    from actors.engram_client import dequantize_rows
    from model.transformer import Transformer

    small = dataclasses.replace(text, engram_num_embeddings=(1,) * len(tables), engram_vocab_size=1)
    model = Transformer(small).init_weights(seed=0).eval()
    for block in model.layers:
        if block.engram is None:
            continue
        packed = tables[block.plan.index]
        values = torch.empty(packed.data.shape, dtype=torch.float32)
        for start in range(0, values.shape[0], 1 << 18):  # bounded temporaries
            part = slice(start, start + (1 << 18))
            values[part] = torch.from_numpy(dequantize_rows(packed.data[part].numpy(), packed.scales[part].numpy()))
        block.engram.embed.weight = torch.nn.Parameter(values, requires_grad=False)
        block.engram.embed.num_embeddings = values.shape[0]
    return model


def _percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered) + 0.5) - 1))]


def _lookups(client, hasher, tables, plan, sizes: list[int]) -> list[LookupRow]:
    direct = {t.layer_id: np.asarray(tables[t.layer_id].data) for t in plan.tables}
    generator = torch.Generator().manual_seed(1)
    rows = []
    for size in sizes:
        tokens = torch.randint(0, hasher.token_map.numel(), (size,), generator=generator)
        engram_ids, _ = hasher.hash_ids(tokens)  # [S, L, C]
        client.start(engram_ids).raw()  # warm the path and the pages
        latencies, unique = [], 0
        for _ in range(_REPS_BY_SIZE.get(size, 5)):
            start = time.perf_counter()
            lookup = client.start(engram_ids)
            lookup.raw()
            latencies.append(time.perf_counter() - start)
            unique = lookup.n_unique_rows
        gather = []
        for _ in range(3):  # the reference: gather the same unique rows from memory, one thread
            start = time.perf_counter()
            for t, table in enumerate(plan.tables):
                direct[table.layer_id][np.unique(engram_ids[:, t].numpy())]
            gather.append(time.perf_counter() - start)
        p50 = statistics.median(latencies)
        row_bytes = _HEAD_DIM + _HEAD_DIM // 32
        rows.append(
            LookupRow(
                tokens=size,
                row_ids=engram_ids.numel(),
                unique_rows=unique,
                p50_ms=p50 * 1e3,
                p99_ms=_percentile(latencies, 0.99) * 1e3,
                rows_per_s=engram_ids.numel() / p50,
                gb_per_s=unique * row_bytes / p50 / 1e9,
                direct_gather_ms=min(gather) * 1e3,
            )
        )
    return rows


def _prefill(engine, hasher, client, n_tokens: int, reps: int) -> dict:
    """Median prefill seconds, paired ratios, with in-process tables and with service + prefetch."""
    generator = torch.Generator().manual_seed(2)
    ids = torch.randint(0, hasher.token_map.numel(), (n_tokens,), generator=generator).tolist()

    def in_process():
        return engine.prefill(engine.new_cache(), ids)

    waits = []

    def with_service():
        cache = engine.new_cache()
        engram_ids, _ = hasher.hash_ids(torch.tensor(ids), cache.ngram)
        lookup = client.start(engram_ids).prepare()  # the router's prefetch at arrival

        def rows():  # how long the prefill is held up by the service
            start = time.perf_counter()
            try:
                return lookup.rows()
            finally:
                waits.append(time.perf_counter() - start)

        return engine.prefill(cache, ids, engram_rows=rows)

    a, b = in_process(), with_service()  # warm-up, and the numbers must agree
    identical = torch.equal(a.streams, b.streams) and torch.equal(a.pre, b.pre)
    times = {"in_process": [], "service": []}
    for _ in range(reps):
        for name, run in (("in_process", in_process), ("service", with_service)):
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    # The machine may be shared and drifts: each service run is compared with the
    # in-process run just before it, and the median of those ratios is reported (the
    # ratio of the best runs is shown as well).
    best = {name: min(samples) for name, samples in times.items()}
    pairs = [s / i for i, s in zip(times["in_process"], times["service"])]
    return {
        "tokens": n_tokens,
        "in_process_s": statistics.median(times["in_process"]),
        "service_s": statistics.median(times["service"]),
        "ratio": statistics.median(pairs),
        "best_ratio": best["service"] / best["in_process"],
        "identical": identical,
        "rows_wait_ms_p50": 1e3 * statistics.median(waits[1:]),
    }


def run(args: argparse.Namespace) -> int:
    import ray

    from actors.engram import EngramService, EngramServiceConfig
    from cluster import UserError
    from model.runtime.engine import Engine

    if args.hosts:
        return _across_hosts(args)
    try:
        sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    except ValueError:
        raise UserError(f"--sizes must be comma-separated integers, got {args.sizes!r}") from None
    if not sizes or min(sizes) < 1 or args.shards < 1 or args.rows < 1000 or args.reps < 1:
        raise UserError("--sizes, --shards, --reps must be positive and --rows at least 1000")
    if not (args.config / "config.json").exists():
        raise UserError(f"no config.json in {args.config}")

    threads = torch.get_num_threads()  # `v41 --threads` (the shard actors share these cores)
    started_ray = False
    with tempfile.TemporaryDirectory(prefix="v41-bench-engram-") as tmp:
        directory = Path(tmp)
        text = _bench_config(args.config, args.rows)
        tables = _write_tables(directory, text)
        layout = EngramLayout.from_config(text)
        hasher = NgramHasher(layout, torch.arange(text.vocab_size) % text.engram_compressed_vocab_size)
        copy_gb_s = suite.copy_gb_s()
        if args.address or ray.is_initialized():
            ray.init(address=args.address, ignore_reinit_error=True, logging_level="ERROR")
        else:
            ray.init(
                address="local",  # this bench's own instance, not another on the machine
                num_cpus=max(2, args.shards),
                resources={"engram_host": args.shards},
                object_store_memory=1 << 30,
                include_dashboard=False,
                logging_level="ERROR",
            )
            started_ray = True
        service = EngramService.launch(
            EngramServiceConfig(checkpoint=str(directory), n_shards=args.shards, num_cpus=0, timeout_s=60.0),
            text.engram_layer_ids,
        )
        try:
            client = service.client(hasher)
            lookups = _lookups(client, hasher, tables, service.plan, sizes)
            model = _model_with_tables(text, tables)
            prefill = _prefill(Engine(model, hasher), hasher, client, args.prefill_tokens, args.reps)
        finally:
            service.shutdown()
            if started_ray:
                ray.shutdown()

    _print(args, text, tables, lookups, prefill, copy_gb_s, threads)
    return 0 if prefill["identical"] else 1


def _across_hosts(args: argparse.Namespace) -> int:
    """This bench run inside a head host of namespace hosts (the Ray head), its shards
    on an Engram host (``engram_host`` resources) across a link of ``--link-gbit``:
    every row the prefill reads crosses it. The JSON gains ``hosts`` and ``link_gbit``."""
    from cluster import UserError, hosts
    from cluster.hosts import Hosts
    from cluster.hosts_app import RAY_PORT, HostsApp

    if hosts.available() is not None:
        raise UserError(f"--hosts: {hosts.available()}")
    with Hosts(1, link_gbit=args.link_gbit) as cluster:
        head, engram = cluster.hosts
        raylets = HostsApp(cluster, config="", head_resources={}, worker_resources=[{"engram_host": args.shards}])
        raylets.start_raylets()
        bench = ["v41", "bench", "engram", "--address", f"{head.address}:{RAY_PORT}", "--config", str(args.config),
                 "--rows", str(args.rows), "--sizes", args.sizes, "--shards", str(args.shards),
                 "--prefill-tokens", str(args.prefill_tokens), "--reps", str(args.reps)] + (["--json"] if args.json else [])
        done = raylets.run(head, bench, timeout=3600, check=False)
    lines = done.stdout.strip().splitlines()
    if done.returncode not in (0, 1) or not lines:
        raise UserError(f"the bench on the head host failed:\n{done.stderr[-3000:]}")
    print(f"across hosts: this bench on {head.address}, {args.shards} shard(s) on the Engram host {engram.address}, "
          f"a {args.link_gbit:g} Gbit/s link")
    if args.json:
        print("\n".join(lines[:-1]))
        print(json.dumps({**json.loads(lines[-1]), "hosts": 2, "link_gbit": args.link_gbit}))
    else:
        print("\n".join(lines))
    return done.returncode


def _print(args: argparse.Namespace, text, tables: dict, lookups: list, prefill: dict, copy_gb_s: float,
           threads: int) -> None:
    """The look-up table, the prefill comparison and (``--json``) the JSON line."""
    table_gb = sum(t.data.numel() + t.scales.numel() for t in tables.values()) / 1e9
    print(
        f"Engram service: {args.shards} shard actor(s), tables {len(tables)} x {list(text.engram_num_embeddings)} rows "
        f"x {_HEAD_DIM} FP8 + scales ({table_gb:.2f} GB); in-memory copy {copy_gb_s:.1f} GB/s; "
        f"{threads} torch thread(s)"
    )
    print(f"{'tokens':>7} {'row ids':>9} {'unique':>9} {'p50 ms':>8} {'p99 ms':>8} {'rows/s':>11} {'GB/s':>6} {'direct gather ms':>17}")
    for row in lookups:
        print(
            f"{row.tokens:>7} {row.row_ids:>9} {row.unique_rows:>9} {row.p50_ms:>8.1f} {row.p99_ms:>8.1f} "
            f"{row.rows_per_s:>11.3g} {row.gb_per_s:>6.2f} {row.direct_gather_ms:>17.1f}"
        )
    print(
        f"prefill {prefill['tokens']} tokens: in-process tables {prefill['in_process_s']:.3f} s, "
        f"service + prefetch {prefill['service_s']:.3f} s (medians of {args.reps}); ratio {prefill['ratio']:.3f} "
        f"(median of paired runs; of the best runs {prefill['best_ratio']:.3f}), identical outputs: {prefill['identical']}; the prefill "
        f"waited {prefill['rows_wait_ms_p50']:.1f} ms (p50) for the rows"
    )
    if args.json:
        largest = lookups[-1]
        print(
            json.dumps(
                {
                    "prefetch_prefill_ratio": round(prefill["ratio"], 4),
                    "rows_per_s": round(largest.rows_per_s),
                    "gb_per_s": round(largest.gb_per_s, 3),
                    "copy_gb_per_s": round(copy_gb_s, 2),
                    "prefill_tokens": prefill["tokens"],
                    "prefill_in_process_s": round(prefill["in_process_s"], 4),
                    "prefill_service_s": round(prefill["service_s"], 4),
                    "prefill_best_ratio": round(prefill["best_ratio"], 4),
                    "prefill_rows_wait_ms_p50": round(prefill["rows_wait_ms_p50"], 2),
                    "prefill_identical": prefill["identical"],
                    "shards": args.shards,
                    "torch_threads": threads,
                    "table_rows": list(text.engram_num_embeddings),
                    "lookups": [dataclasses.asdict(row) for row in lookups],
                }
            )
        )
