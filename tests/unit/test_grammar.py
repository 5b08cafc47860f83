"""Constrained decoding: whatever the model's weights, a constrained answer follows its
grammar; with DSpark too, where a guess outside the grammar is rejected like any other."""

from __future__ import annotations

import json

import jsonschema
import pytest

from model.dspark import DSparkDrafter
from model.runtime.batcher import Batcher, Speculation
from model.runtime.engine import Engine
from model.runtime.grammar import GrammarCompiler, GrammarError, json_grammar, json_or_calls_grammar, tool_call_grammar
from model.runtime.sampling import SamplingParams
from model.runtime.speculative import SpeculativeDrafter
from model.tokenizer import Tokenizer
from model.tools import split_answer
from model.training import init_module

pytestmark = pytest.mark.unit

TINY = "configs/tiny"

# Bounded schemas: a random model must still finish them within max_tokens.
SCHEMAS = [
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "level": {"enum": ["low", "mid", "high"]}},
     "required": ["ok", "level"], "additionalProperties": False},
    {"type": "array", "items": {"type": "integer", "minimum": -5, "maximum": 500}, "minItems": 1, "maxItems": 4},
    {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 6},
        "point": {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9},
                                                   "y": {"type": "integer", "minimum": 0, "maximum": 9}},
                  "required": ["x", "y"], "additionalProperties": False},
        "tag": {"anyOf": [{"type": "null"}, {"type": "boolean"}]}},
     "required": ["name", "point", "tag"], "additionalProperties": False},
]
WEATHER = {"name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"enum": ["Paris", "Rome"]}, "days": {"type": "integer", "minimum": 1, "maximum": 7},
    "metric": {"type": "boolean"}, "note": {"type": "string", "minLength": 1, "maxLength": 8}},
    "required": ["city", "days", "note"]}}  # a string as is, within its length bounds
CLOCK = {"name": "clock", "parameters": {"type": "object", "properties": {}}}
MEMO = {"name": "memo", "parameters": {"type": "object", "properties": {"text": {"type": "string"}},
                                       "required": ["text"]}}


@pytest.fixture(scope="module")
def tiny(tiny_backbone):
    config, model, hasher = tiny_backbone
    drafter = init_module(DSparkDrafter(config), seed=1, std=0.08).eval()
    return Engine(model, hasher), drafter, Tokenizer.from_dir(TINY)


def _run(engine, tokenizer, prompts, params, speculation=None):
    batcher = Batcher(engine, tokenizer, eos_token_ids=(tokenizer.special.eos,), max_batch=4,
                      speculation=speculation)
    ids = {str(i): [] for i in range(len(prompts))}
    finish = {}
    for i, prompt in enumerate(prompts):
        event = batcher.add(str(i), params, prompt=prompt)
        ids[str(i)].append(event.token_id)
        finish[str(i)] = event.finish_reason
    while batcher.running:
        for event in batcher.step():
            ids[event.request_id].append(event.token_id)
            finish[event.request_id] = event.finish_reason
    return [(tokenizer.decode(ids[str(i)], skip_special_tokens=True), ids[str(i)], finish[str(i)])
            for i in range(len(prompts))]


def _prompts(tokenizer):
    return [tokenizer.encode(text) for text in ("def parse(data):", "import json\nx = ", "class A:\n    pass")]


@pytest.mark.parametrize("speculate", [False, True])
@pytest.mark.parametrize("schema", range(len(SCHEMAS)))
def test_every_answer_is_valid_json_of_its_schema(tiny, schema, speculate):
    engine, drafter, tokenizer = tiny
    spec = Speculation(SpeculativeDrafter(drafter, engine), "fixed", k=3) if speculate else None
    for temperature, seed in ((0.0, None), (1.0, 7), (1.5, 11)):
        params = SamplingParams(temperature=temperature, seed=seed, max_tokens=120,
                                grammar=json_grammar(SCHEMAS[schema]))
        for text, _, finish in _run(engine, tokenizer, _prompts(tokenizer), params, spec):
            assert finish == "stop", text
            jsonschema.validate(json.loads(text), SCHEMAS[schema])


