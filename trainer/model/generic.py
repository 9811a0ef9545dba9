"""The generic path: any decoder-only transformers model whose decoder layers form one list, computed by
transformers' own modules over the streamed weights (``torch.func.functional_call``).

The model class is built once from config.json on the meta device, as ``from_pretrained`` builds it (no memory;
its buffers, such as rotary frequencies or an embedding scale, are then made real, drawn by the model's own
``_init_weights``, and copied to the compute device).
Its parameters become the store's groups by where their modules sit in the backbone: those registered
before the layer list are the "embed" group, each layer its own group, those after the list and the LM head
the "head" group. The stages then run:

- embedding: the backbone's own forward with the streamed embedding weights, stopped as it enters the
  layers; what it hands each layer besides the hidden states (rotary embeddings, the attention mask of that
  layer's kind, position ids) is kept per micro-batch for the layers' forward and recompute, and its
  backward is the autograd of that same run (an embedding scale, a padding row are the model's own);
- a layer: the layer module called over its streamed weights with what the backbone handed it;
- the head: the modules after the layers (the final norm) and the causal-LM class's own forward from the
  final hidden states (its LM head and any logit soft-capping), chunked over tokens for the loss.

A mixture-of-experts model's routers are the modules transformers records router logits from
(``_can_record_outputs["router_logits"]``); where its causal-LM class adds the router's load-balancing loss
(``load_balancing_loss_func``, ``router_aux_loss_coef``) and config.json turns it on (``output_router_logits``),
the stages add it as the template does (``trainer.model.moe.RouterStats``: counted in the forward, each layer's
share differentiated in its backward). The checkpoint's own layout on disk (experts one tensor each) against the
fused tensors the store holds: ``trainer.model.disk_layout``.

The model as read from config.json (its class, skeleton, routers and weights): ``trainer.model.generic_config``.
transformers is needed for this path only (``pip install 'tiermem[generic]'``). A model it cannot take is
refused with one line naming what is missing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.func import functional_call

from trainer.model.generic_config import GenericConfig
from trainer.model.moe import RouterStats


class _Entered(Exception):
    """Raised by the last layer's stand-in: the backbone's forward has handed every layer its inputs."""


@dataclass
class Inputs:
    """What the backbone handed each layer of one micro-batch besides the hidden states."""

    per_layer: list = field(default_factory=list)  # (args, kwargs) of each layer
    router: RouterStats | None = None  # a mixture of experts' load-balancing loss, while it is on


def _relative(params: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    n = len(prefix) + 1
    return {k[n:]: v for k, v in params.items() if k.startswith(prefix + ".")}


class GenericStages:
    """The executor's stages (see ``trainer.model.stages``) computed by the transformers model's modules."""

    embed_grads_need_weights = True  # the embedding's backward reruns the backbone's entry

    def __init__(self, cfg: GenericConfig, dtype: torch.dtype, device: torch.device):
        self.cfg, self.dtype, self.device = cfg, dtype, device
        self.embed_name, self.head_name = cfg.embed_name, cfg.head_weight
        model = cfg.model
        self.backbone = getattr(model, cfg.backbone_name)
        self.layers = model.get_submodule(cfg.layers_name)
        self.buffers = {n: b.to(device) for n, b in model.named_buffers()}  # (as built: fp32)

    @property
    def aux_loss_coef(self) -> float:
        return self.cfg.moe.aux_loss_coef if self.cfg.moe is not None else 0.0

    # -- embedding ---------------------------------------------------------------------------------
    def _enter(self, w: dict[str, torch.Tensor], ids: torch.Tensor) -> tuple[torch.Tensor, Inputs]:
        """Run the backbone's forward with the embedding weights ``w`` until it enters the layers: (the first
        layer's hidden states, what each layer was handed besides)."""
        got = Inputs([None] * self.cfg.num_layers)
        first: list[torch.Tensor] = []
        last = self.cfg.num_layers - 1

        def stand_in(i):
            def forward(hidden_states, *args, **kwargs):
                if i == 0:
                    first.append(hidden_states)
                got.per_layer[i] = (args, kwargs)
                if i == last:
                    raise _Entered
                return hidden_states
            return forward

        for i, layer in enumerate(self.layers):
            layer.forward = stand_in(i)
        params = dict(_relative(self.buffers, self.cfg.backbone_name))
        params.update(_relative(w, self.cfg.backbone_name))
        try:
            functional_call(self.backbone, params, (), {"input_ids": ids, "use_cache": False})
        except _Entered:
            pass
        finally:
            for layer in self.layers:
                del layer.forward
        if not first or any(p is None for p in got.per_layer):
            raise RuntimeError(f"{self.cfg.arch}: the backbone's forward did not call every layer once")
        for i, (args, kwargs) in enumerate(got.per_layer):
            got.per_layer[i] = (_detached(args), _detached(kwargs))
        return first[0], got

    def contexts(self, ids: list[torch.Tensor], masks: list, n_micro: int, train: bool) -> list[Inputs]:
        """(Filled by embed) with, on a training step whose load-balancing loss is on, each micro-batch's router
        statistics, weighted for the step's loss as the template's (``TemplateStages.contexts``)."""
        coef = self.aux_loss_coef if train else 0.0
        return [Inputs(router=RouterStats(m, x.numel(), self.cfg.moe, coef / n_micro, self.device) if coef else None)
                for x, m in zip(ids, masks)]

    def embed(self, w: dict[str, torch.Tensor], ids: torch.Tensor, ctx: Inputs) -> torch.Tensor:
        h, got = self._enter(w, ids)
        ctx.per_layer = got.per_layer
        return h.detach()

    def embed_grads(self, w: dict[str, torch.Tensor], ids: list[torch.Tensor], grads_h: list[torch.Tensor],
                    ctxs: list[Inputs], tied_grad: torch.Tensor | None,
                    acc: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        leaves = {k: t.detach().requires_grad_() for k, t in w.items()}
        if acc is None:
            acc = {k: torch.zeros(t.shape, dtype=torch.float32, device=self.device) for k, t in w.items()}
        for x, g in zip(ids, grads_h):
            with torch.enable_grad():
                h, _ = self._enter(leaves, x)
                got = torch.autograd.grad(h, list(leaves.values()), g, allow_unused=True)
            for k, gk in zip(leaves, got):
                if gk is not None:
                    acc[k].add_(gk)
        if tied_grad is not None:
            acc[self.embed_name].add_(tied_grad)
        return acc

    # -- layers ------------------------------------------------------------------------------------
    def _call_layer(self, i: int, w: dict[str, torch.Tensor], x: torch.Tensor, ctx: Inputs) -> torch.Tensor:
        args, kwargs = ctx.per_layer[i]
        params = dict(_relative(self.buffers, f"{self.cfg.layers_name}.{i}"))
        params.update(w)
        hooks = []
        if ctx.router is not None and i in self.cfg.moe.sparse_layers:  # its router's logits to the statistics
            target, index = self.cfg.routers
            seen = ctx.router

            def observe(module, inputs, output):
                logits = output[index] if isinstance(output, (tuple, list)) else output
                top_i = torch.topk(torch.softmax(logits.float(), dim=-1), self.cfg.moe.top_k, dim=-1).indices
                seen.observe(logits, top_i)

            hooks = [m.register_forward_hook(observe) for m in self.layers[i].modules() if isinstance(m, target)]
        try:
            out = functional_call(self.layers[i], params, (x, *args), kwargs)
        finally:
            for h in hooks:
                h.remove()
        return out[0] if isinstance(out, tuple) else out

    def chunk(self, x: torch.Tensor, ctx: Inputs) -> None:
        """The generic path runs every row whole through the model's own layer (sequence chunks are the
        template's: ``trainer.model.chunked``)."""
        return None

    def layer(self, i: int, w: dict[str, torch.Tensor], x: torch.Tensor, ctx: Inputs) -> torch.Tensor:
        return self._call_layer(i, w, x, ctx)

    def layer_backward(self, i: int, w: dict[str, torch.Tensor], x: torch.Tensor, gy: torch.Tensor, ctx: Inputs):
        x = x.detach().requires_grad_()
        leaves = {k: t.detach().requires_grad_() for k, t in w.items()}
        with torch.enable_grad():
            y = self._call_layer(i, leaves, x, ctx)
            outs, grads = [y], [gy]
            term = ctx.router.take_term() if ctx.router is not None else None
            if term is not None:  # (the layer's share of the load-balancing loss)
                outs.append(term)
                grads.append(torch.ones_like(term))
            res = torch.autograd.grad(outs, [x, *leaves.values()], grads, allow_unused=True)
        return res[0], [g if g is not None else torch.zeros_like(t) for g, t in zip(res[1:], leaves.values())]

    def layer_graph(self, i: int, w: dict[str, torch.Tensor], x: torch.Tensor, ctx: Inputs):
        """As the template's: the layer's forward keeping its graph, for a backward without recompute."""
        from trainer.model.stages import keep_graph

        return keep_graph(lambda leaves, x_: self._call_layer(i, leaves, x_, ctx), w, x)

    def graph_backward(self, graph, gy: torch.Tensor):
        from trainer.model.stages import backward_of

        return backward_of(graph, gy)

    def forward_done(self, ctxs: list[Inputs]) -> torch.Tensor | None:
        terms = [c.router.weight * c.router.freeze() for c in ctxs if c.router is not None]
        return sum(terms) if terms else None

    # -- head --------------------------------------------------------------------------------------
    def _final(self, h: torch.Tensor, w: dict[str, torch.Tensor]) -> torch.Tensor:
        for name in self.cfg.head_modules:
            module = self.cfg.model.get_submodule(name)
            h = functional_call(module, {**_relative(self.buffers, name), **_relative(w, name)}, (h,))
        return h

    def _logits(self, normed: torch.Tensor, head_w: torch.Tensor) -> torch.Tensor:
        """The causal-LM class's own forward from final hidden states ``normed`` [1, n, H]: its LM head and
        whatever it applies to the logits (soft-capping, scaling)."""
        out = _backbone_output()(last_hidden_state=normed)
        self.backbone.forward = lambda *a, **k: out
        try:
            res = functional_call(self.cfg.model, {self.head_name: head_w}, (),
                                  {"inputs_embeds": normed, "use_cache": False})
        finally:
            del self.backbone.forward
        return res.logits

    def _head_weight(self, w: dict[str, torch.Tensor], tied: dict[str, torch.Tensor] | None) -> torch.Tensor:
        return tied[self.embed_name] if tied is not None else w[self.head_name]

    def head_loss_backward(self, h: torch.Tensor, targets: torch.Tensor, w: dict[str, torch.Tensor],
                           tied: dict[str, torch.Tensor] | None, scale: float, chunk: int,
                           acc: dict[str, torch.Tensor] | None = None, tied_acc: torch.Tensor | None = None):
        own = {k: t.detach().requires_grad_() for k, t in w.items() if k != self.head_name}
        hw = self._head_weight(w, tied).detach().requires_grad_()
        x = h.detach().requires_grad_()
        with torch.enable_grad():
            normed = self._final(x, own)
        flat = normed.detach().reshape(-1, normed.shape[-1])
        tgt = targets.reshape(-1)
        grad_flat = torch.empty_like(flat)
        g_hw = tied_acc if tied is not None else (acc[self.head_name] if acc is not None else None)
        if g_hw is None:
            g_hw = torch.zeros(hw.shape, dtype=torch.float32, device=hw.device)
        loss = torch.zeros((), dtype=torch.float32, device=h.device)
        for s in range(0, flat.shape[0], chunk):
            xc = flat[s: s + chunk].requires_grad_()
            with torch.enable_grad():
                logits = self._logits(xc.unsqueeze(0), hw)[0].float()
                part = F.cross_entropy(logits, tgt[s: s + chunk], ignore_index=-100, reduction="sum")
                gx, gw = torch.autograd.grad(part * scale, [xc, hw])
            grad_flat[s: s + chunk] = gx
            g_hw += gw
            loss += part.detach()
        with torch.enable_grad():
            res = torch.autograd.grad(normed, [x, *own.values()], grad_flat.view_as(normed), allow_unused=True)
        grads = {k: (g if g is not None else torch.zeros_like(t)).float() for (k, t), g in zip(own.items(), res[1:])}
        if acc is not None:
            for k, g in grads.items():
                acc[k].add_(g)
            grads = {k: acc[k] for k in grads}
        if tied is not None:
            return loss, res[0], grads, g_hw
        grads[self.head_name] = g_hw
        return loss, res[0], grads, None

    def head_loss(self, h: torch.Tensor, targets: torch.Tensor, w: dict[str, torch.Tensor],
                  tied: dict[str, torch.Tensor] | None, chunk: int) -> torch.Tensor:
        hw = self._head_weight(w, tied)
        flat = self._final(h, w).reshape(-1, h.shape[-1])
        tgt = targets.reshape(-1)
        loss = torch.zeros((), dtype=torch.float32, device=h.device)
        for s in range(0, flat.shape[0], chunk):
            logits = self._logits(flat[s: s + chunk].unsqueeze(0), hw)[0].float()
            loss += F.cross_entropy(logits, tgt[s: s + chunk], ignore_index=-100, reduction="sum")
        return loss


_OUTPUT = []


def _backbone_output():
    """A backbone's output holding only the last hidden states (any other field a causal-LM class reads from
    it, such as cross-attentions, is None)."""
    if not _OUTPUT:
        from transformers.modeling_outputs import BaseModelOutputWithPast

        class Hidden(BaseModelOutputWithPast):
            def __getattr__(self, name):
                if name.startswith("__"):
                    raise AttributeError(name)
                return None

        _OUTPUT.append(Hidden)
    return _OUTPUT[0]


def _detached(value):
    """``value`` (tensors in tuples, lists, dicts) with every tensor detached: what the backbone computed for
    the layers from positions alone (rotary tables, masks) carries no gradient."""
    if isinstance(value, torch.Tensor):
        return value.detach()
    if isinstance(value, tuple):
        return tuple(_detached(v) for v in value)
    if isinstance(value, list):
        return [_detached(v) for v in value]
    if isinstance(value, dict):
        return {k: _detached(v) for k, v in value.items()}
    return value
