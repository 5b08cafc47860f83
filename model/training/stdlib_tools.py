"""The tool world the small checkpoint is fine-tuned to call: 28 functions over the
Python standard library (its modules, their sources and names) and over numbers, text
and dates, executed here.

``FUNCTIONS`` are the ``function`` objects a request's ``tools`` carry; ``run_tool``
executes one call and returns its result as text (an error is a result too: the model
reads it). ``MODULES`` are the pure-Python modules the questions are about, split into
training and held-out ones (every fifth, in sorted order) so that an evaluation asks
about modules the fine-tune never saw.

Results are short on purpose: a count, a flag, one line, a list of at most ten names.
A small model answers by copying them, not by counting a long list.
"""

from __future__ import annotations

import ast
import calendar
import datetime
import hashlib
import importlib
import inspect
import json
import math
import operator
import sys
import sysconfig
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

# Pure-Python standard-library modules (each has a source file), importable without
# side effects on any supported platform.
MODULES = tuple(sorted((
    "abc", "argparse", "ast", "base64", "bisect", "bz2", "calendar", "cmd", "code", "codecs", "codeop",
    "colorsys", "compileall", "configparser", "contextlib", "copy", "copyreg", "csv", "dataclasses", "datetime",
    "decimal", "difflib", "dis", "email", "enum", "filecmp", "fileinput", "fnmatch", "fractions", "ftplib",
    "functools", "genericpath", "getopt", "gettext", "glob", "gzip", "hashlib", "heapq", "hmac", "html", "http",
    "imaplib", "inspect", "ipaddress", "json", "keyword", "linecache", "locale", "logging", "lzma", "mailbox",
    "mimetypes", "netrc", "numbers", "opcode", "operator", "optparse", "pathlib", "pickle", "pkgutil", "platform",
    "plistlib", "poplib", "posixpath", "pprint", "py_compile", "queue", "quopri", "random", "re", "reprlib",
    "runpy", "sched", "secrets", "selectors", "shelve", "shlex", "shutil", "smtplib", "socket", "socketserver",
    "stat", "statistics", "string", "stringprep", "struct", "subprocess", "symtable", "tabnanny", "tarfile",
    "tempfile", "textwrap", "threading", "timeit", "token", "tokenize", "trace", "traceback", "tracemalloc",
    "types", "typing", "uuid", "warnings", "wave", "weakref", "webbrowser", "xml", "zipapp", "zipfile",
    "zipimport",
)))
HELD_OUT_MODULES = MODULES[4::5]
TRAIN_MODULES = tuple(m for m in MODULES if m not in HELD_OUT_MODULES)


def _function(name: str, description: str, properties: dict, required: tuple[str, ...] | None = None) -> dict:
    return {"name": name, "description": description,
            "parameters": {"type": "object", "properties": properties,
                           "required": list(properties if required is None else required)}}


_MODULE = {"module": {"type": "string"}}
_TEXT = {"text": {"type": "string"}}
_INT = {"type": "integer"}
_NUMBERS = {"numbers": {"type": "array", "items": {"type": "number"}}}

FUNCTIONS: tuple[dict, ...] = (
    _function("count_names", "How many public names a standard-library module defines", _MODULE),
    _function("list_names", "The first public names of a module", {**_MODULE, "limit": {**_INT, "minimum": 1,
                                                                                      "maximum": 10}}, ("module",)),
    _function("has_name", "Whether a module defines a name", {**_MODULE, "name": {"type": "string"}}),
    _function("module_doc", "The first line of a module's docstring", _MODULE),
    _function("read_source", "The first lines of a module's source", {**_MODULE, "lines": {**_INT, "minimum": 1,
                                                                                          "maximum": 40}}),
    _function("count_lines", "How many lines a module's source has", _MODULE),
    _function("search_source", "The lines of a module's source that contain a text", {**_MODULE, **_TEXT}),
    _function("source_file", "The path of a module's source file", _MODULE),
    _function("function_signature", "The parameters of a module's function", {**_MODULE, "function": {"type": "string"}}),
    _function("function_doc", "The first line of a function's docstring", {**_MODULE, "function": {"type": "string"}}),
    _function("list_classes", "The classes a module defines", _MODULE),
    _function("list_functions", "The functions a module defines", _MODULE),
    _function("constant_value", "The value of a module's constant", {**_MODULE, "name": {"type": "string"}}),
    _function("is_package", "Whether a module is a package", _MODULE),
    _function("list_submodules", "The submodules of a package", {"package": {"type": "string"}}),
    _function("calculate", "The value of an arithmetic expression", {"expression": {"type": "string"}}),
    _function("is_prime", "Whether a number is prime", {"n": _INT}),
    _function("factorize", "The prime factors of a number", {"n": _INT}),
    _function("gcd", "The greatest common divisor of two numbers", {"a": _INT, "b": _INT}),
    _function("convert_base", "A number written in another base", {"number": _INT, "base": {**_INT, "minimum": 2,
                                                                                             "maximum": 36}}),
    _function("sum_numbers", "The sum of numbers", _NUMBERS),
    _function("sort_numbers", "Numbers in order", {**_NUMBERS, "descending": {"type": "boolean"}}, ("numbers",)),
    _function("word_count", "How many words a text has", _TEXT),
    _function("reverse_text", "A text backwards", _TEXT),
    _function("upper_case", "A text in capitals", _TEXT),
    _function("hash_text", "The start of a text's hash", {**_TEXT, "algorithm": {"type": "string",
                                                                                 "enum": ["md5", "sha1", "sha256"]}}),
    _function("days_between", "Days from one date to another (YYYY-MM-DD)", {"start": {"type": "string"},
                                                                              "end": {"type": "string"}}),
    _function("weekday", "The day of the week of a date (YYYY-MM-DD)", {"date": {"type": "string"}}),
)
BY_NAME = {f["name"]: f for f in FUNCTIONS}


