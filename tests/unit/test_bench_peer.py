"""`v41 bench peer`: v41's side generates what the reference generated (the golden
checkpoint's recorded greedy continuations), and without an importable reference the
bench says so and reports v41's side alone."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from cluster.bench.peer import _agreement, float_copy, needs_float_copy, prompt_ids, reference_missing, run_v41
from model.config import ModelConfig

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = ROOT / "tests" / "golden" / "A"
SMALL = ROOT / "configs" / "small"


def test_v41_side_generates_the_references_greedy_tokens():
    prompts = json.loads((GOLDEN / "inputs.json").read_text())["prompts"]
    results = json.loads((GOLDEN / "generation.json").read_text())["results"]
    expected = {r["prompt_index"]: r["new_tokens"] for r in results}
    for index in (0, 2):
        out = run_v41(GOLDEN, prompts[index]["input_ids"], len(expected[index]), compiled=False)
        assert out["tokens"] == expected[index]
        assert out["prefill_s"] > 0 and out["decode_tokens_per_s"] > 0
        assert out["peak_rss_mb"] >= out["rise_rss_mb"] >= 0


def test_a_quantised_checkpoint_is_run_as_a_float_copy_of_the_same_weights(tmp_path):
    """configs/small (FP8/FP4, the composite layout) becomes the flat float32 text
    layout the reference loads: every parameter the value v41's loader reads from the
    original, the same greedy tokens from v41's engine on either."""
    from model.loader import load_checkpoint

    assert needs_float_copy(SMALL) and not needs_float_copy(GOLDEN)
    copy = float_copy(SMALL, tmp_path / "float")
    raw = json.loads((copy / "config.json").read_text())
    assert raw["model_type"] == "deepseek_v41_text" and "quantization_config" not in raw and "text_config" not in raw
    assert not needs_float_copy(copy)
    with safe_open(copy / "model.safetensors", "pt") as weights:  # (transformers maps every name but the head's)
        names = set(weights.keys())
    assert "lm_head.weight" in names and all(name.startswith("model.") for name in names - {"lm_head.weight"})
    original, floats = load_checkpoint(SMALL, vision=False), load_checkpoint(copy)
    assert floats.vision is None and floats.drafter is not None
    for part in ("backbone", "drafter"):
        want, got = getattr(original, part).state_dict(), getattr(floats, part).state_dict()
        assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want), part
    ids = prompt_ids(ModelConfig.load(SMALL), 40, seed=1)
    assert run_v41(copy, ids, 8, compiled=False)["tokens"] == run_v41(SMALL, ids, 8, compiled=False)["tokens"]


def test_prompts_are_seeded_ordinary_tokens():
    config = ModelConfig.load(GOLDEN)
    ids = prompt_ids(config, 300, seed=4)
    assert len(ids) == 300 and ids[0] == config.text.bos_token_id
    assert not {config.text.bos_token_id, config.text.eos_token_id, config.text.pad_token_id} & set(ids[1:])
    assert all(0 <= i < config.text.vocab_size for i in ids)
    assert ids == prompt_ids(config, 300, seed=4) and ids != prompt_ids(config, 300, seed=5)


def test_agreement_is_the_common_prefix():
    assert _agreement([1, 2, 3, 4], [1, 2, 3, 4]) == 1.0
    assert _agreement([1, 2, 9, 4], [1, 2, 3, 4]) == 0.5
    assert _agreement([1, 2], [1, 2, 3, 4]) == 0.5  # one side stopped at EOS


def _bench(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cluster.cli", "bench", "peer", "--checkpoint", str(GOLDEN), *argv],
                          cwd=ROOT, capture_output=True, text=True, timeout=600, check=False)


@pytest.mark.slow
@pytest.mark.e2e
def test_the_bench_runs_each_side_in_its_own_process():
    done = _bench("--lengths", "24,40", "--new-tokens", "3", "--pairs", "1", "--exact-replay", "--json")
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["step"] == "compiled" and result["exact_replay"] and not result["float_copy"]
    missing = reference_missing()
    assert result["reference_missing"] == missing
    assert set(result["lengths"]) == {"24", "40"}
    for entry in result["lengths"].values():
        assert entry["v41"]["decode_tokens_per_s"] > 0 and entry["v41"]["peak_rss_mb"] > 0
    if missing is None:  # the reference is installed: every ratio is there
        assert result["decode_over_reference_batch1"] > 0
        assert all(0 <= e["greedy_agreement"] <= 1 for e in result["lengths"].values())
    else:
        assert f"reference: skipped: {missing}" in done.stdout
        assert result["decode_over_reference_batch1"] is None


@pytest.mark.e2e
def test_bad_arguments_are_one_line():
    done = _bench("--lengths", "5")
    assert done.returncode == 2 and "--lengths must be at least 17" in done.stderr
    done = _bench("--lengths", "a,b")
    assert done.returncode == 2 and "invalid literal" in done.stderr
