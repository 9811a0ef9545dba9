"""The template's computation in the executor's terms: per-micro-batch contexts, the embedding, one decoder
layer forward, its backward by recompute, the final norm + LM head loss, and the embedding's gradient.

The executor (``trainer.run.executor``) runs a step layer-major over these, whatever computes them: this
hand-written template for the Llama family, its MoE members and gpt-oss, or ``trainer.model.generic`` for other
transformers models (the same methods). Weights come as dicts: the embedding's and the head's by full
name, a layer's by names relative to the layer. Gradients come back in fp32.

A sparse model's load-balancing loss (``trainer.model.moe``) lives in the contexts: each micro-batch's
``RouterStats`` counts during the forward, ``forward_done`` freezes them and returns the step's loss term,
and each layer's backward differentiates the layer's share of it along with the layer's output.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from trainer.model import chunked
from trainer.model.compiled import chunk_parts, layer_function
from trainer.model.config import ModelConfig
from trainer.model.layers import head_loss, head_loss_backward
from trainer.model.moe import RouterStats
from trainer.model.rope import Rope
from trainer.model.weights import EMBED, LM_HEAD, NORM


@dataclass
class MicroBatch:
    """What a micro-batch's layers need besides their weights and input."""

    rope: tuple
    router: RouterStats | None = None


