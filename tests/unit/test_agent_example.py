"""examples/agent.py: its tools are those of `model.training.stdlib_tools` (tested in
test_tool_data.py), its tasks ask about held-out modules and have answers."""

from __future__ import annotations

import pytest

from model.training import stdlib_tools
from tests.example_agent import load_agent

pytestmark = pytest.mark.unit

agent = load_agent()


def test_the_agent_offers_tools_of_the_tool_world():
    names = [tool["function"]["name"] for tool in agent.TOOLS]
    assert 2 <= len(names) <= 6  # as many as the fine-tune offered
    assert all(stdlib_tools.BY_NAME[name] is tool["function"] for name, tool in zip(names, agent.TOOLS))


def test_every_task_has_answers_and_asks_about_held_out_modules():
    tasks = agent.tasks()
    assert len(tasks) == 12
    for task in tasks:
        assert task.question and task.calls and task.answers
        assert all(text and not text.startswith("error") for text in task.answers)
        for module in stdlib_tools.TRAIN_MODULES:
            assert f" {module} " not in f" {task.question.rstrip('?.')} ", (module, task.question)


def test_drawn_tasks_alternate_one_and_two_calls_over_held_out_modules_with_computed_answers():
    drawn = agent.drawn_tasks(40, seed=3)
    assert drawn == agent.drawn_tasks(40, seed=3) != agent.drawn_tasks(40, seed=4)
    assert [len(task.calls) for task in drawn] == [1, 2] * 20
    for task in drawn:
        for name, arguments in task.calls:
            assert name in {tool["function"]["name"] for tool in agent.TOOLS}
            assert arguments.get("module", "bisect") in stdlib_tools.HELD_OUT_MODULES
        assert all(text and not text.startswith("error") and text != "no docstring" for text in task.answers)
        # Solved by its own calls and an answer holding its texts; a two-call task by
        # both calls only.
        answer = " and ".join(task.answers)
        assert agent.grade(task, agent.Trace(list(task.calls), answer)).solved
        if len(task.calls) == 2:
            assert not agent.grade(task, agent.Trace(list(task.calls[:1]), answer)).solved
        if task.calls[-1][0] == "calculate" and len(task.calls) == 2:  # the count, then arithmetic on it
            count = stdlib_tools.run_tool(*task.calls[0])
            assert task.calls[1][1]["expression"].startswith(f"{count} ")
            value = stdlib_tools.run_tool("calculate", task.calls[1][1])
            assert task.answers == (value,) and value != count


def test_a_task_is_solved_by_its_calls_and_answer_and_not_by_luck():
    by_question = {task.question: task for task in agent.tasks()}
    bisect = by_question["How many public names does the bisect module define?"]
    count = stdlib_tools.run_tool("count_names", {"module": "bisect"})
    right = agent.Trace([("count_names", {"module": "bisect"})], f"bisect defines {count} public names.")
    assert agent.grade(bisect, right).solved
    # The right text after the wrong call (the shipped model counted bz2's names, as
    # many as bisect's on Python 3.11).
    luck = agent.grade(bisect, agent.Trace([("count_names", {"module": "bz2"})], f"bz2 defines {count}."))
    assert luck.answer and not luck.calls and not luck.solved
    assert not agent.grade(bisect, agent.Trace(right.calls, f"bisect defines {int(count) + 1} names.")).solved
    # A call left unparsed (its markup returned as content) that holds the number.
    unparsed = f'<｜DSML｜ calls>\n<｜DSML｜ invoke name="calculate">\n<｜DSML｜ parameter name="expression" string="true">{count} + {count}'
    assert not agent.grade(bisect, agent.Trace(right.calls, unparsed)).answer
    # An expression is compared by its value; numbers as written, not by type.
    product = by_question["What is (48 + 17) * 6?"]
    assert agent.grade(product, agent.Trace([("calculate", {"expression": "65*6"})], "It is 390.")).solved
    assert not agent.grade(product, agent.Trace([("calculate", {"expression": "(48 + 17"})], "390")).solved
    prime = by_question["Is 1001 a prime number?"]
    assert agent.grade(prime, agent.Trace([("is_prime", {"n": "1001"})], "No: 1001 = 7 * 11 * 13.")).solved
    assert not agent.grade(prime, agent.Trace([("is_prime", {"n": 1011})], "No: 1011 is not prime.")).solved
    # Both modules of a two-module question.
    two = by_question["How many public names do html and token define?"]
    html = ("count_names", {"module": "html"})
    assert not agent.grade(two, agent.Trace([html], " and ".join(two.answers))).calls
    assert agent.grade(two, agent.Trace([html, ("count_names", {"module": "token"})], " and ".join(two.answers))).solved
