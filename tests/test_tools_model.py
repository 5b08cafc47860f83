"""The shipped small model calls tools (`v41 train-tools`): held-out conversations in the
released format, greedy, free and under `tool_choice: required`; and a chat offered no
tools is still answered in text. Slow: it generates (about a minute)."""

from __future__ import annotations

from pathlib import Path

import pytest

SMALL = Path(__file__).resolve().parent.parent / "configs" / "small"


@pytest.mark.slow
def test_the_shipped_model_calls_the_right_tool_on_held_out_modules():
    from cluster.bench.tools import evaluate_tools

    held = evaluate_tools(SMALL, n=12, seed=1, splits=("held_out",))["held_out"]
    assert held["call"]["turns"] >= 10
    # Constrained decoding: every forced call that ends is well formed (the grammar; one
    # may run to the token limit inside a string).
    assert held["call_constrained"]["well_formed"] + held["call_constrained"]["cut_at_max_tokens"] == 1.0
    # Free decoding, about modules the fine-tune never saw: measured 0.985 / 0.879 / 0.879
    # on 60 conversations; a margin for rounding that differs between CPUs.
    assert held["call"]["well_formed"] >= 0.75 and held["call"]["right_function"] >= 0.6
    assert held["call"]["valid_arguments"] >= 0.5
    assert held["answer"]["no_call"] >= 0.9  # answers after tool results call nothing


@pytest.mark.slow
def test_a_chat_without_tools_is_answered_in_text():
    import torch

    from model.chat import ChatTemplate, Message, Tokenizer
    from model.loader import load_checkpoint, load_hasher
    from model.runtime.batcher import generate
    from model.runtime.engine import Engine
    from model.runtime.sampling import SamplingParams

    checkpoint = load_checkpoint(SMALL)
    engine = Engine(checkpoint.backbone, load_hasher(SMALL, checkpoint.config))
    tokenizer = Tokenizer.from_dir(SMALL)
    template = ChatTemplate(tokenizer)
    prompts = [template.render([Message("user", text)]) for text in
               ("def fibonacci(n):", "import os\nimport sys\n", "class Point:", "Hello!")]
    with torch.no_grad():
        outputs = generate(engine, prompts, SamplingParams(temperature=0.0, max_tokens=40),
                           (tokenizer.special.eos,))
    texts = [tokenizer.decode(ids) for ids in outputs]
    assert not any("DSML" in text for text in texts), texts
    assert all(text.strip() for text in texts), texts