def test_speculative_greedy_equals_plain_greedy_under_a_grammar(tiny):
    engine, drafter, tokenizer = tiny
    params = SamplingParams(temperature=0.0, max_tokens=80, grammar=json_grammar(SCHEMAS[2]))
    plain = _run(engine, tokenizer, _prompts(tokenizer), params)
    spec = Speculation(SpeculativeDrafter(drafter, engine), "fixed", k=4)
    assert _run(engine, tokenizer, _prompts(tokenizer), params, spec) == plain


@pytest.mark.parametrize("name, parallel", [(None, True), ("clock", False), ("get_weather", False)])
@pytest.mark.slow
def test_a_required_call_is_a_well_formed_call_of_a_listed_tool(tiny, name, parallel):
    engine, _, tokenizer = tiny
    grammar = tool_call_grammar([WEATHER, CLOCK], name, parallel)
    for temperature, seed in ((0.0, None), (1.0, 3), (1.0, 4)):
        params = SamplingParams(temperature=temperature, seed=seed, max_tokens=400, grammar=grammar)
        for text, _, finish in _run(engine, tokenizer, _prompts(tokenizer), params):
            assert finish == "stop", text
            rest, calls = split_answer([text])
            assert calls and not rest, text
            assert parallel or len(calls) == 1
            for call in calls:
                assert call.name == (name or call.name) and call.name in ("get_weather", "clock")
                if call.name == "get_weather":
                    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])


def test_the_grammar_starts_after_the_reasoning(tiny):
    """With thinking on, the reasoning is free and the grammar governs what follows ``</think>``."""
    _, _, tokenizer = tiny
    compiler = GrammarCompiler(tokenizer.json, tokenizer.vocab_size, tokenizer.special.eos)
    constraint = compiler.constraint(json_grammar(SCHEMAS[0]), tokenizer.vocab_size, (tokenizer.special.think_end,))
    for token in tokenizer.encode("anything at all }{"):
        assert constraint.mask() is None
        constraint.advance(token)
    constraint.advance(tokenizer.special.think_end)
    allowed = constraint.mask()
    assert allowed[tokenizer.encode("{")[0]] and int(allowed.sum()) < tokenizer.vocab_size // 10
    walker, path = compiler.constraint(json_grammar(SCHEMAS[0]), tokenizer.vocab_size), []
    for _ in range(6):  # a path inside the grammar: the highest allowed id at each step
        path.append(int(walker.mask().nonzero()[-1]))
        walker.advance(path[-1])
    masks = constraint.masks_along(path + [tokenizer.special.think_end])  # the last guess leaves it
    assert len(masks) == len(path) + 1 and all(m is not None for m in masks)
    assert (constraint.mask() == allowed).all()  # the look-ahead left the matcher where it was


def test_a_schema_the_engine_cannot_compile_is_a_clear_error(tiny):
    _, _, tokenizer = tiny
    compiler = GrammarCompiler(tokenizer.json, tokenizer.vocab_size, tokenizer.special.eos)
    with pytest.raises(GrammarError, match="type"):
        compiler.check(json_grammar({"type": 7}))
    with pytest.raises(GrammarError):
        tool_call_grammar([WEATHER], "nope")


def test_the_drafts_masks_are_the_ones_verification_would_compute(tiny):
    """The verify pass reuses the masks the drafter walked: they must equal a fresh walk
    of the matcher along the same guesses (Constraint.masks_along)."""
    engine, drafter, tokenizer = tiny
    speculative = SpeculativeDrafter(drafter, engine)
    batcher = Batcher(engine, tokenizer, eos_token_ids=(tokenizer.special.eos,), max_batch=4,
                      speculation=Speculation(speculative, "fixed", k=4))
    for i, (prompt, temperature) in enumerate(zip(_prompts(tokenizer), (0.0, 1.0, 1.3))):
        batcher.add(str(i), SamplingParams(temperature=temperature, seed=i, max_tokens=50,
                                           grammar=json_grammar(SCHEMAS[i % len(SCHEMAS)])), prompt=prompt)
    for _ in range(3):
        running = list(batcher.running.values())
        if not running:
            break
        drafted = speculative.propose([r.context for r in running], [r.tokens[-1] for r in running],
                                      [r.params for r in running], [r.generator for r in running],
                                      [r.constraint for r in running])
        for row, r in enumerate(running):
            guesses = drafted.proposal.tokens[row].tolist()
            walked, fresh = drafted.walks[row].masks_for(guesses), r.constraint.masks_along(guesses)
            assert len(walked) == len(fresh) == len(guesses) + 1  # drafted inside the grammar
            assert all((a is None and b is None) or bool((a == b).all()) for a, b in zip(walked, fresh))
        assert drafted.walks[0].masks_for([-1]) is None  # other guesses than the walk's: not reused
        batcher.step()


