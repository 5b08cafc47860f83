"""Engram: token map, hash layout, n-gram hashing and the gate, against the golden
checkpoint in tests/golden/A (reference: transformers deepseek_v41 @ 0a2080b43eb6)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from model.engram import DEAD, EngramLayout, NgramContext, NgramHasher, build_token_map
from model.engram_gate import EngramGate
from model.engram_primes import _is_prime, multiplier_bound

pytestmark = pytest.mark.unit

GOLDEN = Path(__file__).parents[1] / "golden" / "A"

FULL_CONFIG = dict(
    engram_layer_ids=[1, 14],
    engram_vocab_size=16_000_000,
    engram_max_ngram_size=4,
    engram_n_heads=8,
    engram_head_dim=256,
    engram_num_embeddings=[384006168, 384016682],
    engram_compressed_vocab_size=99092,
    engram_pad_id=2,
)


@pytest.fixture(scope="module")
def config() -> dict:
    return json.loads((GOLDEN / "config.json").read_text())


@pytest.fixture(scope="module")
def golden_engram() -> dict:
    return json.loads((GOLDEN / "engram.json").read_text())


@pytest.fixture(scope="module")
def prompts() -> list[dict]:
    return json.loads((GOLDEN / "inputs.json").read_text())["prompts"]


@pytest.fixture(scope="module")
def token_map() -> tuple[list[int], int]:
    from tokenizers import Tokenizer

    return build_token_map(Tokenizer.from_file(str(GOLDEN / "tokenizer.json")))


@pytest.fixture(scope="module")
def layout(config) -> EngramLayout:
    # An attribute object, as the model config will be.
    return EngramLayout.from_config(SimpleNamespace(**config))


@pytest.fixture(scope="module")
def hasher(layout, token_map) -> NgramHasher:
    return NgramHasher(layout, token_map[0])


def naive_row_ids(layout: EngramLayout, compressed: list[int], pad: int, layer: int, pos: int) -> list[int]:
    """Row ids of one position, straight from the definition (DEAD = image/start)."""
    look = []
    blocked = False
    for k in range(layout.max_ngram_size):
        src = pos - k
        blocked = blocked or src < 0 or compressed[src] == DEAD
        look.append(pad if blocked else compressed[src])
    out = []
    running = look[0] * layout.multipliers[layer][0]
    for n in range(2, layout.max_ngram_size + 1):
        running ^= look[n - 1] * layout.multipliers[layer][n - 1]
        for h, p in enumerate(layout.primes[layer][n - 2]):
            out.append(running % p + layout.offsets[layer][(n - 2) * layout.n_heads + h])
    return out


# ------------------------------------------------------------------ token map / layout


def test_token_map_matches_golden(token_map, golden_engram):
    lookup, size = token_map
    assert size == golden_engram["engram_compressed_vocab_size"] == 1464
    assert len(lookup) == golden_engram["token_map_len"]
    assert lookup == golden_engram["token_map"]
    assert lookup[golden_engram["pad_id_raw"]] == golden_engram["pad_id_compressed"]


def test_token_map_normalisation_rules():
    from tokenizers import Tokenizer, models

    words = ["<unk>", "Café", "cafe", "CAFE", " the", "The", "\ufb01", "fi", " ", "  ", "\t\n", "x",
             "a\u00a0b", "a b", "\u00c5ngstr\u00f6m", "angstrom"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    lookup, size = build_token_map(tok)
    # accents, case, NFKC ligatures and no-break spaces merge; whitespace-only tokens
    # collapse to the single-space token instead of vanishing
    assert lookup == [0, 1, 1, 1, 2, 2, 3, 3, 4, 4, 4, 5, 6, 6, 7, 7]
    assert size == 8


def test_layout_matches_golden(layout, hasher, golden_engram):
    assert [[list(per) for per in layer] for layer in layout.primes] == golden_engram["primes"]
    assert [list(row) for row in layout.offsets] == golden_engram["offsets"]
    assert [list(row) for row in layout.multipliers] == golden_engram["multipliers"]
    assert list(layout.num_embeddings) == golden_engram["engram_num_embeddings"]
    assert hasher.pad_id == golden_engram["pad_id_compressed"]
    assert layout.n_cols == 6


def test_layout_accepts_mapping_and_nested_text_config(config, layout):
    assert EngramLayout.from_config(config) == layout
    assert EngramLayout.from_config({"text_config": config}) == layout


def test_full_config_prime_sums():
    layout = EngramLayout.from_config(SimpleNamespace(**FULL_CONFIG))
    sums = [sum(p for per in layer for p in per) for layer in layout.primes]
    assert sums == [384006168, 384016682]
    flat = [p for layer in layout.primes for per in layer for p in per]
    assert len(flat) == len(set(flat)) == 2 * 3 * 8
    assert all(p >= 16_000_000 for p in flat)
    assert layout.offsets[1][-1] + layout.primes[1][-1][-1] == 384016682


def test_full_config_multipliers_odd_and_bounded():
    layout = EngramLayout.from_config(SimpleNamespace(**FULL_CONFIG))
    bound = (np.iinfo(np.int64).max // 99092) // 2
    assert multiplier_bound(99092) == bound
    for layer_id, row in zip(layout.layer_ids, layout.multipliers):
        assert len(row) == 4
        expected = np.random.default_rng(10007 * layer_id).integers(0, bound, size=(4,), dtype=np.int64)
        assert list(row) == [int(v) * 2 + 1 for v in expected]
        for m in row:
            assert m % 2 == 1
            assert 0 < (m - 1) // 2 < bound
            assert (99092 - 1) * m <= np.iinfo(np.int64).max


def test_wrong_num_embeddings_is_a_clear_error():
    bad = dict(FULL_CONFIG, engram_num_embeddings=[384006168, 384016683])
    with pytest.raises(ValueError, match="sum to 384016682"):
        EngramLayout.from_config(SimpleNamespace(**bad))
    with pytest.raises(ValueError, match="entries"):
        EngramLayout.from_config(SimpleNamespace(**dict(FULL_CONFIG, engram_num_embeddings=[384006168])))


def test_miller_rabin_agrees_with_sympy():
    import sympy  # a dependency of torch
    for n in list(range(0, 5000)) + list(range(15_999_000, 16_001_000)):
        assert _is_prime(n) == bool(sympy.isprime(n)), n


def test_hasher_rejects_wrong_compressed_vocab(layout, token_map):
    lookup = list(token_map[0])
    lookup[-1] = max(lookup) + 1
    with pytest.raises(ValueError, match="engram_compressed_vocab_size"):
        NgramHasher(layout, lookup)


# ------------------------------------------------------------------ hashing


def test_hash_ids_match_golden(hasher, prompts):
    golden = load_file(str(GOLDEN / "engram_hash_ids.safetensors"))
    assert len(prompts) == 3
    for prompt in prompts:
        i = prompt["index"]
        ids = torch.tensor(prompt["input_ids"]).unsqueeze(0)
        rows, ctx = hasher.hash_ids(ids)
        assert rows.shape == (1, prompt["len"], 2, 6) and rows.dtype == torch.long
        for l, layer_id in enumerate((1, 3)):
            expected = golden[f"p{i}.engram{l}.layer{layer_id}"]
            assert torch.equal(rows[0, :, l], expected), (i, layer_id)
        # the context holds the last N-1 compressed ids
        assert ctx.tail[0].tolist() == hasher.compress(ids[0, -3:]).tolist()


def test_hash_ids_match_naive_definition(hasher, layout, prompts):
    ids = torch.tensor(prompts[0]["input_ids"])
    compressed = hasher.compress(ids).tolist()
    rows, _ = hasher.hash_ids(ids)  # 1-D input: no batch dim
    assert rows.shape == (len(ids), 2, 6)
    for pos in range(len(ids)):
        for l in range(2):
            assert rows[pos, l].tolist() == naive_row_ids(layout, compressed, hasher.pad_id, l, pos)


def test_batched_rows_are_independent(hasher, prompts):
    a = torch.tensor(prompts[1]["input_ids"][:40])
    b = torch.tensor(prompts[2]["input_ids"][:40])
    both, _ = hasher.hash_ids(torch.stack([a, b]))
    assert torch.equal(both[0], hasher.hash_ids(a)[0])
    assert torch.equal(both[1], hasher.hash_ids(b)[0])


@pytest.mark.parametrize("split", [1, 2, 3, 17, 149])
def test_incremental_two_parts(hasher, prompts, split):
    ids = torch.tensor(prompts[1]["input_ids"]).unsqueeze(0)
    full, full_ctx = hasher.hash_ids(ids)
    first, ctx = hasher.hash_ids(ids[:, :split])
    second, ctx2 = hasher.hash_ids(ids[:, split:], ctx)
    assert torch.equal(torch.cat([first, second], dim=1), full)
    assert torch.equal(ctx2.tail, full_ctx.tail)


def test_incremental_one_token_at_a_time(hasher, prompts):
    ids = torch.tensor(prompts[0]["input_ids"]).unsqueeze(0)
    mask = torch.ones_like(ids, dtype=torch.bool)
    mask[0, 10:13] = False
    full, _ = hasher.hash_ids(ids, token_mask=mask)
    ctx = hasher.empty_context(1)
    before = ctx.tail.clone()
    steps = []
    for s in range(ids.shape[1]):
        out, ctx = hasher.hash_ids(ids[:, s : s + 1], ctx, token_mask=mask[:, s : s + 1])
        steps.append(out)
    assert torch.equal(torch.cat(steps, dim=1), full)
    assert torch.equal(hasher.empty_context(1).tail, before)  # contexts are values


def test_lengths_for_right_padded_batches(hasher, prompts):
    a = prompts[0]["input_ids"]
    b = prompts[1]["input_ids"][:25]
    ids = torch.full((2, len(a)), 2, dtype=torch.long)
    ids[0] = torch.tensor(a)
    ids[1, : len(b)] = torch.tensor(b)
    mask = torch.zeros_like(ids, dtype=torch.bool)
    mask[0] = True
    mask[1, : len(b)] = True
    rows, ctx = hasher.hash_ids(ids, token_mask=mask, lengths=[len(a), len(b)])
    assert torch.equal(rows[1, : len(b)], hasher.hash_ids(torch.tensor(b))[0])
    nxt = torch.tensor([[a[5]], [b[5]]])
    step, _ = hasher.hash_ids(nxt, ctx)
    assert torch.equal(step[0, 0], hasher.hash_ids(torch.tensor(a + [a[5]]))[0][-1])
    assert torch.equal(step[1, 0], hasher.hash_ids(torch.tensor(b + [b[5]]))[0][-1])
    # context selection / concatenation round-trips
    assert torch.equal(NgramContext.cat([ctx.select(1), ctx.select(0)]).tail, ctx.tail.flip(0))


def test_image_tokens_and_their_followers_use_pad(hasher, layout, prompts):
    ids = torch.tensor(prompts[1]["input_ids"][:60])
    start, end = 20, 29  # an "image span" of 9 tokens
    mask = torch.ones_like(ids, dtype=torch.bool)
    mask[start:end] = False
    rows, _ = hasher.hash_ids(ids, token_mask=mask)
    pad = hasher.pad_id
    compressed = hasher.compress(ids, mask).tolist()
    assert compressed[start:end] == [DEAD] * (end - start)

    # the ids under the mask do not matter
    scrambled = ids.clone()
    scrambled[start:end] = torch.arange(100, 100 + end - start)
    assert torch.equal(hasher.hash_ids(scrambled, token_mask=mask)[0], rows)

    # a masked position is the all-pad n-gram, identical to the first slot at the
    # start of a text whose first token is the pad token
    all_pad = [naive_row_ids(layout, [pad], pad, l, 0) for l in range(2)]
    for pos in range(start, end):
        assert rows[pos].tolist() == all_pad
    # the N-1 positions after the span see pad in place of the image tokens
    for pos in range(end, end + layout.max_ngram_size - 1):
        live = pos - end + 1  # real tokens available, the current one included
        look = [compressed[pos - k] for k in range(live)] + [pad] * (layout.max_ngram_size - live)
        for l in range(2):
            assert rows[pos, l].tolist() == naive_row_ids(layout, look[::-1], pad, l, layout.max_ngram_size - 1)
    # ... and from then on the span is out of reach
    unmasked, _ = hasher.hash_ids(ids)
    assert torch.equal(rows[end + 3 :], unmasked[end + 3 :])
    assert torch.equal(rows[:start], unmasked[:start])
    assert not torch.equal(rows[end : end + 3], unmasked[end : end + 3])


def test_start_of_text_uses_pad(hasher, layout, prompts):
    ids = torch.tensor(prompts[2]["input_ids"][:5])
    rows, _ = hasher.hash_ids(ids)
    pad = hasher.pad_id
    c = hasher.compress(ids).tolist()
    # position 1: the 2-gram is (c0, c1); 3- and 4-grams are padded on the left
    look = [pad, pad, c[0], c[1]]
    for l in range(2):
        assert rows[1, l].tolist() == naive_row_ids(layout, look, pad, l, 3)


# ------------------------------------------------------------------ gate


@pytest.fixture(scope="module")
def golden_gate(config) -> tuple[EngramGate, dict]:
    prefix = "model.layers.1.engram."
    with safe_open(str(GOLDEN / "model.safetensors"), "pt") as f:
        tensors = {k[len(prefix) :]: f.get_tensor(k) for k in f.keys() if k.startswith(prefix)}
    gate = EngramGate.from_config(SimpleNamespace(**config), layer_id=1)
    gate.load_state_dict(tensors, strict=True)
    return gate.eval(), tensors


def test_gate_parameter_names_and_shapes(golden_gate):
    gate, tensors = golden_gate
    shapes = {k: tuple(v.shape) for k, v in tensors.items()}
    assert shapes == {
        "embed.weight": (12126, 32),
        "embed.scale": (12126, 1),
        "wkv.weight": (640, 192),
        "q_weight": (4, 128),
        "k_weight": (4, 128),
    }
    assert {k: tuple(v.shape) for k, v in gate.state_dict().items()} == shapes


def _streams(seq: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, seq, 4, 128, generator=g)


def test_gate_closed_leaves_streams_unchanged(golden_gate, hasher, prompts):
    gate, _ = golden_gate
    ids = torch.tensor(prompts[0]["input_ids"]).unsqueeze(0)
    row_ids = hasher.hash_ids(ids)[0][:, :, 0]
    h = _streams(ids.shape[1])
    with torch.no_grad():
        closed = gate(h, gate.lookup(row_ids), torch.zeros_like(ids, dtype=torch.bool))
        half = torch.ones_like(ids, dtype=torch.bool)
        half[0, ::2] = False
        mixed = gate(h, row_ids, half)
    assert torch.equal(closed, h)
    assert torch.equal(mixed[0, ::2], h[0, ::2])
    assert not torch.allclose(mixed[0, 1::2], h[0, 1::2])


def test_gate_matches_explicit_formula(golden_gate, hasher, prompts, config):
    gate, t = golden_gate
    ids = torch.tensor(prompts[1]["input_ids"][:12]).unsqueeze(0)
    row_ids = hasher.hash_ids(ids)[0][:, :, 0]
    rows = gate.lookup(row_ids)
    assert rows.shape == (1, 12, 6, 32) and rows.dtype == torch.float32
    assert torch.equal(rows[0, 3, 4], t["embed.weight"][row_ids[0, 3, 4]])
    h = _streams(12, seed=1)
    with torch.no_grad():
        out = gate(h, rows)
        assert torch.equal(gate(h, row_ids), out)  # ids are looked up inside

    d, eps = 128, config["rms_norm_eps"]
    w = (t["q_weight"] * t["k_weight"]).double()
    for s in range(12):
        kv = t["wkv.weight"].double() @ rows[0, s].reshape(-1).double()
        keys, value = kv[: 4 * d].view(4, d), kv[4 * d :]
        for c in range(4):
            x = h[0, s, c].double()
            dot = (x * w[c] * keys[c]).sum() / (x.pow(2).mean() + eps).sqrt() / (keys[c].pow(2).mean() + eps).sqrt()
            dot = dot / d**0.5
            g = torch.sigmoid(torch.sign(dot) * dot.abs().clamp_min(1e-6).sqrt())
            torch.testing.assert_close(out[0, s, c].double(), x + g * value, rtol=1e-5, atol=1e-5)


def test_gate_dequantises_fp8_rows(golden_gate):
    gate, t = golden_gate
    ref = EngramGate(num_embeddings=16, head_dim=64, n_cols=6, hidden_size=128, hc_mult=4, eps=1e-20)
    ref.embed.weight.data = t["embed.weight"][:16].repeat(1, 2) * 8.0  # well inside E4M3 range
    q = EngramGate(num_embeddings=16, head_dim=64, n_cols=6, hidden_size=128, hc_mult=4, eps=1e-20)
    assert q.embed.scale.shape == (16, 2)
    scale = torch.tensor([[0.125, 0.5]]).repeat(16, 1)
    fp8 = (ref.embed.weight.data.view(16, 2, 32) / scale.unsqueeze(-1)).view(16, 64).to(torch.float8_e4m3fn)
    q.embed.weight = torch.nn.Parameter(fp8, requires_grad=False)
    q.embed.scale.data = scale
    ids = torch.tensor([[[0, 5, 9, 15, 3, 3]]])
    expected = (fp8.float().view(16, 2, 32) * scale.unsqueeze(-1)).view(16, 64)[ids]
    got = q.lookup(ids)
    assert got.dtype == torch.float32 and torch.equal(got, expected)
    torch.testing.assert_close(got, ref.lookup(ids), rtol=0.07, atol=2e-3)
