"""DSpark speculative decoding: exact rollback, lossless greedy output, a distribution-
preserving rejection sampler, Algorithm 1 with its early stop, calibration."""

from __future__ import annotations

import itertools
import math
import statistics

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from model.runtime.batcher import Batcher, Speculation, generate
from model.dspark import DSparkDrafter
from model.runtime.engine import Engine
from model.runtime.sampling import SamplingParams
from model.runtime.speculative import (
    Calibration,
    SpeculativeDrafter,
    StepCost,
    VerifyRecord,
    accept_tokens,
    expected_calibration_error,
    schedule,
    profile_order,
    replay_schedules,
)
from model.training import init_module

TINY = "configs/tiny"


@pytest.fixture(scope="module")
def tiny(tiny_backbone):
    config, model, hasher = tiny_backbone
    drafter = init_module(DSparkDrafter(config), seed=1, std=0.08).eval()
    return Engine(model, hasher), drafter


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(3, 2000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _flat_cost(k: int = 5, slope: float = 0.0) -> StepCost:
    return StepCost({(r, t): 1.0 + slope * r * t for r in (1, 64) for t in range(1, k + 2)})


class _Oracle(SpeculativeDrafter):
    """Guesses the true greedy continuation with seeded corruptions, so that every
    acceptance length 0..K happens (a random drafter is almost never right)."""

    def __init__(self, drafter, engine, truth: dict[str, list[int]], seed: int = 0):
        super().__init__(drafter, engine)
        self.truth, self.batcher = truth, None
        self.generator = torch.Generator().manual_seed(seed)

    def propose(self, contexts, anchors, params, generators, constraints=None):
        drafted = super().propose(contexts, anchors, params, generators, constraints)
        k = self.block_size
        for i, running in enumerate(self.batcher.running.values()):
            done = len(running.tokens)
            truth = self.truth[running.request_id][done : done + k]
            guess = truth + [7] * (k - len(truth))
            wrong = int(torch.randint(0, k + 2, (), generator=self.generator))
            if wrong < k:
                guess[wrong] = (guess[wrong] + 1) % 2000
            drafted.proposal.tokens[i] = torch.tensor(guess)
        return drafted


# ---------------------------------------------------------------------- engine rollback


def _prefilled(engine, prompt):
    cache = engine.new_cache()
    first = int(engine.replay(cache, engine.prefill(cache, prompt)).argmax())
    return cache, first


def _state(cache):
    windows = [(w.start, w.rows.n) for w in cache.windows]
    counts = {s: (cache.entries[s].n, cache.keys[s].n, cache.pending[s].shape[0]) for s in cache.entries}
    return cache.length, windows, counts, cache.ngram.tail.tolist()


def test_verify_then_accept_all_is_a_decode_step(tiny):
    engine, _ = tiny
    prompt = _tokens(61, 1)
    a, first = _prefilled(engine, prompt)
    b, _ = _prefilled(engine, prompt)
    fed = [first, 11, 12, 13, 14]
    plain = engine.decode([(a, fed)])[0]
    logits, rewinds = engine.verify([(b, fed)])
    engine.accept(b, rewinds[0], len(fed))
    assert torch.equal(plain, logits[0])
    assert _state(a) == _state(b)
    for wa, wb in zip(a.windows, b.windows):
        assert torch.equal(wa.rows.data, wb.rows.data)
    for s in a.entries:
        assert torch.equal(a.entries[s].data, b.entries[s].data) and torch.equal(a.keys[s].data, b.keys[s].data)
        assert torch.equal(a.pending[s], b.pending[s])


@pytest.mark.parametrize("keep", [1, 2, 4])
def test_accept_rolls_back_to_exactly_the_kept_tokens(tiny, keep):
    """Windows (including rows the step slid out), pending pooling rows (ratio-2 groups
    completed by a rejected token), compressed entries, indexer keys and the n-gram
    context equal those of plain decoding of the kept tokens; the next step agrees."""
    engine, _ = tiny
    prompt = _tokens(64 + 7, 2)  # odd length: the ratio-2 sources hold a pending row
    a, first = _prefilled(engine, prompt)
    b, _ = _prefilled(engine, prompt)
    kept = [first, 21, 22, 23][:keep]
    engine.decode([(a, kept)])
    _, rewinds = engine.verify([(b, kept + [901, 902, 903, 904, 905][: 6 - keep])])
    engine.accept(b, rewinds[0], keep)
    assert _state(a) == _state(b)
    for wa, wb in zip(a.windows, b.windows):  # same positions; values to float noise of the batch shape
        assert (wa.rows.values - wb.rows.values).abs().mean() < 1e-3
    for s in a.entries:
        assert torch.allclose(a.pending[s], b.pending[s], atol=1e-4)
        assert torch.allclose(a.entries[s].values, b.entries[s].values, atol=0.5)
    nxt_a = engine.decode([(a, [30])])[0]
    nxt_b = engine.decode([(b, [30])])[0]
    assert torch.allclose(nxt_a, nxt_b, atol=2e-3)
    with pytest.raises(ValueError):
        _, rw = engine.verify([(b, [1, 2])])
        engine.accept(b, rw[0], 3)


# ---------------------------------------------------------------------- lossless greedy


def _plain_greedy(engine, prompts, max_tokens):
    return generate(engine, prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens))


