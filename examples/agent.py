"""A tool-calling agent against `v41 serve`, with the OpenAI SDK.

    v41 serve &                                    # in another shell
    python examples/agent.py "How many public names does the json module define?"
    python examples/agent.py --tasks                # the built-in tasks, with a success rate
    python examples/agent.py --tasks --more 36      # and 36 drawn ones (one-call and two-call)

The model gets six tools of ``model.training.stdlib_tools`` (count a module's public names or
source lines, whether it defines a name, its docstring, arithmetic, primality), executed
here, and runs them in a loop: each answer's tool calls are executed, their results sent
back as ``tool`` messages, until an answer calls no tool (or ``--max-steps``). The trace
is printed.
``--first-call required`` forces a tool call on the first step (constrained decoding);
later steps are ``auto``.

The tasks have answers computed here, from the same standard library, about modules the
shipped small model's tool fine-tune held out; a task succeeds when the final answer
contains the answer(s) as whole words and the calls that give them were made (the same
function and arguments; an expression by its value). An answer that happens to hold
the right text after the wrong calls is counted apart, as luck. ``--more N`` draws N more
tasks of the same kinds over the held-out modules (seeded by ``--seed``), half of them
one call and half two (a count, then arithmetic on it; or two modules' counts), and the
success rate is reported per number of calls a task needs.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
from dataclasses import dataclass, field

import openai

from model.training.stdlib_tools import HELD_OUT_MODULES, run_tool, tools
from model.tools import DSML

# The tools offered on every step (the shipped small model was fine-tuned on 2 to 6
# offered tools, among 28: `v41 train-tools`).
TOOLS = tools("count_names", "count_lines", "calculate", "has_name", "module_doc", "is_prime")


Call = tuple[str, dict]  # a function's name and its arguments


@dataclass(frozen=True)
class Task:
    """A question, the calls that answer it and the texts its final answer must hold."""

    question: str
    calls: tuple[Call, ...]
    answers: tuple[str, ...]


@dataclass
class Trace:
    """What one run of the loop did: the calls it made (arguments as parsed) and its answer."""

    calls: list[Call] = field(default_factory=list)
    answer: str = ""


def task(question: str, *calls: Call, answers: tuple[str, ...] = ()) -> Task:
    """A task whose answers are its calls' results unless given."""
    return Task(question, calls, answers or tuple(run_tool(name, arguments) for name, arguments in calls))


def arithmetic_on(question: str, first: Call, op: str, k: int) -> Task:
    """A two-call task: ``first``, then ``calculate`` of its result ``op`` ``k``, whose
    value is the answer."""
    expression = f"{run_tool(*first)} {op} {k}"
    return task(question, first, ("calculate", {"expression": expression}),
                answers=(run_tool("calculate", {"expression": expression}),))


def tasks() -> list[Task]:
    """The built-in tasks, with answers computed here. The modules are ones the small
    model's tool fine-tune held out."""
    assert {"bisect", "glob", "json", "pprint", "lzma", "html", "token", "re", "weakref"} <= set(HELD_OUT_MODULES)
    return [
        task("How many public names does the bisect module define?", ("count_names", {"module": "bisect"})),
        task("What is (48 + 17) * 6?", ("calculate", {"expression": "(48 + 17) * 6"})),
        task("Does the json module define loads?", ("has_name", {"module": "json", "name": "loads"}), answers=("Yes",)),
        task("How many lines of source does pprint have?", ("count_lines", {"module": "pprint"})),
        task("What is the lzma module for?", ("module_doc", {"module": "lzma"})),
        task("How many public names do html and token define?",
             ("count_names", {"module": "html"}), ("count_names", {"module": "token"})),
        arithmetic_on("How many public names does glob have, times 3?", ("count_names", {"module": "glob"}), "*", 3),
        arithmetic_on("How many source lines does re have, plus 10?", ("count_lines", {"module": "re"}), "+", 10),
        task("Is 1001 a prime number?", ("is_prime", {"n": 1001}), answers=("No",)),
        task("Is 9973 prime?", ("is_prime", {"n": 9973}), answers=("Yes",)),
        task("Compute 777 * 23.", ("calculate", {"expression": "777 * 23"})),
        task("Count the public names in weakref.", ("count_names", {"module": "weakref"})),
    ]


