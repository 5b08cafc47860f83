"""The Serve app end to end through the OpenAI SDK: chat, completions, streaming, stops,
usage with cached tokens, errors, and a decoder replica killed mid-stream (the Responses
and Conversations APIs: tests/e2e/test_serve_responses.py)."""

from __future__ import annotations

import json
import time
from typing import Literal
import urllib.error
import urllib.request

import openai
import pytest
import ray

from cluster.serving.timing import parse_server_timing
from model.chat import ChatTemplate, Message
from model.runtime.engine import Engine
from model.tokenizer import Tokenizer
from tests.serve_harness import GOLDEN, health, post_json, replica_actor_name

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
MODEL = "deepseek-v4.1-small"


def test_models_and_health(app, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert health(app) == {"status": "ok", "problems": []}


def test_a_model_is_retrieved_by_id(client):
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-9")


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def test_a_tool_loop_with_the_sdk_stays_cached_turn_after_turn(client):
    """Tools in the system block, a developer message, calls and their results in the
    history (results out of order), OpenAI's effort names: each returning turn reads the
    whole previous prompt and answer from the cache."""
    messages = [{"role": "developer", "content": "Answer with code.\n" * 6},
                {"role": "user", "content": "What is the weather in Paris and in Rome?\n" * 4}]
    calls = [{"id": f"call_{tag}", "type": "function",
              "function": {"name": "get_weather", "arguments": json.dumps({"city": city})}}
             for tag, city in (("a", "Paris"), ("b", "Rome"))]
    previous = None
    for turn, effort in enumerate(["medium", "medium", "medium"]):
        answer = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0,
                                                tools=[WEATHER], reasoning_effort=effort)
        message = answer.choices[0].message
        assert answer.choices[0].finish_reason in ("length", "stop", "tool_calls")
        assert message.reasoning_content is not None  # thinking on: the reasoning comes apart
        if previous is not None:
            assert answer.usage.prompt_tokens_details.cached_tokens >= previous, turn
        previous = answer.usage.prompt_tokens + answer.usage.completion_tokens - 1
        messages.append({"role": "assistant", "content": message.content,
                         "reasoning_content": message.reasoning_content})
        if turn == 0:  # the model called two tools (written by the client: the small model does not)
            messages[-1]["tool_calls"] = calls
            previous = None  # a turn the client rewrote is not the model's: no claim on its cache
            messages += [{"role": "tool", "tool_call_id": "call_b", "content": "Rome: 21 C"},
                         {"role": "tool", "tool_call_id": "call_a", "content": "Paris: 18 C"}]
        else:
            messages.append({"role": "user", "content": f"and tomorrow? ({turn})"})


def test_logprobs_penalties_and_bias_through_the_sdk(client):
    messages = [{"role": "user", "content": "def fibonacci(n):\n"}]
    plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0,
                                           logprobs=True, top_logprobs=3)
    entries = plain.choices[0].logprobs.content
    assert len(entries) == 8 and "".join(e.token for e in entries) == plain.choices[0].message.content
    for entry in entries:  # greedy: each token is its step's most likely, listed first
        assert entry.top_logprobs[0].token == entry.token and entry.logprob == pytest.approx(
            entry.top_logprobs[0].logprob) and len(entry.top_logprobs) == 3 and entry.logprob <= 0
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0,
                                                 logprobs=True, top_logprobs=3, stream=True))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [(e.token, round(e.logprob, 4)) for e in streamed] == [(e.token, round(e.logprob, 4)) for e in entries]

    # A bias of -100 on the greedy first token: another one comes first.
    first_id = client.completions.create(model=MODEL, prompt="def fibonacci(n):\n", max_tokens=1, temperature=0,
                                         logprobs=1)
    assert first_id.choices[0].logprobs.tokens[0] == first_id.choices[0].text
    assert first_id.choices[0].logprobs.top_logprobs[0] == {first_id.choices[0].text: pytest.approx(
        first_id.choices[0].logprobs.token_logprobs[0])}
    tokenizer = Tokenizer.from_dir(GOLDEN)
    banned = tokenizer.encode(entries[0].token)
    assert len(banned) == 1  # the token's text encodes back to the token
    biased = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0,
                                            logit_bias={str(banned[0]): -100}, logprobs=True)
    assert biased.choices[0].logprobs.content[0].token != entries[0].token
    # A strong frequency penalty: no token repeats in greedy output... unless every other is worse.
    repeated = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "a a a a a a"}],
                                              max_tokens=12, temperature=0, frequency_penalty=2.0, logprobs=True)
    plain_repeat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "a a a a a a"}],
                                                  max_tokens=12, temperature=0, logprobs=True)
    tokens = [e.token for e in repeated.choices[0].logprobs.content]
    plain_tokens = [e.token for e in plain_repeat.choices[0].logprobs.content]
    assert len(set(tokens)) > len(set(plain_tokens)), (tokens, plain_tokens)


