"""Shared fixtures: the golden checkpoint and its reference outputs (tests/golden/A)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

# The models under test are tiny: one intra-op thread is faster than two, and it does not
# collapse when the suite's Ray workers share the two cores (OpenMP threads spin).
torch.set_num_threads(1)

GOLDEN = Path(__file__).parent / "golden" / "A"


@pytest.fixture(scope="session")
def golden_dir() -> Path:
    return GOLDEN


@pytest.fixture(scope="session")
def golden_model():
    from model.loader import load_model

    return load_model(GOLDEN)


@pytest.fixture(scope="session")
def golden_hasher(golden_model):
    from tokenizers import Tokenizer

    from model.engram import EngramLayout, NgramHasher

    config, _ = golden_model
    tokenizer = Tokenizer.from_file(str(GOLDEN / "tokenizer.json"))
    return NgramHasher.from_tokenizer(EngramLayout.from_config(config.text), tokenizer)


@pytest.fixture(scope="session")
def golden_prompts() -> list[list[int]]:
    return [p["input_ids"] for p in json.loads((GOLDEN / "inputs.json").read_text())["prompts"]]


@pytest.fixture(scope="session")
def tiny_backbone():
    """configs/tiny (every mechanism) with random weights: (text config, model, hasher)."""
    from model.config import ModelConfig
    from model.engram import EngramLayout, NgramHasher
    from model.loader import load_tokenizer
    from model.transformer import Transformer

    config = ModelConfig.load("configs/tiny").text
    model = Transformer(config).init_weights(seed=3, std=0.08).eval()
    hasher = NgramHasher.from_tokenizer(EngramLayout.from_config(config), load_tokenizer("configs/tiny"))
    return config, model, hasher