@pytest.mark.parametrize("note", ["ok", "a</b>c"])
def test_a_call_follows_the_grammar_where_the_markup_is_one_token(note):
    """In the released vocabulary ``｜DSML｜`` is one token, so the close tags a grammar
    ends a string argument with hold a token, not text. A well-formed call, written as
    the template writes it, walks the grammar to its end, a value may contain "</"
    (unbounded), and the markup spelled as text is outside the grammar."""
    from model.tools import DSML, ToolCall, calls_text

    tokenizer = _dsml_tokenizer()
    dsml = tokenizer.special.dsml
    compiler = GrammarCompiler(tokenizer.json, tokenizer.vocab_size, tokenizer.special.eos)
    calls = [ToolCall("get_weather", json.dumps({"city": "Rome", "days": 3, "note": "ok"}), "a"),
             ToolCall("memo", json.dumps({"text": note}), "b")]
    text = calls_text(calls)
    ids = _markup_ids(tokenizer, text)
    assert ids.count(dsml) == text.count(DSML)
    constraint = compiler.constraint(tool_call_grammar([WEATHER, MEMO, CLOCK], None, True, dsml),
                                     tokenizer.vocab_size)
    for token in ids:
        assert constraint.mask()[token], tokenizer.decode(ids[: ids.index(token) + 1])
        constraint.advance(token)
    assert constraint.matcher.is_accepting()
    rest, parsed = split_answer([tokenizer.decode(ids)])
    assert not rest and [call.name for call in parsed] == ["get_weather", "memo"]
    # The markup spelled as bytes is not the markup: the first "｜" byte is refused.
    spelled = compiler.constraint(tool_call_grammar([CLOCK], "clock", False, dsml), tokenizer.vocab_size)
    for token in tokenizer.encode("\n\n<"):
        spelled.advance(token)
    allowed = spelled.mask()
    assert allowed[dsml] and not allowed[tokenizer.encode(DSML)[0]]


def test_a_json_answer_beside_tools_is_json_of_its_schema_or_a_calls_block():
    """``tool_choice`` auto with a JSON answer asked for (the OpenAI Agents SDK's
    ``output_type`` beside tools): the answer is a JSON value of the schema, or a calls
    block; free text and JSON of another shape are outside the grammar."""
    from model.tools import ToolCall, calls_text

    tokenizer = _dsml_tokenizer()
    compiler = GrammarCompiler(tokenizer.json, tokenizer.vocab_size, tokenizer.special.eos)
    schema = {"type": "object", "properties": {"lines": {"type": "integer"}}, "required": ["lines"],
              "additionalProperties": False}
    grammar = json_or_calls_grammar(schema, [WEATHER, CLOCK], False, tokenizer.special.dsml)

    def walks(ids: list[int]) -> bool:
        constraint = compiler.constraint(grammar, tokenizer.vocab_size)
        for token in ids:
            if not constraint.mask()[token]:
                return False
            constraint.advance(token)
        return constraint.matcher.is_accepting()

    call = calls_text([ToolCall("get_weather", json.dumps({"city": "Rome", "days": 3, "note": "ok"}), "a")])
    assert walks(tokenizer.encode('{"lines": 42}')) and walks(_markup_ids(tokenizer, call))
    assert not walks(tokenizer.encode('{"lines": "many"}')) and not walks(tokenizer.encode("It has 42 lines."))
    two = calls_text([ToolCall("clock", "{}", "a"), ToolCall("clock", "{}", "b")])
    assert not walks(_markup_ids(tokenizer, two))  # (parallel_tool_calls false: one call)


