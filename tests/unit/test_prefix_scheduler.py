"""DSpark's goodput scheduler (Algorithm 1 with its early stop, the step-cost table and
its profile, replayed schedules) and the confidence head's calibration."""

from __future__ import annotations

import math
import statistics

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from model.runtime.calibration import Calibration, expected_calibration_error
from model.runtime.prefix_scheduler import StepCost, VerifyRecord, profile_order, replay_schedules, schedule

pytestmark = pytest.mark.unit


def flat_cost(k: int = 5, slope: float = 0.0) -> StepCost:
    return StepCost({(r, t): 1.0 + slope * r * t for r in (1, 64) for t in range(1, k + 2)})


def test_scheduler_admits_by_survival_and_stops_early():
    survival = torch.tensor([[0.9, 0.6, 0.3], [0.8, 0.2, 0.1]])
    # Flat cost: every admission with a > 0 raises the expected tokens: verify everything.
    assert schedule(survival, flat_cost(3)) == [3, 3]
    # Each batch token costs 20% more time at R = 2: admit while a > (current tau) * 0.2 / (1 + 0.2 B) ...
    cost = StepCost({(2, t): 1.0 + 0.2 * 2 * t for t in range(1, 5)})

    def theta(lengths):
        tokens = 2 + sum(lengths)
        tau = 2 + sum(float(survival[r, :l].sum()) for r, l in enumerate(lengths))
        return tau * cost.sps(2, tokens)

    got = schedule(survival, cost)
    # Hand path: 0.9 (r0), 0.8 (r1), 0.6 (r0), 0.3 (r0) ...: stop at the first that does not help.
    path, lengths, best = [(0, 1), (1, 1), (0, 2), (0, 3), (1, 2), (1, 3)], [0, 0], theta([0, 0])
    expected = [0, 0]
    for r, j in path:
        lengths[r] = j
        if theta(lengths) <= best:
            break
        best, expected = theta(lengths), list(lengths)
    assert got == expected and got != [3, 3] and sum(got) > 0


def test_scheduler_early_stop_does_not_look_past_a_dip():
    """A curve with a dip then a rise: the early stop must not admit past the dip."""
    table = {(1, 1): 1.0, (1, 2): 1.9, (1, 3): 1.9, (1, 4): 1.9}
    survival = torch.tensor([[0.5, 0.5, 0.5]])
    assert schedule(survival, StepCost(table)) == [0]  # 1.5 / 1.9 < 1 / 1.0: stop at once


def test_the_scheduler_pays_for_the_padding_of_the_longest_verify():
    """Two requests, the first's guesses sure, the second's hopeless. Per token alone
    the first's guesses pay; when each slot padded in the other request costs twice a
    step's rise per token, extending one request alone no longer pays. When both are
    sure, the first guess pads the other and does not pay, the second's fill it and
    do: the search goes past that dip (an early stop would verify nothing)."""
    table = {(2, t): 1.0 + 0.1 * 2 * t for t in range(1, 5)}
    one_sided = torch.tensor([[0.95, 0.9, 0.85], [0.05, 0.0, 0.0]])
    assert schedule(one_sided, StepCost(table)) == [3, 0]
    padded = StepCost(table, padding={2: 2.0})
    # 5 tokens: 2.5 each, between the table's t = 2 and 3; 2 x 4 - 5 = 3 padded slots
    assert math.isclose(padded.seconds_per_step(2, 5, longest=4), (table[(2, 2)] + table[(2, 3)]) / 2 + 2.0 * 3)
    assert padded.seconds_per_step(2, 8, longest=4) == StepCost(table).seconds_per_step(2, 8)  # nothing padded
    assert schedule(one_sided, padded) == [0, 0]
    both = torch.tensor([[0.95, 0.9, 0.85], [0.95, 0.9, 0.85]])
    assert schedule(both, padded) == [3, 3]


def _schedule_one_by_one(survival: torch.Tensor, cost: StepCost) -> list[int]:
    """Algorithm 1 as the paper states it, one admission at a time: the oracle of the
    vectorised :func:`schedule`."""
    r_count, k = survival.shape
    a = survival.double().tolist()
    order = sorted(((a[r][j], j, r) for r in range(r_count) for j in range(k) if a[r][j] > 0),
                   key=lambda item: (-item[0], item[1], item[2]))
    lengths, tokens, expected, longest = [0] * r_count, r_count, float(r_count), 1
    best, best_lengths = expected * cost.sps(r_count, tokens, longest), list(lengths)
    for value, j, r in order:
        if j != lengths[r]:
            break
        tokens, expected, longest = tokens + 1, expected + value, max(longest, j + 2)
        lengths[r] = j + 1
        throughput = expected * cost.sps(r_count, tokens, longest)
        if throughput > best:
            best, best_lengths = throughput, list(lengths)
        elif not cost.padding:
            break
    return best_lengths


@settings(max_examples=300, deadline=None)
@given(requests=st.integers(1, 24), k=st.integers(1, 6), seed=st.integers(0, 2**16), padded=st.booleans(),
       rise=st.floats(0.0, 0.5), ties=st.booleans())
