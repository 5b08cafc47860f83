"""A seeded synthetic tool-use set over :mod:`model.training.stdlib_tools`, rendered in the
released V4.1 format.

An episode is a user question, the assistant turns that call tools (one call, two in
parallel, or two steps where the second call uses the first result), the tool results
(computed here by running the tools), and a final answer that quotes the results. Some
episodes call no tool (a greeting), some get an error back and say so, some follow an
earlier episode in the same conversation. Each conversation offers the tools it needs
among distractors (2 to 6 tools, shuffled).

Splits: ``train`` asks about the training modules in the training phrasings;
``held_out`` about the held-out modules (every fifth) in the same phrasings;
``held_out_phrasing`` about held-out modules in phrasings the fine-tune never saw.
Numbers, texts and dates are drawn per episode (the chance that a held-out episode
repeats a training one is negligible). In ``train``, half of the texts and every
module outside the standard library (whose call gets an error back) are words of the
training modules' sources (:func:`name_pool`, thousands): with only a few dozen
modules and words to ask about, a model learns to name one it has seen, not to copy
the one in the question.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import random
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from model.training import stdlib_tools
from model.training.stdlib_tools import BY_NAME, run_tool
from model.chat import ChatTemplate, Message
from model.tools import PARAMETER_CLOSE, PARAMETER_OPEN, ToolCall

SYSTEM = "You answer questions about the Python standard library. Use the tools, then answer briefly."
SPLITS = ("train", "held_out", "held_out_phrasing")
_WORDS = ("apple river stone quiet bright window garden paper orange silver ocean yellow market winter "
          "planet candle forest engine pencil bridge music violet harbor summer rocket castle meadow").split()


@dataclass(frozen=True)
class Step:
    """One assistant turn's calls, as (function name, arguments in schema order)."""

    calls: tuple[tuple[str, dict], ...]


@dataclass
class Episode:
    question: str
    steps: list[Step]
    answer: Callable[[list[list[str]]], str]  # the final answer from each step's results
    needs: tuple[str, ...] = ()  # the tools it calls
    then: Callable[[list[list[str]]], Step] | None = None  # a second step made from the first's results
    results: list[list[str]] = field(default_factory=list)

    def final(self) -> str:
        return self.answer(self.results)


@dataclass(frozen=True)
class Conversation:
    """Messages ending in the final answer, the ``function`` objects offered, and for
    each assistant turn what it must hold (calls, or text the answer contains)."""

    messages: tuple[Message, ...]
    tools: tuple[dict, ...]
    kind: str


@functools.cache
def name_pool() -> tuple[str, ...]:
    """Lower-case words of 4 to 12 letters in the training modules' sources that name
    no standard-library module, so the tools answer any of them with an error (sorted;
    the same on every machine with this Python)."""
    words: set[str] = set()
    for module in stdlib_tools.TRAIN_MODULES:
        spec = importlib.util.find_spec(module)
        if spec is not None and spec.origin and spec.origin.endswith(".py"):
            with open(spec.origin, encoding="utf-8", errors="replace") as source:
                words.update(re.findall(r"\b[a-z]{4,12}\b", source.read()))
    return tuple(sorted(words - set(sys.stdlib_module_names) - set(stdlib_tools.MODULES)))


class _Draw:
    """Argument draws for one split (``names``: the training split's wide pool)."""

    def __init__(self, rng: random.Random, modules: Sequence[str], names: Sequence[str] = ()):
        self.rng, self.modules, self.names = rng, modules, names

    def module(self) -> str:
        return self.rng.choice(self.modules)

    def package(self) -> str:
        packages = [m for m in self.modules if run_tool("is_package", {"module": m}) == "true"]
        return self.rng.choice(packages)

    def public_name(self, module: str, kind: str = "name") -> str | None:
        listed = json.loads(run_tool("list_functions" if kind == "function" else "list_names", {"module": module}))
        return self.rng.choice(listed) if isinstance(listed, list) and listed else None

    def words(self, lo: int = 1, hi: int = 5) -> str:
        pool = self.names if self.names and self.rng.random() < 0.5 else _WORDS
        return " ".join(self.rng.choice(pool) for _ in range(self.rng.randint(lo, hi)))

    def date(self) -> str:
        return f"{self.rng.randint(1990, 2035)}-{self.rng.randint(1, 12):02d}-{self.rng.randint(1, 28):02d}"

    def expression(self) -> str:
        r = self.rng
        a, b, c = r.randint(2, 999), r.randint(2, 99), r.randint(2, 9)
        return r.choice([f"{a} + {b}", f"{a} * {b}", f"{a} - {b}", f"({a} + {b}) * {c}", f"{a} // {c}",
                         f"{c} ** {r.randint(2, 9)}", f"{a} % {b}"])