def _dsml_tokenizer() -> Tokenizer:
    """The golden tokenizer with ``｜DSML｜`` as one special token, as in the release."""
    import tokenizers

    from model.tools import DSML

    raw = tokenizers.Tokenizer.from_file("tests/golden/A/tokenizer.json")
    raw.add_special_tokens([tokenizers.AddedToken(DSML, special=True, normalized=False)])
    return Tokenizer(raw.to_str())


def _markup_ids(tokenizer: Tokenizer, text: str) -> list[int]:
    """``text`` as the chat template tokenizes an answer (the markup's token as one id)."""
    from model.chat import ChatTemplate

    ids = []
    for part in ChatTemplate(tokenizer)._markup(text):
        ids += [part] if isinstance(part, int) else tokenizer.encode(part)
    return ids


@pytest.mark.parametrize("thinking", [False, True])
def test_an_auto_answer_is_free_until_the_model_opens_a_call(thinking):
    """``tool_choice`` auto: text (and the reasoning) is free; from the ｜DSML｜ token
    that opens a calls block, the rest follows the tools' grammar: the template's own
    rendering of a call walks it to the end, a tool not offered or a second call where
    parallel calls are off is refused, and a look-ahead across the trigger rewinds."""
    from model.tools import ToolCall, calls_text

    tokenizer = _dsml_tokenizer()
    dsml, think_end = tokenizer.special.dsml, tokenizer.special.think_end
    compiler = GrammarCompiler(tokenizer.json, tokenizer.vocab_size, tokenizer.special.eos)
    after = (think_end, dsml) if thinking else (dsml,)
    reasoning = _markup_ids(tokenizer, "a call? " + calls_text([ToolCall("clock", "{}", "x")])) + [think_end] \
        if thinking else []  # a block inside the reasoning does not start the grammar
    call = ToolCall("get_weather", json.dumps({"city": "Paris", "days": 2, "note": "a b"}), "a")
    ids = reasoning + _markup_ids(tokenizer, "Let me look." + calls_text([call]))
    opens = ids.index(dsml, len(reasoning))
    constraint = compiler.constraint(tool_call_grammar([WEATHER, MEMO], None, False, dsml, opened=True),
                                     tokenizer.vocab_size, after)
    assert all(m is None for m in constraint.masks_along(ids[:opens]))
    assert constraint.masks_along(ids[: opens + 3])[-1] is not None  # the look-ahead entered the grammar
    for k, token in enumerate(ids):
        mask = constraint.mask()
        assert (mask is None) == (k <= opens), k
        assert mask is None or mask[token], tokenizer.decode(ids[: k + 1])
        constraint.advance(token)
    assert constraint.matcher.is_accepting()
    content, calls = split_answer([tokenizer.decode(ids[len(reasoning):])])
    assert content == "Let me look." and [(c.name, c.arguments) for c in calls] == [(call.name, call.arguments)]
    # After the trigger: only the offered tools' names; and one call, since parallel is off.
    fresh = compiler.constraint(tool_call_grammar([WEATHER, MEMO], None, False, dsml, opened=True),
                                tokenizer.vocab_size, (dsml,))
    head = _markup_ids(tokenizer, calls_text([ToolCall("clock", "{}", "x")]))
    refused = next(k for k, token in enumerate(head) if not fresh.try_advance(token))
    assert tokenizer.decode(head[: refused + 1]).endswith("c")  # name="c...: no offered tool's name starts so
    two = _markup_ids(tokenizer, calls_text([call, call]))
    single = compiler.constraint(tool_call_grammar([WEATHER, MEMO], None, False, dsml, opened=True),
                                 tokenizer.vocab_size, (dsml,))
    assert not all(single.try_advance(token) for token in two)
    with pytest.raises(GrammarError, match="DSML"):
        tool_call_grammar([WEATHER], None, True, None, opened=True)
