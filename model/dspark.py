"""DSpark: the speculative drafter on top of the backbone (parallel draft, Markov head, confidence).

Context. The drafter reads the *attention inputs* of the target layers
``dspark_target_layer_ids`` (37, 38, 39): the residual streams [B, T, hc, D] entering each
of those blocks, averaged over the ``hc`` mHC streams, concatenated in layer order and
projected into one vector per position::

    main_x = main_norm(main_proj([mean_hc(s_37); mean_hc(s_38); mean_hc(s_39)]))   # [B, T, D]

Each drafter layer turns ``main_x`` into its own window entries with its own ``wkv`` /
``kv_norm`` (rotated at the position, FP8 like the backbone's window cache): one entry per
committed position, kept for the last ``sliding_window`` positions only. This is DFlash-style
"KV injection": the drafter never runs its layers over the context.

Parallel draft. A block of ``dspark_block_size`` (5) positions: the last real token (the
anchor, at position ``p``) then ``dspark_noise_token_id`` placeholders at ``p+1 .. p+4``,
embedded with the backbone's embedding and copied into the ``hc`` streams. The
``num_nextn_predict_layers`` (3) drafter blocks are backbone blocks (mHC, CSA2 attention
with window only, main RoPE, per-head sinks, MoE with a shared expert) with their own MoE
of ``dspark_n_routed_experts`` (128) experts, top ``dspark_num_experts_per_tok`` (3). A
block query attends to the window entries of the ``sliding_window`` context positions
before ``p`` and to every position of the block: no causal mask inside the block. The
final collapse, the last block's ``norm`` and the backbone's output head give base logits
for all 5 positions at once; position ``k`` guesses the token at ``p + k + 1``.

Markov head. A low-rank bigram bias ``B(prev, .) = W1[prev] W2`` (``W1`` = ``embed`` [V, r],
``W2`` = ``head.weight`` [V, r] transposed, r = ``dspark_markov_rank``) added to position
``k``'s base logits given the token just picked at ``k - 1`` (the anchor for ``k = 0``);
sampling runs left to right.

Confidence head. ``c_k = sigmoid(w . [h_k; W1[prev_k]])``: the chance that guess ``k``
survives verification given that the ones before it survived, from the un-normalised
collapsed drafter hidden ``h_k`` and the Markov embedding of the previous token. The
survival of the first ``j`` guesses is ``prod_{k<=j} c_k``.

Released tensor names (prefix ``mtp.S.``, S = 0..2; found in the release's tensor
inventory as used by public ports): every backbone block tensor with the backbone's names
(``attn.{wq_a,q_norm,wq_b,wkv,kv_norm,wo_a,wo_b,attn_sink}``, ``attn_norm``, ``ffn_norm``,
``ffn.gate.{weight,bias,bias_vl}``, ``ffn.experts.E.{w1,w2,w3}``,
``ffn.shared_experts.{w1,w2,w3}``, ``hc_{attn,ffn}_{fn,base,scale}``); plus on ``mtp.0``:
``main_proj.weight`` [D, 3D], ``main_norm.weight``; on the last: ``norm.weight``,
``markov_head.embed.weight`` [V, r], ``markov_head.head.weight`` [V, r],
``confidence_head.proj.weight`` [1, D + r] (no bias). The embedding and output head are
the backbone's (``embed.weight``, ``head.weight``), passed in, not owned here.

Choices the release does not pin by name (see the module report): the context window is
the last ``sliding_window`` positions *before* the anchor plus the whole block (as a public
inference port does), the block uses the ``main`` rotary embedding, and the confidence
head reads the hidden state before the final norm.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from . import mhc
from .config import AttentionMode, ConfigError, LayerPlan, TextConfig
from .norm import RMSNorm
from .rope import Rotary
from .transformer import Block, Tap, run_blocks


def _window_entries(block: Block, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The FP8 window entries of ``x``; under autograd the rounding is straight-through
    (same values forward, identity backward), so training reaches ``wkv`` and ``kv_norm``."""
    if not (torch.is_grad_enabled() and x.requires_grad):
        return block.attn.window_entries(x, cos, sin)
    raw = block.attn.window_raw(x, cos, sin)
    return raw + (block.attn.window_entries(x.detach(), cos, sin) - raw).detach()