# Phrasings: the last one of each list is held out (asked only in ``held_out_phrasing``).
_ONE_CALL: dict[str, tuple[tuple[str, ...], Callable[[_Draw], dict | None], str]] = {
    "count_names": (("How many public names does the {module} module define?",
                     "Count the public names in {module}.", "How many names does {module} export?",
                     "What is the number of public names in the {module} module?"),
                    lambda d: {"module": d.module()}, "The {module} module defines {r} public names."),
    "list_names": (("List the first {limit} public names of {module}.", "Which names does {module} export? Show {limit}.",
                    "Give me {limit} names from the {module} module."),
                   lambda d: {"module": d.module(), "limit": d.rng.randint(2, 6)}, "The first names of {module}: {r}"),
    "has_name": (("Does the {module} module define {name}?", "Is {name} a name in {module}?",
                  "Can I import {name} from {module}?"),
                 lambda d: _with_name(d), "{yes_no}: {module} {defines} {name}."),
    "module_doc": (("What is the {module} module for?", "Describe the {module} module.",
                    "What does the {module} module's docstring say?"),
                   lambda d: {"module": d.module()}, "The {module} module: {r}"),
    "read_source": (("Show the first {lines} lines of {module}.", "Read {lines} lines of the {module} source.",
                     "Print the beginning of {module}, {lines} lines."),
                    lambda d: {"module": d.module(), "lines": d.rng.randint(1, 4)},
                    "The first {lines} lines of {module}:\n{r}"),
    "count_lines": (("How many lines of source does {module} have?", "How long is the {module} source, in lines?",
                     "Count the lines in {module}'s source file."),
                    lambda d: {"module": d.module()}, "The {module} source has {r} lines."),
    "search_source": (("Find the lines in {module} that contain {text}.", "Search the {module} source for {text}.",
                       "Where does {module} mention {text}?"),
                      lambda d: {"module": d.module(), "text": d.rng.choice(["def ", "class ", "import ", "return",
                                                                             "self", "None", "raise", "__all__"])},
                      "Lines of {module} with {text}:\n{r}"),
    "source_file": (("Where is the source file of {module}?", "Which file holds the {module} module?",
                     "Give the path of {module}'s source."),
                    lambda d: {"module": d.module()}, "The {module} module is in {r}."),
    "function_signature": (("What are the parameters of {module}.{function}?",
                            "What arguments does {function} in {module} take?", "Show the signature of {module}.{function}."),
                           lambda d: _with_function(d), "{module}.{r}"),
    "function_doc": (("What does {module}.{function} do?", "Describe the function {function} of {module}.",
                      "What is the docstring of {module}.{function}?"),
                     lambda d: _with_function(d), "{module}.{function}: {r}"),
    "list_classes": (("Which classes does {module} define?", "List the classes in the {module} module.",
                      "What classes are in {module}?"),
                     lambda d: {"module": d.module()}, "Classes in {module}: {r}"),
    "list_functions": (("Which functions does {module} define?", "List the functions of {module}.",
                        "What functions are in the {module} module?"),
                       lambda d: {"module": d.module()}, "Functions in {module}: {r}"),
    "constant_value": (("What is the value of {module}.{name}?", "Show me {name} from {module}.",
                        "What does {module}.{name} hold?"),
                       lambda d: _with_name(d), "{module}.{name} = {r}"),
    "is_package": (("Is {module} a package?", "Is the {module} module a package or a single file?",
                    "Does {module} have submodules?"),
                   lambda d: {"module": d.module()}, "{yes_no}: {module} {is_a} package."),
    "list_submodules": (("Which submodules does the {package} package have?", "List the modules inside {package}.",
                         "What is in the {package} package?"),
                        lambda d: {"package": d.package()}, "The {package} package holds {r}."),
    "calculate": (("What is {expression}?", "Compute {expression}.", "Calculate {expression} for me.",
                   "How much is {expression}?"),
                  lambda d: {"expression": d.expression()}, "{expression} = {r}"),
    "is_prime": (("Is {n} a prime number?", "Is {n} prime?", "Tell me whether {n} is prime."),
                 lambda d: {"n": d.rng.randint(2, 10**5)}, "{yes_no}: {n} is {not_}prime."),
    "factorize": (("What are the prime factors of {n}?", "Factorize {n}.", "Break {n} into prime factors."),
                  lambda d: {"n": d.rng.randint(2, 10**5)}, "The prime factors of {n} are {r}."),
    "gcd": (("What is the greatest common divisor of {a} and {b}?", "Find the gcd of {a} and {b}.",
             "What is the largest number that divides both {a} and {b}?"),
            lambda d: {"a": d.rng.randint(2, 5000), "b": d.rng.randint(2, 5000)}, "The gcd of {a} and {b} is {r}."),
    "convert_base": (("Write {number} in base {base}.", "Convert {number} to base {base}.",
                      "What is {number} in base {base}?"),
                     lambda d: {"number": d.rng.randint(0, 10**6), "base": d.rng.choice([2, 3, 8, 16, 36])},
                     "{number} in base {base} is {r}."),
    "sum_numbers": (("What is the sum of {numbers}?", "Add up {numbers}.", "Give the total of {numbers}."),
                    lambda d: {"numbers": [d.rng.randint(-50, 500) for _ in range(d.rng.randint(2, 6))]},
                    "The sum is {r}."),
    "sort_numbers": (("Sort {numbers}.", "Put {numbers} in order.", "Order these numbers: {numbers}."),
                     lambda d: {"numbers": [d.rng.randint(-50, 500) for _ in range(d.rng.randint(2, 6))]},
                     "In order: {r}"),
    "word_count": (('How many words are in "{text}"?', 'Count the words of "{text}".',
                    'What is the word count of "{text}"?'),
                   lambda d: {"text": d.words(1, 8)}, 'The text has {r} words.'),
    "reverse_text": (('Reverse "{text}".', 'Write "{text}" backwards.', 'What is "{text}" reversed?'),
                     lambda d: {"text": d.words(1, 3)}, "Reversed: {r}"),
    "upper_case": (('Write "{text}" in capitals.', 'Uppercase "{text}".', 'Make "{text}" upper case.'),
                   lambda d: {"text": d.words(1, 4)}, "In capitals: {r}"),
    "hash_text": (('What is the {algorithm} hash of "{text}"?', 'Hash "{text}" with {algorithm}.',
                   'Compute the {algorithm} digest of "{text}".'),
                  lambda d: {"text": d.words(1, 3), "algorithm": d.rng.choice(["md5", "sha1", "sha256"])},
                  "The {algorithm} hash starts {r}."),
    "days_between": (("How many days are there from {start} to {end}?", "Count the days between {start} and {end}.",
                      "How long is it from {start} until {end}, in days?"),
                     lambda d: {"start": d.date(), "end": d.date()}, "From {start} to {end}: {r} days."),
    "weekday": (("What day of the week is {date}?", "Which weekday was {date}?", "On what day does {date} fall?"),
                lambda d: {"date": d.date()}, "{date} is a {r}."),
}
assert set(_ONE_CALL) == set(BY_NAME), "every function has phrasings"