def test_structured_outputs_and_forced_calls_through_the_sdk(client):
    """The small model does not call tools or write JSON by itself: constrained decoding
    makes every answer here well formed, streamed or not."""
    import pydantic

    class Point(pydantic.BaseModel):
        x: int = pydantic.Field(ge=0, le=99)
        label: Literal["a", "b"]
        ok: bool

    messages = [{"role": "user", "content": "def distance(p, q):\n"}]
    # (With thinking on, the grammar starts after </think>: test_grammar.py; the small
    # model was not trained to reason, so it would not get there.)
    parsed = client.chat.completions.parse(model=MODEL, messages=messages, response_format=Point, max_tokens=300,
                                           temperature=0)
    assert isinstance(parsed.choices[0].message.parsed, Point), parsed.choices[0].message.content
    with client.chat.completions.stream(model=MODEL, messages=messages, response_format=Point, max_tokens=300,
                                        temperature=0.8, seed=3) as stream:
        streamed = stream.get_final_completion()
    assert isinstance(streamed.choices[0].message.parsed, Point), streamed.choices[0].message.content
    anything = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=300, temperature=0.7,
                                              seed=1, response_format={"type": "json_object"})
    assert isinstance(json.loads(anything.choices[0].message.content), dict)

    weather = {"type": "function", "function": {"name": "get_weather", "strict": True, "parameters": {
        "type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}, "days": {
            "type": "integer", "minimum": 1, "maximum": 7}}, "required": ["city", "days"],
        "additionalProperties": False}}}
    clock = {"type": "function", "function": {"name": "clock", "parameters": {"type": "object", "properties": {}}}}
    # One call: this untrained model, free to add calls, repeats the same one to the end.
    forced = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=300, temperature=0,
                                            tools=[weather, clock], tool_choice="required", parallel_tool_calls=False)
    assert forced.choices[0].finish_reason == "tool_calls" and forced.choices[0].message.content is None
    assert forced.choices[0].message.tool_calls and all(
        call.function.name in ("get_weather", "clock") for call in forced.choices[0].message.tool_calls)
    with client.chat.completions.stream(model=MODEL, messages=messages, max_tokens=300, temperature=0.9, seed=2,
                                        tools=[weather], parallel_tool_calls=False,
                                        tool_choice={"type": "function", "function": {"name": "get_weather"}}) as s:
        final = s.get_final_completion()
    calls = final.choices[0].message.tool_calls
    assert len(calls) == 1 and calls[0].function.name == "get_weather"
    assert final.choices[0].message.content is None  # the stream sent no content, as unstreamed
    arguments = json.loads(calls[0].function.arguments)
    assert arguments["city"] in ("Paris", "Rome") and 1 <= arguments["days"] <= 7
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 7}}}
    with pytest.raises(openai.BadRequestError, match="response_format"):
        client.chat.completions.create(model=MODEL, messages=messages, response_format=bad)


