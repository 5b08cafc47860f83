"""The training math (model/training/__init__.py) and a smoke run of `v41 train-small`.

The differentiable forward must equal the reference forward of the quantised
checkpoint, keep the indexer's loss and the LM loss apart, and apply the bounded
replays' window cuts only where they belong; a few training steps must lower the loss;
the smoke run's checkpoint must load through the released-format loader and agree with
the model that was trained.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from model import formats, training
from model.config import ModelConfig
from model.engram import EngramLayout, NgramHasher
from model.training.loop import lr_factor
from model.transformer import SequenceMemory, Transformer

pytestmark = pytest.mark.unit

TINY = Path(__file__).parents[2] / "configs" / "tiny"


@pytest.fixture(scope="module")
def tiny():
    from tokenizers import Tokenizer

    config = ModelConfig.load(TINY).text
    model = Transformer(config).init_weights(seed=1, std=0.05)
    with torch.no_grad():  # the values a saved checkpoint holds
        params = dict(model.named_parameters())
        for name in training.quantised_weight_names(model):
            params[name].copy_(training.fake_quant_weight(name, params[name]))
        for block in model.layers:
            if block.engram is not None:
                block.engram.embed.weight.copy_(formats.ENGRAM_ROW.fake_quant(block.engram.embed.weight))
    hasher = NgramHasher.from_tokenizer(EngramLayout.from_config(config), Tokenizer.from_file(str(TINY / "tokenizer.json")))
    ids = torch.randint(3, config.vocab_size - 1, (2, 120), generator=torch.Generator().manual_seed(0))
    return config, model, hasher, ids, hasher.hash_ids(ids)[0]


def test_attention_of_every_layer_mode_matches_the_reference(tiny):
    """Window-only, Full, Reuse, Reindex (with the candidate pool): the gathered,
    differentiable attention equals the reference's dense masked attention."""
    config, model, _, ids, _ = tiny
    x = torch.randn(2, ids.shape[1], config.hidden_size, generator=torch.Generator().manual_seed(1))
    positions = torch.arange(ids.shape[1]).expand_as(ids)
    reference, memory = SequenceMemory(), {}
    no_replay = torch.full((2,), ids.shape[1])
    modes = set()
    with torch.no_grad():
        for block in model.layers:
            expected = model.attention_reference(block.attn, x, positions, reference)
            got, kl = training._attention(model, block.attn, x, positions, memory, no_replay, True)
            modes.add(block.plan.mode)
            torch.testing.assert_close(got, expected, atol=2e-6, rtol=0)
            assert (kl is not None) == block.plan.runs_indexer
            if block.plan.runs_indexer:
                picks = torch.zeros_like(reference.picks[block.plan.index])
                index, valid = memory[("picks", block.plan.index)]
                picks.scatter_(-1, index, valid)
                assert torch.equal(picks, reference.picks[block.plan.index])
    assert len(modes) == 4


def test_train_forward_equals_the_reference_forward(tiny):
    _, model, _, ids, engram_ids = tiny
    expected = model(ids, engram_ids)
    got = training.train_forward(model, ids, engram_ids).logits.detach()
    diff = (got - expected).abs().amax(-1)
    # The two paths multiply in different orders, so on some CPUs an FP8/FP4 cache
    # rounding flips by one code step and the change carries to later positions
    # (bounded, but not local). The float-cache configurations of test_config_sweep
    # hold the same comparison to 1e-4.
    assert diff.max() < 0.5


def test_indexer_learns_only_from_its_loss(tiny):
    _, model, _, ids, engram_ids = tiny
    indexer = {n for n, _ in model.named_parameters() if ".indexer." in n}
    for part in ("lm", "kl"):
        model.zero_grad(set_to_none=True)
        out = training.train_forward(model, ids, engram_ids)
        (training.lm_loss(out.logits, ids) if part == "lm" else out.indexer_loss).backward()
        grads = {n: p.grad for n, p in model.named_parameters()}
        touched = {n for n, g in grads.items() if g is not None and bool(g.abs().sum() > 0)}
        if part == "lm":
            assert not touched & indexer
            assert {"embed.weight", "lm_head.weight", "layers.2.attn.compressor.wkv.weight",
                    "layers.1.engram.embed.weight", "layers.0.hc_attn_fn"} <= touched
        else:
            # wk/k_norm exist on Full layers only, wq_b/weights_proj on every indexer
            assert touched and touched <= indexer
            assert {n for n in indexer if "wq_b" in n} <= touched
    model.zero_grad(set_to_none=True)
    assert out.indexer_loss > 0 and set(out.indexer_kl) == {2, 4, 6, 8, 10}


