"""`v41 train-small`: train the shipped small checkpoint from scratch (resumable).

Corpus: the ``.py`` files of the running Python's standard library (no tests, no
site-packages), sorted by path; every 50th file is held out. Tokenizer: byte-level BPE
trained on the training files (deterministic), with the V4.1 special tokens at ids 0..7,
the DSpark noise token at 8 and the tool-call markup's ``｜DSML｜`` at 9; a word does not
take the space before it (see :data:`SPLIT_PATTERN`). Config: ``configs/tiny``'s structure at a larger size
(see :func:`small_config`). Training math: :mod:`model.training`.

A progress bar (step, loss, tokens/s, ETA) goes to stderr; the training state (model,
optimizers, step, data RNG, log) is saved to ``OUT/train-state/`` every few minutes and
``--resume`` continues from it. At the end the checkpoint is written in the released
format (``model.loader.save_checkpoint``: FP8 dense, FP4 experts, FP8 Engram rows) with
the tokenizer files, ``training.json`` (the log and the numbers of the model card),
``loss.png`` and ``samples.txt``, and the training state is removed.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shutil
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

from cluster.cli.training import check_bounded, keep_heap, minutes_argument, time_budget

MINUTES = 45.0  # the time budget when neither --minutes nor --steps is given

SPECIAL_TOKENS = (
    "<｜begin▁of▁sentence｜>",
    "<｜end▁of▁sentence｜>",
    "<｜▁pad▁｜>",
    "<｜User｜>",
    "<｜Assistant｜>",
    "<think>",
    "</think>",
    "<｜deepseek_image｜>",
    "<｜▁noise▁｜>",  # the DSpark drafter's placeholder
    "｜DSML｜",  # the tool-call markup's token, as in the released vocabulary
)
BOS, EOS, PAD, USER, ASSISTANT, THINK, THINK_END, IMAGE, NOISE, DSML = range(len(SPECIAL_TOKENS))
# Pre-tokenizer chunks: letters, up to three digits, other symbols, whitespace. Unlike
# GPT-2's pattern a word does not take the space before it, so a name copied out of a
# sentence (" glob" in "the names in glob") is the same tokens as where it stands alone
# (a tool call's argument after '">'), and copying it is plain induction.
SPLIT_PATTERN = r"\p{L}+|\p{N}{1,3}|[^\s\p{L}\p{N}]+|\s+"
HELD_OUT_EVERY = 50
QAT_FROM = 0.7  # share of the schedule after which weights are trained quantisation-aware
FILE_SEPARATOR = "\n\x00\n"
# The induction curriculum (see :class:`Repeats`): alphabets the repeated tokens are
# drawn from, widened when the model repeats INDUCTION_PASS of the tokens at every probe
# length (None: every ordinary token); repeat lengths drawn per step.
INDUCTION_ALPHABETS = (64, 256, 1024, None)
INDUCTION_LENGTHS = (6, 48)
INDUCTION_PROBES = (10, 20, 40)
INDUCTION_PASS = 0.8
SAMPLE_PROMPTS = ("def fibonacci(n):\n", "import os\nimport sys\n\n\ndef main():\n", "class Stack:\n    def __init__(self):\n")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=Path, default=Path("configs/small"), help="checkpoint directory (default configs/small)")
    parser.add_argument("--minutes", **minutes_argument(MINUTES))
    parser.add_argument("--steps", type=int, default=None, help="stop after N steps (the schedule follows N when given)")
    parser.add_argument("--resume", action="store_true", help="continue from OUT/train-state")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--window", type=int, default=64, help="sliding window of every layer (the release's: 128)")
    parser.add_argument("--copy", type=float, default=0.1,
                        help="share of rows that are copy chats (retrieval from up to ~120 tokens back)")
    parser.add_argument("--induction", type=int, default=8,
                        help="random-token repeat rows per step (the induction curriculum; 0: none)")
    parser.add_argument("--induction-every", type=int, default=25,
                        help="steps between repeat-accuracy probes (the alphabet widens when they pass)")
    parser.add_argument("--induction-phase", type=int, default=0,
                        help="at most N steps of repeat rows alone, once (ends when the whole vocabulary's probes "
                             "pass; outside --steps and --minutes; 0: none)")
    parser.add_argument("--induction-at", type=float, default=0.0,
                        help="share of the schedule after which the induction phase runs (0: before the corpus)")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--max-files", type=int, default=None, help="use only the first N corpus files (smoke runs)")
    parser.add_argument("--save-every", type=float, default=5.0, help="minutes between training-state saves")
    parser.add_argument("--eval-every", type=int, default=100, help="steps between held-out evaluations")
    parser.add_argument("--eval-batches", type=int, default=4, help="held-out batches per evaluation")
    parser.add_argument("--no-samples", action="store_true", help="skip the sample continuations at the end")
    parser.add_argument("--keep-state", action="store_true", help="keep OUT/train-state after the final save")


# ---------------------------------------------------------------------- corpus and tokenizer


@dataclass
class Corpus:
    """The stdlib sources: ``train`` / ``held_out`` texts, with paths and a fingerprint."""

    root: str
    train: list[str]
    held_out: list[str]
    train_paths: list[str]
    held_out_paths: list[str]
    fingerprint: str  # sha256 of the sorted files' texts joined by FILE_SEPARATOR
    n_bytes: int


def stdlib_files(root: Path | None = None) -> list[Path]:
    """The standard library's ``.py`` files, sorted by path, without tests and site-packages."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    skip = {"test", "tests", "idle_test", "site-packages", "__pycache__"}
    return sorted(p for p in root.rglob("*.py") if not skip & set(p.relative_to(root).parts))


