"""Move a stored prefix or encode it again (actors/move_cost.py): the choice by measured costs."""

from __future__ import annotations

import pytest

from actors.move_cost import MoveCost

pytestmark = pytest.mark.unit


def test_unmeasured_costs_move_and_the_first_measurement_is_taken_whole():
    cost = MoveCost()
    assert cost.estimate("n1", 4, 64) is None and cost.worth_moving("n1", 4, 64)
    cost.read("n1", 400_000, 4, 0.5)  # 800 KB/s, 100 KB a chunk
    cost.encoded(128, 0.128)  # 1 ms a token
    assert cost.estimate("n1", 4, 64) == pytest.approx((0.5, 0.256))
    assert not cost.worth_moving("n1", 4, 64) and cost.worth_moving("n2", 4, 64)  # (n2 unmeasured)
    assert cost.choices == {"moved": 2, "recomputed": 1}


def test_measurements_are_running_averages_and_empty_ones_are_ignored():
    cost = MoveCost()
    cost.read("n1", 100, 1, 1.0)
    cost.read("n1", 1100, 1, 1.0)
    cost.read("n1", 0, 0, 1.0)
    cost.encoded(0, 1.0)
    assert cost.throughput["n1"] == pytest.approx(0.7 * 100 + 0.3 * 1100)
    assert cost.chunk_bytes == pytest.approx(400) and cost.encode_s_per_token is None


def test_a_read_that_timed_out_counts_as_at_most_the_bytes_asked():
    cost = MoveCost()
    cost.read("n1", 0, 0, 5.0, asked=10)  # nothing known of a chunk's size yet: no measure
    assert "n1" not in cost.throughput
    cost.sized(300_000, 3)  # this node's own chunks: 100 KB each
    cost.read("n1", 0, 0, 0.2, asked=10)  # quick and empty (the store had none): not the link's speed
    assert "n1" not in cost.throughput
    cost.read("n1", 0, 0, 5.0, asked=10)
    assert cost.throughput["n1"] == pytest.approx(10 * 100_000 / 5.0)
