"""The tool world the small model is fine-tuned on (`model.training.stdlib_tools`) and its
synthetic conversations (`model.training.tool_data`): right answers, a closed arithmetic,
held-out modules never trained on, the loss on exactly the assistant turns, and every
gold call inside the grammar constrained decoding enforces."""

from __future__ import annotations

import json
import random
import string
import textwrap
from pathlib import Path

import jsonschema
import pytest

from model.training import stdlib_tools, tool_data
from model.training.stdlib_tools import BY_NAME, run_tool
from model.chat import ChatTemplate
from model.runtime.grammar import GrammarCompiler, tool_call_grammar
from model.tokenizer import Tokenizer
from model.tools import calls_text

pytestmark = pytest.mark.unit

SMALL = Path(__file__).parents[2] / "configs" / "small"


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.from_dir(SMALL)


def test_the_tools_answer_what_is_known_independently():
    assert run_tool("count_names", {"module": "json"}) == str(len(json.__all__))
    assert json.loads(run_tool("list_names", {"module": "json", "limit": 3})) == sorted(json.__all__)[:3]
    assert run_tool("has_name", {"module": "json", "name": "loads"}) == "true"
    assert run_tool("has_name", {"module": "json", "name": "no_such_name"}) == "false"
    assert run_tool("module_doc", {"module": "string"}) == "A collection of string constants."
    assert run_tool("read_source", {"module": "textwrap", "lines": 2}) == \
        "\n".join(Path(textwrap.__file__).read_text().splitlines()[:2])
    assert run_tool("source_file", {"module": "json"}) == "json/__init__.py"
    assert run_tool("function_signature", {"module": "textwrap", "function": "dedent"}) == "dedent(text)"
    assert run_tool("constant_value", {"module": "string", "name": "digits"}) == repr(string.digits)
    assert run_tool("is_package", {"module": "json"}) == "true" and run_tool("is_package", {"module": "glob"}) == "false"
    assert json.loads(run_tool("list_submodules", {"package": "json"})) == ["decoder", "encoder", "scanner", "tool"]
    assert run_tool("calculate", {"expression": "(48 + 17) * 6"}) == "390"
    assert run_tool("calculate", {"expression": "7 / 2"}) == "3.5"
    assert run_tool("calculate", {"expression": "-(2 ** 10) // 3 % 7"}) == str(-(2 ** 10) // 3 % 7)
    assert run_tool("is_prime", {"n": 9973}) == "true" and run_tool("is_prime", {"n": 1001}) == "false"
    assert json.loads(run_tool("factorize", {"n": 360})) == [2, 2, 2, 3, 3, 5]
    assert run_tool("gcd", {"a": 1071, "b": 462}) == "21"
    assert run_tool("convert_base", {"number": 255, "base": 16}) == "ff"
    assert run_tool("convert_base", {"number": -10, "base": 2}) == "-1010"
    assert run_tool("sum_numbers", {"numbers": [1, 2.5, -3]}) == "0.5"
    assert json.loads(run_tool("sort_numbers", {"numbers": [3, -1, 2], "descending": True})) == [3, 2, -1]
    assert run_tool("word_count", {"text": "a b  c"}) == "3"
    assert run_tool("reverse_text", {"text": "abc"}) == "cba"
    assert run_tool("upper_case", {"text": "abc"}) == "ABC"
    assert run_tool("hash_text", {"text": "abc", "algorithm": "md5"}) == "900150983cd2"  # RFC 1321's test vector
    assert run_tool("days_between", {"start": "2024-02-01", "end": "2024-03-01"}) == "29"  # a leap year
    assert run_tool("weekday", {"date": "2000-01-01"}) == "Saturday"


@pytest.mark.parametrize("name, arguments", [
    ("calculate", {"expression": "__import__('os').system('true')"}),
    ("calculate", {"expression": "9 ** 9 ** 9"}),
    ("calculate", {"expression": "1 / 0"}),
    ("count_names", {"module": "os.path; import sys"}),
    ("count_names", {"module": "numpy"}),
    ("count_names", {}),
    ("is_prime", {"n": "7"}),
    ("convert_base", {"number": 5, "base": 99}),
    ("hash_text", {"text": "a", "algorithm": "crc"}),
    ("weekday", {"date": "yesterday"}),
    ("nope", {}),
])
def test_a_bad_call_is_an_error_the_model_reads(name, arguments):
    assert run_tool(name, arguments).startswith("error:")


def test_every_module_answers_and_the_held_out_ones_are_never_trained_on():
    assert len(stdlib_tools.FUNCTIONS) == 28
    assert not set(stdlib_tools.HELD_OUT_MODULES) & set(stdlib_tools.TRAIN_MODULES)
    for module in stdlib_tools.MODULES:
        assert not run_tool("count_lines", {"module": module}).startswith("error:"), module
    trained = {json.loads(call.arguments).get("module") for conv in tool_data.conversations(300, "train")
               for message in conv.messages for call in message.tool_calls}
    assert not trained & set(stdlib_tools.HELD_OUT_MODULES)
    held = {json.loads(call.arguments).get("module") for conv in tool_data.conversations(60, "held_out")
            for message in conv.messages for call in message.tool_calls}
    assert held - {None} <= set(stdlib_tools.HELD_OUT_MODULES) | {"numpy", "requests", "pandas", "flask", "yaml",
                                                                     "django", "torch", "scipy", "attr", "rich"}


def test_training_asks_about_thousands_of_names_so_that_the_model_must_copy_them():
    """A few dozen modules and words are memorised, not copied: in training, half of the
    texts and every module outside the standard library come from the sources' words,
    which name no standard-library module (held-out ones included) and whose calls get
    an error back; the held-out splits ask as before."""
    import sys

    pool = tool_data.name_pool()
    assert len(pool) > 3000 and pool == tuple(sorted(set(pool)))
    assert not set(pool) & (set(sys.stdlib_module_names) | set(stdlib_tools.MODULES))
    asked = {"module": set(), "text": set()}
    for conv in tool_data.conversations(300, "train", seed=5):
        results = {m.tool_call_id: m.content for m in conv.messages if m.role == "tool"}
        for message in conv.messages:
            for call in message.tool_calls:
                arguments = json.loads(call.arguments)
                for key, seen in asked.items():
                    seen.update(str(arguments.get(key, "")).split())
                if conv.kind.startswith("error") and arguments.get("module") in pool:
                    assert results[call.id].startswith("error: ")
    assert len(asked["module"] & set(pool)) > 15 and len(asked["text"] & set(pool)) > 30
    texts = [json.loads(call.arguments) for conv in tool_data.conversations(200, "held_out", seed=5)
             for message in conv.messages for call in message.tool_calls]
    held = {word for arguments in texts if "module" not in arguments  # (not a search in a module's source)
            for word in str(arguments.get("text", "")).split()}
    assert held and held <= set(tool_data._WORDS)


def test_multi_call_draws_that_share_of_episodes_as_chains_and_parallel_calls():
    """`v41 train-tools --multi-call`: 0 is the default mix, draw for draw; 1 makes every
    tool episode a chain or parallel calls (the chats offered no tools stay)."""
    import random

    def kinds(multi_call: float, n: int = 300) -> list[str]:
        rng = random.Random("multi")
        return [tool_data.conversation(rng, multi_call=multi_call).kind for _ in range(n)]

    default = kinds(0.0)
    rng_a, rng_b = random.Random(1), random.Random(1)
    assert [tool_data.conversation(rng_a) for _ in range(30)] == \
        [tool_data.conversation(rng_b, multi_call=0.0) for _ in range(30)]
    every = kinds(1.0)
    assert {part for kind in every for part in kind.split("+")} == {"chain", "parallel", "no_tools"}
    multi = sum(kind != "no_tools" and all(p in ("chain", "parallel") for p in kind.split("+")) for kind in every)
    assert multi > 0.8 * len(every)

    def share(drawn: list[str]) -> float:
        return sum(any(p in ("chain", "parallel") for p in kind.split("+")) for kind in drawn) / len(drawn)

    assert share(default) < 0.25 and share(kinds(0.3)) > 0.35


def test_conversations_are_seeded_and_their_calls_are_valid_and_offered():
    assert tool_data.conversations(20, "train", 3) == tool_data.conversations(20, "train", 3)
    assert tool_data.conversations(20, "train", 3) != tool_data.conversations(20, "train", 4)
    kinds = set()
    for conv in tool_data.conversations(200, "held_out_phrasing"):
        kinds.update(conv.kind.split("+"))
        offered = {f["name"] for f in conv.tools}
        assert 2 <= len(offered) <= 6 or conv.kind == "no_tools" and not offered
        results = {m.tool_call_id: m.content for m in conv.messages if m.role == "tool"}
        for message in conv.messages:
            for call in message.tool_calls:
                assert call.name in offered
                arguments = json.loads(call.arguments)
                jsonschema.validate(arguments, BY_NAME[call.name]["parameters"])
                # the schema's order, as the grammar writes them
                assert list(arguments) == [k for k in BY_NAME[call.name]["parameters"]["properties"] if k in arguments]
                assert results[call.id] == run_tool(call.name, arguments)
        assert conv.messages[-1].role == "assistant" and not conv.messages[-1].tool_calls
    assert kinds == {"one_call", "parallel", "chain", "error", "no_call", "no_tools"}


def test_the_loss_is_on_exactly_the_assistant_turns(tokenizer):
    template = ChatTemplate(tokenizer)
    for conv in tool_data.conversations(12, "train", 7):
        rendered = tool_data.render(template, conv)
        assert rendered.ids == template.render(conv.messages, add_generation_prompt=False, tools=conv.tools)
        spans, current = [], []
        for token, target in zip(rendered.ids, rendered.targets):
            if target:
                current.append(token)
            elif current:
                spans.append(current)
                current = []
        spans += [current] if current else []
        assistants = [m for m in conv.messages if m.role == "assistant"]
        assert len(spans) == len(assistants)
        for span, message in zip(spans, assistants):
            calls = calls_text(message.tool_calls) if message.tool_calls else ""
            assert tokenizer.decode(span) == message.content + calls + "<｜end▁of▁sentence｜>"
        # The content (weighted up in training): argument values and answers, no markup.
        values = []
        for message in assistants:
            for call in message.tool_calls:
                values += [v if isinstance(v, str) else json.dumps(v) for v in json.loads(call.arguments).values()]
            values.append(message.content)
        assert all(t for t, c in zip(rendered.targets, rendered.content) if c)
        assert tokenizer.decode([i for i, c in zip(rendered.ids, rendered.content) if c]) == "".join(values)


def test_every_gold_call_is_inside_the_grammar_constrained_decoding_enforces(tokenizer):
    """The answers the fine-tune teaches are ones a forced call (``tool_choice:
    required``) can produce: each token of each gold call turn is allowed in turn."""
    compiler = GrammarCompiler(tokenizer.json, tokenizer.vocab_size, tokenizer.special.eos)
    template = ChatTemplate(tokenizer)
    rng = random.Random(0)
    for conv in rng.sample(tool_data.conversations(80, "train", 11), 20):
        rendered = tool_data.render(template, conv)
        grammar = tool_call_grammar(conv.tools, None, True, tokenizer.special.dsml)
        for i, message in enumerate(conv.messages):
            if not message.tool_calls:
                continue
            start = len(template.render(conv.messages[:i], tools=conv.tools))
            end = len(template.render(conv.messages[: i + 1], add_generation_prompt=False, tools=conv.tools))
            constraint = compiler.constraint(grammar, tokenizer.vocab_size)
            for token in rendered.ids[start:end]:
                assert constraint.mask()[token], tokenizer.decode(rendered.ids[start:end])
                constraint.advance(token)


@pytest.mark.e2e
@pytest.mark.slow
def test_train_tools_fine_tunes_and_saves_a_loadable_checkpoint(tmp_path):
    """Two steps of `v41 train-tools` from the shipped checkpoint, then one more from the
    result: the backbone's weights move, the drafter and the vision tower are kept as they
    were, the checkpoint loads, the report keeps the runs before it."""
    import subprocess
    import sys

    import torch

    from model.loader import load_checkpoint

    out = tmp_path / "tools"
    run = subprocess.run([sys.executable, "-m", "cluster.cli", "train-tools", "--out", str(out), "--steps", "2",
                          "--max-files", "100", "--eval", "0", "--window", "64"],
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-2000:]
    report = json.loads((out / "tool_training.json").read_text())
    assert report["steps"] == 2 and report["target_tokens"] > 100
    assert set(report["held_out_corpus_loss"]) == {"before", "after"}
    assert report["induction"] == 4 and len(report["log"]["repeat_loss"]) == 2
    # --window: fine-tuned and saved at 64, not the shipped checkpoint's 128; repeats probed
    # inside that window, just past it and at twice it.
    def window(directory):
        return json.loads((directory / "config.json").read_text())["text_config"]["sliding_window"]

    assert window(out) == report["window"] == 64 and window(SMALL) == 128
    assert report["repeat_accuracy"]["lengths"] == [10, 20, 40, 70, 128]
    assert all(0 <= a <= 1 for key in ("before", "after") for a in report["repeat_accuracy"][key])
    before, after = load_checkpoint(SMALL), load_checkpoint(out)
    moved = [name for name, p in after.backbone.named_parameters()
             if not torch.equal(p, dict(before.backbone.named_parameters())[name])]
    assert moved and (out / "tokenizer.json").read_bytes() == (SMALL / "tokenizer.json").read_bytes()
    for part in ("drafter", "vision"):  # (a tower left out made a checkpoint whose config has one)
        kept, shipped = dict(getattr(after, part).named_parameters()), getattr(before, part).named_parameters()
        assert all(torch.equal(kept[name], p) for name, p in shipped), part
    assert not (out / "tools-state").exists()
    again = subprocess.run([sys.executable, "-m", "cluster.cli", "train-tools", "--checkpoint", str(out), "--out",
                            str(out), "--steps", "1", "--max-files", "100", "--eval", "0"],
                           capture_output=True, text=True, timeout=900)
    assert again.returncode == 0, again.stderr[-2000:]
    shipped = json.loads((SMALL / "tool_training.json").read_text())  # the shipped weights' own fine-tune
    runs = json.loads((out / "tool_training.json").read_text())["previous_runs"]
    assert [run["steps"] for run in runs] == [*(r["steps"] for r in shipped.get("previous_runs", [])),
                                              shipped["steps"], 2]

