"""Tenants end to end through the OpenAI SDK (docs/tenants.md): one deployment, an
API-keys file; each tenant's cached prefixes, stored records and share of the router's
places are its own, a system prompt shared on purpose hits for every sharing tenant,
and the debugging headers are shown only to a tenant allowed them."""

from __future__ import annotations

import asyncio
import os
import time

import httpx
import openai
import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
MODEL = "deepseek-v4.1-small"
SHARED_TOKENS = 64  # two of the harness's 32-token chunks
KEYS = """
tenants:
  acme: {keys: [sk-acme], share_prefixes: true, max_concurrent: 40}
  globex: {keys: [sk-globex]}
  initech: {keys: [sk-initech], share_prefixes: true}
  ops: {keys: [sk-ops], debug_headers: true}
  hooli: {keys: [sk-hooli], max_retention: in_memory}
"""
WINDOW_TTL_S = 6.0  # the window's minutes, short: an in_memory conversation is gone after them
SYSTEM = "You review Python code for a bank. Be exact and brief.\n" * 6  # far beyond 64 tokens


@pytest.fixture(scope="module")
def app(serve_runtime, tmp_path_factory):
    folder = tmp_path_factory.mktemp("tenants")
    (folder / "keys.yaml").write_text(KEYS)
    (folder / "secret").write_bytes(os.urandom(32))
    with serve_runtime.app(folder, api_keys_file=str(folder / "keys.yaml"), cache_secret_file=str(folder / "secret"),
                           shared_prefix_tokens=SHARED_TOKENS, window_ttl_minutes=WINDOW_TTL_S / 60) as (url, _redis):
        yield url, folder


def _client(app: tuple, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{app[0]}/v1", api_key=key, max_retries=0, timeout=120)


def _chat(client: openai.OpenAI, messages: list[dict], **extra):
    raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=messages, max_tokens=8,
                                                           temperature=0, **extra)
    return raw.parse(), raw.headers


def test_a_conversation_is_cached_for_its_tenant_alone(app):
    acme, globex, initech = (_client(app, f"sk-{name}") for name in ("acme", "globex", "initech"))
    first = [{"role": "system", "content": SYSTEM},
             {"role": "user", "content": "def transfer(a, b, amount):\n    a.balance -= amount\n" * 5}]
    one, headers = _chat(acme, first)
    assert one.usage.prompt_tokens_details.cached_tokens == 0
    assert not [name for name in headers if name.startswith("x-v41-") or name == "server-timing"]
    # Another tenant sending acme's exact conversation hits nothing of it: not even the
    # system prompt, since globex does not share prefixes.
    copy, headers = _chat(globex, first)
    assert copy.usage.prompt_tokens_details.cached_tokens == 0
    assert not [name for name in headers if name.startswith("x-v41-") or name == "server-timing"]
    # acme's next turn reads everything but the answer's last token from its cache.
    second = first + [{"role": "assistant", "content": one.choices[0].message.content},
                      {"role": "user", "content": "and the audit log?"}]
    two, _ = _chat(acme, second)
    assert two.usage.prompt_tokens_details.cached_tokens == one.usage.prompt_tokens + one.usage.completion_tokens - 1
    # A tenant that shares prefixes hits the shared chunks of acme's system prompt, and
    # no more, though acme stored all of it (144 tokens: 4 whole chunks).
    other = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "def audit(log):\n    pass\n" * 5}]
    shared, _ = _chat(initech, other)
    assert shared.usage.prompt_tokens_details.cached_tokens == SHARED_TOKENS
    # Sending acme's conversation, it hits the 4 chunks of the system prompt it stored
    # itself just now, none of acme's user text.
    copy_of_first, _ = _chat(initech, first)
    assert copy_of_first.usage.prompt_tokens_details.cached_tokens == 4 * 32


def test_the_debug_headers_are_for_a_tenant_allowed_them(app):
    messages = [{"role": "user", "content": "import os\n" * 8}]
    _, headers = _chat(_client(app, "sk-ops"), messages)
    assert headers["x-v41-prefilled-by"] in ("pool", "decoder") and "server-timing" in headers
    stream = _client(app, "sk-acme").chat.completions.with_raw_response.create(
        model=MODEL, messages=messages, max_tokens=4, stream=True)
    assert not [name for name in stream.headers if name.startswith("x-v41-") or name == "server-timing"]
    assert [chunk for chunk in stream.parse()]