def load_corpus(max_files: int | None = None) -> Corpus:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = stdlib_files(root)[:max_files]
    texts = [p.read_text(encoding="utf-8", errors="replace") for p in files]
    paths = [str(p.relative_to(root)) for p in files]
    digest = hashlib.sha256(FILE_SEPARATOR.join(texts).encode("utf-8")).hexdigest()
    held = [i for i in range(len(files)) if i % HELD_OUT_EVERY == HELD_OUT_EVERY - 1]
    train = [i for i in range(len(files)) if i % HELD_OUT_EVERY != HELD_OUT_EVERY - 1]
    return Corpus(
        root=str(root),
        train=[texts[i] for i in train], held_out=[texts[i] for i in held],
        train_paths=[paths[i] for i in train], held_out_paths=[paths[i] for i in held],
        fingerprint=digest, n_bytes=sum(len(t.encode("utf-8")) for t in texts),
    )


def train_tokenizer(texts: list[str], vocab_size: int):
    """Byte-level BPE over :data:`SPLIT_PATTERN`'s chunks, with the special tokens at
    ids 0..9 (deterministic: one thread, texts in corpus order)."""
    os.environ.setdefault("RAYON_NUM_THREADS", "1")
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=2, special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer, length=len(texts))
    for i, token in enumerate(SPECIAL_TOKENS):
        assert tokenizer.token_to_id(token) == i, token
    return tokenizer


def tokenizer_config() -> dict:
    return {
        "backend": "tokenizers",
        "bos_token": SPECIAL_TOKENS[BOS],
        "eos_token": SPECIAL_TOKENS[EOS],
        "pad_token": SPECIAL_TOKENS[PAD],
        "extra_special_tokens": list(SPECIAL_TOKENS[USER:]),
        "model_max_length": 65536,
        "tokenizer_class": "TokenizersBackend",
    }


# ---------------------------------------------------------------------- config


def small_config(tokenizer, window: int = 64) -> dict:
    """The composite config.json of the small model (configs/tiny's structure).

    10 layers: 0-1 window-only; 2-5 the ratio-2 encoder (2 Full, 3 Reuse, 4 Full, 5
    Reuse); 6-9 the ratio-1 decoder (6 Full and candidate source, 7 Reuse, 8 Reindex,
    9 Reuse). Engram at 1 and 4; MoE 8 routed top-2 + shared; one DSpark block.
    """
    from model.engram import build_token_map, find_primes

    token_map, compressed = build_token_map(tokenizer)
    engram_layers, engram_vocab, max_ngram, heads = [1, 4], 12000, 3, 4
    primes = find_primes(engram_vocab, len(engram_layers), max_ngram, heads)
    num_embeddings = [sum(p for per_n in layer for p in per_n) for layer in primes]
    vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    yarn = {"beta_fast": 32, "beta_slow": 1, "factor": 16.0, "original_max_position_embeddings": 4096}
    text = {
        "vocab_size": vocab, "hidden_size": 128, "num_hidden_layers": 10,
        "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 64, "q_lora_rank": 64,
        "qk_rope_head_dim": 16, "o_groups": 2, "o_lora_rank": 64,
        "rope_theta": 10000.0, "compress_rope_theta": 160000.0,
        "rope_parameters": {
            "main": {"partial_rotary_factor": 0.25, "rope_theta": 10000.0, "rope_type": "default"},
            "compress": {**yarn, "attention_factor": 1.0, "partial_rotary_factor": 0.25, "rope_theta": 160000.0,
                         "rope_type": "yarn"},
        },
        "rope_scaling": {**yarn, "rope_type": "yarn"},
        "max_position_embeddings": 65536,
        "sliding_window": window,
        "compress_ratios": [0, 0, 2, 2, 2, 2, 1, 1, 1, 1, 0],
        "kv_source_layer_ids": [2, 4, 6],
        "index_source_layer_ids": [2, 4, 6, 8],
        "candidate_source_layer_id": 6,
        "candidate_topk_blocks": 8, "candidate_block_size": 4,
        "index_n_heads": 8, "index_head_dim": 32, "index_topk": 16,
        "moe_intermediate_size": 96, "n_routed_experts": 8, "n_shared_experts": 1, "num_experts_per_tok": 2,
        "scoring_func": "sqrtsoftplus", "routed_scaling_factor": 1.5, "swiglu_limit": 10.0,
        "hc_mult": 4, "hc_sinkhorn_iters": 20,
        "engram_layer_ids": engram_layers, "engram_vocab_size": engram_vocab,
        "engram_num_embeddings": num_embeddings, "engram_max_ngram_size": max_ngram,
        "engram_n_heads": heads, "engram_head_dim": 32, "engram_pad_id": PAD,
        "engram_compressed_vocab_size": compressed,
        "num_nextn_predict_layers": 1, "dspark_block_size": 5, "dspark_noise_token_id": NOISE,
        "dspark_target_layer_ids": [7, 8, 9], "dspark_markov_rank": 16,
        "dspark_n_routed_experts": 4, "dspark_num_experts_per_tok": 2,
        "initializer_range": 0.02, "rms_norm_eps": 1e-20,
        "bos_token_id": BOS, "eos_token_id": EOS, "pad_token_id": PAD, "tie_word_embeddings": False,
    }
    return {
        "architectures": ["DeepseekV41ForCausalLM"], "model_type": "deepseek_v41",
        "bos_token_id": BOS, "eos_token_id": EOS, "pad_token_id": PAD, "image_token_id": IMAGE,
        "tie_word_embeddings": False,
        "quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [32, 32],
                                "scale_fmt": "ue8m0", "expert_dtype": "fp4"},
        "text_config": text,
    }


