"""`v41 bench serve`: the HTTP path measured against itself and against the engine.

Starts the app on this machine (a local Ray instance, an embedded Redis, RAM and SSD
tiers), then measures through HTTP:

- **concurrency**: N clients at once, each streaming ``--tokens`` tokens: time to
  first token (p50) and aggregate tokens/s;
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
from pathlib import Path

from cluster.bench.sse import sse_chunks


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", type=Path, default=None, help="checkpoint (default: as v41 serve)")
    parser.add_argument("--clients", default="1,4,8", help="concurrency levels")
    parser.add_argument("--tokens", type=int, default=32, help="tokens generated per request")
    parser.add_argument("--history", type=int, default=16384, help="history tokens of the returning turn")
    parser.add_argument("--repeats", type=int, default=40, help="overhead repetitions")
    parser.add_argument("--returning", type=int, default=7, help="returning turns timed (median)")
    parser.add_argument("--cold", type=int, default=3, help="cold runs of the same shape timed (median)")
    parser.add_argument("--compiled-step", action="store_true", help="both pools run the compiled step")


async def _stream(session, url: str, body: dict) -> tuple[float, int, float, dict]:
    """(seconds to first token, tokens, total seconds, usage) of one streamed request."""
    start = time.perf_counter()
    first, tokens, usage = None, 0, {}
    async with session.post(url, json={**body, "stream": True, "stream_options": {"include_usage": True}}) as reply:
        if reply.status != 200:
            raise RuntimeError(f"HTTP {reply.status}: {await reply.text()}")
        async for chunk in sse_chunks(reply):
            if "error" in chunk:
                raise RuntimeError(chunk["error"]["message"])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices", []):
                if choice["delta"].get("content"):
                    first = first or time.perf_counter()
                    tokens += 1
    end = time.perf_counter()
    return (first or end) - start, tokens, end - start, usage


def _history_text(tokenizer, n_tokens: int, nonce: str) -> str:
    """Python-looking text of about ``n_tokens`` tokens, unique per ``nonce``."""
    unit = "".join(f"def handler_{i}(request):\n    return request.get('{nonce}-{i}')\n\n" for i in range(40))
    per_unit = len(tokenizer.encode(unit))
    return unit * max(1, n_tokens // per_unit)


async def _measure(url: str, args, model_name: str, tokenizer) -> dict:
    import aiohttp

    from cluster.serving.timing import parse_server_timing

    chat = f"{url}/v1/chat/completions"
    results: dict = {"concurrency": {}}
    timeout = aiohttp.ClientTimeout(total=3600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        base = {"model": model_name, "max_tokens": args.tokens, "temperature": 0}
        await _stream(session, chat, {**base, "messages": [{"role": "user", "content": "warm up"}]})
        for n in [int(c) for c in args.clients.split(",")]:
            start = time.perf_counter()
            runs = await asyncio.gather(*[
                _stream(session, chat, {**base, "messages": [{"role": "user", "content": f"def client_{n}_{i}():"}]})
                for i in range(n)])
            wall = time.perf_counter() - start
            results["concurrency"][n] = {
                "ttft_ms_p50": 1e3 * statistics.median(r[0] for r in runs),
                "tokens_per_s": sum(r[1] for r in runs) / wall,
            }
        # Returning turn against cold.
        short = {"model": model_name, "max_tokens": 4, "temperature": 0}
        turn_one = [{"role": "user", "content": _history_text(tokenizer, args.history, "a")}]
        _, _, _, _ = await _stream(session, chat, {**short, "messages": turn_one})
        answer = (await (await session.post(chat, json={**short, "messages": turn_one})).json())
        answer_text = answer["choices"][0]["message"]["content"]
        await asyncio.sleep(1.0)  # the window state is written behind the first answer
        # Each returning turn resumes from turn one (its own last message differs):
        # streamed for the TTFT, then the same shape non-streamed for its stages.
        ttfts, stages, usage = [], [], {}
        for i in range(args.returning):
            follow = [{"role": "assistant", "content": answer_text}, {"role": "user", "content": f"and then? {i}"}]
            returning = await _stream(session, chat, {**short, "messages": turn_one + follow})
            ttfts.append(returning[0])
            usage = returning[3]
            follow[1]["content"] = f"and after that? {i}"
            response = await session.post(chat, json={**short, "max_tokens": 1, "messages": turn_one + follow})
            await response.read()
            stages.append(parse_server_timing(response.headers.get("server-timing", ""))[0])
        colds = []  # prompts of the same shape that nothing cached (each its own nonce)
        for i in range(args.cold):
            cold_prompt = [{"role": "user", "content": _history_text(tokenizer, args.history, f"b{i}")}] + follow
            colds.append(await _stream(session, chat, {**short, "messages": cold_prompt}))
        results["returning"] = {"ttft_s": statistics.median(ttfts), "ttft_s_all": ttfts,
                                "stages_ms_p50": {k: round(statistics.median(s.get(k, 0.0) for s in stages), 2)
                                                  for k in stages[0]},
                                "cached_tokens": usage.get("prompt_tokens_details", {}).get("cached_tokens", 0),
                                "prompt_tokens": usage.get("prompt_tokens", 0)}
        results["cold"] = {"ttft_s": statistics.median(c[0] for c in colds), "ttft_s_all": [c[0] for c in colds],
                           "prompt_tokens": colds[-1][3].get("prompt_tokens", 0)}
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


def run(args: argparse.Namespace) -> int:
    from actors.config import AppConfig
    from cluster import UserError
    from cluster.serving.local import default_model, local_app
    from model.tokenizer import Tokenizer
    from storage.redis_server import free_port

    model = args.model or default_model()
    if not (model / "config.json").exists():
        raise UserError(f"no checkpoint at {model}")
    for name in ("repeats", "returning", "cold"):
        if getattr(args, name) < 1:
            raise UserError(f"--{name} must be at least 1, got {getattr(args, name)}")
    tokenizer = Tokenizer.from_dir(model)
    in_process = _in_process_one_token(model, args.repeats)
    port = free_port()
    cache_dir = tempfile.mkdtemp(prefix="v41-bench-serve-")  # removed once the store actors are gone
    app_args = {"model": str(model), "ssd_dir": cache_dir + "/{node}", "max_model_len": args.history * 2 + 1024,
                "compiled_step": args.compiled_step}
    try:
        with local_app(app_args, port=port):  # as `v41 serve` runs the app
            name = AppConfig.from_args({"model": str(model)}).model_name
            results = asyncio.run(_measure(f"http://127.0.0.1:{port}", args, name, tokenizer))
            results.update(_one_token_requests("127.0.0.1", port, name, args.repeats))
    finally:
        shutil.rmtree(cache_dir, ignore_errors=True)
    short = results["short"]["isolated"]
    http_p50 = statistics.median(short["http_s"])
    overhead_ms = _overhead_ms(short)
    vs_in_process_ms = 1e3 * (http_p50 - statistics.median(in_process))
    ratio = results["returning"]["ttft_s"] / results["cold"]["ttft_s"]
    print(f"v41 bench serve: {model}" + (" (compiled step)" if args.compiled_step else ""))
    print(f"{'clients':>8}  {'TTFT p50 ms':>12}  {'tokens/s':>9}")
    for n, row in results["concurrency"].items():
        print(f"{n:>8}  {row['ttft_ms_p50']:>12.1f}  {row['tokens_per_s']:>9.1f}")
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
        best = max(results["concurrency"].values(), key=lambda row: row["tokens_per_s"])
        print(json.dumps({
            "returning_over_cold_ttft": round(ratio, 4),
            "serve_overhead_ms_p50": round(overhead_ms, 2),
            "serve_overhead_back_to_back_ms_p50": round(overheads["short"]["back_to_back"], 2),
            "http_minus_in_process_ms_p50": round(vs_in_process_ms, 2),
            "tokens_per_s": round(best["tokens_per_s"], 2),
            "serve_overhead_pool_path_ms_p50": round(overheads["pool"]["isolated"], 2),
            "serve_overhead_pool_path_back_to_back_ms_p50": round(overheads["pool"]["back_to_back"], 2),
            "one_token_stages_ms_p50": {path: {k: round(v, 2) for k, v in row.items()} for path, row in stages.items()},
            "concurrency": results["concurrency"],
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
