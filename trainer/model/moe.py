"""The mixture-of-experts feed-forward of a sparse layer (Qwen3-MoE, Mixtral, gpt-oss) and the router's
load-balancing loss, as plain functions of the weights they are handed.

Routing: the router's logits over the experts, their softmax in fp32, the top-k experts of each token and
their probabilities (renormalised to sum to one when ``norm_topk_prob``). The experts then run grouped:
the token-expert assignments are sorted by expert and each expert's SwiGLU runs over the tokens routed to
it, as grouped matmuls (``torch._grouped_mm`` over the experts' weights stacked: three kernels a layer, no
host sync) where torch has them for the dtype and device (CPU; bf16 on CUDA) and the rows are 16-byte
aligned, else one matmul chain per expert (a loop over experts, never over tokens;
``TIERMEM_MOE_GROUPED=0`` forces it). The weighted results are added back to their tokens.

gpt-oss routes otherwise: the router has a bias, and each token's top-k logits are softmaxed among themselves.
Its experts keep their weights stacked as its checkpoints store them, used in place (``gate_up_proj`` [E, H,
2I] takes ``x @ W`` and its even columns are the gate, the odd ones the up projection; ``down_proj`` [E, I,
H]), each projection with a bias per expert, and the activation is the clamped SwiGLU ``(clamp(up, -limit,
limit) + 1) * g * sigmoid(alpha g)``, ``g = min(gate, limit)``; grouped the same way.

The load-balancing loss of a micro-batch (transformers' ``load_balancing_loss_func`` with the attention
mask) is ``E * sum_e F_e * P_e`` over the E experts, where ``F_e`` is the share of all (layer, token, k)
assignments that went to expert e and ``P_e`` the mean router probability of e, both over the micro-batch's
non-padding tokens of every sparse layer. ``F`` carries no gradient (it counts a top-k), so the gradient
with respect to layer l's router is that of ``E * sum_e F_e * S_le / (L N)`` with ``F`` held fixed, where
``S_le`` sums layer l's probabilities of e over the tokens: ``RouterStats`` counts ``F`` and ``S`` during
the step's layer-major forward, then, frozen, turns each recomputed layer's probabilities into that term
for the backward to differentiate along with the layer's output.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F


def route(h: torch.Tensor, gate_w: torch.Tensor, top_k: int, norm_topk: bool):
    """Router of tokens ``h`` [N, H]: (logits [N, E], top-k weights [N, k] in h's dtype, expert ids [N, k])."""
    logits = F.linear(h, gate_w)
    probs = torch.softmax(logits.float(), dim=-1)
    top_w, top_i = torch.topk(probs, top_k, dim=-1)
    if norm_topk:
        top_w = top_w / top_w.sum(dim=-1, keepdim=True)
    return logits, top_w.to(h.dtype), top_i


def grouped_available(h: torch.Tensor, inter: int) -> bool:
    """Whether ``torch._grouped_mm`` takes experts over tokens ``h`` with intermediate size ``inter``."""
    if os.environ.get("TIERMEM_MOE_GROUPED", "1") == "0" or not hasattr(torch, "_grouped_mm"):
        return False
    if h.dtype not in ((torch.float32, torch.bfloat16) if h.device.type == "cpu" else (torch.bfloat16,)):
        return False
    align = 16 // h.element_size()
    return h.shape[-1] % align == 0 and inter % align == 0


def route_top_logits(h: torch.Tensor, gate_w: torch.Tensor, gate_b: torch.Tensor, top_k: int):
    """gpt-oss's router of tokens ``h`` [N, H]: (logits [N, E] with the bias, the softmax of each token's
    top-k logits [N, k] in their dtype, expert ids [N, k])."""
    logits = F.linear(h, gate_w, gate_b)
    top_v, top_i = torch.topk(logits, top_k, dim=-1)
    return logits, torch.softmax(top_v, dim=1, dtype=top_v.dtype), top_i


def clamped_swiglu(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's activation of an expert's interleaved gate and up columns [N, 2I] -> [N, I]."""
    gate = gate_up[..., ::2].clamp(min=None, max=limit)
    up = gate_up[..., 1::2].clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def _by_expert(top_i: torch.Tensor, n_experts: int):
    """The token-expert assignments sorted by expert: (their order in the flat [N k] assignments, each one's
    token, each one's expert, the count of each expert's)."""
    k = top_i.shape[1]
    flat = top_i.reshape(-1)
    order = torch.argsort(flat, stable=True)
    return order, order // k, flat[order], torch.bincount(flat, minlength=n_experts)


def stacked_experts(h: torch.Tensor, top_w: torch.Tensor, top_i: torch.Tensor, gate_up: torch.Tensor,
                    gate_up_b: torch.Tensor, down: torch.Tensor, down_b: torch.Tensor, alpha: float, limit: float,
                    grouped: bool | None = None) -> torch.Tensor:
    """gpt-oss's experts: each token's weighted sum of its top-k experts' outputs, ``h`` [N, H] and the stacked
    weights as stored (gate_up [E, H, 2I] and its bias [E, 2I], down [E, I, H] and its bias [E, H])."""
    order, token, expert, counts = _by_expert(top_i, gate_up.shape[0])
    xs = h[token]
    if grouped if grouped is not None else grouped_available(h, down.shape[1]):
        offs = torch.cumsum(counts, 0, dtype=torch.int32)
        act = clamped_swiglu(torch._grouped_mm(xs, gate_up, offs=offs) + gate_up_b[expert], alpha, limit)
        ys = torch._grouped_mm(act.contiguous(), down, offs=offs) + down_b[expert]
    else:
        outs, start = [], 0
        for e, n in enumerate(counts.tolist()):  # (one host sync per layer and micro-batch)
            if n:
                act = clamped_swiglu(xs[start: start + n] @ gate_up[e] + gate_up_b[e], alpha, limit)
                outs.append(act @ down[e] + down_b[e])
            start += n
        ys = torch.cat(outs)
    ys = ys * top_w.reshape(-1)[order].unsqueeze(-1)
    return torch.zeros_like(h).index_add(0, token, ys)


def experts(h: torch.Tensor, top_w: torch.Tensor, top_i: torch.Tensor, weights: list[tuple],
            grouped: bool | None = None) -> torch.Tensor:
    """Each token's weighted sum of its top-k experts' SwiGLU outputs: ``h`` [N, H], ``weights`` the
    experts' (gate [I, H], up [I, H], down [H, I]). Assignments sorted by expert; grouped matmuls over all
    experts at once (``grouped``; None: where available), else one matmul chain per expert over its tokens."""
    order, token, _, counts = _by_expert(top_i, len(weights))
    xs = h[token]
    if grouped if grouped is not None else grouped_available(h, weights[0][0].shape[0]):
        offs = torch.cumsum(counts, 0, dtype=torch.int32)
        gate_up = torch.cat([torch.stack([g for g, _, _ in weights]), torch.stack([u for _, u, _ in weights])], 1)
        down = torch.stack([d for _, _, d in weights])
        gate, up = torch._grouped_mm(xs, gate_up.transpose(-2, -1), offs=offs).chunk(2, dim=-1)
        ys = torch._grouped_mm(F.silu(gate) * up, down.transpose(-2, -1), offs=offs)
    else:
        outs, start = [], 0
        for (g, u, d), n in zip(weights, counts.tolist()):  # (one host sync per layer and micro-batch)
            if n:
                x = xs[start: start + n]
                outs.append(F.linear(F.silu(F.linear(x, g)) * F.linear(x, u), d))
            start += n
        ys = torch.cat(outs)
    ys = ys * top_w.reshape(-1)[order].unsqueeze(-1)
    return torch.zeros_like(h).index_add(0, token, ys)


def moe_ffn(w: dict[str, torch.Tensor], h: torch.Tensor, moe, router: RouterStats | None) -> torch.Tensor:
    """The sparse layer's feed-forward of ``h`` [B, T, H] with the layer's weights ``w`` (names relative to
    the layer); ``router`` collects what the load-balancing loss needs (None: no loss)."""
    b, t, hidden = h.shape
    flat = h.reshape(-1, hidden)
    p = moe.block + "."
    if moe.kind == "gpt_oss":
        logits, top_w, top_i = route_top_logits(flat, w[p + "router.weight"], w[p + "router.bias"], moe.top_k)
        if router is not None:
            router.observe(logits, top_i)
        e = p + "experts."
        return stacked_experts(flat, top_w, top_i, w[e + "gate_up_proj"], w[e + "gate_up_proj_bias"],
                               w[e + "down_proj"], w[e + "down_proj_bias"], moe.alpha, moe.limit).view(b, t, hidden)
    logits, top_w, top_i = route(flat, w[p + "gate.weight"], moe.top_k, moe.norm_topk_prob)
    if router is not None:
        router.observe(logits, top_i)
    gate, up, down = moe.proj
    ws = [(w[f"{p}experts.{e}.{gate}.weight"], w[f"{p}experts.{e}.{up}.weight"], w[f"{p}experts.{e}.{down}.weight"])
          for e in range(moe.num_experts)]
    return experts(flat, top_w, top_i, ws).view(b, t, hidden)


class RouterStats:
    """One micro-batch's routing over the sparse layers of a step, for its load-balancing loss.

    While counting (the forward), each sparse layer adds its top-k assignments per expert (``counts``) and
    its probabilities per expert (``prob_sums``), over the non-padding tokens. ``freeze`` fixes
    ``F = counts / (L N)`` and the loss value; from then on (the backward's recompute) each layer's
    ``observe`` leaves in ``term`` the layer's share of ``weight * loss`` with ``F`` held fixed, whose
    gradient is the loss's gradient with respect to that layer's router logits.
    """

    def __init__(self, mask: torch.Tensor | None, n_tokens: int, moe, weight: float, device: torch.device):
        self.mask = None if mask is None else mask.reshape(-1).to(device=device, dtype=torch.float32)
        self.valid = float(n_tokens) if mask is None else float(self.mask.sum())
        self.layers, self.num_experts, self.weight = len(moe.sparse_layers), moe.num_experts, weight
        self.counts = torch.zeros(moe.num_experts, dtype=torch.float32, device=device)
        self.prob_sums = torch.zeros(moe.num_experts, dtype=torch.float32, device=device)
        self.share: torch.Tensor | None = None  # F, once frozen
        self.term: torch.Tensor | None = None

    def _probs(self, logits: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(logits.float(), dim=-1)
        return probs if self.mask is None else probs * self.mask.unsqueeze(-1)

    def observe(self, logits: torch.Tensor, top_i: torch.Tensor) -> None:
        if self.share is None:
            with torch.no_grad():
                ones = (torch.ones(top_i.shape, device=top_i.device) if self.mask is None
                        else self.mask.unsqueeze(-1).expand(top_i.shape))
                self.counts.index_add_(0, top_i.reshape(-1), ones.reshape(-1).float())
                self.prob_sums += self._probs(logits).sum(0)
            return
        denom = self.layers * max(self.valid, 1.0)
        self.term = self.weight * self.num_experts * (self.share * self._probs(logits).sum(0)).sum() / denom

    def freeze(self) -> torch.Tensor:
        """Stop counting; the micro-batch's load-balancing loss (unweighted, a 0-dim tensor)."""
        denom = self.layers * max(self.valid, 1.0)
        self.share = self.counts / denom
        return self.num_experts * (self.share * self.prob_sums / denom).sum()

    def take_term(self) -> torch.Tensor | None:
        term, self.term = self.term, None
        return term
