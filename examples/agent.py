"""A tool-calling agent against `v41 serve`, with the OpenAI SDK.

    v41 serve &                                    # in another shell
    python examples/agent.py "How many public names does the json module define?"
    python examples/agent.py --tasks                # the built-in tasks, with a success rate

The model gets four tools over the Python standard library (read a module's source, list
its public names, evaluate arithmetic, search a module's source) and runs them in a loop:
each answer's tool calls are executed here, their results sent back as ``tool``
messages, until an answer calls no tool (or ``--max-steps``). The trace is printed.
``--first-call required`` forces a tool call on the first step (constrained decoding);
later steps are ``auto``.

The tasks have answers computed here, from the same standard library; a task succeeds
when the final answer contains that answer.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import inspect
import json
import operator
import sys

import openai

TOOLS = [
    {"type": "function", "function": {
        "name": "list_names", "description": "The public names a standard-library module defines",
        "parameters": {"type": "object", "properties": {"module": {"type": "string"}}, "required": ["module"]}}},
    {"type": "function", "function": {
        "name": "read_source", "description": "The first lines of a standard-library module's source",
        "parameters": {"type": "object", "properties": {"module": {"type": "string"},
                                                        "lines": {"type": "integer", "minimum": 1, "maximum": 200}},
                       "required": ["module"]}}},
    {"type": "function", "function": {
        "name": "calculate", "description": "The value of an arithmetic expression (+ - * / // % **)",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                       "required": ["expression"]}}},
    {"type": "function", "function": {
        "name": "search_source", "description": "Lines of a module's source that contain a text",
        "parameters": {"type": "object", "properties": {"module": {"type": "string"}, "text": {"type": "string"}},
                       "required": ["module", "text"]}}},
]

_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
              ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
              ast.USub: operator.neg, ast.UAdd: operator.pos}


def _arithmetic(node: ast.AST) -> float:
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        right = _arithmetic(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > 64:
            raise ValueError("exponent too large")
        return _OPERATORS[type(node.op)](_arithmetic(node.left), right)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPERATORS:
        return _OPERATORS[type(node.op)](_arithmetic(node.operand))
    raise ValueError("only numbers and + - * / // % ** are allowed")


def _module(name: str):
    if name not in sys.stdlib_module_names:
        raise ValueError(f"{name!r} is not a standard-library module")
    return importlib.import_module(name)


def run_tool(name: str, arguments: dict) -> str:
    """A tool's result as text (an error is a result too: the model reads it)."""
    try:
        if name == "list_names":
            module = _module(arguments["module"])
            names = getattr(module, "__all__", None) or [n for n in dir(module) if not n.startswith("_")]
            return json.dumps(sorted(names))
        if name == "read_source":
            lines = inspect.getsource(_module(arguments["module"])).splitlines()
            return "\n".join(lines[: int(arguments.get("lines", 40))])
        if name == "calculate":
            return str(_arithmetic(ast.parse(arguments["expression"], mode="eval").body))
        if name == "search_source":
            text = arguments["text"]
            found = [line for line in inspect.getsource(_module(arguments["module"])).splitlines() if text in line]
            return "\n".join(found[:20]) or "no line contains it"
        return f"error: no tool named {name!r}"
    except (KeyError, ValueError, TypeError, SyntaxError, ZeroDivisionError, OSError, ImportError) as error:
        return f"error: {type(error).__name__}: {error}"


def tasks() -> list[tuple[str, str]]:
    """(question, the answer the final message must contain), computed here."""
    def count(module: str) -> str:
        return str(len(json.loads(run_tool("list_names", {"module": module}))))

    return [
        ("How many public names does the json module define?", count("json")),
        ("How many public names does the shlex module define?", count("shlex")),
        ("What is 1234 * 5678?", run_tool("calculate", {"expression": "1234 * 5678"})),
        ("What is (2 ** 20) - 7?", run_tool("calculate", {"expression": "(2 ** 20) - 7"})),
        ("Is there a function named dedent in the textwrap module? Answer yes or no.", "yes"),
        ("How many public names does the bisect module define?", count("bisect")),
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
            ok = expected.lower() in final.lower()
            solved += ok
            print(f"  expected {expected!r}: {'solved' if ok else 'not solved'}")
    if args.tasks:
        print(f"solved {solved} of {len(todo)} tasks ({model}, first call {args.first_call})")
        if args.json:
            print(json.dumps({"model": model, "tasks": len(todo), "solved": solved,
                              "success_rate": round(solved / len(todo), 3), "first_call": args.first_call}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
