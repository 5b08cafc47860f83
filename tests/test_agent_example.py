"""examples/agent.py: its tools are those of `cluster.stdlib_tools` (tested in
test_tool_data.py), its tasks ask about held-out modules and have answers."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from cluster import stdlib_tools

_spec = importlib.util.spec_from_file_location("agent", Path(__file__).parents[1] / "examples" / "agent.py")
agent = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(agent)


def test_the_agent_offers_tools_of_the_tool_world():
    names = [tool["function"]["name"] for tool in agent.TOOLS]
    assert 2 <= len(names) <= 6  # as many as the fine-tune offered
    assert all(stdlib_tools.BY_NAME[name] is tool["function"] for name, tool in zip(names, agent.TOOLS))


def test_every_task_has_answers_and_asks_about_held_out_modules():
    tasks = agent.tasks()
    assert len(tasks) == 12
    for question, expected in tasks:
        assert question and expected and all(text and not text.startswith("error") for text in expected)
        for module in stdlib_tools.TRAIN_MODULES:
            assert f" {module} " not in f" {question.rstrip('?.')} ", (module, question)