class MarkovHead(nn.Module):
    """Low-rank bigram bias: ``bias(prev) = embed[prev] @ head.weight.T`` -> [..., V]."""

    def __init__(self, vocab_size: int, rank: int):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, rank)
        self.head = nn.Linear(rank, vocab_size, bias=False)

    def features(self, prev_ids: torch.Tensor) -> torch.Tensor:
        """The Markov embedding ``W1[prev]`` [..., r] (also the confidence head's input)."""
        return self.embed(prev_ids.long()).float()

    def forward(self, prev_ids: torch.Tensor) -> torch.Tensor:
        """Bias [..., V] for the position after ``prev_ids`` [...]."""
        return F.linear(self.features(prev_ids), self.head.weight.float())


class ConfidenceHead(nn.Module):
    """``logit_k = w . [h_k; markov_embed(prev_k)]``; ``sigmoid`` gives the conditional survival."""

    def __init__(self, hidden: int, rank: int):
        super().__init__()
        self.proj = nn.Linear(hidden + rank, 1, bias=False)

    def forward(self, hidden: torch.Tensor, markov_features: torch.Tensor) -> torch.Tensor:
        """``hidden`` [..., D], ``markov_features`` [..., r] -> logits [...] (fp32)."""
        features = torch.cat((hidden.float(), markov_features.float()), dim=-1)
        return F.linear(features, self.proj.weight.float()).squeeze(-1)


class DSparkBlock(Block):
    """One drafter layer: a backbone block (window-only attention, the drafter's MoE).

    The first layer also owns the context projection (``main_proj``, ``main_norm``), the
    last one the final ``norm``, the Markov head and the confidence head, as released.
    """

    def __init__(self, config: TextConfig, index: int, first: bool, last: bool):
        drafter = dataclasses.replace(
            config, n_routed_experts=config.dspark_n_routed_experts, num_experts_per_tok=config.dspark_num_experts_per_tok
        )
        plan = LayerPlan(
            index=config.num_hidden_layers + index,
            half="decoder",
            compress_ratio=0,
            mode=AttentionMode.WINDOW,
            kv_source=None,
            index_source=None,
            candidate_source=None,
            is_candidate_source=False,
            has_engram=False,
        )
        super().__init__(drafter, plan)
        d = config.hidden_size
        if first:
            self.main_proj = nn.Linear(len(config.dspark_target_layer_ids) * d, d, bias=False)
            self.main_norm = RMSNorm(d, config.rms_norm_eps)
        if last:
            self.norm = RMSNorm(d, config.rms_norm_eps)
            self.markov_head = MarkovHead(config.vocab_size, config.dspark_markov_rank)
            self.confidence_head = ConfidenceHead(d, config.dspark_markov_rank)


@dataclass
class DraftKeys:
    """The drafter's :class:`~model.transformer.Keys`: each request's block of K
    positions (rotary ``cos``, ``sin`` [B, K, rd]) reads its drafter layer's context
    entries [B, T, hd] (``contexts`` by layer index) where ``in_window`` [B, T], and the
    whole block's own window entries both ways (``mask`` [B, K, T + K], the two
    together). With ``compiled`` (a :class:`model.runtime.compiled.CompiledBlocks`) the
    attention input is the flat [B * K, D] and runs compiled."""

    cos: torch.Tensor
    sin: torch.Tensor
    mask: torch.Tensor
    in_window: torch.Tensor
    contexts: dict[int, torch.Tensor]
    compiled: Callable | None = None

    def attend(self, block: Block, h: torch.Tensor) -> torch.Tensor:
        context, cos, sin = self.contexts[block.plan.index], self.cos, self.sin
        if self.compiled is not None:
            k = cos.shape[1]
            return self.compiled.draft_attention(block.attn, h.unflatten(0, (-1, k)), cos, sin, context,
                                                 self.in_window).flatten(0, 1)
        q, _ = block.attn.queries(h, cos, sin)
        keys = torch.cat((context.to(h.dtype), _window_entries(block, h, cos, sin)), dim=1)
        return block.attn.output(block.attn.attend(q, keys, self.mask), cos, sin)


@dataclass
class Draft:
    """One parallel draft pass: ``hidden`` [B, K, D] (collapsed, before the final norm) and
    ``logits`` [B, K, V] (fp32, before the Markov bias); position ``k`` guesses token ``p + k + 1``."""

    hidden: torch.Tensor
    logits: torch.Tensor


