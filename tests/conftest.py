"""Shared fixtures: the golden checkpoint and its reference outputs (tests/golden/A), and
the session's Serve runtime (tests/serve_harness.py), closed after the last test in a
row that uses it (tests/layers.py runs those tests together)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from tests.layers import SHARING

# The models under test are tiny: one intra-op thread is faster than two, and it does not
# collapse when the suite's Ray workers share the two cores (OpenMP threads spin).
torch.set_num_threads(1)
# A ray.init without an address starts this run's own instance (here and in the commands
# the tests start): by default Ray would join the cluster another process on this
# machine last wrote down in /tmp/ray (a `ray start`, a test's Cluster).
os.environ.setdefault("RAY_ADDRESS", "local")

GOLDEN = Path(__file__).parent / "golden" / "A"

pytest_plugins = ["tests.layers"]  # the layer marks, checked, and the run order
RUNTIME = pytest.StashKey["ServeRuntime"]()  # session.stash: the serve_runtime fixture's


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """``-n auto``: a worker per core, at most four (each may run a Ray instance and a
    Serve app of its own)."""
    return max(1, min(4, len(os.sched_getaffinity(0))))


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


@pytest.fixture(scope="session")
def serve_runtime(request: pytest.FixtureRequest):
    """One Ray instance, Serve controller and Redis for the apps of consecutive tests
    (``with serve_runtime.app(tmp_path, **args) as (url, supervisor)``)."""
    from tests.serve_harness import ServeRuntime

    runtime = request.session.stash[RUNTIME] = ServeRuntime()
    yield runtime
    runtime.close()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None):
    """After the module fixtures' teardown (their apps removed): the runtime stops with
    the last of the modules in a row that use it, before a module that may start a Ray
    instance of its own."""
    result = yield
    runtime = item.session.stash.get(RUNTIME, None)
    last = nextitem is None or nextitem.getparent(pytest.Module) not in item.config.stash[SHARING]
    if runtime is not None and last:
        runtime.close()
    return result


@pytest.fixture
def tensor_reads(monkeypatch) -> list[str]:
    """The names of the tensors the loader reads from checkpoint files from now on, in order
    (``model.loader.read_tensors`` recorded)."""
    from model import loader

    read: list[str] = []
    real = loader.read_tensors

    def recording(path, keep=None):
        for name, tensor in real(path, keep):
            read.append(name)
            yield name, tensor

    monkeypatch.setattr(loader, "read_tensors", recording)
    return read