def tools(*names: str) -> list[dict]:
    """The OpenAI ``tools`` entries for these functions."""
    return [{"type": "function", "function": BY_NAME[name]} for name in names]


# ---------------------------------------------------------------------- execution

_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
              ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
              ast.USub: operator.neg, ast.UAdd: operator.pos}


def arithmetic(expression: str) -> int | float:
    """The value of ``+ - * / // % **`` over numbers (parsed, never ``eval``-ed)."""
    def value(node: ast.AST) -> int | float:
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Pow) and (abs(right) > 64 or _bits(left) * abs(right) > _MAX_BITS):
                raise ValueError("exponent too large")
            return _bounded(_OPERATORS[type(node.op)](left, right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](value(node.operand))
        raise ValueError("only numbers and + - * / // % ** are allowed")

    result = value(ast.parse(expression, mode="eval").body)
    return int(result) if isinstance(result, float) and result.is_integer() and abs(result) < 2**53 else result


_MAX_BITS = 4096  # no value of an expression is larger (``(9**64)**64**...`` would run for ever)


def _bits(number: int | float) -> int:
    return int(abs(number)).bit_length()


def _bounded(number: int | float) -> int | float:
    if _bits(number) > _MAX_BITS:
        raise ValueError(f"the value is over 2**{_MAX_BITS}")
    return number


def module(name: str):
    """One of ``MODULES``, imported (a model's call names it: any other standard-library
    module, one that opens a browser or a window when imported among them, is refused)."""
    if not isinstance(name, str) or name not in sys.stdlib_module_names:
        raise ValueError(f"{name!r} is not a standard-library module")
    if name not in MODULES:
        raise ValueError(f"{name!r} is not one of the modules these tools read")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return importlib.import_module(name)


def public_names(name: str) -> list[str]:
    mod = module(name)
    names = getattr(mod, "__all__", None)
    return sorted(names) if names else sorted(n for n in vars(mod) if not n.startswith("_"))


def _source(name: str) -> list[str]:
    return inspect.getsource(module(name)).splitlines()


def _defined(name: str, kind: Callable[[Any], bool]) -> list[str]:
    mod = module(name)
    return sorted(n for n, v in vars(mod).items()
                  if not n.startswith("_") and kind(v) and getattr(v, "__module__", None) == mod.__name__)


def _function_of(name: str, function: str):
    value = getattr(module(name), function, None)
    if not callable(value):
        raise ValueError(f"{name} has no function {function!r}")
    return value


def _first_line(doc: str | None) -> str:
    lines = [line.strip() for line in (doc or "").strip().splitlines()]
    return lines[0] if lines and lines[0] else "no docstring"


def _integer(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{what} must be an integer")
    return value


def _numbers(value: Any) -> list[int | float]:
    if not isinstance(value, list) or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value):
        raise ValueError("numbers must be an array of numbers")
    return value


def _date(text: Any) -> datetime.date:
    if not isinstance(text, str):
        raise ValueError("a date is text: YYYY-MM-DD")
    return datetime.date.fromisoformat(text)


def _factors(n: int) -> list[int]:
    if not 1 < n < 10**12:
        raise ValueError("n must be between 2 and 10**12")
    factors, d = [], 2
    while d * d <= n:
        while n % d == 0:
            factors.append(d)
            n //= d
        d += 1
    return factors + ([n] if n > 1 else [])


def _digits(number: int, base: int) -> str:
    if not 2 <= base <= 36:
        raise ValueError("base must be between 2 and 36")
    sign, number, out = "-" if number < 0 else "", abs(number), ""
    while True:
        number, digit = divmod(number, base)
        out = "0123456789abcdefghijklmnopqrstuvwxyz"[digit] + out
        if number == 0:
            return sign + out


def _flag(value: bool) -> str:
    return "true" if value else "false"


def _number(value: int | float) -> str:
    return str(int(value)) if isinstance(value, float) and value.is_integer() else str(value)


def _hash(text: str, algorithm: str) -> str:
    if algorithm not in ("md5", "sha1", "sha256"):
        raise ValueError("algorithm must be md5, sha1 or sha256")
    return hashlib.new(algorithm, text.encode()).hexdigest()[:12]


_RUN: dict[str, Callable[[dict], str]] = {
    "count_names": lambda a: str(len(public_names(a["module"]))),
    "list_names": lambda a: json.dumps(public_names(a["module"])[: _integer(a.get("limit", 10), "limit")]),
    "has_name": lambda a: _flag(a["name"] in public_names(a["module"]) or hasattr(module(a["module"]), a["name"])),
    "module_doc": lambda a: _first_line(module(a["module"]).__doc__),
    "read_source": lambda a: "\n".join(_source(a["module"])[: _integer(a["lines"], "lines")]),
    "count_lines": lambda a: str(len(_source(a["module"]))),
    "search_source": lambda a: "\n".join([line.strip() for line in _source(a["module"]) if a["text"] in line][:3])
    or "no line contains it",
    "source_file": lambda a: Path(inspect.getsourcefile(module(a["module"]))).relative_to(
        Path(sysconfig.get_paths()["stdlib"]).resolve()).as_posix(),
    "function_signature": lambda a: f"{a['function']}{inspect.signature(_function_of(a['module'], a['function']))}",
    "function_doc": lambda a: _first_line(_function_of(a["module"], a["function"]).__doc__),
    "list_classes": lambda a: json.dumps(_defined(a["module"], inspect.isclass)[:10]),
    "list_functions": lambda a: json.dumps(_defined(a["module"], inspect.isfunction)[:10]),
    "constant_value": lambda a: repr(getattr(module(a["module"]), a["name"]))[:80]
    if hasattr(module(a["module"]), a["name"]) else f"error: {a['module']} has no name {a['name']!r}",
    "is_package": lambda a: _flag(hasattr(module(a["module"]), "__path__")),
    "list_submodules": lambda a: json.dumps(sorted(
        p.stem if p.suffix else p.name for p in Path(module(a["package"]).__path__[0]).iterdir()
        if not p.name.startswith("_") and (p.suffix == ".py" or (p / "__init__.py").exists()))[:10])
    if hasattr(module(a["package"]), "__path__") else f"error: {a['package']} is not a package",
    "calculate": lambda a: _number(arithmetic(a["expression"])),
    "is_prime": lambda a: _flag(len(_factors(_integer(a["n"], "n"))) == 1),
    "factorize": lambda a: json.dumps(_factors(_integer(a["n"], "n"))),
    "gcd": lambda a: str(math.gcd(_integer(a["a"], "a"), _integer(a["b"], "b"))),
    "convert_base": lambda a: _digits(_integer(a["number"], "number"), _integer(a["base"], "base")),
    "sum_numbers": lambda a: _number(sum(_numbers(a["numbers"]))),
    "sort_numbers": lambda a: json.dumps(sorted(_numbers(a["numbers"]), reverse=bool(a.get("descending", False)))),
    "word_count": lambda a: str(len(str(a["text"]).split())),
    "reverse_text": lambda a: str(a["text"])[::-1],
    "upper_case": lambda a: str(a["text"]).upper(),
    "hash_text": lambda a: _hash(str(a["text"]), a["algorithm"]),
    "days_between": lambda a: str((_date(a["end"]) - _date(a["start"])).days),
    "weekday": lambda a: calendar.day_name[_date(a["date"]).weekday()],
}
assert set(_RUN) == set(BY_NAME), "every function has an implementation"


def run_tool(name: str, arguments: Any) -> str:
    """A call's result as text; a bad call (unknown function, missing or wrong argument,
    a module outside the standard library) answers ``error: ...``."""
    if name not in _RUN:
        return f"error: no tool named {name!r}"
    if not isinstance(arguments, dict):
        return "error: the arguments must be an object"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return _RUN[name](arguments)
    except KeyError as error:
        return f"error: missing argument {error.args[0]!r}"
    except (ValueError, TypeError, SyntaxError, ZeroDivisionError, OverflowError, OSError, ImportError,
            AttributeError) as error:
        return f"error: {type(error).__name__}: {error}"