def test_replay_cuts_only_the_windows_after_its_start(tiny):
    config, model, _, ids, engram_ids = tiny
    s = 70
    with torch.no_grad():
        plain = training.train_forward(model, ids, engram_ids).logits
        replay = training.ReplayStarts.none(2, ids.shape[1])
        replay.decoder[0] = s
        dec = training.train_forward(model, ids, engram_ids, replay).logits
        replay.encoder[1] = replay.decoder[1] = s
        both = training.train_forward(model, ids, engram_ids, replay).logits
    torch.testing.assert_close(dec[:, :s], plain[:, :s], atol=1e-5, rtol=0)
    torch.testing.assert_close(dec[1], plain[1], atol=1e-5, rtol=0)
    assert (dec[0, s:] - plain[0, s:]).abs().max() > 1e-3
    torch.testing.assert_close(both[0], dec[0], atol=1e-5, rtol=0)
    assert (both[1, s:] - plain[1, s:]).abs().max() > 1e-3


def test_a_few_steps_lower_the_loss_and_balance_the_routers(tiny):
    config, _, hasher, ids, engram_ids = tiny
    ids, engram_ids = ids[:, :64], engram_ids[:, :64]
    model = Transformer(config).init_weights(seed=2)
    optimizers = training.build_optimizers(model, lr=3e-3)
    biases = [b.ffn.gate.bias.clone() for b in model.layers]
    losses = []
    for _ in range(5):
        out = training.train_forward(model, ids, engram_ids)
        loss = training.lm_loss(out.logits, ids)
        for opt in optimizers:
            opt.zero_grad(set_to_none=True)
        (loss + out.indexer_loss).backward()
        for opt in optimizers:
            opt.step()
        training.balance_routers(model, out.loads, gamma=1e-3)
        losses.append(float(loss.detach()))
        assert sum(int(v.sum()) for v in out.loads.values()) == config.num_hidden_layers * ids.numel() * config.num_experts_per_tok
    assert losses[-1] < losses[0] - 0.3, losses
    moved = [b.ffn.gate.bias for b in model.layers]
    assert all(not torch.equal(a, b) for a, b in zip(biases, moved))
    assert all(float(b.abs().max()) <= 5e-3 + 1e-9 for b in moved)


def test_newton_schulz_orthogonalises():
    g = torch.randn(3, 64, 32, generator=torch.Generator().manual_seed(0))
    s = torch.linalg.svdvals(training.newton_schulz(g))
    assert s.min() > 0.5 and s.max() < 1.3


def test_fake_quant_weight_is_the_storage_round_trip():
    w = torch.randn(64, 96, generator=torch.Generator().manual_seed(0)) * 0.05
    fp8 = formats.dequantize_fp8_weight(*formats.quantize_fp8_weight(w))
    fp4 = formats.dequantize_fp4_weight(*formats.quantize_fp4_weight(w))
    assert torch.equal(training.fake_quant_weight("layers.0.attn.wq_a.weight", w), fp8)
    assert torch.equal(training.fake_quant_weight("layers.0.ffn.experts.3.w1.weight", w), fp4)
    assert torch.equal(training.fake_quant_weight("layers.0.ffn.shared_experts.w1.weight", w), fp8)


def test_lr_schedule():
    assert lr_factor(0.0) < 0.1 and lr_factor(0.5) == 1.0
    assert abs(lr_factor(1.0) - 0.1) < 1e-9


# ---------------------------------------------------------------------- the command


def test_tokenizer_training_is_deterministic():
    from model.training import corpus as text

    corpus = text.load_corpus(max_files=20)
    a = text.train_tokenizer(corpus.train, 400)
    b = text.train_tokenizer(corpus.train, 400)
    assert a.to_str() == b.to_str()
    assert [a.id_to_token(i) for i in range(10)] == list(text.SPECIAL_TOKENS)


@pytest.fixture(scope="module")
def small_bpe():
    from model.training.corpus import load_corpus, train_tokenizer

    return train_tokenizer(load_corpus(max_files=60).train, 1024)