def test_n_answers_share_one_prefill(client):
    """n seeded samples: n choices, streamed interleaved or not; the prompt is encoded
    once (the answers' timelines name one prefill) and counted once in the usage."""
    messages = [{"role": "user", "content": "class Stack:\n    def push(self, x):\n" * 6}]
    # Once first, so that every request below finds the same stored cache (a cold prompt
    # and a cached one are different computations: a sampled token may differ).
    client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=1.0, seed=5, n=3)
    raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=messages, max_tokens=6,
                                                            temperature=1.0, seed=5, n=3, logprobs=True)
    assert raw.headers["x-v41-prefills"] == "1"
    plain = raw.parse()
    assert [c.index for c in plain.choices] == [0, 1, 2]
    assert plain.usage.completion_tokens == sum(len(c.logprobs.content) for c in plain.choices) == 18
    texts = [c.message.content for c in plain.choices]
    assert len(set(texts)) > 1  # seeds 5, 6, 7
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=1.0,
                                                 seed=5, n=3, stream=True, stream_options={"include_usage": True}))
    streamed = ["".join(c.choices[0].delta.content or "" for c in chunks if c.choices and c.choices[0].index == i)
                for i in range(3)]
    assert streamed == texts  # the same seeds, the same answers
    assert chunks[-1].usage.completion_tokens == 18
    one = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=1.0, seed=6)
    assert one.choices[0].message.content == texts[1]  # answer i is the request with seed + i
    completions = client.completions.create(model=MODEL, prompt="def f(x):\n", max_tokens=4, n=2, temperature=0)
    assert [c.index for c in completions.choices] == [0, 1]
    assert completions.choices[0].text == completions.choices[1].text  # greedy: the same


def test_the_example_agent_runs_its_tool_loop(client):
    """examples/agent.py against the server: a forced first call is executed here and its
    result goes back; the loop ends with an answer that calls nothing (or at its limit)."""
    import argparse

    from tests.example_agent import load_agent

    agent = load_agent()
    calls = []
    run_tool = agent.run_tool
    agent.run_tool = lambda name, arguments: calls.append(name) or run_tool(name, arguments)
    args = argparse.Namespace(first_call="required", max_steps=3, max_tokens=120)
    # One tool whose argument is bounded (this model, untrained for tools, would fill a
    # free-text argument to max_tokens).
    tools = [{"type": "function", "function": {"name": "list_names", "parameters": {
        "type": "object", "properties": {"module": {"enum": ["json", "shlex"]}}, "required": ["module"]}}}]
    trace = agent.solve(client, MODEL, "How many public names does the json module define?", args, show=False,
                        tools=tools)
    assert calls and set(calls) == {"list_names"}
    assert [name for name, _ in trace.calls] == calls and all(arguments["module"] in ("json", "shlex")
                                                               for _, arguments in trace.calls)
    assert isinstance(trace.answer, str)


def test_chat_streaming_equals_plain_and_counts_usage(client):
    messages = [{"role": "user", "content": "class Queue:\n    def put(self, item):"}]
    plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=7, temperature=0)
    assert plain.choices[0].finish_reason == "length"
    assert plain.usage.completion_tokens == 7 and plain.usage.prompt_tokens > 10
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=7, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 7
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_server_timing_accounts_for_the_whole_trip(client):
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "x = 1"}], max_tokens=1, temperature=0)
    stages, descriptions = parse_server_timing(raw.headers["server-timing"])
    trip = ["parse", "plan", "dispatch", "to_prefill", "prefill_wait", "prefill", "handoff", "decode", "stream",
            "respond"]
    assert list(stages) == trip + ["compute"]
    assert all(stages[name] >= 0 for name in trip)
    assert descriptions == {"prefill": "decoder"}  # a short new prompt is encoded where it decodes
    long = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "def f():\n    return 1\n" * 30}], max_tokens=1,
        temperature=0)
    assert long.parse().usage.prompt_tokens > 128
    assert parse_server_timing(long.headers["server-timing"])[1] == {"prefill": "pool"}
    # The replicas' compute happens inside the prefill and decode stages.
    assert stages["compute"] == pytest.approx(float(raw.headers["x-v41-replica-ms"]), abs=1e-3)
    assert stages["compute"] <= stages["prefill"] + stages["decode"] + 1e-3
    # When the stored prefix was looked up, and when the answer's conversation was
    # stored: inside the trip, in that order (a replay's simulator reads them).
    looked, stored = (float(raw.headers[f"x-v41-{name}-at"]) for name in ("lookup", "stored"))
    assert 0 < stored - looked < sum(stages[name] for name in trip) / 1e3