_PROMPT_LENGTHS, _MAX_TOKENS = (23, 45, 70, 33), [12, 8, 14, 10]


@pytest.fixture(scope="module")
def greedy_truth(tiny):
    engine, _ = tiny
    prompts = [_tokens(n, 40 + n) for n in _PROMPT_LENGTHS]
    return prompts, {str(i): _plain_greedy(engine, [p], n)[0] for i, (p, n) in enumerate(zip(prompts, _MAX_TOKENS))}


@pytest.mark.parametrize("mode,k", [("fixed", 2), ("fixed", 5), ("scheduled", 0)])
def test_greedy_speculation_equals_plain_greedy_with_joins_and_leaves(tiny, greedy_truth, mode, k):
    engine, drafter = tiny
    prompts, truth = greedy_truth
    oracle = _Oracle(drafter, engine, truth, seed=k)
    batcher = Batcher(engine, max_batch=2, speculation=Speculation(oracle, mode, k=k, cost=_flat_cost()))
    oracle.batcher = batcher
    out = {str(i): [] for i in range(len(prompts))}
    waiting = list(range(len(prompts)))
    while waiting or batcher.running:
        while waiting and batcher.can_add():  # requests join as others leave
            i = waiting.pop(0)
            out[str(i)].append(batcher.add(str(i), SamplingParams(temperature=0.0, max_tokens=_MAX_TOKENS[i]),
                                           prompt=prompts[i]).token_id)
        for event in batcher.step():
            out[event.request_id].append(event.token_id)
    assert out == truth
    m = batcher.metrics
    assert m.emitted == sum(_MAX_TOKENS) - len(prompts) and 0 < m.accepted <= m.verified
    assert m.acceptance_length > 1.0 and m.tokens_per_pass > 1.0
    if mode == "fixed":
        assert set(m.verify_lengths) <= set(range(k + 1)) and k in m.verify_lengths


def test_random_drafter_and_the_scheduler_keep_greedy_output(tiny):
    engine, drafter = tiny
    prompts = [_tokens(n, n) for n in (30, 52)]
    plain = _plain_greedy(engine, prompts, 6)
    spec = Speculation(SpeculativeDrafter(drafter, engine), "scheduled", cost=_flat_cost())
    assert generate(engine, prompts, SamplingParams(temperature=0.0, max_tokens=6), speculation=spec) == plain


def test_a_guess_of_the_image_placeholder_is_rejected(tiny_backbone, tiny):
    """The drafter guesses plain greedy's tokens, the placeholder among them: the target
    rejects it and the output is greedy without it, as with a -100 bias on it."""
    engine, drafter = tiny
    _, model, hasher = tiny_backbone
    prompt = _tokens(45, 7)
    truth = _plain_greedy(engine, [prompt], 10)[0]
    placeholder = truth[3]
    assert placeholder not in prompt
    expected = generate(engine, [prompt], SamplingParams(temperature=0.0, max_tokens=10,
                                                         logit_bias=((placeholder, -100),)))[0]
    reader = Engine(model, hasher, image_token_id=placeholder)
    oracle = _Oracle(drafter, reader, {"a": truth}, seed=2)
    batcher = Batcher(reader, speculation=Speculation(oracle, "fixed", k=5))
    oracle.batcher = batcher
    events = [batcher.add("a", SamplingParams(temperature=0.0, max_tokens=10), prompt=prompt)]
    while batcher.running:
        events += batcher.step()
    assert [e.token_id for e in events] == expected and placeholder not in expected
    assert expected[:3] == truth[:3]