@settings(max_examples=200, deadline=None)
@given(words=st.lists(st.text(st.characters(categories=("L", "N"), max_codepoint=0x24F), min_size=1, max_size=12),
                      min_size=1, max_size=6))
def test_a_word_is_the_same_tokens_after_a_space_as_alone(small_bpe, words):
    """A name copied out of a sentence is the tokens it is alone, so that a tool call's
    argument ('">glob') repeats its question's tokens (' glob') exactly."""
    space = small_bpe.encode(" ", add_special_tokens=False).ids
    for word in words:
        alone = small_bpe.encode(word, add_special_tokens=False).ids
        assert small_bpe.encode(" " + word, add_special_tokens=False).ids == space + alone
        sentence = small_bpe.encode(f"names in {word}?", add_special_tokens=False).ids
        assert any(sentence[i : i + len(alone)] == alone for i in range(len(sentence))), word
    text = " ".join(words)
    assert small_bpe.decode(small_bpe.encode(text, add_special_tokens=False).ids) == text


def test_the_tool_markup_is_one_token(small_bpe):
    from model.training.corpus import DSML, tokenizer_config
    from model.tokenizer import Tokenizer
    from model.tools import DSML as MARKUP

    tokenizer = Tokenizer(small_bpe.to_str(), tokenizer_config())
    assert tokenizer.special.dsml == DSML == small_bpe.token_to_id(MARKUP)
    # Plain text never turns into the markup token (a user cannot forge a call) ...
    assert DSML not in tokenizer.encode(f"<{MARKUP}invoke")
    # ... and the template renders the markup as that one token.
    assert tokenizer.decode([DSML]) == MARKUP


def test_loss_plot_is_a_png_of_the_asked_size(tmp_path):
    import struct

    from model.training.loss_plot import write_loss_png

    log = {"steps": [1, 2, 3], "loss": [7.0, 6.0, 5.5], "eval": [[3, 5.8]]}
    write_loss_png(tmp_path / "loss.png", log, baseline=6.4, width=320, height=200)
    data = (tmp_path / "loss.png").read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    assert struct.unpack(">II", data[16:24]) == (320, 200)


@pytest.mark.slow
def test_train_small_smoke_run_saves_a_loadable_checkpoint(tmp_path):
    """A few steps of the real command on a corpus slice; then a resumed run; the
    released-format checkpoint loads and agrees with its own reference forward."""
    from cluster.cli import main
    from model.loader import load_checkpoint, load_hasher

    out = tmp_path / "small"
    common = ["train-small", "--out", str(out), "--max-files", "50", "--vocab-size", "512", "--batch", "2",
              "--seq-len", "64", "--window", "16", "--copy", "0.5", "--induction", "2", "--induction-every", "2",
              "--induction-phase", "3", "--induction-at", "0.5",
              "--eval-every", "2", "--eval-batches", "1", "--no-samples", "--minutes", "0"]
    assert main([*common, "--steps", "2", "--keep-state"]) == 0
    assert (out / "train-state" / "state.pt").exists()
    assert main([*common, "--steps", "4", "--resume"]) == 0
    assert not (out / "train-state").exists()
    report = json.loads((out / "training.json").read_text())
    assert report["steps"] == 4 and report["log"]["steps"] == [1, 2, 3, 4]
    assert [probe[0] for probe in report["log"]["induction"]] == [2, 4] and len(report["log"]["repeat_loss"]) == 4
    assert report["induction"]["rows_per_step"] == 2 and report["induction"]["alphabet"] == 64
    # The phase ran once, halfway through the first run (step 1 of 2), and not again on resume.
    assert report["induction"]["phase"] == {"at": 0.5, "steps": 3, "seconds": report["induction"]["phase"]["seconds"],
                                            "widened": []}
    assert len(report["log"]["phase"]["loss"]) == 3 and report["log"]["phase"]["probes"][0][0] == 2
    assert sorted(report["induction"]["repeat_accuracy"]) == ["10", "20", "40"]
    assert abs(report["held_out_loss"] - report["held_out_loss_saved_checkpoint"]) < 1e-3
    assert 0.5 < report["held_out_bits_per_byte"] < 8 * report["held_out_loss_saved_checkpoint"]
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "loss.png"):
        assert (out / name).exists(), name

    checkpoint = load_checkpoint(out)
    assert checkpoint.drafter is not None
    text = checkpoint.config.text
    assert text.dspark_noise_token_id == 8 and text.engram_pad_id == 2 and text.vocab_size == 512
    assert text.sliding_window == 16
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        assert f.get_slice("layers.0.attn.wq_a.weight").get_dtype() == "F8_E4M3"
        assert f.get_slice("layers.0.ffn.experts.0.w1.weight").get_dtype() == "I8"
        assert f.get_slice("layers.1.engram.embed.weight").get_dtype() == "F8_E4M3"
    hasher = load_hasher(out, checkpoint.config)
    ids = torch.randint(9, 512, (1, 80), generator=torch.Generator().manual_seed(0))
    engram_ids = hasher.hash_ids(ids)[0]
    expected = checkpoint.backbone(ids, engram_ids)
    got = training.train_forward(checkpoint.backbone, ids, engram_ids).logits.detach()
    # Equal up to summation order, which can flip an FP4/FP8 rounding of a cache entry.
    assert (got - expected).abs().amax(-1).median() < 1e-3
    assert (got.argmax(-1) == expected.argmax(-1)).float().mean() > 0.95