def test_the_scheduler_admits_as_algorithm_1_one_by_one(requests, k, seed, padded, rise, ties):
    """The vectorised search returns what admitting candidates one at a time returns:
    random survivals (rounded to a coarse grid for ties, some rows cut to zero by a
    request's room), tables with and without padding, R between and beyond the
    table's points."""
    g = torch.Generator().manual_seed(seed)
    c = torch.rand(requests, k, generator=g)
    if ties:
        c = (c * 4).round() / 4
    room = torch.randint(0, k + 1, (requests, 1), generator=g)
    survival = c.cumprod(1) * (torch.arange(k)[None] < room)
    steps = {r: (rise * torch.rand(k + 1, generator=g)).cumsum(0).tolist() for r in (1, 4, 16)}  # rising in t
    table = {(r, t): 0.01 * r**0.5 * (1.0 + steps[r][t - 1]) for r in (1, 4, 16) for t in range(1, k + 2)}
    cost = StepCost(table, padding={4: 0.003 * rise, 16: 0.01 * rise} if padded else None)
    assert schedule(survival, cost) == _schedule_one_by_one(survival, cost)


def test_scheduler_never_admits_zero_survival():
    assert schedule(torch.tensor([[0.9, 0.0], [0.0, 0.0]]), flat_cost(2)) == [1, 0]


def test_step_cost_interpolates_and_extrapolates_in_requests():
    cost = StepCost({(1, 1): 1.0, (1, 3): 3.0, (4, 1): 2.0, (4, 3): 4.0})
    assert math.isclose(cost.seconds_per_step(1, 2), 2.0)
    assert math.isclose(cost.seconds_per_step(4, 8), 3.0)
    assert math.isclose(cost.seconds_per_step(2, 2), (2 / 3) * 1.0 + (1 / 3) * 2.0)
    assert math.isclose(cost.seconds_per_step(8, 8), 4.0)


# ---------------------------------------------------------------------- calibration


def test_temperature_scaling_fixes_overconfidence():
    g = torch.Generator().manual_seed(0)
    n, k = 4000, 3
    logits = torch.randn(n, k, generator=g) * 3
    true_c = torch.sigmoid(logits / 2.5)  # the head is overconfident by a temperature of 2.5
    survive = torch.rand(n, k, generator=g) < true_c
    accepted = survive.long().cumprod(dim=-1).bool()
    calibration = Calibration.fit(logits, accepted)
    assert abs(calibration.temperatures[0] - 2.5) < 0.6
    assert all(after <= before + 1e-9 for before, after in zip(calibration.ece_before, calibration.ece_after))
    assert calibration.ece_after[0] < 0.5 * calibration.ece_before[0]
    again = Calibration.from_dict(calibration.to_dict())
    assert torch.allclose(again.apply(logits), calibration.apply(logits), atol=1e-5)
    with pytest.raises(ValueError):
        Calibration.from_dict({"temperatures": [1.0, -2.0]})


def test_expected_calibration_error_of_a_perfect_predictor_is_small():
    g = torch.Generator().manual_seed(1)
    p = torch.rand(20000, generator=g)
    outcome = torch.rand(20000, generator=g) < p
    assert expected_calibration_error(p, outcome) < 0.02
    assert expected_calibration_error(torch.full((100,), 0.9), torch.zeros(100)) > 0.8


def test_profile_rounds_cancel_a_drifting_machine():
    # Each step timed on a machine slowing down steadily: a step's time is its position.
    # The median rise of every t over the same round's t = 1 must come out 0, or drift
    # would read as a cost of verifying more guesses.
    rounds = profile_order(6, 8)
    assert all(sorted(r) == [1, 2, 3, 4, 5, 6] for r in rounds)
    for t in range(2, 7):
        assert statistics.median(r.index(t) - r.index(1) for r in rounds) == 0
    one_way = [list(range(1, 7))] * 8  # rounds all in one order: drift shows
    assert statistics.median(r.index(6) - r.index(1) for r in one_way) == 5


def test_replayed_schedules_score_by_the_table():
    """`bench spec` replays each way of choosing verify lengths on the draft states of
    a run that verified every guess: by hand on two steps, and the oracle (verify
    exactly what will be accepted) beats every choice that cannot see the outcome."""
    cost = StepCost({(2, t): 1.0 + 0.1 * t for t in range(1, 4)})  # seconds: 1 + 0.1 t at R = 2
    records = [VerifyRecord(np.array([[0.9, 0.8], [0.2, 0.1]]), np.array([2, 2]), np.array([2, 2]), np.array([2, 0])),
               VerifyRecord(np.array([[0.9, 0.0], [0.5, 0.4]]), np.array([1, 2]), np.array([1, 2]), np.array([1, 1]))]
    scores = replay_schedules(records, cost, fixed=(1, 2))
    # k=1: tokens (2 + 1) + (2 + 2), time 1.2 + 1.2 (t = 2 a request); k=2: (3 + 1) + (2 + 2), time 1.3 + 1.25
    # (room caps the first request of the second step at one guess: 5 tokens, t = 2.5; no padding in the table)
    assert scores["k=1"] == pytest.approx(7 / 2.4) and scores["k=2"] == pytest.approx(8 / 2.55)
    # the oracle: lengths (2, 0) then (1, 1): 4 tokens out of each step, both at t = 2
    assert scores["oracle"] == pytest.approx(8 / 2.4)
    assert scores["oracle"] >= max(scores.values()) - 1e-12
    with pytest.raises(ValueError, match="did not verify"):
        replay_schedules([VerifyRecord(records[0].survival, np.array([2, 2]), np.array([1, 2]), np.array([1, 0]))],
                         cost, fixed=(1,))