def test_metrics_reach_prometheus_through_ray(client):
    """The router's and the pools' metrics, scraped from the node's Ray metrics port."""
    client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "def metrics():"}],
                                   max_tokens=3, temperature=0)
    port = ray.nodes()[0]["MetricsExportPort"]
    wanted = ("v41_requests_total", "v41_ttft_seconds", "v41_prompt_tokens_total", "v41_decoder_batch_size",
              "v41_decoder_running_requests", "v41_router_decoder_choices_total")
    deadline, text = time.monotonic() + 60, ""
    while time.monotonic() < deadline:  # Ray pushes a worker's metrics every few seconds
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
            text = response.read().decode()
        if all(name in text for name in wanted):
            break
        time.sleep(1.0)
    missing = [name for name in wanted if name not in text]
    assert not missing, f"not exported: {missing}"
    served = [line for line in text.splitlines()
              if line.startswith("ray_v41_requests_total{") or line.startswith("v41_requests_total{")]
    assert any('status="200"' in line and float(line.rsplit(" ", 1)[1]) >= 1 for line in served), served
    # As configs/grafana-dashboard.json queries them: Ray's prefix, TTFT by prompt depth.
    assert any(line.startswith("ray_v41_ttft_seconds_bucket{") and 'depth="<1K"' in line
               for line in text.splitlines())


def test_completions_stop_string(client):
    full = client.completions.create(model=MODEL, prompt="import os\nimport sys\n", max_tokens=12, temperature=0)
    text = full.choices[0].text
    stop = text[4:7]
    assert len(stop) == 3
    cut = client.completions.create(model=MODEL, prompt="import os\nimport sys\n", max_tokens=12, temperature=0,
                                    stop=[stop])
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == text[: text.index(stop)]


def test_second_turn_is_cached_and_equals_a_cold_exact_run(client):
    first = [{"role": "user", "content": "def parse(path):\n    with open(path) as handle:\n" * 6}]
    one = client.chat.completions.create(model=MODEL, messages=first, max_tokens=10, temperature=0)
    assert one.usage.prompt_tokens_details.cached_tokens == 0
    second = first + [{"role": "assistant", "content": one.choices[0].message.content},
                      {"role": "user", "content": "and the writer?"}]
    # Sent the moment the answer is in, as an agent does: the conversation was stored
    # and indexed before its last token went out.
    two = client.chat.completions.create(model=MODEL, messages=second, max_tokens=10, temperature=0)
    # Everything but the answer's last token (never fed) came from turn one's window state,
    # which the router found in the index.
    assert two.usage.prompt_tokens_details.cached_tokens == one.usage.prompt_tokens + one.usage.completion_tokens - 1
    # The same conversation, cold and exact, in-process.
    from model.runtime.batcher import generate
    from model.loader import load_hasher, load_model
    from model.runtime.sampling import SamplingParams

    config, model = load_model(GOLDEN)
    engine = Engine(model, load_hasher(GOLDEN, config), bounded_replay=False)
    template = ChatTemplate(Tokenizer.from_dir(GOLDEN))
    greedy = SamplingParams(temperature=0.0, max_tokens=10)
    prompt_one = template.render([Message("user", first[0]["content"])])
    answer = generate(engine, [prompt_one], greedy, eos_token_ids=(1,))[0]
    prompt_two = template.render([Message("user", first[0]["content"]), Message("assistant", token_ids=tuple(answer)),
                                  Message("user", "and the writer?")])
    cold = generate(engine, [prompt_two], greedy, eos_token_ids=(1,))[0]
    assert two.choices[0].message.content == template.tokenizer.decode(cold, skip_special_tokens=True)


