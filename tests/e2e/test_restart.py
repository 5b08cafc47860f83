"""A full stop and start of the app on the same cache directory: a returning turn reads
every chunk it stored (its window state lived in RAM only: the encoder replays it), a
stored Responses API response and a conversation are still there to read and continue, and damaged SSD
objects read as misses, never as wrong bytes."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest

from tests.serve_harness import running_app, stored_objects, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
MODEL = "deepseek-v4.1-small"
HISTORY = "def handle(event):\n    queue.put(event)\n" * 20
CHUNK = 32  # the harness's chunk_tokens


def conversation(client, n: int) -> tuple[int, int, str]:
    """Turn ``n`` of a conversation: (prompt tokens, cached tokens, answer)."""
    messages = [{"role": "user", "content": HISTORY}, {"role": "assistant", "content": "ok"},
                {"role": "user", "content": f"turn {n}"}]
    answer = client.chat.completions.create(model=MODEL, max_tokens=6, temperature=0, messages=messages)
    usage = answer.usage
    return usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens, answer.choices[0].message.content


def chunk_files(root: Path, suffix: str = "chunk") -> list[Path]:
    return sorted(root.glob(f"ssd-*/objects/*/*/*.{suffix}"))


def test_a_full_restart_keeps_every_stored_chunk_and_damage_reads_as_a_miss(tmp_path):
    # exact_replay: a prefix read from the store gives the answer a cold run gives.
    with running_app(tmp_path, exact_replay=True) as (url, _):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
        conversation(client, 1)
        conversation(client, 2)  # stores every whole chunk of turn 2's prompt
        kept = client.responses.create(model=MODEL, input="def main():\n", max_output_tokens=4, temperature=0)
        talk = client.conversations.create(items=[{"role": "user", "content": "def main():\n"}])
        joined = client.responses.create(model=MODEL, conversation=talk.id, input="    pass\n", max_output_tokens=2,
                                         temperature=0)
        items = [item.id for item in client.conversations.items.list(talk.id, order="asc").data]
        wait_until(lambda: stored_objects() > 0 and chunk_files(tmp_path, "response")
                   and chunk_files(tmp_path, "conversation"), what="the writes")
        stored = len(chunk_files(tmp_path))
    assert [path.name for path in tmp_path.iterdir() if path.name.startswith("ssd-")] == ["ssd-node-0"]

    with running_app(tmp_path, exact_replay=True) as (url, _):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
        # The restarted store publishes its SSD index to the new Redis within a heartbeat.
        wait_until(lambda: conversation(client, 2)[1] > 0, 30, "the restarted store's index")
        prompt, cached, restored = conversation(client, 2)
        print(f"\nafter a full restart: {cached} of {prompt} prompt tokens cached ({stored} chunks on SSD)")
        assert cached == (prompt - 1) // CHUNK * CHUNK  # every whole chunk short of the last token
        again = client.responses.retrieve(kept.id)
        assert again.output_text == kept.output_text and again.usage == kept.usage
        continued = client.responses.create(model=MODEL, previous_response_id=kept.id, input="    return 0\n",
                                            max_output_tokens=2, temperature=0)
        assert continued.previous_response_id == kept.id
        assert continued.usage.input_tokens > kept.usage.input_tokens + kept.usage.output_tokens
        # The conversation too: its items, and the next turn naming it reads them.
        assert [item.id for item in client.conversations.items.list(talk.id, order="asc").data] == items
        assert len(items) == 2 + len(joined.output)
        later = client.responses.create(model=MODEL, conversation=talk.id, input="x", max_output_tokens=2,
                                        temperature=0)
        assert later.usage.input_tokens > joined.usage.input_tokens + joined.usage.output_tokens
    files = chunk_files(tmp_path) + chunk_files(tmp_path, "response") + chunk_files(tmp_path, "conversation")
    assert len(files) >= stored + 3

    # Damage every chunk file: a bit flipped in half of them, the other half torn.
    for number, path in enumerate(files):
        data = path.read_bytes()
        if number % 2:
            flipped = bytearray(data)
            flipped[len(data) // 2] ^= 0x10
            path.write_bytes(bytes(flipped))
        else:
            path.write_bytes(data[: len(data) // 2])
    with running_app(tmp_path, exact_replay=True) as (url, _):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
        _, cached, cold = conversation(client, 2)
        assert cached == 0  # every stored chunk is a miss now: encoded afresh
        assert cold == restored  # the answer from the restored cache is the cold answer
        for rid in (kept.id, continued.id):
            with pytest.raises(openai.NotFoundError):
                client.responses.retrieve(rid)
        with pytest.raises(openai.NotFoundError):
            client.conversations.retrieve(talk.id)
