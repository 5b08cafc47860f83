"""`v41 train-vision [--checkpoint DIR] [--out DIR] [--minutes M]`: teach a text checkpoint
to read code from images.

A vision tower (ViT, 3 x 3 merge, aligner, span markers; the released architecture at a
small size) is trained on a frozen text backbone: each example is an image of a few
lines of the backbone's own training corpus (the Python standard library), drawn in
one of three DejaVu Sans Mono faces (regular, bold, oblique; the ones matplotlib ships)
at 16 to 24 pixels, and the chat turn ``Transcribe the code in the image:\\n<image>``
whose answer is the lines' text. Snippets are one or two lines of at most 32
characters and the image comes last in the turn: the small backbone's attention window
is 32 positions, so its first answer tokens see the whole image span (12 to 25
positions) beside them; the frozen indexer was never taught to fetch image positions
from further back. The loss is the answer's next-token cross entropy;
its gradient reaches the tower through the whole backbone (the backbone's weights and
caches rounded as served, straight-through). The result is the source checkpoint
plus the tower (its other files copied), in ``--out``.

``evaluate`` greedy-transcribes held-out snippets (files the backbone never trained
on) with the engine, image in the prompt, against the same prompt without the image
(the text-only baseline) and with a white image of the same size (what the image's
shape alone tells): character accuracy ``1 - edit distance / length``.
``--evaluate-only`` evaluates ``--checkpoint`` as it is.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict
from pathlib import Path

import torch
import torch.nn.functional as F

from cluster.cli.training import keep_heap
from model.chat import ChatTemplate, ImagePart, Message
from model.config import VisionConfig
from model.loader import load_checkpoint, load_hasher, save_with_vision
from model.tokenizer import Tokenizer
from model.training import train_forward
from model.training.corpus import load_corpus
from model.training.loop import Plan, Task, train
from model.transformer import init_module
from model.vision import VisionTower, preprocess_image

PROMPT = "Transcribe the code in the image:\n"
VISION = {"hidden_size": 192, "intermediate_size": 384, "num_hidden_layers": 4, "num_attention_heads": 4,
          "max_image_tokens": 256, "min_pixels": 84 * 84}
FACES = ("DejaVuSansMono.ttf", "DejaVuSansMono-Bold.ttf", "DejaVuSansMono-Oblique.ttf")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--checkpoint", type=Path, default=Path("configs/small"), help="the text checkpoint")
    parser.add_argument("--out", type=Path, default=Path(".v41/vision"), help="where the checkpoint is written")
    parser.add_argument("--minutes", type=float, default=45.0, help="training time")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--glyph-weight", type=float, default=0.5, help="weight of the auxiliary glyph loss")
    parser.add_argument("--init", type=Path, default=None,
                        help="start from the vision tower of this checkpoint (trained on the same backbone)")
    parser.add_argument("--eval", type=int, default=100, help="held-out snippets evaluated at the end")
    parser.add_argument("--evaluate-only", action="store_true", help="only evaluate --checkpoint (a reader)")


# ---------------------------------------------------------------------- data
def font_paths() -> list[Path]:
    import matplotlib

    root = Path(matplotlib.get_data_path()) / "fonts" / "ttf"
    return [root / face for face in FACES]


def snippets(texts: list[str], max_chars: int = 32) -> list[str]:
    """Every run of 1 or 2 consecutive non-blank lines of at most ``max_chars`` characters
    (tabs expanded, right-stripped) in ``texts``: one list, deterministic."""
    out = []
    for text in texts:
        lines = [line.expandtabs(4).rstrip() for line in text.splitlines()]
        for start in range(0, len(lines), 2):
            for length in (1, 2):
                chunk = lines[start:start + length]
                if len(chunk) == length and all(0 < len(line) <= max_chars and line.isascii() for line in chunk):
                    out.append("\n".join(chunk))
    return out


def render(text: str, font: Path, size: int, margin: int):
    """``text`` drawn black on white: [3, H, W] uint8."""
    return render_with_boxes(text, font, size, margin)[0]


def render_with_boxes(text: str, font: Path, size: int, margin: int):
    """(``text`` drawn black on white [3, H, W] uint8, the box (x0, y0, x1, y1) and
    character of every glyph that is not a space)."""
    import numpy as np
    from PIL import Image, ImageDraw, ImageFont

    face = ImageFont.truetype(str(font), size)
    ascent, descent = face.getmetrics()
    height, spacing = ascent + descent, size // 4
    lines = text.split("\n")
    width = max(face.getlength(line) for line in lines)
    image = Image.new("RGB", (math.ceil(width) + 2 * margin, len(lines) * (height + spacing) - spacing + 2 * margin),
                      "white")
    pen = ImageDraw.Draw(image)
    boxes = []
    for row, line in enumerate(lines):
        y = margin + row * (height + spacing)
        pen.text((margin, y), line, fill="black", font=face)
        for i, char in enumerate(line):
            if char != " ":
                boxes.append((margin + face.getlength(line[:i]), y, margin + face.getlength(line[:i + 1]), y + height,
                              char))
    return torch.from_numpy(np.asarray(image).copy()).permute(2, 0, 1).contiguous(), boxes


# The glyph each ViT patch mostly shows: printable ASCII (33..126) and 0 for none. An
# auxiliary head reads it from the patch's features while the tower trains (then is
# dropped): a direct signal that teaches the tower glyphs sooner than the language
# model's loss alone, which stayed at ~3.0 nats for the first 520 steps without it.
GLYPHS = 95


def patch_glyphs(boxes, plan, source_height: int, source_width: int, patch: int = 14):
    """[vit_h * vit_w] glyph classes (row-major) of a planned image's patches."""
    labels = torch.zeros(plan.vit_h, plan.vit_w, dtype=torch.long)
    best = torch.zeros(plan.vit_h, plan.vit_w)
    sx, sy = plan.content_width / source_width, plan.content_height / source_height
    for x0, y0, x1, y1, char in boxes:
        left, right = plan.left + x0 * sx, plan.left + x1 * sx
        top, bottom = plan.top + y0 * sy, plan.top + y1 * sy
        for r in range(plan.vit_h):
            if not top <= r * patch + patch / 2 < bottom:
                continue
            for c in range(max(0, int(left // patch)), min(plan.vit_w, int(right // patch) + 1)):
                overlap = min(right, (c + 1) * patch) - max(left, c * patch)
                if overlap > best[r, c]:
                    best[r, c], labels[r, c] = overlap, ord(char) - 32
    return labels.flatten()


def draw(text: str, generator, boxes: bool = False):
    """``text`` in a random face, size and margin: pixels (and glyph boxes)."""
    fonts = font_paths()
    face = fonts[int(torch.randint(len(fonts), (1,), generator=generator))]
    size = int(torch.randint(16, 25, (1,), generator=generator))
    margin = int(torch.randint(2, 7, (1,), generator=generator))
    pixels, glyphs = render_with_boxes(text, face, size, margin)
    return (pixels, glyphs) if boxes else pixels


class Example:
    """One turn: the prompt with the image's span, the answer's ids, the image."""

    def __init__(self, template, vision_config, text: str, pixels, boxes=None):
        self.text, self.pixels = text, pixels
        self.patches, self.plan = preprocess_image(pixels, vision_config)
        self.glyphs = None if boxes is None else patch_glyphs(boxes, self.plan, pixels.shape[1], pixels.shape[2])
        tokenizer = template.tokenizer
        self.prompt = template.render([Message("user", parts=(PROMPT, ImagePart(self.plan.num_tokens)))])
        self.answer = tokenizer.encode(text) + [tokenizer.special.eos]


# ---------------------------------------------------------------------- training
def run(args: argparse.Namespace) -> int:
    if args.evaluate_only:
        result = evaluate(args.checkpoint, args.eval)
        print(json.dumps({k: v for k, v in result.items() if k != "examples"}))
        return 0
    keep_heap()
    torch.manual_seed(args.seed)
    checkpoint = load_checkpoint(args.checkpoint, keep_stored=True)
    task = VisionTraining(args, checkpoint)
    task.tower.train()
    counters = train(task, Plan(_schedule, seconds=args.minutes * 60))
    task.tower.eval()
    out = save_with_vision(args.checkpoint, args.out, checkpoint, task.tower, task.tokenizer.special.image)
    (out / "vision_training.json").write_text(json.dumps({
        "steps": counters.step, "minutes": args.minutes, "batch": args.batch, "lr": args.lr, "seed": args.seed,
        "init": str(args.init) if args.init else None,
        "vision_config": asdict(task.vision), "prompt": PROMPT, "faces": FACES, "font_sizes": [16, 24],
        "glyph_weight": args.glyph_weight, "glyph_loss_every_20": _means(task.glyph_log),
        "training_snippets": len(task.snippets), "loss_every_20": _means(task.log)}, indent=1) + "\n")
    result = evaluate(out, args.eval)
    (out / "vision_eval.json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "examples"}))
    return 0


def _schedule(step: int, progress: float) -> float:
    """3% linear warmup, then a cosine from 1 down to 0.1."""
    return min(1.0, progress / 0.03) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def _means(values: list[float], every: int = 20) -> list[float]:
    return [round(sum(values[i:i + every]) / len(values[i:i + every]), 4) for i in range(0, len(values), every)]


class VisionTraining(Task):
    """The tower's steps on its frozen backbone: a batch of drawn snippets, the answer's
    cross entropy plus the glyph head's (``--glyph-weight``)."""

    def __init__(self, args: argparse.Namespace, checkpoint):
        self.args, self.backbone, text = args, checkpoint.backbone, checkpoint.config.text
        self.backbone.requires_grad_(False)
        self.vision = VisionConfig(**VISION)
        self.tower = init_module(VisionTower(self.vision, text), seed=args.seed, std=0.02)
        if args.init is not None:  # (the glyph head is not saved: it starts afresh)
            start = load_checkpoint(args.init).vision
            if start is None or start.config != self.vision:
                raise SystemExit(f"v41 train-vision: {args.init} has no vision tower of this size")
            self.tower.load_state_dict(start.state_dict())
        self.tokenizer = Tokenizer.from_dir(args.checkpoint)
        self.template = ChatTemplate(self.tokenizer)
        self.hasher = load_hasher(args.checkpoint, checkpoint.config)
        self.snippets = snippets(load_corpus().train)
        print(f"{len(self.snippets)} training snippets; tower {sum(p.numel() for p in self.tower.parameters()):,} "
              "parameters", file=sys.stderr)
        self.reader = torch.nn.Linear(self.vision.hidden_size, GLYPHS)  # the auxiliary glyph head (not saved)
        self.optimizers = [torch.optim.AdamW([{"params": [*self.tower.parameters(), *self.reader.parameters()],
                                               "base_lr": args.lr}], lr=args.lr, weight_decay=0.01)]
        self.generator = torch.Generator().manual_seed(args.seed)
        self.log: list[float] = []
        self.glyph_log: list[float] = []

    def step(self, progress: float) -> None:
        args, special = self.args, self.tokenizer.special
        picks = [self.snippets[i] for i in torch.randint(len(self.snippets), (args.batch,),
                                                           generator=self.generator).tolist()]
        examples = [Example(self.template, self.vision, text, *draw(text, self.generator, boxes=True))
                    for text in picks]
        loss, glyph_loss = _loss(self.backbone, self.tower, self.hasher, examples, special.image, special.pad, F,
                                 self.reader)
        self.glyph_log.append(round(glyph_loss.item(), 4))
        loss = loss + args.glyph_weight * glyph_loss
        (optimizer,) = self.optimizers
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.tower.parameters(), 1.0)
        optimizer.step()
        self.log.append(round(loss.item() - args.glyph_weight * self.glyph_log[-1], 4))

    def status(self) -> str:
        loss, glyphs = self.log[-20:], self.glyph_log[-20:]
        return f"loss {sum(loss) / len(loss):.3f} | glyphs {sum(glyphs) / len(glyphs):.3f}"


def _loss(backbone, tower, hasher, examples: list[Example], image_id: int, pad_id: int, F, reader=None):
    """The answers' cross entropy; with ``reader`` (the glyph head), also the patches'
    glyph cross entropy: (answer loss, glyph loss)."""

    rows = [e.prompt + e.answer for e in examples]
    length = max(len(r) for r in rows)
    ids = torch.full((len(rows), length), pad_id, dtype=torch.long)
    target = torch.zeros_like(ids, dtype=torch.bool)
    for b, (row, example) in enumerate(zip(rows, examples)):
        ids[b, :len(row)] = torch.tensor(row)
        target[b, len(example.prompt):len(row)] = True
    mask = ids == image_id
    spans, glyph_losses = [], []
    for e in examples:
        features = tower.vision(e.patches, e.plan.vit_h, e.plan.vit_w)
        if reader is not None:
            glyph_losses.append(F.cross_entropy(reader(features), e.glyphs))
        tokens = tower.aligner(features, e.plan.vit_h, e.plan.vit_w).float()
        spans.append(tower.span(tokens, e.plan.llm_h, e.plan.llm_w))
    embeds = torch.cat(spans)
    engram_ids = hasher.hash_ids(ids, token_mask=~mask)[0] if hasher is not None else None
    out = train_forward(backbone, ids, engram_ids, quantize=True, image_mask=mask, image_embeds=embeds)
    logits = out.logits[:, :-1]
    labels = ids[:, 1:]
    keep = target[:, 1:]
    loss = F.cross_entropy(logits[keep].float(), labels[keep])
    if reader is None:
        return loss
    return loss, torch.stack(glyph_losses).mean()


# ---------------------------------------------------------------------- evaluation
def edit_distance(a: str, b: str) -> int:
    previous = list(range(len(b) + 1))
    for i, x in enumerate(a, 1):
        current = [i]
        for j, y in enumerate(b, 1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (x != y)))
        previous = current
    return previous[-1]


def char_accuracy(predicted: str, truth: str) -> float:
    return max(0.0, 1.0 - edit_distance(predicted, truth) / max(1, len(truth)))


def evaluate(directory: Path, n: int = 100, seed: int = 1234, max_tokens: int = 64) -> dict:
    """Greedy transcriptions of ``n`` held-out snippets, with the image and without it."""
    from actors.pool_model import ImageEncoder
    from actors.state import PromptImage
    from cluster.serving.images import pixel_digest
    from model.runtime.engine import Engine

    checkpoint = load_checkpoint(directory)
    tokenizer = Tokenizer.from_dir(directory)
    template = ChatTemplate(tokenizer)
    image_id = checkpoint.config.image_token_id
    engine = Engine(checkpoint.backbone, load_hasher(directory, checkpoint.config), image_token_id=image_id)
    encoder = ImageEncoder(checkpoint.vision, checkpoint.config.vision)
    held = snippets(load_corpus().held_out)
    generator = torch.Generator().manual_seed(seed)
    picks = torch.randperm(len(held), generator=generator)[:n].tolist()

    def greedy(prompt: list[int], spans) -> str:
        cache = engine.new_cache()
        out = [int(engine.replay(cache, engine.prefill(cache, prompt, images=spans)).argmax())]
        while out[-1] != tokenizer.special.eos and len(out) < max_tokens:
            out.append(int(engine.decode([(cache, [out[-1]])])[0][-1].argmax()))
        return tokenizer.decode([t for t in out if t != tokenizer.special.eos])

    rows = []
    for index in picks:
        text = held[index]
        example = Example(template, checkpoint.config.vision, text, draw(text, generator))
        start = example.prompt.index(image_id)
        image = PromptImage(start, example.plan.num_tokens, example.pixels, pixel_digest(example.pixels))
        read = greedy(example.prompt, encoder.spans((image,)))
        blind = greedy(template.render([Message("user", PROMPT.strip())]), [])
        white = torch.full_like(example.pixels, 255)  # an image of the same size with nothing on it
        blank = greedy(example.prompt, encoder.spans((PromptImage(start, example.plan.num_tokens, white,
                                                                  pixel_digest(white)),)))
        rows.append({"truth": text, "read": read, "text_only": blind, "blank_image": blank,
                     "accuracy": char_accuracy(read, text), "text_only_accuracy": char_accuracy(blind, text),
                     "blank_image_accuracy": char_accuracy(blank, text)})

    def mean(key: str) -> float:
        return round(sum(r[key] for r in rows) / len(rows), 4)

    return {"snippets": len(rows), "held_out_pool": len(held), "char_accuracy": mean("accuracy"),
            "text_only_char_accuracy": mean("text_only_accuracy"),
            "blank_image_char_accuracy": mean("blank_image_accuracy"),
            "exact": round(sum(r["read"] == r["truth"] for r in rows) / len(rows), 4),
            "examples": rows[:12]}