def test_a_key_not_in_the_file_is_refused(app):
    for key in ("sk-nobody", "sk-acm", "sk-acme-1"):
        with pytest.raises(openai.AuthenticationError):
            _client(app, key).models.list()
    assert [m.id for m in _client(app, "sk-globex").models.list().data] == [MODEL]


def test_a_tenants_records_are_unknown_to_another(app):
    acme, globex = _client(app, "sk-acme"), _client(app, "sk-globex")
    stored = acme.responses.create(model=MODEL, input="def f():\n" * 4, max_output_tokens=8, store=True)
    conversation = acme.conversations.create(items=[{"type": "message", "role": "user", "content": "hello"}])
    with pytest.raises(openai.NotFoundError):
        globex.responses.retrieve(stored.id)
    with pytest.raises(openai.NotFoundError):
        globex.responses.delete(stored.id)
    with pytest.raises(openai.NotFoundError):
        globex.conversations.retrieve(conversation.id)
    with pytest.raises(openai.NotFoundError):
        globex.conversations.delete(conversation.id)
    with pytest.raises(openai.NotFoundError):
        globex.conversations.items.list(conversation.id)
    # Continuing another's response or conversation answers as for an unknown id (OpenAI's 400, naming it).
    with pytest.raises(openai.BadRequestError) as error:
        globex.responses.create(model=MODEL, input="go on", previous_response_id=stored.id, max_output_tokens=4)
    assert error.value.body["param"] == "previous_response_id"
    with pytest.raises(openai.BadRequestError) as error:
        globex.responses.create(model=MODEL, input="go on", conversation=conversation.id, max_output_tokens=4)
    assert error.value.body["param"] == "conversation"
    # Nothing of acme's was changed by the attempts.
    assert acme.responses.retrieve(stored.id).id == stored.id
    assert acme.conversations.retrieve(conversation.id).id == conversation.id
    again = acme.responses.create(model=MODEL, input="go on", previous_response_id=stored.id, max_output_tokens=4)
    assert again.usage.input_tokens_details.cached_tokens > 0


def test_one_tenants_flood_fills_its_own_share(app):
    """300 requests of one tenant at once: beyond its 40 places they are refused (429,
    ``tenant_limit``); another tenant's requests, sent meanwhile, are all answered."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "import sys\n" * 4}], "max_tokens": 4}

    async def flood() -> tuple[list[int], list[int], list[str]]:
        limits = httpx.Limits(max_connections=400, max_keepalive_connections=400)
        async with httpx.AsyncClient(base_url=f"{app[0]}/v1", timeout=300, limits=limits) as http:
            refused = asyncio.Event()

            async def send(key: str) -> tuple[int, str]:
                answer = await http.post("/chat/completions", json=body, headers={"authorization": f"Bearer {key}"})
                code = answer.json()["error"]["code"] if answer.status_code != 200 else ""
                if answer.status_code == 429:
                    refused.set()
                return answer.status_code, code

            acme = [asyncio.ensure_future(send("sk-acme")) for _ in range(300)]
            await asyncio.wait_for(refused.wait(), 120)  # acme is at its limit now
            others = await asyncio.gather(*(send("sk-globex") for _ in range(5)))
            flood = await asyncio.gather(*acme)
        return [s for s, _ in flood], [s for s, _ in others], [c for s, c in flood if s == 429]

    flooded, others, codes = asyncio.run(flood())
    assert others == [200] * 5
    assert flooded.count(200) >= 40 and flooded.count(429) > 0 and set(flooded) == {200, 429}
    assert set(codes) == {"tenant_limit"}
    # The metrics say it by tenant (configs/grafana-dashboard.json's per-tenant panels).
    wanted = {("acme", "429"): flooded.count(429), ("globex", "200"): 5}
    counts = _requests_by_tenant(wanted)
    assert all(counts.get(series, 0) >= least for series, least in wanted.items()), counts


def _requests_by_tenant(wanted: dict[tuple[str, str], int]) -> dict[tuple[str, str], float]:
    """``v41_requests_total`` of the chat endpoint by (tenant, status), scraped from the
    node's Ray metrics port until each ``wanted`` series counts at least so many (Ray
    pushes a worker's metrics every few seconds)."""
    import re
    import time
    import urllib.request

    import ray

    port = ray.nodes()[0]["MetricsExportPort"]
    deadline, counts = time.monotonic() + 60, {}
    while time.monotonic() < deadline:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
            text = response.read().decode()
        counts = {}
        for line in text.splitlines():
            if line.startswith("ray_v41_requests_total{") and 'endpoint="chat"' in line:
                labels = dict(re.findall(r'(\w+)="([^"]*)"', line.split("}")[0]))
                key = (labels.get("tenant"), labels.get("status"))
                counts[key] = counts.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
        if all(counts.get(series, 0) >= least for series, least in wanted.items()):
            break
        time.sleep(1.0)
    return counts


