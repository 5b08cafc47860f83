"""examples/agent.py's tools: right answers from the standard library, and no way out of
arithmetic into Python."""

from __future__ import annotations

import importlib.util
import json
import textwrap
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location("agent", Path(__file__).parents[1] / "examples" / "agent.py")
agent = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(agent)


def test_the_tools_answer_from_the_standard_library():
    assert json.loads(agent.run_tool("list_names", {"module": "json"})) == sorted(json.__all__)
    assert agent.run_tool("calculate", {"expression": "1234 * 5678"}) == str(1234 * 5678)
    assert agent.run_tool("calculate", {"expression": "-(2 ** 10) // 3 % 7"}) == str(-(2 ** 10) // 3 % 7)
    assert "def dedent" in agent.run_tool("search_source", {"module": "textwrap", "text": "def dedent"})
    assert agent.run_tool("read_source", {"module": "textwrap", "lines": 3}) == \
        "\n".join(Path(textwrap.__file__).read_text().splitlines()[:3])


@pytest.mark.parametrize("name, arguments", [
    ("calculate", {"expression": "__import__('os').system('true')"}),
    ("calculate", {"expression": "9 ** 9 ** 9"}),
    ("calculate", {"expression": "1 / 0"}),
    ("list_names", {"module": "os.path; import sys"}),
    ("read_source", {"module": "numpy"}),
    ("nope", {}),
])
def test_a_bad_call_is_an_error_the_model_reads(name, arguments):
    assert agent.run_tool(name, arguments).startswith("error:")


def test_every_task_has_an_answer():
    for question, expected in agent.tasks():
        assert question and expected
