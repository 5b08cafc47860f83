"""The compiled layer step (model/runtime/compiled.py) against the eager engine, its oracle.

The two compute the same formulas in a different order (fused reductions, the MoE's
experts gathered or all at once instead of a dispatch loop), so they agree to float
rounding: logits to the golden tolerance (1e-4) and greedy tokens exactly, on the
golden checkpoint (trained weights: no near-ties for rounding to flip).
"""

from __future__ import annotations

import dataclasses
import json
import re

import pytest
import torch
from safetensors.torch import load_file

from model.runtime.engine import Engine

pytestmark = [pytest.mark.integration, pytest.mark.slow]  # AOTInductor builds: minutes with a cold cache


@pytest.fixture(scope="module")
def engines(golden_model, golden_hasher):
    _, model = golden_model
    return (Engine(model, golden_hasher, bounded_replay=False),
            Engine(model, golden_hasher, bounded_replay=False, compiled=True))


def _decode(engine, prompts, fed):
    """Prefill each prompt, then decode ``fed[i]`` one token a step, all prompts in one
    batch: logits [steps + 1, V] per prompt."""
    caches = [engine.new_cache() for _ in prompts]
    logits = [[engine.replay(c, engine.prefill(c, p))] for c, p in zip(caches, prompts)]
    for step in range(len(fed[0])):
        for i, out in enumerate(engine.decode([(c, [f[step]]) for c, f in zip(caches, fed)])):
            logits[i].append(out[-1])
    return [torch.stack(rows) for rows in logits]


def test_compiled_decode_reproduces_the_golden_generations(engines, golden_dir):
    eager, compiled = engines
    assert compiled.compiled is not None and eager.compiled is None
    steps = load_file(golden_dir / "generation_step_logits.safetensors")
    for result in json.loads((golden_dir / "generation.json").read_text())["results"]:
        prompt = result["full_sequence"][: result["prompt_len"]]
        cache = compiled.new_cache()
        logits = [compiled.replay(cache, compiled.prefill(cache, prompt))]
        tokens = []
        for _ in range(20):
            tokens.append(int(logits[-1].argmax()))
            logits.append(compiled.decode([(cache, [tokens[-1]])])[0][-1])
        assert tokens == result["new_tokens"]
        assert (torch.stack(logits[:20]) - steps[f"gen_step_logits_p{result['prompt_index']}"]).abs().max() < 1e-4


@pytest.mark.parametrize("batch", [1, 3, 6])  # 1 and 3 tokens x 2 slots < 8 experts: gathered; 6: all experts
def test_compiled_batched_decode_agrees_with_eager(engines, golden_prompts, batch):
    eager, compiled = engines
    prompts = [golden_prompts[i % 3][: 41 + 37 * i] for i in range(batch)]
    fed = [[(7 * i + 13 * step) % 4000 + 16 for step in range(6)] for i in range(batch)]
    for want, got in zip(_decode(eager, prompts, fed), _decode(compiled, prompts, fed)):
        assert (want - got).abs().max() < 1e-4


def test_short_prompts_whose_candidate_pool_is_not_whole_yet_decode_as_eager(engines, golden_prompts):
    """Between ``index_topk`` keys and a whole candidate pool (golden A: 8 and 3 blocks of
    4) a candidate source lists a shorter pool; the compiled picks take whole pools only
    (a shorter one read past its packaged shape: a served 20-token chat failed so)."""
    eager, compiled = engines
    prompts = [golden_prompts[0][:7], golden_prompts[1][:8]]  # 8 keys: 2 blocks listed, not 3
    fed = [[(5 * i + 11 * step) % 4000 + 16 for step in range(4)] for i in range(2)]
    for want, got in zip(_decode(eager, prompts, fed), _decode(compiled, prompts, fed)):
        assert (want - got).abs().max() < 2e-4  # (measured 1.0e-4: 7-8 tokens, the fewest sums to average out)


@pytest.mark.parametrize("which", ["eager", "compiled"])
def test_every_window_of_a_batch_slides(engines, golden_prompts, which):
    """After each decode step every sequence's windows hold the last ``sliding_window``
    positions, not more: a batch slides each of them, not only one."""
    engine = engines[which == "compiled"]
    window = engine.config.sliding_window
    caches = [engine.new_cache() for _ in golden_prompts]
    for cache, prompt in zip(caches, golden_prompts):
        engine.replay(cache, engine.prefill(cache, prompt))
    for step in range(3):
        engine.decode([(cache, [100 + step]) for cache in caches])
        for cache in caches:
            assert all(w.rows.n == window and w.end == cache.length for w in cache.windows if w is not None)


