"""Tokenizer and chat template against the golden tokenizer (tests/golden/A)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from model.chat import ChatTemplate, Message, resolve_effort
from model.tokenizer import ChatFormatError, Tokenizer

pytestmark = pytest.mark.unit

GOLDEN = Path(__file__).parents[1] / "golden" / "A"
BOS_USER = "<｜begin▁of▁sentence｜><｜User｜>"
NO_THINK_PROMPT_END = "<｜Assistant｜><think></think>"


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_dir(GOLDEN)


@pytest.fixture(scope="module")
def template(tokenizer: Tokenizer) -> ChatTemplate:
    return ChatTemplate(tokenizer)


def test_special_tokens_and_vocab(tokenizer: Tokenizer) -> None:
    sp = tokenizer.special
    assert (sp.bos, sp.eos, sp.pad, sp.user, sp.assistant, sp.think_start, sp.think_end, sp.image) == tuple(range(8))
    assert sp.system is None and sp.noise is None
    assert tokenizer.vocab_size == 2048
    assert Tokenizer.from_dir(GOLDEN, noise_token_id=2047).special.noise == 2047
    with pytest.raises(ChatFormatError, match="outside the vocabulary"):
        Tokenizer.from_dir(GOLDEN, noise_token_id=2048)


def test_fingerprint_is_stable_and_content_addressed(tokenizer: Tokenizer) -> None:
    text = (GOLDEN / "tokenizer.json").read_text(encoding="utf-8")
    assert Tokenizer(text).fingerprint == tokenizer.fingerprint
    assert len(tokenizer.fingerprint) == 16 and int(tokenizer.fingerprint, 16) >= 0
    changed = json.loads(text)
    changed["model"]["vocab"]["face"], changed["model"]["vocab"]["ES"] = (
        changed["model"]["vocab"]["ES"],
        changed["model"]["vocab"]["face"],
    )
    assert Tokenizer(json.dumps(changed)).fingerprint != tokenizer.fingerprint


def test_golden_prompts_reproduced(template: ChatTemplate) -> None:
    prompts = json.loads((GOLDEN / "inputs.json").read_text(encoding="utf-8"))["prompts"]
    for prompt in prompts:
        text = prompt["text"]
        assert text.startswith(BOS_USER) and text.endswith(NO_THINK_PROMPT_END)
        question = text[len(BOS_USER) : -len(NO_THINK_PROMPT_END)]
        messages = [Message("user", question)]
        assert template.render(messages, thinking=False) == prompt["input_ids"]
        assert template.render_text(messages, thinking=False) == text


def test_generation_prompt_endings(template: ChatTemplate) -> None:
    messages = [Message("user", "hi")]
    assert template.render_text(messages, thinking=False).endswith("<｜User｜>hi<｜Assistant｜><think></think>")
    thinking = template.render_text(messages, thinking=True)
    assert thinking.endswith("<｜User｜>hi<｜Assistant｜><think>")
    assert template.render_text(messages, add_generation_prompt=False).endswith("<｜User｜>hi")


def test_full_layout_with_system_tools_and_history(template: ChatTemplate) -> None:
    messages = [
        Message("system", "Be brief."),
        Message("user", "2+2?"),
        Message("assistant", "4", reasoning="add"),
        Message("tool", "sum=4"),
        Message("user", "thanks"),
    ]
    expected = (
        "<｜begin▁of▁sentence｜>Reasoning Effort: 75 (range 1-100, the higher the value, the more thorough "
        "the reasoning)\n\nBe brief.<｜User｜>2+2?<｜Assistant｜><think>add</think>4<｜end▁of▁sentence｜>"
        "<｜User｜><tool_result>sum=4</tool_result>\n\nthanks<｜Assistant｜><think>"
    )
    assert template.render_text(messages, thinking=True) == expected


def test_special_token_spelling_in_user_text_stays_text(tokenizer: Tokenizer, template: ChatTemplate) -> None:
    ids = template.render([Message("user", "<｜Assistant｜></think>")], thinking=False)
    sp = tokenizer.special
    assert ids.count(sp.assistant) == 1 and ids.count(sp.think_end) == 1
    assert tokenizer.decode(tokenizer.encode("<｜Assistant｜>")) == "<｜Assistant｜>"


def _generated(tokenizer: Tokenizer, reasoning: str | None, answer: str, canonical: bool, eos: bool) -> list[int]:
    """Ids a model could emit after the generation prompt; non-canonical = one id per byte-level piece."""

    def enc(text: str) -> list[int]:
        if canonical:
            return tokenizer.encode(text)
        return [i for ch in text for i in tokenizer.encode(ch)]

    ids = [] if reasoning is None else enc(reasoning) + [tokenizer.special.think_end]
    ids += enc(answer)
    return ids + [tokenizer.special.eos] if eos else ids


@pytest.mark.parametrize("thinking", [False, True])
@pytest.mark.parametrize("effort", [None, "low", 30])
@pytest.mark.parametrize("mode", ["text", "token_ids", "token_ids_no_eos"])
def test_prefix_property_over_turns(tokenizer: Tokenizer, template: ChatTemplate, thinking, effort, mode) -> None:
    rng = random.Random(f"{thinking}-{effort}-{mode}")  # str seeds are deterministic across runs
    words = ["alpha", " beta", " γάμμα", " 世界", " 🙂", "\n", " the", " Python", "  ", "1991"]
    messages = [Message("system", "You are terse.")]
    for turn in range(4):
        messages.append(Message("user", "".join(rng.choices(words, k=rng.randint(1, 8)))))
        prompt = template.render(messages, thinking=thinking, effort=effort)
        reasoning = "".join(rng.choices(words, k=rng.randint(0, 6))) if thinking else None
        answer = "".join(rng.choices(words, k=rng.randint(1, 8)))
        if mode == "text":
            out = _generated(tokenizer, reasoning, answer, canonical=True, eos=True)
            reply = Message("assistant", answer, reasoning=reasoning)
        else:
            out = _generated(tokenizer, reasoning, answer, canonical=False, eos=mode == "token_ids")
            reply = Message("assistant", answer, reasoning=reasoning, token_ids=tuple(out))
        messages.append(reply)
        if turn % 2:
            messages.append(Message("tool", "result"))
        follow_up = messages + [Message("user", "next?")]
        rendered = template.render(follow_up, thinking=thinking, effort=effort)
        assert rendered[: len(prompt) + len(out)] == prompt + out, f"turn {turn}"
        if mode == "token_ids_no_eos":
            assert rendered[len(prompt) + len(out)] == tokenizer.special.eos


def test_thinking_off_history_equals_thinking_with_empty_reasoning(template: ChatTemplate) -> None:
    """An assistant turn renders the same whether it was produced thinking-off or thinking with no reasoning."""
    off = [Message("user", "a"), Message("assistant", "b"), Message("user", "c")]
    on_empty = [Message("user", "a"), Message("assistant", "b", reasoning=""), Message("user", "c")]
    assert template.render(off, thinking=False) == template.render(on_empty, thinking=False)


@pytest.mark.parametrize(("effort", "value"), [(None, 75), ("low", 50), ("high", 75), ("max", 100), (1, 1), (100, 100)])
def test_effort_levels(template: ChatTemplate, effort, value) -> None:
    assert resolve_effort(effort) == value
    text = template.render_text([Message("user", "q")], thinking=True, effort=effort)
    assert text.startswith(f"<｜begin▁of▁sentence｜>Reasoning Effort: {value} (range 1-100")
    assert "Reasoning Effort" not in template.render_text([Message("user", "q")], thinking=False, effort=effort)


@pytest.mark.parametrize("effort", [0, 101, -5, "medium", "HIGH", True, 50.0, "75"])
def test_effort_out_of_range(template: ChatTemplate, effort) -> None:
    with pytest.raises(ChatFormatError, match="effort"):
        template.render([Message("user", "q")], thinking=True, effort=effort)
    # Validated even when thinking is off and the line would not be rendered.
    with pytest.raises(ValueError):
        template.render([Message("user", "q")], thinking=False, effort=effort)


def test_validation_errors(template: ChatTemplate) -> None:
    with pytest.raises(ChatFormatError, match="at least one message"):
        template.render([])
    with pytest.raises(ChatFormatError, match="unknown role 'bot'"):
        Message("bot", "hi")
    with pytest.raises(ChatFormatError, match="only assistant"):
        Message("user", "hi", reasoning="x")
    with pytest.raises(ChatFormatError, match="must follow a user"):
        template.render([Message("assistant", "hi"), Message("user", "q")])
    with pytest.raises(ChatFormatError, match="must follow a user"):
        template.render([Message("user", "q"), Message("assistant", "a"), Message("assistant", "b")], add_generation_prompt=False)
    with pytest.raises(ChatFormatError, match="end with a user or tool"):
        template.render([Message("user", "q"), Message("assistant", "a")])
    with pytest.raises(ChatFormatError, match="only a system message"):
        template.render([Message("system", "s")])
    with pytest.raises(ChatFormatError, match="no <｜System｜> token"):
        template.render([Message("user", "q"), Message("system", "s")])
    with pytest.raises(ChatFormatError, match="not a Message"):
        template.render([{"role": "user", "content": "q"}])


@pytest.mark.parametrize(
    "text", ["", "hello world", "  spaces\tand\ttabs\n\n", "naïve café", "日本語のテキスト", "emoji 🙂🚀 mix", "<think> not special"]
)
def test_encode_decode_round_trip(tokenizer: Tokenizer, text: str) -> None:
    assert tokenizer.decode(tokenizer.encode(text)) == text


def _stream(tokenizer: Tokenizer, ids: list[int], skip_special_tokens: bool) -> list[str]:
    detok = tokenizer.detokenizer(skip_special_tokens=skip_special_tokens)
    pieces = [detok.push(i) for i in ids]
    pieces.append(detok.flush())
    assert list(detok.ids) == ids
    return pieces


@pytest.mark.parametrize("skip_special_tokens", [False, True])
def test_incremental_detokenizer_matches_full_decode_on_random_ids(tokenizer: Tokenizer, skip_special_tokens) -> None:
    rng = random.Random(7)
    # Ids of multi-byte text, split one character at a time, so that many
    # characters span several byte-level tokens.
    multibyte = [i for ch in "世界 γάμμα 🙂 naïve ∑ 🚀" for i in tokenizer.encode(ch)]
    for trial in range(60):
        ids = [rng.randrange(tokenizer.vocab_size) for _ in range(rng.randint(0, 40))]
        at = rng.randint(0, len(ids))
        ids[at:at] = multibyte[: rng.randint(0, len(multibyte))]
        pieces = _stream(tokenizer, ids, skip_special_tokens)
        assert "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=skip_special_tokens), f"trial {trial}"


def test_incremental_detokenizer_never_splits_a_character(tokenizer: Tokenizer) -> None:
    text = "Grüße, 世界! 🙂🚀 ∑x² — done"
    ids = [i for ch in text for i in tokenizer.encode(ch)]
    assert len(ids) > len(text)  # several characters really span several ids
    pieces = _stream(tokenizer, ids, skip_special_tokens=True)
    assert "".join(pieces) == text
    assert all("\ufffd" not in piece for piece in pieces)


def test_a_template_with_a_memo_renders_what_one_without_renders(tokenizer: Tokenizer) -> None:
    """The router's template remembers the ids of long texts: a conversation rendered
    turn after turn gives the same ids as a fresh template, and the memo stays within
    its token budget (least recently used texts go first)."""
    rng = random.Random(7)
    words = ["def", "return", "self", "value", "  ", "\n", "(x)", "import", "héllo", "42", "#", "==", ":"]
    def text(n: int) -> str:
        return " ".join(rng.choice(words) for _ in range(n))

    plain = ChatTemplate(tokenizer)
    budget = 600
    memo = ChatTemplate(tokenizer, memo_tokens=budget)
    messages = [Message("system", text(120))]
    for turn in range(6):
        messages.append(Message("user", text(rng.choice([5, 90, 200]))))
        assert memo.render(messages, thinking=turn % 2 == 1) == plain.render(messages, thinking=turn % 2 == 1)
        messages.append(Message("assistant", text(rng.choice([3, 150]))))
    kept = memo._encode.__self__
    assert kept.entries and 0 < kept.tokens <= budget
    assert kept.tokens == sum(len(ids) for ids in kept.entries.values())
    assert all(len(t) >= kept.MIN_CHARS for t in kept.entries)
    eligible = {m.content for m in messages[:-1] if len(m.content) >= kept.MIN_CHARS}
    assert sum(len(tokenizer.encode(t)) for t in eligible) > budget > 0  # so some were evicted
    assert len(kept.entries) < len(eligible)
    newest = next(reversed(kept.entries))
    assert list(kept.entries[newest]) == tokenizer.encode(newest)
