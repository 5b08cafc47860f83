"""DSpark speculative decoding: exact rollback, lossless greedy output, a distribution-
preserving rejection sampler, speculation in the batcher (its scheduler and calibration:
tests/unit/test_prefix_scheduler.py)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from model.dspark import DSparkDrafter
from model.runtime.batcher import Batcher, Speculation, generate
from model.runtime.engine import Engine
from model.runtime.prefix_scheduler import StepCost
from model.runtime.sampling import SamplingParams
from model.runtime.speculative import SpeculativeDrafter, accept_tokens
from model.training import init_module
from tests.unit.test_prefix_scheduler import flat_cost

pytestmark = pytest.mark.unit

TINY = "configs/tiny"


@pytest.fixture(scope="module")
def tiny(tiny_backbone):
    config, model, hasher = tiny_backbone
    drafter = init_module(DSparkDrafter(config), seed=1, std=0.08).eval()
    return Engine(model, hasher), drafter


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(3, 2000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


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
    batcher = Batcher(engine, max_batch=2, speculation=Speculation(oracle, mode, k=k, cost=flat_cost()))
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
    spec = Speculation(SpeculativeDrafter(drafter, engine), "scheduled", cost=flat_cost())
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


def test_profiled_cost_has_every_point(tiny):
    engine, drafter = tiny
    cost = StepCost.profile(engine, SpeculativeDrafter(drafter, engine), requests=(1, 2), max_tokens=3,
                            context=40, rounds=2)
    assert set(cost.seconds) == set(itertools.product((1, 2), (1, 2, 3)))
    assert all(s > 0 for s in cost.seconds.values())
    assert set(cost.padding) == {2} and cost.padding[2] >= 0  # measured where there are others to pad
    assert cost.seconds_per_step(2, 6) >= cost.seconds_per_step(2, 2)
    assert all(cost.seconds[(r, t)] <= cost.seconds[(r, t + 1)] for r in (1, 2) for t in (1, 2))


def test_bench_lockstep_runs_every_mode_as_if_alone(tiny):
    """`v41 bench spec` interleaves the modes' steps: each mode must still decode exactly
    what it decodes alone (no batcher sees another's requests), and be timed by its own
    steps only."""
    from cluster.bench.lockstep import lockstep

    engine, drafter = tiny
    prompts = [_tokens(n, n) for n in (30, 41, 52)]
    plain = _plain_greedy(engine, prompts, 7)
    spec = SpeculativeDrafter(drafter, engine)
    modes = {"plain": None, "k=2": Speculation(spec, "fixed", k=2),
             "scheduler": Speculation(spec, "scheduled", cost=flat_cost(slope=0.01))}
    runs = lockstep(engine, prompts, 7, modes, cost=flat_cost(slope=0.01), seed=3)
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
    from cluster.bench.lockstep import lockstep

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