def test_train_small_rejects_resume_without_state(tmp_path, capsys):
    from cluster.cli import main

    code = main(["train-small", "--out", str(tmp_path / "none"), "--max-files", "50", "--vocab-size", "512",
                 "--steps", "1", "--resume"])
    assert code == 2 and "no training state" in capsys.readouterr().err


def test_copy_rows_repeat_the_users_tokens_after_the_assistant_header():
    """`v41 train-tools`'s copy chats: <bos><User>Repeat: X<Assistant><think></think> X
    <eos>, X shown with a leading space and said with or without it, then the stream."""
    from model.training.batches import Batches
    from model.training.corpus import ASSISTANT, BOS, EOS, THINK_END, USER, load_corpus, token_stream
    from model.loader import load_tokenizer

    bpe = load_tokenizer(Path(__file__).resolve().parents[2] / "configs" / "small")
    corpus = load_corpus(60)
    rows = Batches(token_stream(bpe, corpus.train), corpus.train, bpe, 256, chat=0.0, copy=1.0).sample(
        24, torch.Generator().manual_seed(3))
    assert rows.shape == (24, 257)
    spaced = 0
    for row in rows.tolist():
        assert row[:2] == [BOS, USER] and ASSISTANT in row
        start, end = row.index(ASSISTANT), row.index(EOS)
        shown_ids = row[2 + len(bpe.encode("Repeat:", add_special_tokens=False).ids): start]
        shown, said = bpe.decode(shown_ids), bpe.decode(row[start + 3: end])
        assert row[start + 2] == THINK_END and 1 <= len(shown_ids) <= 120 and end > start + 3
        assert said in (shown, shown[1:]) and shown.startswith(" ")
        spaced += said == shown
    assert 0 < spaced < 24  # both forms


def test_a_run_given_only_steps_is_not_cut_by_the_default_minutes():
    """`v41 train-tools --steps 790` stopped at step 600: the 45-minute default bounded it too."""
    import argparse
    import math

    from cluster.cli import train_drafter, train_small, train_tools
    from cluster.cli.training import time_budget

    assert time_budget(None, 790, 45.0) == math.inf  # the steps bound the run
    assert time_budget(None, None, 45.0) == 45 * 60  # nothing given: the default
    assert time_budget(10.0, 790, 45.0) == 600  # both given: whichever comes first
    assert time_budget(0.0, None, 45.0) == math.inf
    for command in (train_tools, train_small, train_drafter):
        parser = argparse.ArgumentParser()
        command.add_arguments(parser)
        assert parser.parse_args(["--steps", "5"]).minutes is None
        assert parser.parse_args(["--minutes", "3"]).minutes == 3.0