def test_an_agent_loop_of_immediate_turns_always_hits(client):
    """Five turns, each sent the moment the last streamed answer ended (a tool result
    appended): every turn reads the whole conversation so far, from the cache the
    decoder replica kept after the last answer (actors/resident.py)."""
    messages = [{"role": "system", "content": "You call tools.\n" * 10},
                {"role": "user", "content": "list the files\n" * 8}]
    history = 0
    for turn in range(5):
        raw = client.chat.completions.with_raw_response.create(
            model=MODEL, messages=messages, max_tokens=8, temperature=0, stream=True,
            stream_options={"include_usage": True})
        chunks = list(raw.parse())
        usage = chunks[-1].usage
        if turn:
            assert usage.prompt_tokens_details.cached_tokens == history, turn
            assert raw.headers["x-v41-prefilled-by"] == "resident", turn
        history = usage.prompt_tokens + usage.completion_tokens - 1  # the last token was never fed
        answer = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": f"tool output {turn}\n"}]


@pytest.mark.parametrize("body, status, code", [
    (b"{not json", 400, None),
    (json.dumps({"model": "gpt-9", "messages": [{"role": "user", "content": "x"}]}).encode(), 404, "model_not_found"),
    (json.dumps({"model": MODEL, "messages": []}).encode(), 400, None),
    (json.dumps({"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}).encode(), 400, None),
    (json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "n": 30}).encode(), 400, None),
    (json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "top_p": 7}).encode(), 400, None),
    (json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "reasoning_effort": "huge"}).encode(),
     400, None),
    (json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 100000}).encode(),
     400, None),  # (more than the app's max_answer_tokens)
    # This tokenizer has no ｜DSML｜ token, so auto cannot hold a call to one.
    (json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "parallel_tool_calls": False,
                 "tools": [{"type": "function", "function": {"name": "f"}}]}).encode(), 400, None),
])
def test_bad_requests_are_4xx_with_a_message(app, body, status, code):
    got, payload = post_json(f"{app}/v1/chat/completions", body)
    assert got == status
    assert payload["error"]["message"] and payload["error"]["code"] == code


def test_more_requests_than_the_batch_wait_for_a_place_and_all_finish(client):
    """24 streams at once against a batch of 16 places: the rest wait, none fails (the
    decoder used to answer the 17th with a stream error, "batch is full")."""
    from concurrent.futures import ThreadPoolExecutor

    def stream(i: int) -> tuple[int, str | None]:
        chunks = client.chat.completions.create(model=MODEL, max_tokens=6, temperature=0, stream=True,
                                                messages=[{"role": "user", "content": f"def f_{i}():"}])
        tokens, finish = 0, None
        for chunk in chunks:
            if chunk.choices:
                tokens += bool(chunk.choices[0].delta.content)
                finish = chunk.choices[0].finish_reason or finish
        return tokens, finish

    with ThreadPoolExecutor(24) as pool:
        results = list(pool.map(stream, range(24)))
    assert all(finish in ("length", "stop") for _, finish in results), results
    assert sum(tokens for tokens, _ in results) > 24


def test_killed_decoder_mid_stream_gives_an_error_and_caches_nothing(client):
    messages = [{"role": "user", "content": "while True:\n    x = queue.get()\n" * 4}]
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=200, temperature=0,
                                            stream=True)
    chunks = iter(stream)
    assert next(chunks).choices[0].delta.role == "assistant"
    assert next(chunks).choices[0].delta.content is not None  # decoding has started
    replica = ray.get_actor(replica_actor_name("DecoderPool"), namespace="serve")
    ray.kill(replica, no_restart=True)
    with pytest.raises(openai.APIError):
        for _ in chunks:  # the stream ends with an error object, which the SDK raises
            pass
    # Serve replaces the replica; the next request succeeds and nothing was cached.
    deadline = time.time() + 90
    while True:
        try:
            again = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=3, temperature=0)
            break
        except openai.APIError:
            if time.time() > deadline:
                raise
            time.sleep(2)
    assert again.usage.prompt_tokens_details.cached_tokens == 0
