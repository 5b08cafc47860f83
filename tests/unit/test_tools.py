"""Tool calls in the released V4.1 format: the system block's schemas, DSML calls in the
history, results in call order, and the streaming parser of generated calls."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import tokenizers
from hypothesis import given, settings
from hypothesis import strategies as st

from model.chat import ChatTemplate, Message
from model.tokenizer import SYSTEM_TOKEN, Tokenizer
from model.tools import (
    CALLS_MARKER,
    DSML,
    Called,
    Content,
    ToolCall,
    ToolCallStream,
    calls_text,
    split_answer,
)

pytestmark = pytest.mark.unit

GOLDEN = Path(__file__).parents[1] / "golden"
WEATHER = {"name": "get_weather", "description": "Get the current weather for a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "City name"},
                                                           "days": {"type": "integer", "description": "Forecast days"}},
                          "required": ["city"]}}


def _tokenizer(*extra: str) -> Tokenizer:
    """The golden checkpoint's tokenizer, with ``extra`` special tokens added (the
    released vocabulary has ``<｜System｜>`` and ``｜DSML｜``; the small ones do not)."""
    raw = tokenizers.Tokenizer.from_file(str(GOLDEN / "A" / "tokenizer.json"))
    raw.add_special_tokens([tokenizers.AddedToken(token, special=True, normalized=False) for token in extra])
    return Tokenizer(raw.to_str())


@pytest.fixture(scope="module")
def released() -> Tokenizer:
    return _tokenizer(SYSTEM_TOKEN, DSML)


def _loop() -> list[Message]:
    calls = (ToolCall("get_weather", '{"city": "Paris", "days": 1}', "call_1"),
             ToolCall("get_weather", '{"city": "Tokyo", "days": 1}', "call_2"))
    return [
        Message("system", "You are a helpful assistant."),
        Message("user", "What's the weather in Paris and Tokyo?"),
        Message("assistant", "", reasoning="I need weather for two cities; call the tool twice in parallel.",
                tool_calls=calls),
        # Out of order on purpose: results are rendered in the order of the calls.
        Message("tool", '{"city": "Tokyo", "temp_c": 25}', tool_call_id="call_2"),
        Message("tool", '{"city": "Paris", "temp_c": 18}', tool_call_id="call_1"),
        Message("assistant", "Paris is 18°C and Tokyo is 25°C.", reasoning="Both results are in; summarise."),
    ]


def test_a_tool_loop_renders_as_the_released_encoder_does(released: Tokenizer) -> None:
    template = ChatTemplate(released)
    text = template.render_text(_loop(), thinking=True, add_generation_prompt=False, tools=[WEATHER])
    assert text == (GOLDEN / "dsml" / "thinking_tool_loop.txt").read_text(encoding="utf-8")
    ids = template.render(_loop(), thinking=True, add_generation_prompt=False, tools=[WEATHER])
    # ｜DSML｜ is one token wherever the markup has it: 9 times in the tools text, 14 in
    # the calls (the calls lines, and per call its invoke lines and two per parameter).
    assert ids.count(released.special.dsml) == text.count(DSML) == 9 + 14
    assert released.decode(ids) == text


def test_without_the_special_token_the_markup_is_text() -> None:
    plain = _tokenizer()
    template = ChatTemplate(plain)
    ids = template.render(_loop(), thinking=True, add_generation_prompt=False, tools=[WEATHER])
    assert plain.special.dsml is None
    assert DSML in plain.decode(ids)


def test_tools_without_a_system_message_get_an_empty_system_block(released: Tokenizer) -> None:
    text = ChatTemplate(released).render_text([Message("user", "hi")], tools=[WEATHER])
    assert text.startswith(f"<｜begin▁of▁sentence｜>{SYSTEM_TOKEN}\n\n## Tools\n\n")
    assert text.endswith("invoke tool calls.\n<｜User｜>hi<｜Assistant｜><think></think>")


def test_developer_messages_are_system_messages(released: Tokenizer) -> None:
    template = ChatTemplate(released)
    as_developer = [Message("developer", "Be brief."), Message("user", "hi")]
    as_system = [Message("system", "Be brief."), Message("user", "hi")]
    assert template.render(as_developer) == template.render(as_system)


arguments = st.dictionaries(
    st.text(st.characters(blacklist_characters='"', blacklist_categories=("Cs",)), min_size=1, max_size=8),
    st.one_of(st.text(max_size=20).filter(lambda s: DSML not in s and "</" not in s), st.integers(), st.booleans(),
              st.none(), st.lists(st.integers(), max_size=3), st.dictionaries(st.text(max_size=4), st.floats(
                  allow_nan=False, allow_infinity=False), max_size=2)),
    max_size=4)
names = st.from_regex(r"[a-z_][a-z0-9_]{0,12}", fullmatch=True)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(names, arguments), min_size=1, max_size=3), st.text(max_size=30), st.data())
def test_calls_survive_rendering_and_streaming_in_any_pieces(calls, answer, data) -> None:
    """What the format writes, the parser reads back: the same names and arguments,
    whether the text comes whole or in arbitrary pieces."""
    answer = answer.replace("\n\n<", "")
    written = [ToolCall(name, json.dumps(args)) for name, args in calls]
    text = answer + calls_text(written)
    rest, parsed = split_answer([calls_text(written)])
    assert rest == ""
    assert [(c.name, json.loads(c.arguments)) for c in parsed] == [(n, a) for n, a in calls]
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=8)))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    content, streamed = split_answer(pieces)
    assert content == answer
    assert [(c.name, json.loads(c.arguments)) for c in streamed] == [(n, a) for n, a in calls]
    assert len({c.id for c in streamed}) == len(calls)


def test_the_stream_releases_text_and_each_call_as_soon_as_it_is_certain() -> None:
    stream = ToolCallStream()
    assert stream.push("It is") == [Content("It is")]
    assert stream.push(" sunny.\n") == [Content(" sunny.")]  # "\n" may begin the marker
    assert stream.push("\n<") == []
    block = calls_text([ToolCall("a", '{"x": 1}'), ToolCall("b", '{"y": "z"}')])[3:]
    first_close = block.index("</｜DSML｜ invoke>") + len("</｜DSML｜ invoke>")
    events = stream.push(block[:first_close])
    assert [(type(e), getattr(e, "index", None)) for e in events] == [(Called, 0)]
    assert events[0].call.name == "a" and json.loads(events[0].call.arguments) == {"x": 1}
    events = stream.push(block[first_close:])
    assert [e.index for e in events] == [1] and json.loads(events[0].call.arguments) == {"y": "z"}
    assert stream.finish() == []


@pytest.mark.parametrize("bad", [
    CALLS_MARKER + '\n<｜DSML｜ invoke name="f">\n<｜DSML｜ parameter name="x" string="false">not json'
                   '</｜DSML｜ parameter>\n</｜DSML｜ invoke>\n</｜DSML｜ calls>',
    CALLS_MARKER + '\n<｜DSML｜ invoke name="f">\n<｜DSML｜ parameter name="x" string="true">cut off',
    CALLS_MARKER + "\nsomething else entirely",
    CALLS_MARKER + "\n</｜DSML｜ calls>",
])
def test_a_call_that_does_not_parse_comes_back_as_text(bad: str) -> None:
    content, calls = split_answer(["Sure.", bad[:9], bad[9:]])
    assert calls == [] and content == "Sure." + bad


@pytest.mark.parametrize("cut", ["", "\n", "\n</", "\n</｜DSML｜ cal", "\n<", "\n<｜DSML｜ inv"])
def test_a_block_cut_off_after_a_call_keeps_its_calls_and_shows_no_markup(cut: str) -> None:
    """max_tokens can run out after a </｜DSML｜ invoke>: the calls are whole, and a start
    of the next invoke or of the block's close is neither a call nor answer text."""
    whole = calls_text([ToolCall("f", '{"x": 1}')])
    block = whole[: whole.index("</｜DSML｜ invoke>") + len("</｜DSML｜ invoke>")] + cut
    content, calls = split_answer(["Sure.", block[:20], block[20:]])
    assert content == "Sure." and [(c.name, json.loads(c.arguments)) for c in calls] == [("f", {"x": 1})]
    content, calls = split_answer(["Sure.", block + "\nand then text"])  # not a close: text again
    assert content == "Sure." + cut + "\nand then text" and len(calls) == 1


