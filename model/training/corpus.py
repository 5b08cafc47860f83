"""The small model's text: the standard library's sources, its tokenizer, its token ids.

Corpus: the ``.py`` files of the running Python's standard library (no tests, no
site-packages), sorted by path; every ``HELD_OUT_EVERY``-th file is held out. Tokenizer:
byte-level BPE trained on the training files (deterministic), with the V4.1 special
tokens at ids 0..7, the DSpark noise token at 8 and the tool-call markup's ``｜DSML｜``
at 9; a word does not take the space before it (see :data:`SPLIT_PATTERN`).

Every training command reads its text from here (``v41 train-small`` trains the
tokenizer; the others load the checkpoint's), and so does ``v41 bench spec`` for its
held-out prompts.
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

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
FILE_SEPARATOR = "\n\x00\n"


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
    """The corpus (its first ``max_files`` files when given: smoke runs)."""
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
    """``tokenizer_config.json`` of a checkpoint with this tokenizer."""
    return {
        "backend": "tokenizers",
        "bos_token": SPECIAL_TOKENS[BOS],
        "eos_token": SPECIAL_TOKENS[EOS],
        "pad_token": SPECIAL_TOKENS[PAD],
        "extra_special_tokens": list(SPECIAL_TOKENS[USER:]),
        "model_max_length": 65536,
        "tokenizer_class": "TokenizersBackend",
    }


def token_stream(tokenizer, texts: list[str]):
    """The texts as one int64 array of token ids, ``<bos> text <eos>`` each."""
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