def test_a_stop_inside_a_step_leaves_the_cache_of_plain_decoding(tiny):
    engine, drafter = tiny
    prompt = _tokens(40, 5)
    truth = _plain_greedy(engine, [prompt], 10)[0]
    stop = truth[6]
    finished = {}
    oracle = _Oracle(drafter, engine, {"a": truth}, seed=99)
    oracle.generator.manual_seed(3)
    batcher = Batcher(engine, speculation=Speculation(oracle, "fixed", k=5),
                      on_finish=lambda rid, cache, tokens: finished.update({rid: (cache.length, list(tokens))}))
    oracle.batcher = batcher
    params = SamplingParams(temperature=0.0, max_tokens=10, stop_token_ids=(stop,))
    events = [batcher.add("a", params, prompt=prompt)]
    while batcher.running:
        events += batcher.step()
    assert [e.token_id for e in events] == truth[: truth.index(stop) + 1]
    assert events[-1].finish_reason == "stop"
    length, tokens = finished["a"]
    assert length == len(prompt) + len(tokens) - 1  # every token but the last was fed


# ---------------------------------------------------------------------- rejection sampling


def _chi_square_p(observed: torch.Tensor, expected_p: torch.Tensor) -> float:
    """Pearson's chi-square p-value; cells expecting fewer than 5 are pooled into one."""
    expected = expected_p.double() * observed.sum()
    small = expected < 5
    obs = torch.cat((observed[~small].double(), observed[small].double().sum().reshape(1)))
    exp = torch.cat((expected[~small], expected[small].sum().reshape(1)))
    keep = exp > 0
    stat = ((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum()
    df = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2.0, dtype=torch.float64), stat / 2))


def _markov_run(P, Q, params, trials, accept_fn, seed=0):
    """Speculative generation of 3 tokens from a Markov target P (given the previous
    token) with a Markov draft Q and 3 guesses a step; returns counts of the 3-token
    sequences [V, V, V]."""
    v = P.shape[0]
    counts = torch.zeros(v, v, v)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(trials):
        out, last = [], 0
        while len(out) < 3:
            guesses, q_rows, prev = [], [], last
            for _ in range(3):
                x = int(torch.multinomial(Q[prev], 1, generator=gen))
                guesses.append(x)
                q_rows.append(Q[prev])
                prev = x
            rows = [last] + guesses
            target_logits = torch.log(P[rows])
            _, emitted = accept_fn(target_logits, guesses, params, gen, torch.stack(q_rows))
            out += emitted
            last = out[-1]
        counts[out[0], out[1], out[2]] += 1
    return counts


def _markov_pair(v=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    P = torch.softmax(torch.randn(v, v, generator=g) * 1.5, -1)
    Q = torch.softmax(torch.randn(v, v, generator=g) * 1.5, -1)
    return P, Q


def test_rejection_sampling_preserves_the_target_distribution():
    P, Q = _markov_pair()
    params = SamplingParams(temperature=1.0)
    counts = _markov_run(P, Q, params, trials=2500, accept_fn=accept_tokens)
    exact = P[0][:, None, None] * P[:, :, None] * P[None, :, :]  # P(x1|0) P(x2|x1) P(x3|x2)
    assert _chi_square_p(counts.flatten(), exact.flatten()) > 1e-3


def test_the_chi_square_test_catches_a_biased_sampler():
    P, Q = _markov_pair()

    def accept_all(target_logits, guesses, params, generator, q):  # keeps every draft: samples Q, not P
        return len(guesses), list(guesses) + [int(torch.multinomial(torch.softmax(target_logits[-1], -1), 1,
                                                                    generator=generator))]

    counts = _markov_run(P, Q, SamplingParams(temperature=1.0), trials=2500, accept_fn=accept_all)
    exact = P[0][:, None, None] * P[:, :, None] * P[None, :, :]
    assert _chi_square_p(counts.flatten(), exact.flatten()) < 1e-6


def test_rejection_sampling_respects_top_k_and_temperature():
    """The target is ``probabilities(logits, params)``: a token outside top-k never comes out."""
    P, Q = _markov_pair(v=4, seed=1)
    params = SamplingParams(temperature=0.7, top_k=2)
    gen = torch.Generator().manual_seed(0)
    logits = torch.log(P[[0, 1, 2]])
    allowed = [set(logits[j].topk(2).indices.tolist()) for j in range(3)]
    for _ in range(300):
        guesses = [int(torch.multinomial(Q[0], 1, generator=gen)) for _ in range(2)]
        m, emitted = accept_tokens(logits, guesses, params, gen, Q[[0, 0]])
        assert emitted[-1] in allowed[m]


def test_sampled_speculation_runs_and_is_seeded(tiny):
    engine, drafter = tiny
    spec = Speculation(SpeculativeDrafter(drafter, engine), "fixed", k=3)
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=5, max_tokens=4)
    prompts = [_tokens(40, 8), _tokens(33, 9)]
    a = generate(engine, prompts, params, speculation=spec)
    b = generate(engine, prompts, params, speculation=spec)
    assert a == b and all(len(t) == 4 for t in a)