def drawn_tasks(n: int, seed: int = 0) -> list[Task]:
    """``n`` tasks of the built-in tasks' kinds over the held-out modules, alternately one
    call and two, with answers computed here."""
    rng = random.Random(f"agent-tasks:{seed}")
    modules = sorted(HELD_OUT_MODULES)
    documented = [m for m in modules if run_tool("module_doc", {"module": m}) != "no docstring"]

    def one_call() -> Task:
        module, kind = rng.choice(modules), rng.randrange(5)
        if kind == 0:
            return task(f"How many public names does the {module} module define?", ("count_names", {"module": module}))
        if kind == 1:
            return task(f"How many lines of source does {module} have?", ("count_lines", {"module": module}))
        if kind == 2:
            module = rng.choice(documented)
            return task(f"What is the {module} module for?", ("module_doc", {"module": module}))
        if kind == 3:
            number = rng.randint(100, 9999)
            prime = run_tool("is_prime", {"n": number}) == "true"
            return task(f"Is {number} a prime number?", ("is_prime", {"n": number}), answers=("Yes" if prime else "No",))
        expression = f"{rng.randint(11, 999)} * {rng.randint(11, 99)}"
        return task(f"What is {expression}?", ("calculate", {"expression": expression}))

    def two_calls() -> Task:
        module, kind = rng.choice(modules), rng.randrange(3)
        if kind == 0:
            k = rng.randint(2, 20)
            return arithmetic_on(f"How many public names does {module} have, times {k}?",
                                 ("count_names", {"module": module}), "*", k)
        if kind == 1:
            k = rng.randint(2, 20)
            return arithmetic_on(f"How many source lines does {module} have, plus {k}?",
                                 ("count_lines", {"module": module}), "+", k)
        other = rng.choice([m for m in modules if m != module])
        return task(f"How many public names do {module} and {other} define?", ("count_names", {"module": module}),
                    ("count_names", {"module": other}))

    return [one_call() if i % 2 == 0 else two_calls() for i in range(n)]


def same_call(made: Call, wanted: Call) -> bool:
    """Whether a call the model made is the one wanted: the same function and arguments
    (numbers compared as written, an arithmetic expression by its value)."""
    (name, arguments), (wanted_name, wanted_arguments) = made, wanted
    if name != wanted_name or set(arguments) != set(wanted_arguments):
        return False
    for key, value in wanted_arguments.items():
        if key == "expression":
            result = run_tool("calculate", {"expression": str(arguments[key])})
            if result.startswith("error") or result != run_tool("calculate", {"expression": value}):
                return False
        elif str(arguments[key]) != str(value):
            return False
    return True


@dataclass(frozen=True)
class Grade:
    calls: bool  # every wanted call was made
    answer: bool  # the final answer holds every answer text, as whole words

    @property
    def solved(self) -> bool:
        """Both: an answer that holds the right text after the wrong calls is luck (the
        shipped model's count of bz2's names is also bisect's)."""
        return self.calls and self.answer


def grade(task: Task, trace: Trace) -> Grade:
    """An answer is text: a call the server could not parse comes back as content (its
    DSML markup), and holding the right number inside it is no answer."""
    calls = all(any(same_call(made, wanted) for made in trace.calls) for wanted in task.calls)
    answer = DSML not in trace.answer and all(re.search(rf"(?<!\w){re.escape(text)}(?!\w)", trace.answer, re.IGNORECASE)
                                              for text in task.answers)
    return Grade(calls, answer)