# ---------------------------------------------------------------------- data


class Batches:
    """Training sequences: random windows of the token stream (``<bos> file <eos>`` per
    file), and with probability ``chat`` a chat-formatted completion (user: a few lines
    of a file; assistant: the lines that follow), so that ``v41 generate --prompt``
    continues code; and with probability ``copy`` a copy chat (user: ``Repeat:`` and a
    few lines; assistant: the same lines), which teaches retrieval from 5 to ~120 tokens
    back, past the sliding window (the tool fine-tune uses it: a call copies its
    arguments from the question)."""

    def __init__(self, stream, files: list[str], tokenizer, seq_len: int, chat: float = 0.1, copy: float = 0.0):
        self.stream, self.files, self.tokenizer = stream, files, tokenizer
        self.seq_len, self.chat, self.copy = seq_len, chat, copy

    def sample(self, batch: int, generator):
        import torch

        rows = []
        for _ in range(batch):
            row = None
            u = float(torch.rand((), generator=generator))
            if u < self.chat:
                row = self._chat_row(generator)
            elif u < self.chat + self.copy:
                row = self._copy_row(generator)
            if row is None:
                start = int(torch.randint(0, len(self.stream) - self.seq_len - 1, (), generator=generator))
                row = self.stream[start : start + self.seq_len + 1]
            rows.append(torch.as_tensor(row, dtype=torch.long))
        return torch.stack(rows)

    def _chat_row(self, generator):
        import torch

        text = self.files[int(torch.randint(0, len(self.files), (), generator=generator))]
        lines = text.split("\n")
        if len(lines) < 8:
            return None
        i = int(torch.randint(0, len(lines) - 4, (), generator=generator))
        k = int(torch.randint(1, 5, (), generator=generator))
        user = "\n".join(lines[i : i + k])
        rest = "\n" + "\n".join(lines[i + k :])
        user_ids = self.tokenizer.encode(user, add_special_tokens=False).ids[: self.seq_len // 2]
        head = [BOS, USER, *user_ids, ASSISTANT, THINK, THINK_END]
        body = self.tokenizer.encode(rest, add_special_tokens=False).ids + [EOS]
        row = (head + body)[: self.seq_len + 1]
        return row if len(row) == self.seq_len + 1 else None

    def _copy_row(self, generator):
        """``<bos><User>Repeat: lines<Assistant><think></think> lines<eos>`` then the
        stream, to the row length. The copied text: 1-3 lines, cut at 4-120 tokens."""
        import torch

        text = self.files[int(torch.randint(0, len(self.files), (), generator=generator))]
        lines = [line for line in text.split("\n") if line.strip()]
        if len(lines) < 4:
            return None
        i = int(torch.randint(0, len(lines) - 3, (), generator=generator))
        k = int(torch.randint(1, 4, (), generator=generator))
        cap = int(torch.randint(4, 121, (), generator=generator))
        copied = "\n".join(lines[i : i + k]).strip()
        shown = self.tokenizer.encode(" " + copied, add_special_tokens=False).ids[:cap]
        # Half the time the copy drops the leading space (" zip" -> "zip"), as a tool
        # call's argument does after '">'.
        spaced = float(torch.rand((), generator=generator)) < 0.5
        said = self.tokenizer.encode(self.tokenizer.decode(shown)[0 if spaced else 1 :], add_special_tokens=False).ids
        row = [BOS, USER, *self.tokenizer.encode("Repeat:", add_special_tokens=False).ids, *shown,
               ASSISTANT, THINK, THINK_END, *said, EOS]
        if len(row) > self.seq_len + 1:
            return None
        start = int(torch.randint(0, len(self.stream) - self.seq_len - 1, (), generator=generator))
        return row + self.stream[start : start + self.seq_len + 1 - len(row)].tolist()


class Repeats:
    """The induction curriculum: rows ``<bos> x x`` of ``L`` distinct random tokens ``x``
    repeated, the loss on the second copy after its first token (the first copy and its
    first token are unpredictable). Distinct, so that the token after the one earlier
    occurrence of the current token is always right: with repeats in ``x`` (64 tokens, L =
    40) plain induction is ambiguous and the task asks for more than the heads.

    A model trained on code alone never learns to copy a token it has not seen in that
    context (an *induction head*: attend to the token after the earlier occurrence of the
    current one), so a tool call cannot copy an argument out of the question. Random
    tokens leave nothing else to learn, and a small alphabet first (``INDUCTION_ALPHABETS``,
    widened when every probe of :meth:`accuracy` passes ``INDUCTION_PASS``) gives the
    heads a signal before the full vocabulary does."""

    def __init__(self, vocab_size: int, stage: int = 0):
        self.vocab_size, self.stage = vocab_size, stage

    @property
    def final(self) -> bool:
        return self.stage == len(INDUCTION_ALPHABETS) - 1

    def alphabet(self, stage: int | None = None) -> int:
        """How many token ids (from the first ordinary one) rows draw from."""
        size = INDUCTION_ALPHABETS[self.stage if stage is None else stage]
        ordinary = self.vocab_size - len(SPECIAL_TOKENS)
        return ordinary if size is None else min(size, ordinary)

    def sample(self, rows: int, generator, length: int | None = None, stage: int | None = None):
        """(ids [rows, 2L + 1], loss weights [rows, 2L + 1]); ``L`` drawn from
        ``INDUCTION_LENGTHS`` unless given."""
        import torch

        if length is None:
            length = int(torch.randint(INDUCTION_LENGTHS[0], INDUCTION_LENGTHS[1] + 1, (), generator=generator))
        alphabet = self.alphabet(stage)
        if length <= alphabet:  # distinct tokens: each has one earlier occurrence to copy from
            x = torch.rand((rows, alphabet), generator=generator).argsort(dim=1)[:, :length]
        else:
            x = torch.randint(0, alphabet, (rows, length), generator=generator)
        x = x + len(SPECIAL_TOKENS)
        ids = torch.cat([torch.full((rows, 1), BOS), x, x], dim=1)
        weights = torch.zeros(ids.shape)
        weights[:, length + 2 :] = 1.0
        return ids, weights

    def train_loss(self, model, hasher, rows: int, generator, quantize_weights: bool = True):
        """(the masked loss of ``rows`` fresh rows, their training forward's output)."""
        from model import training

        ids, weights = self.sample(rows, generator)
        result = training.train_forward(model, ids, _engram_ids(hasher, ids), quantize_weights=quantize_weights)
        return training.masked_lm_loss(result.logits, ids, weights), result

    def accuracy(self, model, hasher, seed: int, stage: int | None = None, rows: int = 16,
                 reference: bool = False, lengths: tuple[int, ...] = INDUCTION_PROBES) -> list[float]:
        """Greedy next-token accuracy on the weighted positions, per probe length (of
        ``INDUCTION_PROBES`` unless given; its own generator: probing leaves the training
        RNG alone)."""
        import torch

        from model import training

        generator = torch.Generator().manual_seed(seed)
        was_training = model.training
        model.eval()
        out = []
        with torch.no_grad():
            for length in lengths:
                ids, weights = self.sample(rows, generator, length, stage)
                engram_ids = _engram_ids(hasher, ids)
                logits = model(ids, engram_ids) if reference else training.train_forward(model, ids, engram_ids).logits
                right = (logits[:, :-1].argmax(-1) == ids[:, 1:]).float() * weights[:, 1:]
                out.append(round(float(right.sum() / weights[:, 1:].sum()), 3))
        model.train(was_training)
        return out

    def update(self, accuracies: list[float]) -> bool:
        """Widen the alphabet if every probe passed; True when it did."""
        if self.final or min(accuracies) < INDUCTION_PASS:
            return False
        self.stage += 1
        return True


def _engram_ids(hasher, ids):
    return hasher.hash_ids(ids)[0] if hasher is not None else None


def token_stream(tokenizer, texts: list[str]):
    import numpy as np

    out = []
    for encoding in tokenizer.encode_batch(texts, add_special_tokens=False):
        out.extend((BOS, *encoding.ids, EOS))
    return np.asarray(out, dtype=np.int64)


def unigram_baseline(train_stream, held_stream, vocab: int) -> float:
    """Cross-entropy (nats/token) of the held-out tokens under the add-one-smoothed
    unigram distribution of the training tokens."""
    import numpy as np

    counts = np.bincount(train_stream, minlength=vocab).astype(np.float64) + 1.0
    log_p = np.log(counts / counts.sum())
    return float(-log_p[held_stream].mean())


# ---------------------------------------------------------------------- loop


def _format_time(seconds: float) -> str:
    seconds = max(0, int(seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def run(args: argparse.Namespace) -> int:
    import torch

    from cluster import UserError
    from model import training
    from model.config import ModelConfig
    from model.engram import EngramLayout, NgramHasher
    from model.loader import Checkpoint, build_modules, save_checkpoint

    out: Path = args.out
    state_dir = out / "train-state"
    check_bounded(args.minutes, args.steps)
    keep_heap()
    if args.induction_phase and args.induction <= 0:
        raise UserError("--induction-phase needs repeat rows: give --induction N with N > 0")
    if not 0.0 <= args.induction_at < 1.0:
        raise UserError("--induction-at is a share of the schedule: from 0 up to (not including) 1")
    if args.seq_len < 64:
        raise UserError("--seq-len must be at least 64")
    if not 0 < args.window < args.seq_len:
        raise UserError(f"--window must be between 1 and --seq-len - 1 ({args.seq_len - 1})")
    started = time.time()
    corpus = load_corpus(args.max_files)
    if len(corpus.held_out) == 0:
        raise UserError(f"--max-files {args.max_files} leaves no held-out file (every {HELD_OUT_EVERY}th is held out)")
    print(f"corpus: {len(corpus.train)} train + {len(corpus.held_out)} held-out files, {corpus.n_bytes / 1e6:.1f} MB, "
          f"sha256 {corpus.fingerprint[:16]}", file=sys.stderr)
    if args.resume and (state_dir / "tokenizer.json").exists():
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(str(state_dir / "tokenizer.json"))
    elif args.resume:
        raise UserError(f"--resume: no training state in {state_dir}")
    else:
        tokenizer = train_tokenizer(corpus.train, args.vocab_size)
    config_dict = small_config(tokenizer, args.window)
    config = ModelConfig.from_dict(config_dict)
    text = config.text
    hasher = NgramHasher.from_tokenizer(EngramLayout.from_config(text), tokenizer)
    train_stream = token_stream(tokenizer, corpus.train)
    held_stream = token_stream(tokenizer, corpus.held_out)
    baseline = unigram_baseline(train_stream, held_stream, text.vocab_size)
    print(f"tokens: {len(train_stream):,} train, {len(held_stream):,} held-out; unigram baseline {baseline:.3f} nats",
          file=sys.stderr)

    torch.manual_seed(args.seed)
    parts = build_modules(config)
    model, drafter = parts.backbone, parts.drafter
    model.init_weights(args.seed, std=text.initializer_range)
    training.init_module(drafter, args.seed + 1, std=text.initializer_range)
    optimizers = training.build_optimizers(model, args.lr)
    data = Batches(train_stream, corpus.train, tokenizer, args.seq_len, copy=args.copy)
    generator = torch.Generator().manual_seed(args.seed)
    eval_rows = _held_out_rows(held_stream, args.seq_len, args.eval_batches * args.batch)
    repeats = Repeats(text.vocab_size)
    log = {"steps": [], "loss": [], "indexer_kl": [], "eval": [], "replays": 0, "repeat_loss": [], "induction": [],
           "widened": []}
    step, elapsed = 0, 0.0
    if args.resume:
        state = torch.load(state_dir / "state.pt", weights_only=False)
        model.load_state_dict(state["model"])
        drafter.load_state_dict(state["drafter"])
        for opt, opt_state in zip(optimizers, state["optimizers"]):
            opt.load_state_dict(opt_state)
        generator.set_state(state["generator"])
        torch.set_rng_state(state["torch_rng"])
        step, elapsed, log = state["step"], state["elapsed"], state["log"]
        repeats.stage = state["induction_stage"]
        print(f"resumed at step {step} ({_format_time(elapsed)} trained)", file=sys.stderr)
    else:
        state_dir.mkdir(parents=True, exist_ok=True)
        tokenizer.save(str(state_dir / "tokenizer.json"))

    def save_state():
        tmp = state_dir / "state.pt.tmp"
        torch.save({
            "model": model.state_dict(), "drafter": drafter.state_dict(),
            "optimizers": [o.state_dict() for o in optimizers], "generator": generator.get_state(),
            "torch_rng": torch.get_rng_state(), "step": step, "elapsed": elapsed, "log": log,
            "induction_stage": repeats.stage, "args": {k: str(v) for k, v in vars(args).items() if not k.startswith("_")},
        }, tmp)
        tmp.replace(state_dir / "state.pt")

    phase = log.setdefault("phase", {"steps": 0, "seconds": 0.0, "loss": [], "probes": [], "widened": [],
                                     "done": not args.induction_phase})
    budget = time_budget(args.minutes, args.steps, MINUTES)
    tokens_per_step = args.batch * args.seq_len
    last_save, window_start, window_steps = time.time(), time.time(), 0
    model.train()
    while True:
        progress = max(step / args.steps if args.steps else 0.0, elapsed / budget)
        if progress >= 1.0:
            break
        if not phase["done"] and progress >= args.induction_at:
            induction_phase(model, optimizers, repeats, hasher, generator, args, phase, save_state)
            window_start, window_steps = time.time(), 0
        tick = time.time()
        training.set_lr(optimizers, training.lr_factor(progress))
        ids = data.sample(args.batch, generator)
        replay = _replay_starts(args.batch, args.seq_len, text.sliding_window, generator)
        log["replays"] += int((replay.decoder < args.seq_len).sum())
        engram_ids, _ = hasher.hash_ids(ids)
        # Weights are rounded to their storage formats (straight-through) from the decay phase on.
        result = training.train_forward(model, ids, engram_ids, replay, quantize_weights=progress >= QAT_FROM)
        loss = training.lm_loss(result.logits, ids)
        total_loss, loads = loss + result.indexer_loss, result.loads
        if args.induction:
            repeat_loss, repeated = repeats.train_loss(model, hasher, args.induction, generator,
                                                       quantize_weights=progress >= QAT_FROM)
            total_loss = total_loss + repeat_loss + repeated.indexer_loss
            loads = {k: loads[k] + repeated.loads[k] for k in loads}
            log["repeat_loss"].append(round(float(repeat_loss.detach()), 4))
        training.backbone_step(model, optimizers, total_loss, loads)
        step += 1
        elapsed += time.time() - tick
        log["steps"].append(step)
        log["loss"].append(round(float(loss.detach()), 4))
        log["indexer_kl"].append(round(float(result.indexer_loss.detach()), 4))
        window_steps += 1
        if args.induction and step % args.induction_every == 0:
            accuracies = repeats.accuracy(model, hasher, seed=step)
            log["induction"].append([step, repeats.alphabet(), accuracies])
            if repeats.update(accuracies):
                log["widened"].append([log["induction"][-1][1], step])
                print(f"\nstep {step}: repeats {accuracies} of {log['induction'][-1][1]} tokens; "
                      f"widening to {repeats.alphabet()}", file=sys.stderr)
        if step % args.eval_every == 0:
            held = evaluate(model, hasher, eval_rows, args.batch)
            log["eval"].append([step, round(held, 4)])
            print(f"\nstep {step}: held-out loss {held:.3f} (unigram {baseline:.3f})", file=sys.stderr)
        rate = window_steps * tokens_per_step / max(1e-9, time.time() - window_start)
        if args.steps:
            remaining = min(((args.steps - step) * tokens_per_step) / max(rate, 1e-9), budget - elapsed)
        else:
            remaining = budget - elapsed
        recent = log["loss"][-20:]
        total = args.steps if args.steps else "?"
        induction = f"| repeats {log['induction'][-1][2]} of {log['induction'][-1][1]} " if log["induction"] else ""
        print(f"\rstep {step}/{total} | loss {sum(recent) / len(recent):.3f} | ix-KL {log['indexer_kl'][-1]:.3f} "
              f"{induction}"
              f"| {rate:,.0f} tok/s | ETA {_format_time(remaining)}   ", end="", file=sys.stderr, flush=True)
        if time.time() - window_start > 60:
            window_start, window_steps = time.time(), 0
        if time.time() - last_save > args.save_every * 60:
            save_state()
            last_save = time.time()
    print(file=sys.stderr)
    save_state()

    held = evaluate(model, hasher, eval_rows, args.batch)
    if not log["eval"] or log["eval"][-1][0] != step:
        log["eval"].append([step, round(held, 4)])
    out.mkdir(parents=True, exist_ok=True)
    save_checkpoint(out, Checkpoint(config, model.eval(), drafter.eval()))
    tokenizer.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(), indent=2, ensure_ascii=False) + "\n")
    # Held-out loss of what was saved (reloaded from the released format: the numbers users get).
    from model.loader import load_model

    _, saved = load_model(out)
    saved_held = evaluate(saved, hasher, eval_rows, args.batch, reference=True)
    # Repeats over the whole vocabulary, by the saved checkpoint (whatever stage training reached).
    full_vocab = repeats.accuracy(saved, hasher, seed=args.seed, stage=len(INDUCTION_ALPHABETS) - 1, reference=True)
    report = {
        "corpus": {"source": f"Python {sys.version.split()[0]} standard library (.py, no tests)", "root": corpus.root,
                   "files": len(corpus.train) + len(corpus.held_out), "held_out_files": len(corpus.held_out),
                   "bytes": corpus.n_bytes, "sha256": corpus.fingerprint,
                   "train_tokens": int(len(train_stream)), "held_out_tokens": int(len(held_stream))},
        "steps": step, "train_seconds": round(elapsed, 1), "wall_seconds": round(time.time() - started, 1),
        "tokens_seen": step * tokens_per_step, "batch": args.batch, "seq_len": args.seq_len, "lr": args.lr,
        "held_out_loss": round(held, 4), "held_out_loss_saved_checkpoint": round(saved_held, 4),
        "held_out_eval_tokens": int(eval_rows.numel() - eval_rows.shape[0]),
        # Comparable across tokenizers: nats per token x tokens / bytes, in bits.
        "held_out_bits_per_byte": round(bits_per_byte(saved_held, eval_rows, tokenizer), 4),
        "unigram_baseline": round(baseline, 4), "replayed_sequences": log["replays"],
        "induction": {"rows_per_step": args.induction, "alphabet": repeats.alphabet(),
                      "widened": log["widened"],
                      "phase": {"at": args.induction_at, "steps": phase["steps"],
                                "seconds": round(phase["seconds"], 1), "widened": phase["widened"]},
                      "repeat_accuracy": dict(zip(map(str, INDUCTION_PROBES), full_vocab))},
        "log": log,
    }
    (out / "training.json").write_text(json.dumps(report) + "\n")
    write_loss_png(out / "loss.png", log, baseline)
    if not args.no_samples:
        (out / "samples.txt").write_text(samples(out))
    if not args.keep_state:
        shutil.rmtree(state_dir, ignore_errors=True)
    print(f"saved {out}: {step} steps, held-out loss {held:.3f} ({saved_held:.3f} as saved), unigram {baseline:.3f}",
          file=sys.stderr)
    return 0


def induction_phase(model, optimizers, repeats: Repeats, hasher, generator, args, phase: dict, save_state) -> None:
    """Repeat rows alone at the peak learning rate (after a 50-step ramp), widening the
    alphabet as the main loop does, until the whole vocabulary's probes pass or
    ``--induction-phase`` steps. Resumable (its state, ``phase``, is in the log). Rows
    are short, so a step costs a fraction of a corpus step, and the heads form without
    the corpus's gradient drowning theirs."""
    from model import training

    last_save = time.time()
    model.train()
    while not phase["done"]:
        tick = time.time()
        training.set_lr(optimizers, min(1.0, (phase["steps"] + 1) / 50))
        loss, result = repeats.train_loss(model, hasher, args.induction, generator)
        training.backbone_step(model, optimizers, loss + result.indexer_loss, result.loads)
        phase["steps"] += 1
        phase["seconds"] += time.time() - tick
        phase["loss"].append(round(float(loss.detach()), 4))
        if phase["steps"] % args.induction_every == 0:
            accuracies = repeats.accuracy(model, hasher, seed=1_000_000 + phase["steps"])
            phase["probes"].append([phase["steps"], repeats.alphabet(), accuracies])
            if repeats.final and min(accuracies) >= INDUCTION_PASS:
                phase["done"] = True
            elif repeats.update(accuracies):
                phase["widened"].append([phase["probes"][-1][1], phase["steps"]])
        phase["done"] = phase["done"] or phase["steps"] >= args.induction_phase
        probe = f"| repeats {phase['probes'][-1][2]} of {phase['probes'][-1][1]} " if phase["probes"] else ""
        print(f"\rinduction phase {phase['steps']}/{args.induction_phase} | repeat loss "
              f"{sum(phase['loss'][-20:]) / len(phase['loss'][-20:]):.3f} {probe}  ", end="", file=sys.stderr,
              flush=True)
        if time.time() - last_save > args.save_every * 60 or phase["done"]:
            save_state()
            last_save = time.time()
    print(f"\ninduction phase: {phase['steps']} steps, {phase['seconds']:.0f} s, alphabet {repeats.alphabet()}",
          file=sys.stderr)


def _replay_starts(batch: int, seq_len: int, window: int, generator, p_decoder: float = 0.25, p_encoder: float = 0.1):
    """Per sequence: no replay, a decoder replay, or an encoder (+ decoder) replay from a
    random start ``s`` in ``[window, seq_len - window // 2]``."""
    import torch

    from model.training import ReplayStarts

    starts = ReplayStarts.none(batch, seq_len)
    for b in range(batch):
        u = float(torch.rand((), generator=generator))
        s = int(torch.randint(window, max(window + 1, seq_len - window // 2), (), generator=generator))
        if u < p_encoder:
            starts.encoder[b] = starts.decoder[b] = s
        elif u < p_encoder + p_decoder:
            starts.decoder[b] = s
    return starts


def _held_out_rows(held_stream, seq_len: int, n: int):
    """``n`` evenly spaced held-out windows of ``seq_len + 1`` tokens (fixed)."""
    import torch

    n = max(1, min(n, (len(held_stream) - 1) // (seq_len + 1)))
    step = (len(held_stream) - seq_len - 1) // n
    return torch.stack([torch.as_tensor(held_stream[i * step : i * step + seq_len + 1]) for i in range(n)])


def evaluate(model, hasher, rows, batch: int, reference: bool = False) -> float:
    """Mean next-token loss over ``rows`` (the training forward with no replay, or the
    reference forward)."""
    import torch

    from model import training

    total = 0.0
    with torch.no_grad():
        for lo in range(0, rows.shape[0], batch):
            ids = rows[lo : lo + batch]
            engram_ids, _ = hasher.hash_ids(ids)
            logits = model(ids, engram_ids) if reference else training.train_forward(model, ids, engram_ids).logits
            total += float(training.lm_loss(logits, ids)) * ids.shape[0]
    return total / rows.shape[0]


def bits_per_byte(loss: float, rows, tokenizer) -> float:
    """A mean next-token loss over ``rows`` (nats/token) as bits per byte of the
    predicted text (special tokens count no bytes)."""
    targets = rows[:, 1:]
    n_bytes = sum(len(tokenizer.decode(row, skip_special_tokens=True).encode("utf-8")) for row in targets.tolist())
    return loss * targets.numel() / max(1, n_bytes) / math.log(2)


def samples(directory: Path, max_new_tokens: int = 96) -> str:
    """Greedy continuations of :data:`SAMPLE_PROMPTS` by the engine on the saved checkpoint."""
    from model.runtime.batcher import generate
    from model.runtime.engine import Engine
    from model.loader import load_hasher, load_model, load_tokenizer
    from model.runtime.sampling import SamplingParams

    config, model = load_model(directory)
    tokenizer = load_tokenizer(directory)
    engine = Engine(model, load_hasher(directory, config))
    prompts = [[BOS, *tokenizer.encode(p, add_special_tokens=False).ids] for p in SAMPLE_PROMPTS]
    outs = generate(engine, prompts, SamplingParams(temperature=0.0, max_tokens=max_new_tokens), eos_token_ids=(EOS,))
    parts = []
    for prompt, out in zip(SAMPLE_PROMPTS, outs):
        parts.append(f"=== prompt ===\n{prompt}=== greedy continuation ({len(out)} tokens) ===\n"
                     f"{tokenizer.decode(out, skip_special_tokens=True)}\n")
    return "\n".join(parts)


# ---------------------------------------------------------------------- the loss plot


def write_loss_png(path: Path, log: dict, baseline: float, width: int = 640, height: int = 400) -> None:
    """The loss curve (matplotlib, no display): the training loss per step (light) and
    its running mean over 1/30 of the steps (dark), the held-out evaluations (red
    squares), the unigram baseline (dashed grey); nats/token from 0 against steps."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    steps, loss = np.asarray(log["steps"], dtype=float), np.asarray(log["loss"], dtype=float)
    dpi = 100
    figure, axes = plt.subplots(figsize=(width / dpi, height / dpi), dpi=dpi)
    try:
        axes.plot(steps, loss, color="#9ecae1", linewidth=0.8, label="training loss")
        if len(loss):
            k = max(1, len(loss) // 30)
            mean = np.convolve(loss, np.ones(k) / k, mode="valid")
            axes.plot(steps[k - 1 :], mean, color="#08519c", linewidth=1.5, label=f"running mean ({k} steps)")
        if log.get("eval"):
            at, held = zip(*log["eval"])
            axes.plot(at, held, "s", color="#cb181d", markersize=4, label="held-out")
        axes.axhline(baseline, color="grey", linestyle="--", linewidth=1, label="unigram baseline")
        axes.set_ylim(0, max([baseline + 1.0, *loss]) if len(loss) else baseline + 1.0)
        axes.set_xlim(0, max(1.0, steps[-1] if len(steps) else 1.0))
        axes.set_xlabel("step")
        axes.set_ylabel("nats / token")
        axes.grid(alpha=0.3)
        axes.legend(fontsize="small")
        figure.tight_layout()
        figure.savefig(path, format="png")
    finally:
        plt.close(figure)