# ---------------------------------------------------------------------- scheduler


def test_scheduler_admits_by_survival_and_stops_early():
    survival = torch.tensor([[0.9, 0.6, 0.3], [0.8, 0.2, 0.1]])
    # Flat cost: every admission with a > 0 raises the expected tokens: verify everything.
    assert schedule(survival, _flat_cost(3)) == [3, 3]
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
    assert schedule(torch.tensor([[0.9, 0.0], [0.0, 0.0]]), _flat_cost(2)) == [1, 0]


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


def test_profiled_cost_has_every_point(tiny):
    engine, drafter = tiny
    cost = StepCost.profile(engine, SpeculativeDrafter(drafter, engine), requests=(1, 2), max_tokens=3,
                            context=40, rounds=2)
    assert set(cost.seconds) == set(itertools.product((1, 2), (1, 2, 3)))
    assert all(s > 0 for s in cost.seconds.values())
    assert set(cost.padding) == {2} and cost.padding[2] >= 0  # measured where there are others to pad
    assert cost.seconds_per_step(2, 6) >= cost.seconds_per_step(2, 2)
    assert all(cost.seconds[(r, t)] <= cost.seconds[(r, t + 1)] for r in (1, 2) for t in (1, 2))


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


def test_bench_lockstep_runs_every_mode_as_if_alone(tiny):
    """`v41 bench spec` interleaves the modes' steps: each mode must still decode exactly
    what it decodes alone (no batcher sees another's requests), and be timed by its own
    steps only."""
    from cluster.bench.spec import lockstep

    engine, drafter = tiny
    prompts = [_tokens(n, n) for n in (30, 41, 52)]
    plain = _plain_greedy(engine, prompts, 7)
    spec = SpeculativeDrafter(drafter, engine)
    modes = {"plain": None, "k=2": Speculation(spec, "fixed", k=2),
             "scheduler": Speculation(spec, "scheduled", cost=_flat_cost(slope=0.01))}
    runs = lockstep(engine, prompts, 7, modes, cost=_flat_cost(slope=0.01), seed=3)
    assert list(runs) == list(modes)
    for name, run in runs.items():
        assert run.outputs == plain, name
        assert run.tokens == 3 * 6  # the first token of each request comes from its replay
        assert run.timing.wall > 0 and run.timing.cpu > 0
    assert runs["plain"].timing.modelled == 0.0  # plain does not draft: no table time
    alone = Batcher(engine, max_batch=3, speculation=modes["k=2"])
    for i, p in enumerate(prompts):
        alone.add(str(i), SamplingParams(temperature=0.0, max_tokens=7), prompt=p)
    while alone.running:
        alone.step()
    assert runs["k=2"].metrics.passes == alone.metrics.passes
    assert runs["k=2"].metrics.verified == alone.metrics.verified
    # Plain decoding's requests all finish at the last step: its batch is full throughout.
    assert runs["plain"].full_tokens == runs["plain"].tokens and runs["k=2"].full_tokens <= runs["k=2"].tokens