def test_a_history_call_given_as_json_text_renders_like_the_generated_one(released: Tokenizer) -> None:
    """Clients send arguments back as the JSON text they got; a double-encoded string or
    a non-object becomes what the released encoder makes of it."""
    assert calls_text([ToolCall("f", '"{\\"a\\": [1, 2]}"')]) == calls_text([ToolCall("f", '{"a": [1, 2]}')])
    assert 'name="arguments" string="true">[1]<' in calls_text([ToolCall("f", "[1]")])


def test_the_prefix_property_holds_over_a_tool_loop(released: Tokenizer) -> None:
    """A turn's prompt plus the ids the model generated (calls included) is a prefix of
    the next turn's prompt, which adds the results: the cache is reused along the loop."""
    template = ChatTemplate(released)
    messages = [Message("system", "Tools ahead."), Message("user", "Weather in Paris, then Rome?")]
    for step in range(4):
        prompt = template.render(messages, thinking=True, tools=[WEATHER])
        call = ToolCall("get_weather", json.dumps({"city": f"City {step}", "days": step}), f"call_{step}")
        generated = template.render([Message("user", "x"), Message("assistant", "", reasoning=f"step {step}",
                                                                     tool_calls=(call,))],
                                    add_generation_prompt=False)
        generated = generated[len(template.render([Message("user", "x")])) - 1:]  # after <think>
        messages += [Message("assistant", "", reasoning=f"step {step}", tool_calls=(call,),
                             token_ids=tuple(generated)),
                     Message("tool", json.dumps({"temp_c": 10 + step}), tool_call_id=call.id)]
        after = template.render(messages, thinking=True, tools=[WEATHER])
        assert after[: len(prompt) + len(generated)] == prompt + generated