@pytest.mark.parametrize("command", ["train-small", "train-tools", "train-drafter"])
def test_a_run_with_no_time_limit_and_no_steps_is_refused(command, tmp_path, capsys):
    """`--minutes 0` means no time limit: without --steps the run would never end
    (train-drafter ran forever)."""
    from cluster.cli import main

    assert main([command, "--out", str(tmp_path / "x"), "--minutes", "0"]) == 2
    assert "give --steps or a positive --minutes" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("options, message", [
    (["--induction", "0", "--induction-phase", "5"], "--induction-phase needs repeat rows"),
    (["--induction-phase", "5", "--induction-at", "1"], "--induction-at is a share of the schedule"),
])
def test_train_small_refuses_an_induction_phase_that_could_not_run(options, message, tmp_path, capsys):
    from cluster.cli import main

    assert main(["train-small", "--out", str(tmp_path / "x"), "--steps", "1", *options]) == 2
    assert message in capsys.readouterr().err and not (tmp_path / "x").exists()


def test_repeat_rows_copy_their_tokens_and_weigh_only_the_predictable_copy():
    """The induction curriculum's rows: <bos> x x, x distinct tokens from the current
    alphabet of ordinary tokens, the loss on the second copy's tokens after its first."""
    from model.training.corpus import SPECIAL_TOKENS
    from model.training.induction import INDUCTION_LENGTHS, Repeats

    repeats = Repeats(vocab_size=4096)
    generator = torch.Generator().manual_seed(0)
    lengths = set()
    for _ in range(20):
        ids, weights = repeats.sample(3, generator)
        length = (ids.shape[1] - 1) // 2
        lengths.add(length)
        assert INDUCTION_LENGTHS[0] <= length <= INDUCTION_LENGTHS[1] and ids.shape[1] == 2 * length + 1
        assert (ids[:, 0] == 0).all() and torch.equal(ids[:, 1 : length + 1], ids[:, length + 1 :])
        x = ids[:, 1:]
        assert x.min() >= len(SPECIAL_TOKENS) and x.max() < len(SPECIAL_TOKENS) + 64
        assert all(len(set(row)) == length for row in ids[:, 1 : length + 1].tolist())  # distinct
        # Weighted targets: ids[:, L + 2 :], predicted from ids[:, L + 1 : -1].
        assert weights[:, : length + 2].sum() == 0 and (weights[:, length + 2 :] == 1).all()
    assert len(lengths) > 5


def test_the_repeat_alphabet_widens_only_when_every_probe_passes():
    from model.training.corpus import SPECIAL_TOKENS
    from model.training.induction import INDUCTION_PASS, Repeats

    repeats = Repeats(vocab_size=4096)
    assert not repeats.update([0.9, INDUCTION_PASS - 0.01, 0.95]) and repeats.alphabet() == 64
    assert repeats.update([INDUCTION_PASS] * 3) and repeats.alphabet() == 256
    assert repeats.update([1.0] * 3) and repeats.alphabet() == 1024
    assert repeats.update([1.0] * 3) and repeats.alphabet() == 4096 - len(SPECIAL_TOKENS)
    assert repeats.final and not repeats.update([1.0] * 3)
    assert Repeats(vocab_size=512).alphabet(stage=2) == 512 - len(SPECIAL_TOKENS)  # capped by the vocabulary


class _Copier(torch.nn.Module):
    """Logits with the token one copy-length back on top (for <bos> x x rows: a perfect
    induction head), or with ``echo`` the current token."""

    def __init__(self, vocab: int, echo: bool = False):
        super().__init__()
        self.vocab, self.echo = vocab, echo

    def forward(self, ids, engram_ids=None):
        length = (ids.shape[1] - 1) // 2
        # Position t predicts ids[t + 1], which in the second copy is ids[t + 1 - L].
        guess = ids if self.echo else torch.roll(ids, length - 1, dims=1)
        return torch.nn.functional.one_hot(guess, self.vocab).float()


def test_repeat_accuracy_scores_a_perfect_copier_one_and_an_echo_near_zero():
    from model.training.induction import Repeats

    repeats = Repeats(vocab_size=512, stage=3)
    assert repeats.accuracy(_Copier(512), None, seed=0, reference=True) == [1.0, 1.0, 1.0]
    echo = repeats.accuracy(_Copier(512, echo=True), None, seed=0, reference=True)
    assert max(echo) < 0.05  # right only where a token happens to repeat itself


def test_train_tools_refuses_a_multi_call_share_outside_0_to_1(tmp_path, capsys):
    from cluster.cli import main

    assert main(["train-tools", "--out", str(tmp_path / "x"), "--steps", "1", "--multi-call", "1.5"]) == 2
    assert "--multi-call must be a share in [0, 1]" in capsys.readouterr().err and not (tmp_path / "x").exists()