def test_bench_lockstep_continuous_refills_the_batch(tiny):
    """With ``in_flight``, the bench's queue feeds each mode's batch as requests finish:
    every request still decodes what it does alone, no more than ``in_flight`` run at
    once, and only the steps with the batch full count as full."""
    from cluster.bench.spec import lockstep

    engine, drafter = tiny
    prompts = [_tokens(n, n) for n in (30, 41, 52, 35, 47)]
    plain = _plain_greedy(engine, prompts, 7)
    spec = SpeculativeDrafter(drafter, engine)
    modes = {"plain": None, "k=2": Speculation(spec, "fixed", k=2)}
    widths = []
    original = Batcher.step

    def step(self):
        widths.append(len(self.running))
        return original(self)

    Batcher.step = step
    try:
        runs = lockstep(engine, prompts, 7, modes, seed=1, in_flight=2)
    finally:
        Batcher.step = original
    for name, run in runs.items():
        assert run.outputs == plain, name
        assert run.tokens == 5 * 6
        assert 0 < run.full_tokens <= run.tokens and 0 < run.full.cpu <= run.timing.cpu
    # Plain decoding runs the requests in pairs of equal length: the fifth runs alone.
    assert runs["plain"].full_tokens == 4 * 6 and runs["plain"].full.cpu < runs["plain"].timing.cpu
    assert max(widths) == 2 and 1 in widths


def _events(batcher, prompts, params):
    out = {str(i): [] for i in range(len(prompts))}
    for i, prompt in enumerate(prompts):
        out[str(i)].append(batcher.add(str(i), params, prompt=prompt))
    while batcher.running:
        for event in batcher.step():
            out[event.request_id].append(event)
    return [out[str(i)] for i in range(len(prompts))]


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


def test_batcher_trace_records_what_each_step_verified_and_accepted(tiny):
    engine, drafter = tiny
    batcher = Batcher(engine, max_batch=2, speculation=Speculation(SpeculativeDrafter(drafter, engine), "fixed", k=3))
    batcher.trace = []
    for i, n in enumerate((30, 41)):
        batcher.add(str(i), SamplingParams(temperature=0.0, max_tokens=6), prompt=_tokens(n, n))
    while batcher.running:
        batcher.step()
    trace = batcher.trace
    assert len(trace) == batcher.metrics.passes
    assert sum(int(r.accepted.sum()) for r in trace) == batcher.metrics.accepted
    assert sum(int(r.verified.sum()) for r in trace) == batcher.metrics.verified
    for record in trace:
        assert np.array_equal(record.verified, np.minimum(3, record.room))  # k=3, or the room left
        assert np.all(record.survival[np.arange(record.survival.shape[1])[None] >= record.room[:, None]] == 0)


def test_penalties_bias_and_logprobs_are_the_same_with_speculation(tiny):
    """A verify pass scores each guess after the guesses before it: the penalties count
    them, so speculative greedy equals plain greedy under penalties and a bias, and each
    token's logprobs agree (a verify pass and a decode step compute the logits in a
    different order: to the 2e-3 this file allows next-token logits)."""
    engine, drafter = tiny
    prompts = [_tokens(n, 70 + n) for n in (33, 57)]
    params = SamplingParams(temperature=0.0, max_tokens=12, frequency_penalty=1.5, presence_penalty=0.5,
                            logit_bias=((11, 100.0), (12, -100.0)), logprobs=3)
    plain = _events(Batcher(engine, max_batch=2), prompts, params)
    tokens = [[e.token_id for e in events] for events in plain]
    unshaped = [[e.token_id for e in events] for events in _events(Batcher(engine, max_batch=2), prompts,
                                                                    SamplingParams(temperature=0.0, max_tokens=12))]
    assert tokens != unshaped  # the shaping changed what greedy picks
    assert all(12 not in row for row in tokens)  # banned
    oracle = _Oracle(drafter, engine, {str(i): row for i, row in enumerate(tokens)}, seed=3)
    batcher = Batcher(engine, max_batch=2, speculation=Speculation(oracle, "fixed", k=3))
    oracle.batcher = batcher
    speculative = _events(batcher, prompts, params)
    assert [[e.token_id for e in events] for events in speculative] == tokens
    assert batcher.metrics.accepted > 0
    for a_row, b_row in zip(plain, speculative):
        for a, b in zip(a_row, b_row):
            assert a.logprob == pytest.approx(b.logprob, abs=2e-3)
            assert [t for t, _ in a.top_logprobs] == [t for t, _ in b.top_logprobs] and len(a.top_logprobs) == 3
            assert a.logprob <= a.top_logprobs[0][1] + 1e-6