def _files(folder) -> set:
    return {path for path in folder.rglob("*") if path.is_file()}


def test_a_conversation_asked_in_memory_stays_in_ram_for_the_windows_minutes(app):
    """``prompt_cache_retention: in_memory``: nothing of the conversation reaches the SSD
    (the app keeps no bytes in Redis); its next turn is a hit while the window's
    minutes last, and cold after them. The answer says what was kept, and a tenant
    allowed only RAM gets RAM whatever it asks."""
    acme = _client(app, "sk-acme")
    first = [{"role": "user", "content": "class Ledger:\n    entries = []\n" * 6}]
    before = _files(app[1])
    one, headers = _chat(acme, first, prompt_cache_retention="in_memory")
    assert headers["v41-cache-retention"] == "in_memory"
    second = first + [{"role": "assistant", "content": one.choices[0].message.content},
                      {"role": "user", "content": "and the totals?"}]
    two, _ = _chat(acme, second, prompt_cache_retention="in_memory")
    assert two.usage.prompt_tokens_details.cached_tokens == one.usage.prompt_tokens + one.usage.completion_tokens - 1
    time.sleep(WINDOW_TTL_S + 1)
    assert _files(app[1]) == before  # not a byte of it on the SSD
    three, _ = _chat(acme, second, prompt_cache_retention="in_memory")
    assert three.usage.prompt_tokens_details.cached_tokens == 0
    _, headers = _chat(_client(app, "sk-hooli"), first, prompt_cache_retention="72h")
    assert headers["v41-cache-retention"] == "in_memory"
    _, headers = _chat(acme, first)
    assert headers["v41-cache-retention"] == "72h"
    answer = acme.responses.create(model=MODEL, input="def f():\n" * 4, max_output_tokens=4,
                                   prompt_cache_retention="24h")
    assert answer.prompt_cache_retention == "24h"
    with pytest.raises(openai.BadRequestError) as error:
        _chat(acme, first, prompt_cache_retention="48h")
    assert error.value.body["param"] == "prompt_cache_retention"


def test_deleting_a_response_or_conversation_forgets_its_cache(app):
    """"Forget me": a deleted response's record takes the cached chunks of its prompt
    and answer with it (on every node that holds them), so the same prompt is cold
    again; a deleted conversation's likewise. The shared prefix stays."""
    acme = _client(app, "sk-acme")
    prompt = "def settle(account):\n    return account.balance * 7\n" * 6

    def cached(text: str) -> int:
        answer = acme.responses.create(model=MODEL, input=text, max_output_tokens=4, store=False)
        return answer.usage.input_tokens_details.cached_tokens

    stored = acme.responses.create(model=MODEL, input=prompt, max_output_tokens=4, store=True)
    assert stored.usage.input_tokens_details.cached_tokens == 0
    assert cached(prompt) > 0  # its chunks are stored
    acme.responses.delete(stored.id)
    assert cached(prompt) == SHARED_TOKENS  # acme shares prefixes: the chunks of the first 64 tokens stay
    conversation = acme.conversations.create()
    other = "class Vault:\n    locked = True\n" * 8
    acme.responses.create(model=MODEL, input=other, max_output_tokens=4, conversation=conversation.id)
    assert cached(other) > 0
    acme.conversations.delete(conversation.id)
    assert cached(other) == SHARED_TOKENS
