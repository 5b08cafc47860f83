"""A tool-calling agent against `v41 serve`, with the OpenAI SDK.

    v41 serve &                                    # in another shell
    python examples/agent.py "How many public names does the json module define?"
    python examples/agent.py --tasks                # the built-in tasks, with a success rate

The model gets six tools of ``cluster.stdlib_tools`` (count a module's public names or
source lines, whether it defines a name, its docstring, arithmetic, primality), executed
here, and runs them in a loop: each answer's tool calls are executed, their results sent
back as ``tool`` messages, until an answer calls no tool (or ``--max-steps``). The trace
is printed.
``--first-call required`` forces a tool call on the first step (constrained decoding);
later steps are ``auto``.

The tasks have answers computed here, from the same standard library, about modules the
shipped small model's tool fine-tune held out; a task succeeds when the final answer
contains the answer(s) as whole words.
"""

from __future__ import annotations

import argparse
import json
import re
import sys

import openai

from cluster.stdlib_tools import HELD_OUT_MODULES, run_tool, tools

# The tools offered on every step (the shipped small model was fine-tuned on 2 to 6
# offered tools, among 28: `v41 train-tools`).
TOOLS = tools("count_names", "count_lines", "calculate", "has_name", "module_doc", "is_prime")


def tasks() -> list[tuple[str, tuple[str, ...]]]:
    """(question, the texts the final answer must contain), computed here. The modules
    are ones the small model's tool fine-tune held out."""
    def run(name: str, **arguments) -> str:
        return run_tool(name, arguments)

    assert {"bisect", "glob", "json", "pprint", "lzma", "html", "token", "re", "weakref"} <= set(HELD_OUT_MODULES)
    glob_names = run("count_names", module="glob")
    re_lines = run("count_lines", module="re")
    return [
        ("How many public names does the bisect module define?", (run("count_names", module="bisect"),)),
        ("What is (48 + 17) * 6?", (run("calculate", expression="(48 + 17) * 6"),)),
        ("Does the json module define loads?", ("Yes",)),
        ("How many lines of source does pprint have?", (run("count_lines", module="pprint"),)),
        ("What is the lzma module for?", (run("module_doc", module="lzma"),)),
        ("How many public names do html and token define?",
         (run("count_names", module="html"), run("count_names", module="token"))),
        ("How many public names does glob have, times 3?", (run("calculate", expression=f"{glob_names} * 3"),)),
        ("How many source lines does re have, plus 10?", (run("calculate", expression=f"{re_lines} + 10"),)),
        ("Is 1001 a prime number?", ("No",)),
        ("Is 9973 prime?", ("Yes",)),
        ("Compute 777 * 23.", (run("calculate", expression="777 * 23"),)),
        ("Count the public names in weakref.", (run("count_names", module="weakref"),)),
    ]


def solve(client: openai.OpenAI, model: str, question: str, args: argparse.Namespace, show: bool,
          tools: list[dict] = TOOLS) -> str:
    messages = [{"role": "system", "content": "You answer questions about the Python standard library. Use the "
                                              "tools, then answer briefly."},
                {"role": "user", "content": question}]
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
            return message.content or ""
        for call in message.tool_calls:
            try:
                arguments = json.loads(call.function.arguments)
            except json.JSONDecodeError:
                arguments = {}
            result = run_tool(call.function.name, arguments if isinstance(arguments, dict) else {})
            if show:
                print(f"  call {call.function.name}({call.function.arguments}) -> {result[:120]!r}")
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return messages[-1].get("content") or ""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("question", nargs="?", help="one question (or --tasks)")
    parser.add_argument("--tasks", action="store_true", help="run the built-in tasks and report the success rate")
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--api-key", default="unused")
    parser.add_argument("--first-call", default="auto", choices=("auto", "required"))
    parser.add_argument("--max-steps", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=200)
    parser.add_argument("--json", action="store_true", help="print one JSON object on the last line")
    args = parser.parse_args()
    if not args.tasks and not args.question:
        parser.error("give a question or --tasks")
    client = openai.OpenAI(base_url=args.base_url, api_key=args.api_key, max_retries=0, timeout=300)
    model = client.models.list().data[0].id
    todo = tasks() if args.tasks else [(args.question, None)]
    solved = 0
    for question, expected in todo:
        print(f"task: {question}")
        final = solve(client, model, question, args, show=True)
        if expected is not None:
            ok = all(re.search(rf"(?<!\w){re.escape(text)}(?!\w)", final, re.IGNORECASE) for text in expected)
            solved += ok
            print(f"  expected {' and '.join(map(repr, expected))}: {'solved' if ok else 'not solved'}")
    if args.tasks:
        print(f"solved {solved} of {len(todo)} tasks ({model}, first call {args.first_call})")
        if args.json:
            print(json.dumps({"model": model, "tasks": len(todo), "solved": solved,
                              "success_rate": round(solved / len(todo), 3), "first_call": args.first_call}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