def _with_name(d: _Draw) -> dict | None:
    module = d.module()
    name = d.public_name(module) if d.rng.random() < 0.7 else d.rng.choice(["parse", "load", "Error", "run", "main"])
    return None if name is None else {"module": module, "name": name}


def _with_function(d: _Draw) -> dict | None:
    module = d.module()
    function = d.public_name(module, "function")
    return None if function is None else {"module": module, "function": function}


def _fill(template: str, arguments: dict, result: str | None = None) -> str:
    values = {key: (json.dumps(value) if isinstance(value, list) else value) for key, value in arguments.items()}
    if result is not None:
        flag = result == "true"
        values.update(r=result, yes_no="Yes" if flag else "No", defines="defines" if flag else "does not define",
                      is_a="is a" if flag else "is not a", not_="" if flag else "not ")
    return template.format(**values)


def _phrasing(phrasings: Sequence[str], split: str, rng: random.Random) -> str:
    return phrasings[-1] if split == "held_out_phrasing" else rng.choice(phrasings[:-1])


def _one_call(d: _Draw, split: str, name: str | None = None) -> Episode | None:
    name = name or d.rng.choice(sorted(_ONE_CALL))
    phrasings, draw, answer = _ONE_CALL[name]
    arguments = draw(d)
    if arguments is None:
        return None
    question = _fill(_phrasing(phrasings, split, d.rng), arguments)

    def final(results: list[list[str]]) -> str:
        result = results[0][0]
        if result.startswith("error:"):
            return f"The {name} tool failed: {result[len('error: '):]}"
        return _fill(answer, arguments, result)
    return Episode(question, [Step(((name, arguments),))], final, (name,))