def solve(client: openai.OpenAI, model: str, question: str, args: argparse.Namespace, show: bool,
          tools: list[dict] = TOOLS) -> Trace:
    messages = [{"role": "system", "content": "You answer questions about the Python standard library. Use the "
                                              "tools, then answer briefly."},
                {"role": "user", "content": question}]
    trace = Trace()
    for step in range(args.max_steps):
        choice = args.first_call if step == 0 else "auto"
        answer = client.chat.completions.create(model=model, messages=messages, tools=tools, tool_choice=choice,
                                                max_tokens=args.max_tokens, temperature=0)
        message = answer.choices[0].message
        messages.append({"role": "assistant", "content": message.content,
                         "tool_calls": [call.model_dump() for call in message.tool_calls or ()] or None})
        if not message.tool_calls:
            if show:
                print(f"  answer: {message.content!r}")
            trace.answer = message.content or ""
            return trace
        for call in message.tool_calls:
            try:
                arguments = json.loads(call.function.arguments)
            except json.JSONDecodeError:
                arguments = {}
            arguments = arguments if isinstance(arguments, dict) else {}
            result = run_tool(call.function.name, arguments)
            trace.calls.append((call.function.name, arguments))
            if show:
                print(f"  call {call.function.name}({call.function.arguments}) -> {result[:120]!r}")
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    if show:
        print(f"  no answer in {args.max_steps} steps")
    return trace  # (no answer: a tool result is not one)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("question", nargs="?", help="one question (or --tasks)")
    parser.add_argument("--tasks", action="store_true", help="run the built-in tasks and report the success rate")
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--api-key", default="unused")
    parser.add_argument("--more", type=int, default=0, help="with --tasks: N drawn tasks besides the built-in ones")
    parser.add_argument("--seed", type=int, default=0, help="the draw of --more")
    parser.add_argument("--first-call", default="auto", choices=("auto", "required"))
    parser.add_argument("--max-steps", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=200)
    parser.add_argument("--json", action="store_true", help="print one JSON object on the last line")
    args = parser.parse_args()
    if not args.tasks and not args.question:
        parser.error("give a question or --tasks")
    client = openai.OpenAI(base_url=args.base_url, api_key=args.api_key, max_retries=0, timeout=300)
    model = client.models.list().data[0].id
    if not args.tasks:
        print(f"task: {args.question}")
        solve(client, model, args.question, args, show=True)
        return 0
    grades, todo = [], tasks() + drawn_tasks(args.more, args.seed)
    for each in todo:
        print(f"task: {each.question}")
        grades.append(grade(each, solve(client, model, each.question, args, show=True)))
        wanted = ", ".join(f"{name}({json.dumps(arguments)})" for name, arguments in each.calls)
        print(f"  wanted {wanted} -> {' and '.join(map(repr, each.answers))}: calls {'made' if grades[-1].calls else 'not made'}, "
              f"answer {'right' if grades[-1].answer else 'wrong'}: {'solved' if grades[-1].solved else 'not solved'}")
    solved = sum(g.solved for g in grades)
    by_calls = {}  # calls a task needs: [solved, tasks]
    for each, g in zip(todo, grades):
        by_calls.setdefault(len(each.calls), [0, 0])[0] += g.solved
        by_calls[len(each.calls)][1] += 1
    print(f"solved {solved} of {len(grades)} tasks ({model}, first call {args.first_call}): the right calls in "
          f"{sum(g.calls for g in grades)}, the right answer in {sum(g.answer for g in grades)}; "
          + ", ".join(f"{n}-call tasks {s} of {t}" for n, (s, t) in sorted(by_calls.items())))
    if args.json:
        print(json.dumps({"model": model, "tasks": len(grades), "solved": solved,
                          "success_rate": round(solved / len(grades), 3), "right_calls": sum(g.calls for g in grades),
                          "right_answers": sum(g.answer for g in grades), "first_call": args.first_call,
                          "by_calls": {str(n): {"solved": s, "tasks": t} for n, (s, t) in sorted(by_calls.items())}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