@pytest.mark.parametrize("sequences", [1, 2])
def test_compiled_verify_and_accept_agree_with_eager(engines, golden_prompts, sequences):
    """A DSpark verify step (several tokens per sequence), part of it accepted, then a
    decode step: the same logits either way. One sequence's tokens read its window
    keys as one broadcast view (stride 0), which the compiled code must not take for
    a contiguous tensor."""
    results = []
    for engine in engines:
        caches = [engine.new_cache() for _ in range(sequences)]
        for cache, prompt in zip(caches, golden_prompts[:sequences]):
            engine.replay(cache, engine.prefill(cache, prompt))
        guesses = [[101, 102, 103, 104, 105], [201, 202, 203]][:sequences]
        logits, rewinds = engine.verify(list(zip(caches, guesses)))
        for cache, rewind, keep in zip(caches, rewinds, (3, 1)):
            engine.accept(cache, rewind, keep)
        after = engine.decode([(cache, [77]) for cache in caches])
        results.append([*logits, *after])
    for want, got in zip(*results):
        assert want.shape == got.shape and (want - got).abs().max() < 1e-4


def test_a_long_prefill_runs_the_compiled_blocks_in_chunks(engines, golden_prompts, monkeypatch):
    """A prompt longer than the compiled step takes is encoded in chunks it takes, each
    through the compiled blocks; the caches carry over between chunks exactly, so the
    two engines encode the prompt to the same bytes and the replay's logits agree."""
    compiled = engines[1]
    prompt = golden_prompts[2]
    steps = []
    call = type(compiled.compiled).__call__

    def counted(self, block, streams, *args, **kwargs):
        steps.append(streams.shape[0])
        return call(self, block, streams, *args, **kwargs)

    monkeypatch.setattr(type(compiled.compiled), "__call__", counted)
    assert len(prompt) > compiled.compiled.max_tokens
    caches = [engine.new_cache() for engine in engines]
    logits = [engine.replay(cache, engine.prefill(cache, prompt)) for engine, cache in zip(engines, caches)]
    chunks = [min(compiled.compiled.max_tokens, len(prompt) - lo)
              for lo in range(0, len(prompt), compiled.compiled.max_tokens)]
    encoder = compiled.config.decoder_start
    assert steps[: encoder * len(chunks)] == [n for n in chunks for _ in range(encoder)]
    for source in caches[0].entries:
        assert torch.equal(caches[0].entries[source].data, caches[1].entries[source].data)
    assert (logits[0] - logits[1]).abs().max() < 1e-4


def test_compiled_step_is_an_app_setting_both_pools_warm_at_start(golden_dir, golden_prompts):
    """`compiled_step: true` gives the decoder replicas a compiled engine and the prefill
    replicas (encoder half) one that encodes in compiled chunks, each warmed before
    anything is timed or served: requests build nothing. The prefill pool's compiled
    engine encodes the prompts to the bytes the eager one does."""
    from actors.replica import ModelBundle
    from actors.config import AppConfig

    config = AppConfig(model=str(golden_dir), compiled_step=True, ssd_dir=None)
    decoder, prefill = ModelBundle(config), ModelBundle(config, drop_decoder=True)
    eager = ModelBundle(AppConfig(model=str(golden_dir), compiled_step=False, ssd_dir=None), drop_decoder=True)
    assert decoder.engine.compiled is not None and prefill.engine.compiled is not None
    assert eager.engine.compiled is None
    # (draft_attention, before and after are the DSpark drafter's, warmed with it, and the golden model has
    # none; a prefill replica's chunks are too long for the batched picks)
    used = ((decoder.engine, ("layer_in", "layer_out", "pick", "repick", "pool_groups")),
            (prefill.engine, ("layer_in", "layer_out", "pool_groups")))
    functions = [engine.compiled.functions[name] for engine, names in used for name in names]
    variants = [len(function._variants) for function in functions]
    assert all(variants)
    caches = [decoder.engine.new_cache() for _ in range(3)]
    for cache, prompt in zip(caches, golden_prompts):
        decoder.engine.replay(cache, decoder.engine.prefill(cache, prompt))
        encoded, want = prefill.engine.new_cache(), eager.engine.new_cache()
        prefill.engine.prefill(encoded, prompt)
        eager.engine.prefill(want, prompt)
        assert all(torch.equal(encoded.entries[s].data, want.entries[s].data) for s in want.entries)
    decoder.engine.decode([(caches[0], [42])])
    decoder.engine.decode([(cache, [43]) for cache in caches])
    decoder.engine.decode([(caches[1], list(range(100, 120)))])  # the MoE's other form
    assert [len(function._variants) for function in functions] == variants  # built at start, not by requests


def test_v41_serve_readies_both_pools_packages_and_a_second_start_builds_none(golden_dir):
    """`v41 serve` builds or loads the compiled step's packages (both pools') before the
    app starts, a line per package built; a second start loads every one and builds none."""
    from cluster.cli.step_packages import decoder_step, ready_compiled_step

    args = {"model": str(golden_dir), "ssd_dir": None}
    starts = [[], []]
    for said in starts:
        assert ready_compiled_step(args, said.append) == args and decoder_step(args) == "compiled step"
    (built, loaded), again = [tuple(map(int, re.search(r"\((\d+) packages built, (\d+) loaded", said[-1]).groups()))
                              for said in starts]
    assert again == (0, built + loaded) and built + loaded >= 8  # (layer_in / layer_out / picks / pooling signatures)
    assert len([line for line in starts[0] if line.startswith("v41:   built ")]) == built
    assert len(starts[1]) == 1