def _parallel(d: _Draw, split: str) -> Episode:
    """The same module question about two modules: two calls in one turn."""
    name = d.rng.choice(["count_names", "count_lines", "is_package", "module_doc", "source_file"])
    a, b = d.module(), d.module()
    while b == a:
        b = d.module()
    phrasings = {"count_names": ("How many public names do {a} and {b} define?",
                                 "Compare the number of public names in {a} and {b}.",
                                 "Count the public names of both {a} and {b}."),
                 "count_lines": ("How many source lines do {a} and {b} have?", "Compare the lengths of {a} and {b}.",
                                 "Count the lines of {a} and of {b}."),
                 "is_package": ("Are {a} and {b} packages?", "Which of {a} and {b} is a package?",
                                "Tell me whether {a} and {b} are packages."),
                 "module_doc": ("What are {a} and {b} for?", "Describe the modules {a} and {b}.",
                                "Summarise {a} and {b}."),
                 "source_file": ("Where are the sources of {a} and {b}?", "Which files hold {a} and {b}?",
                                 "Give the paths of {a} and {b}.")}[name]
    question = _phrasing(phrasings, split, d.rng).format(a=a, b=b)
    return Episode(question, [Step(((name, {"module": a}), (name, {"module": b})))],
                   lambda r: f"{a}: {r[0][0]}; {b}: {r[0][1]}", (name,))


def _chain(d: _Draw, split: str) -> Episode:
    """Two steps: a module fact, then arithmetic on it."""
    name = d.rng.choice(["count_names", "count_lines"])
    module, k = d.module(), d.rng.randint(2, 12)
    noun = "public names" if name == "count_names" else "source lines"
    op, word = d.rng.choice([("*", "times"), ("+", "plus"), ("-", "minus")])
    phrasings = (f"How many {noun} does {module} have, {word} {k}?",
                 f"Take the number of {noun} in {module} and compute it {word} {k}.",
                 f"What is the count of {noun} of {module} {word} {k}?")
    question = _phrasing(phrasings, split, d.rng)
    return Episode(question, [Step(((name, {"module": module}),))],
                   lambda r: f"{module} has {r[0][0]} {noun}; {r[0][0]} {op} {k} = {r[1][0]}.", (name, "calculate"),
                   then=lambda r: Step((("calculate", {"expression": f"{r[0][0]} {op} {k}"}),)))


def _error(d: _Draw, split: str) -> Episode:
    """A module outside the standard library: the tool answers an error, the answer says so."""
    name = d.rng.choice(["count_names", "module_doc", "is_package", "count_lines"])
    fake = d.rng.choice(d.names or ["numpy", "requests", "pandas", "flask", "yaml", "django", "torch", "scipy", "attr",
                                    "rich"])
    phrasings, _, _ = _ONE_CALL[name]
    question = _fill(_phrasing(phrasings, split, d.rng), {"module": fake})
    return Episode(question, [Step(((name, {"module": fake}),))],
                   lambda r: f"The {name} tool failed: {r[0][0][len('error: '):]}", (name,))


_GREETINGS = (("Hello!", "Hello! Ask me about the Python standard library."),
              ("Thanks, that helps.", "You are welcome."),
              ("Who are you?", "An assistant for questions about the Python standard library."),
              ("Good morning.", "Good morning! What would you like to know?"))


def episode(d: _Draw, split: str, multi_call: float = 0.0) -> Episode | None:
    """One question and its calls. With ``multi_call``, that share of episodes is first
    drawn as one that makes more than one call (a chain, or parallel calls: two to one);
    the rest follow the default mix (17% of it is multi-call already)."""
    if multi_call and d.rng.random() < multi_call:
        return _chain(d, split) if d.rng.random() < 2 / 3 else _parallel(d, split)
    u = d.rng.random()
    if u < 0.05:
        greeting, reply = d.rng.choice(_GREETINGS)
        return Episode(greeting, [], lambda r: reply)
    if u < (0.17 if d.names else 0.10):  # the training split's errors teach copying a name never seen
        return _error(d, split)
    if u < 0.22:
        return _parallel(d, split)
    if u < 0.34:
        return _chain(d, split)
    return _one_call(d, split)