class TemplateStages:
    embed_name = EMBED
    norm_name = NORM
    head_name = LM_HEAD
    embed_grads_need_weights = False  # the embedding's gradient is a scatter of the input gradients

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device):
        self.cfg, self.dtype, self.device = cfg, dtype, device
        self._rope = Rope(cfg.rope, cfg.head_dim, cfg.max_position_embeddings, device, dtype)
        self._layer = layer_function(cfg.compile)  # (decoder_layer, or compiled: torch_compile)
        self._parts = chunk_parts(cfg.compile)  # (a long row's layer in sequence chunks: trainer.model.chunked)

    @property
    def parts(self) -> tuple:
        """The (pre-attention, post-attention) functions of a layer over a row cut into chunks (compiled or not)."""
        return self._parts

    @property
    def aux_loss_coef(self) -> float:
        return self.cfg.moe.aux_loss_coef if self.cfg.moe is not None else 0.0

    def contexts(self, ids: list[torch.Tensor], masks: list, n_micro: int, train: bool) -> list[MicroBatch]:
        """One context per micro-batch of ``ids`` (with their padding ``masks``, None: no padding); on a
        training step of ``n_micro`` micro-batches in all, a sparse model's router statistics, each weighted
        for the step's loss (the mean over its micro-batches of their load-balancing losses, times the
        coefficient)."""
        coef = self.aux_loss_coef if train else 0.0
        return [MicroBatch(self._rope.tables(x.shape[1]),
                           RouterStats(m, x.numel(), self.cfg.moe, coef / n_micro, self.device) if coef else None)
                for x, m in zip(ids, masks)]

    def embed(self, w: dict[str, torch.Tensor], ids: torch.Tensor, ctx: MicroBatch) -> torch.Tensor:
        return F.embedding(ids, w[EMBED])

    def chunk(self, x: torch.Tensor, ctx: MicroBatch) -> int | None:
        """The tokens of each row a layer over ``x`` computes at once (``trainer.model.chunked``), or None: the
        row whole (a short row, or a layer whose router counts for the load-balancing loss: the config refuses
        such rows where they would be cut)."""
        if ctx.router is not None:
            return None
        return chunked.chunk_of(self.cfg.seq_chunk, x.shape[0], x.shape[1])

    def layer(self, i: int, w: dict[str, torch.Tensor], x: torch.Tensor, ctx: MicroBatch) -> torch.Tensor:
        """Decoder layer ``i`` over ``x`` with its weights ``w`` (no gradient)."""
        c = self.chunk(x, ctx)
        if c is not None:
            return chunked.forward(w, x, ctx.rope, self.cfg, self.cfg.window(i), c, self._parts)
        return self._layer(w, x, ctx.rope, self.cfg, ctx.router, self.cfg.window(i))

    def forward_done(self, ctxs: list[MicroBatch]) -> torch.Tensor | None:
        """The forward of these micro-batches is complete: freeze their router statistics; the weighted sum
        of their load-balancing losses (None without)."""
        terms = [c.router.weight * c.router.freeze() for c in ctxs if c.router is not None]
        return sum(terms) if terms else None

    def layer_backward(self, i: int, w: dict[str, torch.Tensor], x: torch.Tensor, gy: torch.Tensor, ctx: MicroBatch):
        """Recompute the layer from its input ``x`` and backpropagate ``gy`` (plus the layer's share of the
        load-balancing loss): (input gradient, the weights' gradients in ``w``'s order). Over a row cut into chunks
        the input gradient is written over ``gy`` (``trainer.model.chunked.backward``)."""
        c = self.chunk(x, ctx)
        if c is not None:
            return chunked.backward(w, x, gy, ctx.rope, self.cfg, self.cfg.window(i), c, self._parts)
        x = x.detach().requires_grad_()
        leaves = {k: t.detach().requires_grad_() for k, t in w.items()}
        with torch.enable_grad():
            y = self._layer(leaves, x, ctx.rope, self.cfg, ctx.router, self.cfg.window(i))
            outs, grads = [y], [gy]
            term = ctx.router.take_term() if ctx.router is not None else None
            if term is not None:
                outs.append(term)
                grads.append(torch.ones_like(term))
            res = torch.autograd.grad(outs, [x, *leaves.values()], grads, allow_unused=True)
        return res[0], [g if g is not None else torch.zeros_like(t) for g, t in zip(res[1:], leaves.values())]

    def layer_graph(self, i: int, w: dict[str, torch.Tensor], x: torch.Tensor, ctx: MicroBatch):
        """Decoder layer ``i``'s forward keeping its autograd graph (its activations), for a backward without
        the recompute: (output, graph). Over a row cut into chunks, the attention's graph alone (its backward
        recomputes the token-wise chunks, not q/k/v nor the attention: ``trainer.model.chunked``). Not for a layer
        whose router feeds the load-balancing loss."""
        window = self.cfg.window(i)
        c = self.chunk(x, ctx)
        if c is not None:
            y, kept = chunked.forward(w, x, ctx.rope, self.cfg, window, c, self._parts, keep=True)
            return y, ChunkedGraph(w, x, ctx.rope, window, c, kept)
        return keep_graph(lambda leaves, x_: self._layer(leaves, x_, ctx.rope, self.cfg, ctx.router, window), w, x)

    def graph_backward(self, graph, gy: torch.Tensor):
        if isinstance(graph, ChunkedGraph):
            g = graph
            return chunked.backward(g.w, g.x, gy, g.rope, self.cfg, g.window, g.chunk, self._parts, g.kept)
        return backward_of(graph, gy)

    def head_loss_backward(self, h: torch.Tensor, targets: torch.Tensor, w: dict[str, torch.Tensor],
                           tied: dict[str, torch.Tensor] | None, scale: float, chunk: int,
                           acc: dict[str, torch.Tensor] | None = None, tied_acc: torch.Tensor | None = None):
        """Summed cross-entropy of the head over ``targets`` and its backward for ``sum * scale``: (loss sum,
        grad of h, {head weight: grad}, the tied embedding's grad or None). ``acc`` ({head weight: fp32
        tensor}) and ``tied_acc``: the gradients are added into them and they are returned (a step's sums over
        micro-batches, with no vocab x hidden tensor of one micro-batch's alone)."""
        head_w = tied[EMBED] if tied is not None else w[LM_HEAD]
        into = tied_acc if tied is not None else (acc[LM_HEAD] if acc is not None else None)
        loss, gh, gnw, ghw = head_loss_backward(h, targets, w[NORM], head_w, self.cfg.rms_norm_eps, scale, chunk,
                                                into, self.cfg.norm_weight_fp32)
        if acc is not None:
            acc[NORM].add_(gnw)
            gnw = acc[NORM]
        if tied is not None:
            return loss, gh, {NORM: gnw}, ghw
        return loss, gh, {NORM: gnw, LM_HEAD: ghw}, None

    def head_loss(self, h: torch.Tensor, targets: torch.Tensor, w: dict[str, torch.Tensor],
                  tied: dict[str, torch.Tensor] | None, chunk: int) -> torch.Tensor:
        head_w = tied[EMBED] if tied is not None else w[LM_HEAD]
        return head_loss(h, targets, w[NORM], head_w, self.cfg.rms_norm_eps, chunk, self.cfg.norm_weight_fp32)

    def embed_grads(self, w: dict[str, torch.Tensor], ids: list[torch.Tensor], grads_h: list[torch.Tensor],
                    ctxs: list[MicroBatch], tied_grad: torch.Tensor | None,
                    acc: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """The embedding's gradient: every micro-batch's input gradient, plus the tied LM head's. As Hugging
        Face's padding_idx, the lookups of the pad token add nothing to its row; a tied head's gradient of
        that row stays. ``acc`` ({embedding: fp32 tensor}): added into it, and it is returned."""
        cfg = self.cfg
        hidden = cfg.hidden_size
        if acc is not None:
            g = acc[EMBED]
            if tied_grad is not None:
                g.add_(tied_grad)
        else:
            g = tied_grad if tied_grad is not None else torch.zeros((cfg.vocab_size, hidden), dtype=torch.float32,
                                                                     device=self.device)
        pad = cfg.pad_token_id if cfg.pad_token_id is not None and 0 <= cfg.pad_token_id < cfg.vocab_size else None
        pad_row = g[pad].clone() if pad is not None else None
        for x, gy in zip(ids, grads_h):
            g.index_add_(0, x.reshape(-1), gy.reshape(-1, hidden).float())
        if pad is not None:
            g[pad] = pad_row
        return {EMBED: g}


@dataclass
class ChunkedGraph:
    """What a kept layer over a row cut into chunks holds until its backward: its weights (a group that lives in
    HBM), its input, the micro-batch's RoPE tables, its window and chunk, and the attention's graph."""

    w: dict
    x: torch.Tensor
    rope: tuple
    window: int | None
    chunk: int
    kept: tuple


def keep_graph(fn, w: dict[str, torch.Tensor], x: torch.Tensor):
    """``fn(leaves, x)`` with gradients on: its output detached, and (input leaf, weight leaves, output) for
    ``backward_of``. The weights must stay in place until then (a group that lives in HBM)."""
    x = x.detach().requires_grad_()
    leaves = {k: t.detach().requires_grad_() for k, t in w.items()}
    with torch.enable_grad():
        y = fn(leaves, x)
    return y.detach(), (x, leaves, y)


def backward_of(graph, gy: torch.Tensor):
    """The kept layer's backward of ``gy``: (input gradient, the weights' gradients in their order), as the
    recomputing backward returns them."""
    x, leaves, y = graph
    res = torch.autograd.grad(y, [x, *leaves.values()], gy, allow_unused=True)
    return res[0], [g if g is not None else torch.zeros_like(t) for g, t in zip(res[1:], leaves.values())]
