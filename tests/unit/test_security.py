"""Hostile requests: nothing a request names is retrieved, what a request may make the
server compile or scan is bounded, and its CPU-heavy parsing stays off the router's
event loop (docs/security.md). The host side (cache folders, the embedded Redis,
secrets) is in test_security_storage.py and test_security_redis.py."""

from __future__ import annotations

import base64
import http.server
import io
import json
import subprocess
import sys
import threading
import time

import pytest

from cluster.serving.openai_api import parse_chat
from cluster.serving.responses_api import parse_responses
from cluster.serving.validation import ApiError

pytestmark = pytest.mark.unit

MODEL = "m"
MAX_TOOLS = 128  # OpenAI's limit
MAX_SCHEMA_BYTES = 64 << 10
MAX_CONVERSATION_ITEMS = 10_000


@pytest.fixture
def listener():
    """A local HTTP server that records every request it gets (none may come)."""
    seen: list[str] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (the stdlib's name)
            seen.append(self.path)
            body = json.dumps({"type": "string"}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", seen
    finally:
        server.shutdown()
        server.server_close()


def _tool(parameters: dict, strict: bool = True, name: str = "f") -> dict:
    return {"type": "function", "function": {"name": name, "strict": strict, "parameters": parameters}}


def _chat(**extra):
    return parse_chat({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **extra}, MODEL, 16)


def _refusal(call, *args, **kwargs) -> ApiError:
    with pytest.raises(ApiError) as caught:
        call(*args, **kwargs)
    assert caught.value.status == 400
    return caught.value


def _referring(url: str) -> dict:
    return {"type": "object", "properties": {"x": {"$ref": url}}, "required": ["x"]}


@pytest.mark.parametrize("choice", ["auto", "required"])
def test_a_ref_to_a_url_or_a_file_is_a_400_naming_it_and_nothing_is_fetched(listener, tmp_path, choice):
    url, seen = listener
    secret = tmp_path / "secret.json"
    secret.write_text('{"type": "string"}')
    for target in (f"{url}/schema.json", secret.as_uri(), "other.json#/x"):
        error = _refusal(_chat, tools=[_tool(_referring(target))], tool_choice=choice)
        assert error.param == "tools"
        assert "tools[0].function.parameters.properties.x.$ref" in error.message and target in error.message
        # (the same in a response format's schema, and through the Responses API)
        error = _refusal(_chat, response_format={"type": "json_schema", "json_schema": {
            "name": "r", "schema": _referring(target)}})
        assert error.param == "response_format"
        error = _refusal(parse_responses, {"model": MODEL, "input": "hi", "tool_choice": choice, "tools": [
            {"type": "function", "name": "f", "parameters": _referring(target)}]}, MODEL, 16, 4096)
        assert error.param == "tools" and "$ref" in error.message
    assert seen == []
    # A reference inside the schema is fine.
    local = {"type": "object", "properties": {"x": {"$ref": "#/$defs/n"}}, "$defs": {"n": {"type": "integer"}}}
    assert _chat(tools=[_tool(local)], tool_choice=choice).strict_tools == {"f"}


_CHECK_A_CATASTROPHIC_PATTERN = """
from cluster.serving.chat_answer import ChatAnswer
from cluster.serving.openai_api import parse_chat
from model.tools import ToolCall, calls_text
tool = {"type": "function", "function": {"name": "f", "strict": True, "parameters": {
    "type": "object", "properties": {"x": {"type": "string", "pattern": "^(a+)+$"}}, "required": ["x"]}}}
request = parse_chat({"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": [tool]}, "m", 16)
for value, kept in (("a" * 40 + "b", 0), ("a" * 40, 1)):
    answer = ChatAnswer(request, think_end=6, dsml=None)
    answer.push(-1, calls_text([ToolCall("f", '{"x": "' + value + '"}')]))
    answer.finish()
    assert len(answer.calls) == kept, (value, answer.calls)
print("checked")
"""


@pytest.mark.integration
@pytest.mark.slow
def test_a_strict_calls_pattern_is_checked_in_linear_time():
    """A schema's ``pattern`` on a call's arguments: ``(a+)+$`` against 40 a's and a b
    backtracks 2**40 steps in Python's ``re`` (holding the GIL: the router's loop
    would stop); here the call is refused at once, and one that matches is kept."""
    try:
        done = subprocess.run([sys.executable, "-c", _CHECK_A_CATASTROPHIC_PATTERN], capture_output=True,
                              text=True, timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail("checking one call's arguments against a pattern ran for over a minute")
    assert done.returncode == 0 and "checked" in done.stdout, done.stderr[-2000:]


def test_tools_and_schemas_are_bounded():
    loose = {"type": "object", "properties": {"x": {"type": "string"}}}
    assert len(_chat(tools=[_tool(loose, name=f"t{i}") for i in range(MAX_TOOLS)]).tools) == MAX_TOOLS
    error = _refusal(_chat, tools=[_tool(loose, name=f"t{i}") for i in range(MAX_TOOLS + 1)])
    assert error.param == "tools" and str(MAX_TOOLS) in error.message
    big = {"type": "object", "description": "x" * MAX_SCHEMA_BYTES}
    for strict in (True, False):
        error = _refusal(_chat, tools=[_tool(big, strict)])
        assert error.param == "tools" and "tools[0].function.parameters" in error.message
    error = _refusal(_chat, response_format={"type": "json_schema", "json_schema": {"name": "r", "schema": big}})
    assert error.param == "response_format"


def test_stop_strings_are_bounded():
    assert _chat(stop=["a" * 256] * 4).params.stop == ("a" * 256,) * 4
    for stop in (["a"] * 5, "a" * 257, ["b", "a" * 257]):
        assert _refusal(_chat, stop=stop).param == "stop"


def test_response_metadata_is_bounded_as_openai_bounds_it():
    def parse(metadata):
        return parse_responses({"model": MODEL, "input": "hi", "metadata": metadata}, MODEL, 16, 4096)

    assert parse({f"k{i}": "v" * 512 for i in range(16)}).echo["metadata"]["k15"] == "v" * 512
    for metadata in ({f"k{i}": "v" for i in range(17)}, {"k" * 65: "v"}, {"k": "v" * 513}):
        assert _refusal(parse, metadata).param.startswith("metadata")


def test_a_conversations_items_are_bounded():
    from cluster.serving import conversations_api

    record = conversations_api.created({"items": []})
    record = {**record, "items": [{"id": f"msg_{i}", "type": "message"} for i in range(MAX_CONVERSATION_ITEMS - 1)]}
    new = [{"id": "msg_a", "type": "message"}]
    assert len(conversations_api.with_items(record, new)["items"]) == MAX_CONVERSATION_ITEMS
    error = _refusal(conversations_api.with_items, record, new + [{"id": "msg_b", "type": "message"}])
    assert error.param == "items" and str(MAX_CONVERSATION_ITEMS) in error.message


def _one_bit_png(width: int, height: int) -> str:
    """A data URL of a blank 1-bit PNG: a few KB that decode to width x height x 3 bytes."""
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("1", (width, height)).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def test_a_requests_images_are_bounded_in_pixels_all_together():
    from cluster.serving.images import ImageLimits, read_image

    limits = ImageLimits(max_pixels=30_000, max_request_pixels=50_000)
    decoded = []

    def reader(url: str, earlier: tuple):
        image = read_image(url, limits, sum(image.height * image.width for image in earlier))
        decoded.append(image)
        return 1, image

    def parse(*urls):
        parts = [{"type": "image_url", "image_url": {"url": url}} for url in urls]
        return parse_chat({"model": MODEL, "messages": [{"role": "user", "content": parts}]}, MODEL, 16,
                          read_image=reader, max_images=8)

    assert len(parse(_one_bit_png(200, 120), _one_bit_png(200, 120)).images) == 2
    decoded.clear()
    error = _refusal(parse, _one_bit_png(200, 120), _one_bit_png(200, 120), _one_bit_png(50, 50))
    assert error.param == "messages[0].content[2].image_url" and "50000 pixels in all" in error.message
    assert len(decoded) == 2  # the third was refused before it was decoded


def test_a_file_url_under_the_image_folder_must_be_a_regular_file(tmp_path):
    import os

    from cluster.serving.images import ImageError, ImageLimits, read_image

    fifo = tmp_path / "pipe.png"
    os.mkfifo(fifo)  # reading it would wait for a writer for ever
    errors: list[ImageError] = []

    def read() -> None:
        try:
            read_image(fifo.as_uri(), ImageLimits(image_dir=str(tmp_path)))
        except ImageError as error:
            errors.append(error)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(10)
    if reader.is_alive():
        with open(fifo, "wb"):  # a writer, so that the read ends
            pass
        reader.join()
        pytest.fail("a file URL naming a FIFO was opened, and its read waited for a writer")
    assert len(errors) == 1 and "not a regular file" in str(errors[0])


def test_example_agent_tools_import_only_their_modules_and_bound_arithmetic():
    from model.training.stdlib_tools import run_tool

    for name in ("antigravity", "this", "tkinter"):  # (importing them opens a browser, prints, needs a display)
        assert run_tool("count_names", {"module": name}).startswith("error: ValueError")
    assert run_tool("count_names", {"module": "json"}).isdigit()
    for expression in ("9**9**9", "((9**64)**64)**64", "(2**4096)*2"):
        assert run_tool("calculate", {"expression": expression}).startswith("error: ValueError")
    assert run_tool("calculate", {"expression": "(2**32)**64"}) == str(2**2048)


# ---------------------------------------------------------------- through a real server


@pytest.fixture(scope="module")
def served(serve_runtime, tmp_path_factory):
    # A context long enough that a 3.5 MB prompt passes the check before tokenising
    # and is refused only once it is tokenised (the worst case of parsing).
    with serve_runtime.app(tmp_path_factory.mktemp("security"), max_model_len=200_000,
                           max_answer_tokens=600) as (url, _redis):  # (a stream of 600 tokens)
        yield url


@pytest.mark.slow
@pytest.mark.e2e
def test_a_ref_through_http_is_a_400_never_a_5xx_and_nothing_is_fetched(served, listener):
    import requests

    url, seen = listener
    model = _model(served)
    for target in (f"{url}/schema.json", "file:///dev/zero", "file:///etc/passwd"):
        for choice in ("auto", "required"):
            tool = _tool(_referring(target))
            chat = requests.post(f"{served}/v1/chat/completions", timeout=60, json={
                "model": model, "messages": [{"role": "user", "content": "hi"}], "tools": [tool],
                "tool_choice": choice, "max_tokens": 4})
            responses = requests.post(f"{served}/v1/responses", timeout=60, json={
                "model": model, "input": "hi", "tool_choice": choice, "max_output_tokens": 4,
                "tools": [{"type": "function", "name": "f", "parameters": _referring(target)}]})
            for answer in (chat, responses):
                assert answer.status_code == 400, answer.text
                error = answer.json()["error"]
                assert error["param"] == "tools" and "$ref" in error["message"]
    assert seen == []


def _model(url: str) -> str:
    import requests

    return requests.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]


@pytest.mark.slow
@pytest.mark.e2e
def test_another_clients_stream_keeps_flowing_while_a_worst_case_request_is_parsed(served):
    """A 3.5 MB prompt (the most the body limit lets through under this context) is
    tokenised for a second or more, then refused as too long; a stream that is
    running meanwhile must not stall for that long."""
    import requests

    model = _model(served)
    arrivals: list[float] = []

    def stream() -> None:
        with requests.post(f"{served}/v1/completions", stream=True, timeout=120, json={
                "model": model, "prompt": [5, 6, 7, 8], "max_tokens": 600, "temperature": 0, "stream": True,
                "logit_bias": {"1": -100}}) as answer:  # (id 1: the golden model's end of sentence)
            for line in answer.iter_lines():
                if line.startswith(b"data: {"):
                    arrivals.append(time.perf_counter())

    streaming = threading.Thread(target=stream)
    streaming.start()
    deadline = time.monotonic() + 60
    while len(arrivals) < 20 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(arrivals) >= 20, "the stream did not start"
    prompt = "def f(x):\n    return x + 1\n" * (3_500_000 // 28)
    started = time.perf_counter()
    refused = requests.post(f"{served}/v1/completions", timeout=120,
                            json={"model": model, "prompt": prompt, "max_tokens": 4})
    ended = time.perf_counter()
    streaming.join()
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "context_length_exceeded"
    parsing = ended - started
    during = [b - a for a, b in zip(arrivals, arrivals[1:]) if b > started and a < ended]
    print(f"worst case parsed in {parsing:.2f} s; the stream's longest gap meanwhile {max(during or [0]):.3f} s")
    assert parsing > 0.5, f"the worst case parsed in {parsing:.2f} s: too fast to tell anything"
    assert during and arrivals[-1] > ended, "the stream ended before the worst case was parsed"
    assert max(during) < parsing / 2, f"the stream stalled {max(during):.2f} s of a {parsing:.2f} s parse"


# ---------------------------------------------------------------- the host


def test_the_ray_token_v41_serve_writes_is_private_and_anothers_is_left_alone(tmp_path, monkeypatch):
    import os
    import stat

    from cluster.serving.ray_token import ensure_private_token

    monkeypatch.setenv("HOME", str(tmp_path))
    for name in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        monkeypatch.delenv(name, raising=False)
    umask = os.umask(0)  # (the modes must not come from the umask)
    try:
        assert ensure_private_token() is None
    finally:
        os.umask(umask)
    token = tmp_path / ".ray" / "auth_token"
    assert stat.S_IMODE(token.stat().st_mode) == 0o600 and stat.S_IMODE(token.parent.stat().st_mode) == 0o700
    assert len(token.read_text()) == 64 and int(token.read_text(), 16) > 0
    mine = token.read_text()
    assert ensure_private_token() is None and token.read_text() == mine  # (a second start keeps it)
    token.chmod(0o644)  # an operator's token that others can read: a warning, and it is not changed
    assert "chmod 600" in ensure_private_token() and stat.S_IMODE(token.stat().st_mode) == 0o644
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    token.unlink()
    assert ensure_private_token() is None and not token.exists()