def _play(ep: Episode, ids: list[int]) -> list[Message]:
    """The messages of an episode, running its calls (``ids`` numbers the calls)."""
    messages = [Message("user", ep.question)]
    steps = list(ep.steps)
    ep.results = []
    index = 0
    while index < len(steps):
        step = steps[index]
        calls = []
        for name, arguments in step.calls:
            ids[0] += 1
            calls.append(ToolCall(name, json.dumps(arguments), f"call_{ids[0]}"))
        messages.append(Message("assistant", "", tool_calls=tuple(calls)))
        results = [run_tool(name, arguments) for name, arguments in step.calls]
        ep.results.append(results)
        messages += [Message("tool", result, tool_call_id=call.id) for call, result in zip(calls, results)]
        index += 1
        if index == len(steps) == 1 and ep.then is not None:
            steps.append(ep.then(ep.results))
    messages.append(Message("assistant", ep.final()))
    return messages


def conversation(rng: random.Random, split: str = "train", multi_call: float = 0.0) -> Conversation:
    """One conversation: one episode, or (one in ten) two in a row; or (one in twelve)
    a chat offered no tools, answered in text. ``multi_call``: see :func:`episode`."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}")
    if rng.random() < 1 / 12:
        greeting, reply = rng.choice(_GREETINGS)
        return Conversation((Message("user", greeting), Message("assistant", reply)), (), "no_tools")
    if split == "train":
        d = _Draw(rng, stdlib_tools.TRAIN_MODULES, name_pool())
    else:
        d = _Draw(rng, stdlib_tools.HELD_OUT_MODULES)
    episodes: list[Episode] = []
    while len(episodes) < (2 if rng.random() < 0.1 else 1):
        ep = episode(d, split, multi_call)
        if ep is not None:
            episodes.append(ep)
    messages: list[Message] = [Message("system", SYSTEM)] if rng.random() < 0.7 else []
    ids = [0]
    needs: set[str] = set()
    for ep in episodes:
        messages += _play(ep, ids)
        needs.update(ep.needs)
    others = [name for name in BY_NAME if name not in needs]
    offered = sorted(needs) + rng.sample(others, max(0, rng.randint(2, 6) - len(needs)))
    rng.shuffle(offered)
    kind = "+".join(_kind(ep) for ep in episodes)
    return Conversation(tuple(messages), tuple(BY_NAME[name] for name in offered), kind)


def _kind(ep: Episode) -> str:
    if not ep.steps:
        return "no_call"
    if ep.then is not None:
        return "chain"
    if len(ep.steps[0].calls) > 1:
        return "parallel"
    return "error" if ep.results and ep.results[0][0].startswith("error:") else "one_call"


def conversations(n: int, split: str = "train", seed: int = 0) -> list[Conversation]:
    rng = random.Random(f"{split}:{seed}")
    return [conversation(rng, split) for _ in range(n)]


@dataclass(frozen=True)
class Rendered:
    """A conversation's ids; per position, whether the model is trained to emit it (the
    assistant turns: their text, calls and end token), and whether it is content (an
    argument's value or an answer's text: what the model must copy, not the format)."""

    ids: list[int]
    targets: list[bool]
    content: list[bool]


def render(template: ChatTemplate, conv: Conversation) -> Rendered:
    """Ids of the whole conversation; assistant spans found by rendering each prefix
    (the template's prefix property makes each an exact prefix of the whole)."""
    ids = template.render(conv.messages, add_generation_prompt=False, tools=conv.tools)
    targets, content = [False] * len(ids), [False] * len(ids)
    decode = template.tokenizer.decode
    for i, message in enumerate(conv.messages):
        if message.role != "assistant":
            continue
        start = len(template.render(conv.messages[:i], tools=conv.tools))
        end = len(template.render(conv.messages[: i + 1], add_generation_prompt=False, tools=conv.tools))
        for position in range(start, end):
            targets[position] = True
            if not message.tool_calls:
                content[position] = position < end - 1  # the answer's text, not its end token
                continue
            # Inside a parameter's value: after an opening tag's '">', before its close.
            text = decode(ids[start : position + 1])
            opened = text.rfind(PARAMETER_OPEN)
            value_at = text.find('">', opened) + 2
            content[position] = (opened > text.rfind(PARAMETER_CLOSE) and value_at >= 2
                                 and len(decode(ids[start:position])) >= value_at and "</" not in text[value_at:])
    return Rendered(ids, targets, content)
