"""`v41 params` and `v41 forward`: the released model's accounting, reference logits, errors."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from cluster.cli import main
from model.runtime.cache import SequenceCache
from model.config import ModelConfig
from model.engram import EngramLayout

pytestmark = pytest.mark.unit

FULL = "configs/deepseek-v4.1-flash"


@pytest.fixture(scope="module")
def full_report():
    out = subprocess.run([sys.executable, "-m", "cluster.cli", "params", FULL, "--parallel", "experts=8", "--json"],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.e2e
@pytest.mark.slow
def test_released_model_accounting(full_report):
    r = full_report
    assert abs(r["total"] / 763e9 - 1) < 0.01
    assert abs(r["backbone"] / 552e9 - 1) < 0.01
    text = ModelConfig.load(FULL).text
    assert r["engram"] == sum(text.engram_num_embeddings) * text.engram_head_dim == 196_613_849_600
    assert 15e9 <= r["active_per_output_token"] <= 17e9
    assert 7e9 <= r["active_per_prompt_token"] <= 9e9
    assert abs(r["checkpoint_bytes"] / 511e9 - 1) < 0.03
    assert r["kv_bytes_per_token"] == 890
    assert 13e9 < r["categories"]["drafter"] + r["categories"]["vision"] < 15e9


@pytest.mark.e2e
@pytest.mark.slow
def test_released_model_split_over_eight_devices(full_report):
    """`--parallel experts=8`: the decoder replica's bytes per worker, against the
    formats' arithmetic."""
    from cluster.cli.params import extra_modules
    from model import formats
    from model.accounting import _stored_bytes

    split = full_report["parallel"]
    text = ModelConfig.load(FULL).text
    # Each worker: 48 of 384 experts of 40 layers, three 5120x2304 matrices each, FP4
    # codes (half a byte) with a UE8M0 scale per 32 values.
    experts = text.num_hidden_layers * (text.n_routed_experts // 8) * 3 * text.hidden_size * text.moe_intermediate_size
    assert experts == 67_947_724_800
    assert len(split["worker_bytes"]) == 8 and split["worker_bytes"][1:] == [experts * 17 // 32] * 7
    # All of it: the checkpoint less the Engram tables (the table service's) and the
    # vision tower (the prefill pool's).
    vision = sum(_stored_bytes(name, p.shape)
                 for name, p in extra_modules(ModelConfig.load(FULL))["vision"].named_parameters())
    engram = formats.ENGRAM_ROW.nbytes(full_report["engram"])
    assert sum(split["worker_bytes"]) == split["pool_bytes"] == full_report["checkpoint_bytes"] - engram - vision
    # The lead (attention, 1/8 of the experts, the drafter) leaves 80+ GB of an H200 for caches.
    assert split["fits"] and split["free_bytes"][0] > 80e9 and split["device_bytes"] == 141e9
    assert split["lead_cache_tokens"] == split["free_bytes"][0] // 890
    assert split["bytes_per_token"]["back"] == 40 * 6 * 7 / 8 * 5120 * 2  # BF16 states of remote (token, expert) pairs


def test_released_engram_layout_and_cache_bytes():
    text = ModelConfig.load(FULL).text
    layout = EngramLayout.from_config(text)
    assert [sum(p for per in layer for p in per) for layer in layout.primes] == [384006168, 384016682]
    # Allocating the long-range caches of N tokens (no weights) gives 890 B per token.
    n = 4096
    cache = SequenceCache.empty(text)
    for plan in text.layer_plans():
        if plan.is_kv_source:
            for rows in (cache.entries[plan.index], cache.keys[plan.index]):
                rows.append_bytes(torch.zeros(n // plan.compress_ratio, rows.row_bytes, dtype=torch.uint8))
    assert cache.long_range_bytes() == 890 * n


def test_forward_command_writes_reference_logits(tmp_path, golden_dir, golden_prompts):
    ids = tmp_path / "ids.json"
    ids.write_text(json.dumps(golden_prompts[:2]))
    out = tmp_path / "logits.safetensors"
    assert main(["forward", str(golden_dir), "--ids", str(ids), "--out", str(out)]) == 0
    logits = load_file(out)
    expected = load_file(golden_dir / "logits.safetensors")
    for i in range(2):
        assert (logits[f"logits_{i}"] - expected[f"logits_p{i}"]).abs().max() < 1e-5


@pytest.mark.parametrize("content", ["not json", "[]", "[[1, 2], []]", "[[1, 99999]]", '{"a": 1}'])
def test_forward_command_rejects_bad_ids(tmp_path, golden_dir, capsys, content):
    ids = tmp_path / "ids.json"
    ids.write_text(content)
    out = tmp_path / "logits.safetensors"
    assert main(["forward", str(golden_dir), "--ids", str(ids), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("v41 forward: error:") and len(err.splitlines()) == 1
    assert not out.exists()


def test_params_command_reports_a_missing_config(tmp_path, capsys):
    assert main(["params", str(tmp_path)]) == 2
    assert "no config.json" in capsys.readouterr().err


def test_generate_command_reproduces_golden_greedy(tmp_path, golden_dir, capsys):
    results = json.loads((golden_dir / "generation.json").read_text())["results"]
    ids = tmp_path / "ids.json"
    ids.write_text(json.dumps([r["full_sequence"][: r["prompt_len"]] for r in results]))
    code = main(["generate", str(golden_dir), "--ids", str(ids), "--max-new-tokens", "20", "--greedy",
                 "--exact-replay", "--json"])
    assert code == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["tokens"] == [r["new_tokens"] for r in results]


def test_generate_command_chat_prompt_and_errors(golden_dir, capsys):
    assert main(["generate", str(golden_dir), "--prompt", "def f(x):", "--max-new-tokens", "5", "--seed", "3",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert len(out["tokens"][0]) <= 5 and isinstance(out["text"][0], str)
    assert main(["generate", str(golden_dir), "--prompt", "x", "--temperature", "-1"]) == 2
    assert "temperature" in capsys.readouterr().err
