"""`v41 bench serve`: the HTTP path measured against itself and against the engine.

Starts the app on this machine (a local Ray instance, an embedded Redis, RAM and SSD
tiers), then measures through HTTP:

- **streams**: N clients at once (``--clients``), each streaming a ``--tokens``-token
  answer: time to first token (p50) and decode tokens/s, against the engine's own
  batched decode at batch N on the same weights and step, measured in this process
  before Ray starts (``served_over_engine_batchN``), and where the difference goes
  (CPU per token by process, the engine thread's busy share: :mod:`cluster.bench.serve_streams`);
- **returning turn**: a conversation with a long history (``--history`` tokens) is
  answered once; its next turn (history + answer + a short message) is timed to
  first token (the median of ``--returning`` such turns, each resuming from turn one,
  with the median Server-Timing stages of the same turns non-streamed), against
  cold runs of prompts of the same shape that nothing cached (the median of
  ``--cold``);
- **Serve overhead**: the latency of a one-token request through HTTP minus the time
  the replicas spent computing it (prefill, handoff, replay, sample; reported by the
  router in the ``x-v41-replica-ms`` header), p50, for a short new prompt (encoded by
  the decoder replica) and for a ~200-token new prompt (the prefill pool's path, with
  its handoff); each one request at a time on an idle server ("isolated", the
  headline) and back to back (the next request meets the previous conversation's
  write to the store). Also printed: HTTP minus the same request run in-process
  before Ray started, which adds the slowdown of sharing two cores with the Ray
  processes. Where the time goes: the median of each stage of the responses'
  ``Server-Timing`` header, and ``http`` (the client's wait beyond the router's own
  span).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

from cluster.bench.serve_streams import ROUNDS, breakdown, cpu_now, served_streams, timed_stream


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", type=Path, default=None, help="checkpoint (default: as v41 serve)")
    parser.add_argument("--clients", default="1,4,16", help="concurrency levels (streams at once)")
    parser.add_argument("--tokens", type=int, default=256, help="tokens generated per stream")
    parser.add_argument("--history", type=int, default=16384, help="history tokens of the returning turn")
    parser.add_argument("--repeats", type=int, default=40, help="overhead repetitions")
    parser.add_argument("--returning", type=int, default=7, help="returning turns timed (median)")
    parser.add_argument("--cold", type=int, default=3, help="cold runs of the same shape timed (median)")
    parser.add_argument("--compiled-step", action="store_true", help="both pools run the compiled step")


def _history_text(tokenizer, n_tokens: int, nonce: str) -> str:
    """Python-looking text of about ``n_tokens`` tokens, unique per ``nonce``."""
    unit = "".join(f"def handler_{i}(request):\n    return request.get('{nonce}-{i}')\n\n" for i in range(40))
    per_unit = len(tokenizer.encode(unit))
    return unit * max(1, n_tokens // per_unit)


def _client_prompts(n: int) -> list[str]:
    return [f"def client_{i}():" for i in range(n)]


async def _streams(session, chat: str, args, model_name: str,
                   reference: tuple[dict[int, tuple[float, float]], tuple[int, ...]], pids) -> dict:
    """Each concurrency level's streams against the engine at that batch (``reference``:
    the engine's (tokens/s, tokens per step) by batch, and the stop tokens biased out;
    see :mod:`cluster.bench.serve_streams`)."""
    from ray import serve

    decoder = serve.get_deployment_handle("DecoderPool", app_name="v41")
    engine, stops = reference
    base = {"model": model_name, "max_tokens": args.tokens, "temperature": 0,
            "logit_bias": {str(token): -100 for token in stops}}
    bodies = [{**base, "messages": [{"role": "user", "content": text}]} for text in _client_prompts(max(engine))]
    for body in bodies:  # each prompt once: its cache is kept, and every package loaded
        await timed_stream(session, chat, {**body, "max_tokens": 2})
    rows = {}
    for n, (engine_rate, engine_per_step) in engine.items():
        loop, cpu = await decoder.loop_stats.remote(), cpu_now(*pids)
        runs = [await served_streams(session, chat, bodies[:n]) for _ in range(ROUNDS)]
        loop, cpu = await decoder.loop_stats.remote() - loop, cpu_now(*pids) - cpu
        rate = statistics.median(rate for rate, _, _ in runs)
        tokens = sum(tokens for _, tokens, _ in runs)
        rows[n] = {"tokens_per_s": rate, "engine_tokens_per_s": engine_rate, "served_over_engine": rate / engine_rate,
                   "engine_tokens_per_step": engine_per_step,
                   "tokens": tokens, "ttft_ms_p50": 1e3 * statistics.median(t for _, _, ttfts in runs for t in ttfts),
                   "where_us_per_token": breakdown(tokens, cpu, loop), "decoder_loop": asdict(loop)}
    return rows


async def _measure(url: str, args, model_name: str, tokenizer, engine, pids) -> dict:
    import aiohttp

    from cluster.serving.timing import parse_server_timing

    chat = f"{url}/v1/chat/completions"
    results: dict = {}
    timeout = aiohttp.ClientTimeout(total=3600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        results["streams"] = await _streams(session, chat, args, model_name, engine, pids)
        # Returning turn against cold.
        short = {"model": model_name, "max_tokens": 4, "temperature": 0}
        turn_one = [{"role": "user", "content": _history_text(tokenizer, args.history, "a")}]
        await timed_stream(session, chat, {**short, "messages": turn_one})
        answer = (await (await session.post(chat, json={**short, "messages": turn_one})).json())
        answer_text = answer["choices"][0]["message"]["content"]
        await asyncio.sleep(1.0)  # the window state is written behind the first answer
        # Each returning turn resumes from turn one (its own last message differs):
        # streamed for the TTFT, then the same shape non-streamed for its stages.
        ttfts, stages, usage = [], [], {}
        for i in range(args.returning):
            follow = [{"role": "assistant", "content": answer_text}, {"role": "user", "content": f"and then? {i}"}]
            returning = await timed_stream(session, chat, {**short, "messages": turn_one + follow})
            ttfts.append(returning.ttft_s)
            usage = returning.usage
            follow[1]["content"] = f"and after that? {i}"
            response = await session.post(chat, json={**short, "max_tokens": 1, "messages": turn_one + follow})
            await response.read()
            stages.append(parse_server_timing(response.headers.get("server-timing", ""))[0])
        colds = []  # prompts of the same shape that nothing cached (each its own nonce)
        for i in range(args.cold):
            cold_prompt = [{"role": "user", "content": _history_text(tokenizer, args.history, f"b{i}")}] + follow
            colds.append(await timed_stream(session, chat, {**short, "messages": cold_prompt}))
        results["returning"] = {"ttft_s": statistics.median(ttfts), "ttft_s_all": ttfts,
                                "stages_ms_p50": {k: round(statistics.median(s.get(k, 0.0) for s in stages), 2)
                                                  for k in stages[0]},
                                "cached_tokens": usage.get("prompt_tokens_details", {}).get("cached_tokens", 0),
                                "prompt_tokens": usage.get("prompt_tokens", 0)}
        results["cold"] = {"ttft_s": statistics.median(c.ttft_s for c in colds), "ttft_s_all": [c.ttft_s for c in colds],
                           "prompt_tokens": colds[-1].usage.get("prompt_tokens", 0)}
    return results


def _one_token_requests(host: str, port: int, model_name: str, repeats: int) -> dict:
    """Serve overhead: one-token requests. A short new prompt (the decoder encodes it)
    and a new prompt of ~200 tokens (above local_prefill_tokens: the prefill pool
    encodes it and hands off), each new so that nothing is cached. "isolated": one
    request at a time on an idle server (a pause lets the previous conversation's
    write-behind finish, which the in-process request does not do either);
    "back_to_back": the next request leaves as soon as the answer is in.

    The client is http.client on one keep-alive connection: what is measured is the
    server's path, and aiohttp's own request and response handling adds ~0.6 ms here."""
    import http.client

    from cluster.serving.timing import parse_server_timing

    connection = http.client.HTTPConnection(host, port, timeout=600)
    results: dict = {}
    try:
        for path in ("short", "pool"):
            results[path] = {}
            for pacing, pause in (("isolated", 0.05), ("back_to_back", 0.0)):
                latency, replica, stages = [], [], []
                for i in range(repeats):
                    content = "x = 1" if path == "short" else f"# {pacing} {i}\n" + "def f():\n    return 1\n" * 30
                    body = json.dumps({"model": model_name, "max_tokens": 1, "temperature": 0,
                                       "messages": [{"role": "user", "content": content}]})
                    time.sleep(pause)
                    start = time.perf_counter()
                    connection.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
                    reply = connection.getresponse()
                    payload = reply.read()
                    latency.append(time.perf_counter() - start)
                    if reply.status != 200:
                        raise RuntimeError(f"HTTP {reply.status}: {payload.decode(errors='replace')}")
                    replica.append(float(reply.getheader("x-v41-replica-ms")) / 1e3)
                    stages.append(parse_server_timing(reply.getheader("server-timing", ""))[0])
                results[path][pacing] = {"http_s": latency, "replica_s": replica, "stages_ms": stages}
    finally:
        connection.close()
    return results


def _in_process_one_token(model_dir: Path, repeats: int) -> list[float]:
    from model.chat import ChatTemplate, Message
    from model.tokenizer import Tokenizer
    from model.runtime.engine import Engine
    from model.loader import load_hasher, load_model

    config, model = load_model(model_dir)
    engine = Engine(model, load_hasher(model_dir, config))
    prompt = ChatTemplate(Tokenizer.from_dir(model_dir)).render([Message("user", "x = 1")])
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        cache = engine.new_cache()
        int(engine.replay(cache, engine.prefill(cache, prompt)).argmax())
        times.append(time.perf_counter() - start)
    return times[1:]


def _checked_counts(args: argparse.Namespace) -> list[int]:
    """The concurrency levels; a count the bench cannot run is a :class:`UserError`."""
    from cluster import UserError

    for name in ("repeats", "returning", "cold"):
        if getattr(args, name) < 1:
            raise UserError(f"--{name} must be at least 1, got {getattr(args, name)}")
    clients = [int(c) for c in args.clients.split(",") if c.strip().isdigit()]
    if len(clients) != len(args.clients.split(",")) or min(clients) < 1:
        raise UserError(f"--clients must be comma-separated counts of at least 1, got {args.clients!r}")
    if args.tokens < 2:
        raise UserError(f"--tokens must be at least 2, got {args.tokens}")
    return clients


def run(args: argparse.Namespace) -> int:
    from actors.config import AppConfig
    from cluster import UserError
    from cluster.serving.local import default_model, local_app
    from cluster.bench.serve_streams import engine_rates, print_streams, replica_pid
    from model.chat import ChatTemplate, Message
    from model.config import ModelConfig
    from model.tokenizer import Tokenizer
    from storage.redis_server import free_port

    model = args.model or default_model()
    if not (model / "config.json").exists():
        raise UserError(f"no checkpoint at {model}")
    clients = _checked_counts(args)
    tokenizer = Tokenizer.from_dir(model)
    in_process = _in_process_one_token(model, args.repeats)
    port = free_port()
    cache_dir = tempfile.mkdtemp(prefix="v41-bench-serve-")  # removed once the store actors are gone
    # Both sides verify the same number of guesses a step: the goodput scheduler's cost
    # table is profiled at each start, and two profiles can choose differently (3.15
    # against 3.81 tokens a step at one client, either side), which compares other work.
    app_args = {"model": str(model), "ssd_dir": cache_dir + "/{node}", "max_model_len": args.history * 2 + 1024,
                "compiled_step": args.compiled_step, "speculation": "fixed"}
    template = ChatTemplate(tokenizer)
    stops = ModelConfig.load(model).text.eos_ids  # biased out: every stream runs to --tokens
    engine = engine_rates(app_args, [template.render([Message("user", text)]) for text in _client_prompts(max(clients))],
                          clients, args.tokens, stops)
    try:
        with local_app(app_args, port=port):  # as `v41 serve` runs the app
            name = AppConfig.from_args({"model": str(model)}).model_name
            pids = replica_pid("Router"), replica_pid("DecoderPool")
            results = asyncio.run(_measure(f"http://127.0.0.1:{port}", args, name, tokenizer, (engine, stops), pids))
            results.update(_one_token_requests("127.0.0.1", port, name, args.repeats))
    finally:
        shutil.rmtree(cache_dir, ignore_errors=True)
    short = results["short"]["isolated"]
    http_p50 = statistics.median(short["http_s"])
    overhead_ms = _overhead_ms(short)
    vs_in_process_ms = 1e3 * (http_p50 - statistics.median(in_process))
    ratio = results["returning"]["ttft_s"] / results["cold"]["ttft_s"]
    print(f"v41 bench serve: {model}" + (" (compiled step)" if args.compiled_step else " (eager step)"))
    print_streams(results["streams"], args.tokens)
    print(f"\nreturning turn: TTFT p50 {results['returning']['ttft_s']:.3f} s over {args.returning} turns "
          f"({results['returning']['cached_tokens']} of {results['returning']['prompt_tokens']} prompt tokens cached); "
          "stages (p50 ms): " + ", ".join(f"{k} {v:.1f}" for k, v in results["returning"]["stages_ms_p50"].items()))
    print(f"cold run:       TTFT p50 {results['cold']['ttft_s']:.3f} s over {args.cold} runs "
          f"({results['cold']['prompt_tokens']} prompt tokens)")
    print(f"returning / cold TTFT: {ratio:.4f}")
    print(f"\none-token request, short new prompt: HTTP p50 {1e3 * http_p50:.1f} ms; compute inside the replicas "
          f"p50 {1e3 * statistics.median(short['replica_s']):.1f} ms; the same request in-process (before Ray "
          f"started) p50 {1e3 * statistics.median(in_process):.1f} ms; HTTP - in-process {vs_in_process_ms:.1f} ms")
    overheads = {path: {pacing: _overhead_ms(run) for pacing, run in results[path].items()} for path in ("short", "pool")}
    stages = {path: _stage_medians(results[path]["isolated"]["stages_ms"], results[path]["isolated"]["http_s"])
              for path in ("short", "pool")}
    print(f"\nServe overhead (HTTP - replica compute) p50 ms  {'isolated':>9}  {'back-to-back':>12}")
    for path, label in (("short", "short new prompt (decoder encodes)"), ("pool", "~200-token prompt (prefill pool)")):
        print(f"  {label:<45}  {overheads[path]['isolated']:>9.1f}  {overheads[path]['back_to_back']:>12.1f}")
    for path in ("short", "pool"):
        print(f"  {path}, isolated, where its time goes (p50 ms): "
              + ", ".join(f"{k} {v:.1f}" for k, v in stages[path].items()))
    if args.json:
        best = max(results["streams"].values(), key=lambda row: row["tokens_per_s"])
        print(json.dumps({
            **{f"served_over_engine_batch{n}": round(row["served_over_engine"], 3)
               for n, row in results["streams"].items()},
            "returning_over_cold_ttft": round(ratio, 4),
            "serve_overhead_ms_p50": round(overhead_ms, 2),
            "serve_overhead_back_to_back_ms_p50": round(overheads["short"]["back_to_back"], 2),
            "http_minus_in_process_ms_p50": round(vs_in_process_ms, 2),
            "tokens_per_s": round(best["tokens_per_s"], 2),
            "serve_overhead_pool_path_ms_p50": round(overheads["pool"]["isolated"], 2),
            "serve_overhead_pool_path_back_to_back_ms_p50": round(overheads["pool"]["back_to_back"], 2),
            "one_token_stages_ms_p50": {path: {k: round(v, 2) for k, v in row.items()} for path, row in stages.items()},
            "streams": results["streams"],
            "returning": results["returning"], "cold": results["cold"],
        }))
    return 0


def _stage_medians(stages: list[dict[str, float]], http_s: list[float]) -> dict[str, float]:
    """Per stage of the Server-Timing header, the median; ``http`` is what the client
    waited beyond the router's own span (the HTTP server, the network, the client)."""
    names = [name for name in stages[0] if name != "compute"] if stages else []
    out = {name: statistics.median(s.get(name, 0.0) for s in stages) for name in names}
    inside = [sum(v for k, v in s.items() if k != "compute") for s in stages]
    out["http"] = statistics.median(1e3 * h - i for h, i in zip(http_s, inside))
    return out


def _overhead_ms(run: dict) -> float:
    """p50 of HTTP latency minus the replicas' compute, in ms."""
    return 1e3 * statistics.median(h - r for h, r in zip(run["http_s"], run["replica_s"]))