@dataclass
class Proposal:
    """Drafted tokens [B, K], their logits with the Markov bias [B, K, V], the conditional
    survival ``confidence`` c_k [B, K] (uncalibrated; its logits ``confidence_logits``) and
    the prefix survival ``survival`` prod c [B, K]."""

    tokens: torch.Tensor
    logits: torch.Tensor
    confidence: torch.Tensor
    survival: torch.Tensor
    confidence_logits: torch.Tensor | None = None


class DSparkDrafter(nn.Module):
    """The DSpark drafter. ``named_parameters()`` gives the released ``mtp.S.*`` names."""

    def __init__(self, config: TextConfig):
        super().__init__()
        n = config.num_nextn_predict_layers
        if n < 1:
            raise ConfigError("num_nextn_predict_layers is 0: this config has no DSpark drafter")
        if not config.dspark_target_layer_ids:
            raise ConfigError("dspark_target_layer_ids is empty")
        self.config = config
        self.block_size = config.dspark_block_size
        self.noise_token_id = config.dspark_noise_token_id
        self.window = config.sliding_window
        self.mtp = nn.ModuleList(DSparkBlock(config, s, first=s == 0, last=s == n - 1) for s in range(n))
        self.rotary = Rotary(config.rope_spec("main"), config.qk_rope_head_dim)

    @property
    def markov_head(self) -> MarkovHead:
        return self.mtp[-1].markov_head

    @property
    def confidence_head(self) -> ConfidenceHead:
        return self.mtp[-1].confidence_head

    # ------------------------------------------------------------------ context
    def project_context(self, target_streams: torch.Tensor) -> torch.Tensor:
        """Attention-input streams of the target layers [B, T, n_targets, hc, D] -> main_x [B, T, D].

        ``n_targets`` in the order of ``dspark_target_layer_ids``.
        """
        if target_streams.ndim != 5 or target_streams.shape[2] != len(self.config.dspark_target_layer_ids):
            raise ValueError(f"expected [B, T, {len(self.config.dspark_target_layer_ids)}, hc, D], got {tuple(target_streams.shape)}")
        first = self.mtp[0]
        features = target_streams.float().mean(dim=-2).flatten(-2)  # [B, T, n_targets * D]
        return first.main_norm(first.main_proj(features.to(first.main_proj.weight.dtype)))

    def context_entries(self, main_x: torch.Tensor, positions: torch.Tensor) -> list[torch.Tensor]:
        """main_x [B, T, D] at ``positions`` [B, T] -> each layer's window entries [B, T, head_dim]."""
        cos, sin = self.rotary(positions)
        return [_window_entries(block, main_x, cos, sin) for block in self.mtp]

    # ------------------------------------------------------------------ draft
    def block_ids(self, anchor_ids: torch.Tensor) -> torch.Tensor:
        """[B] anchors -> [B, K] block inputs: the anchor then noise placeholders."""
        ids = torch.full((anchor_ids.shape[0], self.block_size), self.noise_token_id, dtype=torch.long, device=anchor_ids.device)
        ids[:, 0] = anchor_ids
        return ids

    def draft(
        self,
        entries: Sequence[torch.Tensor],
        entry_positions: torch.Tensor,
        anchor_ids: torch.Tensor,
        anchor_positions: torch.Tensor,
        embed: nn.Module,
        head: nn.Module,
        run_block: Callable | None = None,
    ) -> Draft:
        """The parallel pass over one block per request.

        ``entries``: per layer [B, T, head_dim] (from :meth:`context_entries`, possibly a
        cached window); ``entry_positions`` [B, T]; ``anchor_ids`` / ``anchor_positions``
        [B]; ``embed`` / ``head`` the backbone's embedding and output head. Entries at or
        after the anchor's position, or more than ``sliding_window`` before it, are ignored.
        Differentiable (training); inference callers run it under ``no_grad``.
        ``run_block`` (inference, a :class:`model.runtime.compiled.CompiledBlocks`): runs
        each layer in place of :meth:`~model.transformer.Block.forward` over the flat
        [B * K] tokens, its attention through ``run_block.draft_attention``.
        """
        if len(entries) != len(self.mtp):
            raise ValueError(f"{len(entries)} entry tensors for {len(self.mtp)} drafter layers")
        k = self.block_size
        x = embed(self.block_ids(anchor_ids)).float()  # [B, K, D]
        streams = x.unsqueeze(-2).expand(*x.shape[:-1], self.config.hc_mult, x.shape[-1]).contiguous()
        pre = mhc.first_pre(streams)
        positions = anchor_positions.long().unsqueeze(-1) + torch.arange(k, device=x.device)  # [B, K]
        cos, sin = self.rotary(positions)
        before = anchor_positions.long().unsqueeze(-1) - entry_positions.long()  # [B, T]
        in_window = (before > 0) & (before <= self.window)
        mask = torch.cat(
            (in_window.unsqueeze(1).expand(-1, k, -1), torch.ones(x.shape[0], k, k, dtype=torch.bool, device=x.device)),
            dim=-1,
        )  # [B, K, T + K]: the window before the anchor, and the whole block both ways
        keys = DraftKeys(cos, sin, mask, in_window, {block.plan.index: c for block, c in zip(self.mtp, entries)},
                         run_block)
        if run_block is None:
            streams, pre = run_blocks(self.mtp, streams, pre, keys)
        else:  # the compiled blocks run over the flat [B * K] tokens
            streams, pre = (t.unflatten(0, (-1, k)) for t in run_blocks(
                self.mtp, streams.flatten(0, 1), pre.flatten(0, 1), keys, run_block=run_block))
        hidden = mhc.collapse(streams, pre).float()
        logits = head(self.mtp[-1].norm(hidden).to(head.weight.dtype)).float()
        return Draft(hidden=hidden, logits=logits)

    @torch.no_grad()
    def forward(
        self,
        target_streams: torch.Tensor,
        anchor_ids: torch.Tensor,
        embed: nn.Module,
        head: nn.Module,
        positions: torch.Tensor | None = None,
        anchor_positions: torch.Tensor | None = None,
    ) -> Draft:
        """Reference path from the target's streams [B, T, n_targets, hc, D] of positions
        ``positions`` [B, T] (default ``0..T-1``) to the draft of the block anchored at
        ``anchor_positions`` [B] (default ``T``)."""
        b, t = target_streams.shape[:2]
        device = target_streams.device
        if positions is None:
            positions = torch.arange(t, device=device).expand(b, t)
        if anchor_positions is None:
            anchor_positions = torch.full((b,), t, dtype=torch.long, device=device)
        entries = self.context_entries(self.project_context(target_streams), positions)
        return self.draft(entries, positions, anchor_ids, anchor_positions, embed, head)

    def teacher_forced(self, target_streams: torch.Tensor, input_ids: torch.Tensor, anchors: torch.Tensor,
                       embed: nn.Module, head: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        """Training blocks: for sequences ``input_ids`` [B, S] with their target streams
        [B, S, n_targets, hc, D] and anchor positions ``anchors`` [B, A] (each at most
        ``S - 1 - K``), the draft of every block with the Markov bias of the true
        previous tokens: (logits [B * A, K, V], confidence logits [B * A, K]).
        Position k of a block anchored at p guesses token ``p + k + 1``. Differentiable.
        """
        b, s = input_ids.shape
        positions = torch.arange(s, device=input_ids.device).expand(b, s)
        entries = self.context_entries(self.project_context(target_streams), positions)
        rows = torch.arange(b, device=input_ids.device).repeat_interleave(anchors.shape[1])  # [B * A]
        anchor_pos = anchors.reshape(-1).long()
        draft = self.draft([e[rows] for e in entries], positions[rows], input_ids[rows, anchor_pos], anchor_pos,
                           embed, head)
        prev = input_ids[rows[:, None], anchor_pos[:, None] + torch.arange(self.block_size, device=input_ids.device)]
        return self.markov_logits(draft.logits, prev), self.confidence_logits(draft.hidden, prev)

    # ------------------------------------------------------------------ heads
    def markov_logits(self, logits: torch.Tensor, prev_ids: torch.Tensor) -> torch.Tensor:
        """Teacher-forced Markov correction: ``logits`` [..., K, V] + bias of ``prev_ids`` [..., K]."""
        return logits.float() + self.markov_head(prev_ids)

    def confidence_logits(self, hidden: torch.Tensor, prev_ids: torch.Tensor) -> torch.Tensor:
        """Confidence logits [..., K] of ``hidden`` [..., K, D] given the previous tokens [..., K]."""
        return self.confidence_head(hidden, self.markov_head.features(prev_ids))

    @torch.no_grad()
    def propose(
        self,
        draft: Draft,
        anchor_ids: torch.Tensor,
        temperature: float = 0.0,
        generator: torch.Generator | None = None,
        pick: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> Proposal:
        """Pick the block's tokens left to right with the Markov bias.

        Greedy at temperature 0, else softmax sampling at ``temperature``; ``pick``
        (logits [B, V] with the bias -> tokens [B]) replaces both, e.g. the serving
        sampler of :mod:`model.runtime.speculative` with each request's own parameters.
        """
        prev = anchor_ids.long()
        tokens, logits, prevs = [], [], []
        for k in range(draft.logits.shape[1]):
            step = draft.logits[:, k].float() + self.markov_head(prev)  # [B, V]
            if pick is not None:
                pick_k = pick(step)
            elif temperature <= 0:
                pick_k = step.argmax(dim=-1)
            else:
                probs = torch.softmax(step / temperature, dim=-1)
                pick_k = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
            prevs.append(prev)
            tokens.append(pick_k)
            logits.append(step)
            prev = pick_k
        prev_ids = torch.stack(prevs, dim=1)
        confidence_logits = self.confidence_logits(draft.hidden, prev_ids)
        confidence = torch.sigmoid(confidence_logits)
        return Proposal(
            tokens=torch.stack(tokens, dim=1),
            logits=torch.stack(logits, dim=1),
            confidence=confidence,
            survival=confidence.cumprod(dim=-1),
            confidence_logits=confidence_logits,
        )


# ---------------------------------------------------------------------- training


@torch.no_grad()
def target_streams(model: nn.Module, input_ids: torch.Tensor, engram_ids: torch.Tensor | None,
                   layers: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The frozen backbone's reference forward, keeping what the drafter learns from:
    (logits [B, S, V], attention-input streams of ``layers`` [B, S, len(layers), hc, D])."""
    tap = Tap(tuple(layers))
    return model(input_ids, engram_ids, tap=tap), tap.features()


@dataclass
class DraftLoss:
    """The paper's training objective and its parts (each position-weighted by
    w_k = exp(-(k-1)/K), normalised by the weights' sum): ``ce`` cross-entropy of the
    true next tokens, ``tv`` the L1 distance between draft and target distributions,
    ``conf`` binary cross-entropy of the confidence head against c*_k = 1 - tv_k / 2;
    ``total`` = alpha_ce ce + alpha_tv tv + alpha_conf conf. ``acceptance`` [K]: the mean
    c*_k per position (detached), ``argmax_match`` [K] how often the draft's argmax
    equals the target's."""

    total: torch.Tensor
    ce: torch.Tensor
    tv: torch.Tensor
    conf: torch.Tensor
    acceptance: torch.Tensor
    argmax_match: torch.Tensor


def draft_loss(logits: torch.Tensor, confidence_logits: torch.Tensor, target_logits: torch.Tensor,
               target_ids: torch.Tensor, alpha_ce: float = 0.1, alpha_tv: float = 0.9,
               alpha_conf: float = 1.0) -> DraftLoss:
    """``logits`` [N, K, V] (with the teacher-forced Markov bias), ``confidence_logits``
    [N, K], ``target_logits`` [N, K, V] the frozen backbone's at the same positions,
    ``target_ids`` [N, K] the tokens that follow."""
    k = logits.shape[1]
    weights = torch.exp(-torch.arange(k, dtype=torch.float32, device=logits.device) / k)  # w_k, k from 0
    norm = weights.sum() * logits.shape[0]
    ce = F.cross_entropy(logits.flatten(0, 1).float(), target_ids.flatten(), reduction="none").view_as(target_ids)
    draft_p = torch.softmax(logits.float(), dim=-1)
    target_p = torch.softmax(target_logits.float(), dim=-1)
    l1 = (draft_p - target_p).abs().sum(dim=-1)  # [N, K]
    soft_accept = (1.0 - 0.5 * l1.detach()).clamp(0.0, 1.0)
    conf = F.binary_cross_entropy_with_logits(confidence_logits.float(), soft_accept, reduction="none")
    ce_, tv_, conf_ = ((x * weights).sum() / norm for x in (ce, l1, conf))
    match = (logits.argmax(-1) == target_logits.argmax(-1)).float().mean(0)
    return DraftLoss(alpha_ce * ce_ + alpha_tv * tv_ + alpha_conf * conf_, ce_, tv_, conf_,
                     soft_accept.mean(0), match)
