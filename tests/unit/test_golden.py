"""The reference forward against the released implementation's golden outputs.

tests/golden/A holds a tiny random V4.1 checkpoint and what Hugging Face's
``deepseek_v41`` (fp32, CPU) computed for three prompts. Tolerances are those of
tests/golden/README.md: logits to ~1e-5 except around a rare flipped discrete
decision, indexer picks and greedy tokens exactly.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def reference_runs(golden_model, golden_hasher, golden_dir):
    """Full-sequence logits and indexer memory for each golden prompt + continuation."""
    from model import transformer

    _, model = golden_model
    generation = json.loads((golden_dir / "generation.json").read_text())["results"]
    runs = []
    for result in generation:
        ids = torch.tensor([result["full_sequence"][:-1]])
        engram_ids, _ = golden_hasher.hash_ids(ids)
        memories = []
        original = transformer.SequenceMemory
        transformer.SequenceMemory = lambda: memories.append(original()) or memories[-1]
        try:
            logits = model(ids, engram_ids)[0]
        finally:
            transformer.SequenceMemory = original
        runs.append((result, logits, memories[0]))
    return runs


def _allowed_flip_rows(diff: torch.Tensor) -> torch.Tensor:
    return (diff.amax(-1) > 1e-5).nonzero().flatten()


def test_prompt_logits_match_reference(reference_runs, golden_dir):
    expected = load_file(golden_dir / "logits.safetensors")
    for i, (result, logits, _) in enumerate(reference_runs):
        ref = expected[f"logits_p{i}"]
        diff = (logits[: ref.shape[0]] - ref).abs()
        off = _allowed_flip_rows(diff)
        # p2 holds two FP8 window-KV roundings that flip under 1e-6 of noise
        # (meta.json: fakequant_flips_under_1e-6_noise); whether they flip depends on the
        # CPU's float order: 0 rows on one AMD host, 24 and 37 rows (positions 48-84,
        # max 3.9e-4) on others. Its effect stays local.
        assert len(off) <= (48 if i == 2 else 0), f"prompt {i}: rows {off.tolist()} differ"
        assert diff.max() < (1e-3 if len(off) else 1e-5)


def test_greedy_continuations_match_reference(reference_runs, golden_dir):
    step_logits = load_file(golden_dir / "generation_step_logits.safetensors")
    for i, (result, logits, _) in enumerate(reference_runs):
        n = result["prompt_len"]
        predicted = logits[n - 1 :].argmax(-1).tolist()
        assert predicted == result["new_tokens"], f"prompt {i}"
        steps = step_logits[f"gen_step_logits_p{i}"]
        assert (logits[n - 1 :] - steps).abs().max() < 1e-3


def test_indexer_selections_match_reference(reference_runs, golden_dir):
    selections = load_file(golden_dir / "indexer_selections.safetensors")
    for i, (result, _, memory) in enumerate(reference_runs):
        n = result["prompt_len"]
        for layer, picks in memory.picks.items():
            ref = selections[f"p{i}.layer{layer}.topk_indices"]
            mine = [sorted(row.nonzero().flatten().tolist()) for row in picks[0, :n]]
            theirs = [sorted(x for x in row.tolist() if x >= 0) for row in ref]
            assert mine == theirs, f"prompt {i} layer {layer}"
        candidates = selections[f"p{i}.layer5.candidate_mask"].bool()
        assert torch.equal(memory.candidates[0, :n, : candidates.shape[1]], candidates)


def test_engram_rows_match_reference(golden_hasher, golden_prompts, golden_dir):
    expected = load_file(golden_dir / "engram_hash_ids.safetensors")
    for i, prompt in enumerate(golden_prompts):
        ids, _ = golden_hasher.hash_ids(torch.tensor([prompt]))
        for k, layer in enumerate((1, 3)):
            assert torch.equal(ids[0, :, k], expected[f"p{i}.engram{k}.layer{layer}"])


def test_hidden_states_match_reference(golden_model, golden_hasher, golden_prompts, golden_dir):
    """Prompt 0: the embedding, each layer's normed attention input, the final norm output."""
    _, model = golden_model
    states = load_file(golden_dir / "hidden_states_p0.safetensors")
    captured = []
    hooks = [block.attn_norm.register_forward_hook(lambda m, i, o: captured.append(o[0])) for block in model.layers]
    hooks.append(model.norm.register_forward_hook(lambda m, i, o: captured.append(o[0])))
    ids = torch.tensor([golden_prompts[0]])
    try:
        model(ids, golden_hasher.hash_ids(ids)[0])
    finally:
        for hook in hooks:
            hook.remove()
    ours = [model.embed(ids)[0]] + captured[:-2] + captured[-1:]  # the file skips the last layer's input
    assert len(ours) == len(states)
    for i, mine in enumerate(ours):
        assert (mine - states[f"hidden_states_p0.{i}"]).abs().max() < 1e-5, f"hidden state {i}"


def test_the_training_forward_matches_the_released_logits(golden_model, golden_hasher, golden_dir):
    """The third path of the block loop (straight-through, gathered attention) against
    the released implementation's logits, at the tolerance of the reference path."""
    from model import training

    _, model = golden_model
    expected = load_file(golden_dir / "logits.safetensors")
    generation = json.loads((golden_dir / "generation.json").read_text())["results"]
    for i, result in enumerate(generation):
        ref = expected[f"logits_p{i}"]
        ids = torch.tensor([result["full_sequence"][: ref.shape[0]]])
        with torch.no_grad():  # the golden weights are float: no weight rounding, as the reference
            out = training.train_forward(model, ids, golden_hasher.hash_ids(ids)[0], quantize_weights=False)
        logits = out.logits[0]
        diff = (logits - ref).abs()
        off = _allowed_flip_rows(diff)
        assert len(off) <= (48 if i == 2 else 0), f"prompt {i}: rows {off.tolist()} differ"
        assert diff.max() < (1e-3 if len(off) else 1e-5)