@pytest.fixture
def no_compiler(monkeypatch):
    """A host without a C++ compiler: inductor's search finds none (``false --version`` fails)."""
    from torch._inductor import config, cpp_builder

    monkeypatch.setattr(config.cpp, "cxx", ("false",))
    cpp_builder.cpp_compiler_search.cache_clear()
    yield
    cpp_builder.cpp_compiler_search.cache_clear()


def test_without_a_compiler_the_server_says_so_and_serves_the_eager_step(golden_dir, no_compiler):
    from actors.config import AppConfig
    from actors.replica import ModelBundle
    from cluster.cli.step_packages import decoder_step, ready_compiled_step

    said = []
    args = ready_compiled_step({"model": str(golden_dir), "ssd_dir": None}, said.append)
    assert args["compiled_step"] is False and decoder_step(args) == "eager step"
    assert said == ["v41: no working C++ compiler (false --version failed; set CXX to one): "
                    "serving the eager step (decoding ~2-3x slower)"]
    # A replica a deploy config starts on such a host runs eager too (its log says why).
    assert ModelBundle(AppConfig(model=str(golden_dir), ssd_dir=None)).engine.compiled is None
    # Asked for the eager step, nothing is built, loaded or said.
    said.clear()
    eager = {"model": str(golden_dir), "ssd_dir": None, "compiled_step": False}
    assert ready_compiled_step(eager, said.append) == eager and said == []


def test_a_build_that_fails_after_a_stop_is_that_stop_not_an_eager_start(golden_dir, monkeypatch):
    """Ctrl-C during the build raises inside torch's export, whose way out can replace it
    with another exception (an AssertionError: a mode stack popped twice): once the
    server is stopping, that failure goes on as the stop; otherwise it is a build that
    cannot run here, and the server says so and serves eager."""
    import actors.replica
    from cluster.cli.step_packages import ready_compiled_step
    from model.runtime import aot

    def interrupted(*args, **kwargs):
        raise AssertionError("Trying to pop empty mode stack")

    monkeypatch.setattr(aot, "compiler_problem", lambda: None)
    monkeypatch.setattr(actors.replica, "ModelBundle", interrupted)
    said, args = [], {"model": str(golden_dir), "ssd_dir": None}
    with pytest.raises(AssertionError, match="mode stack"):
        ready_compiled_step(args, said.append, stopping=lambda: True)
    assert not any("eager" in line for line in said)
    assert ready_compiled_step(args, said.append)["compiled_step"] is False
    assert "(AssertionError: Trying to pop empty mode stack): serving the eager step" in said[-1]


def test_the_drafter_runs_compiled_and_drafts_as_the_eager_one(engines, golden_model):
    """A DSpark drafter bound to the compiled engine runs its layers through the
    compiled functions (its experts stacked like the backbone's) and proposes the
    same guesses as bound to the eager engine, its logits within the golden tolerance."""
    from model.dspark import DSparkDrafter
    from model.runtime.sampling import SamplingParams
    from model.runtime.speculative import SpeculativeDrafter
    from model.training import init_module

    config, _ = golden_model  # (the golden checkpoint has no drafter layer: one, random)
    module = init_module(DSparkDrafter(dataclasses.replace(config.text, num_nextn_predict_layers=1)), seed=1,
                         std=0.08).eval()
    generator = torch.Generator().manual_seed(3)
    requests = 3
    features = [torch.randn(module.window, len(config.text.dspark_target_layer_ids), config.text.hc_mult,
                            config.text.hidden_size, generator=generator) for _ in range(requests)]
    positions = [torch.arange(40 + i, 40 + i + module.window) for i in range(requests)]
    proposals = []
    for engine in engines:
        drafter = SpeculativeDrafter(module, engine)
        contexts = drafter.extend([None] * requests, features, positions)
        proposals.append(drafter.propose(contexts, [11, 12, 13], [SamplingParams(temperature=0.0)] * requests,
                                         [None] * requests).proposal)
    functions = engines[1].compiled.functions
    index = module.mtp[0].plan.index  # it ran compiled, its attention too
    assert [variant for variant in functions["after"]._variants if variant[0] == index]
    assert list(functions["draft_attention"]._variants) == [id(module.mtp[0].attn)]
    eager, compiled = proposals
    assert torch.equal(eager.tokens, compiled.tokens)
    assert (eager.logits - compiled.logits).abs().max() < 1e-4
    assert (eager.confidence - compiled.confidence).abs().max() < 1e-4
    # Warming builds the layer's other MoE form (a draft of as many blocks as a step takes).
    forms = {variant[1] for variant in functions["after"]._variants if variant[0] == index}
    SpeculativeDrafter(module, engines[1]).warm_compiled()
    assert {variant[1] for variant in functions["after"]._variants if variant[0] == index} == {True, False} != forms
