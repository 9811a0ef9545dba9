"""The step schedule (docs/architecture.md has it too): one optimizer step over all of its micro-batches, layer
by layer.

1. Forward, layer-major: for each layer, wait for its weights on the GPU, run every micro-batch through
   it, keep each micro-batch's boundary activation, release the layer.
2. Loss: final norm + LM head + cross-entropy, chunked over tokens, with its backward.
3. Backward, layer-major, with recompute: for each layer from the last, recompute its forward from the
   boundary activation per micro-batch and backpropagate; accumulate the layer's gradient (fp32) on the
   GPU, hand it to the store and add its squared norm to the step's total.
4. Clip by the exact global norm and start the store's optimizer, which updates the groups in forward
   order while the next step's forward consumes them (forward of layer i waits only for update i).

The loss of a step is the mean over all its unmasked label tokens (labels shifted by one), as the
Hugging Face Trainer computes it, plus a sparse model's load-balancing loss when it is on; with an ``objective``
(stage dpo: ``trainer.run.preference.PreferenceHead``) the head's loss is that objective's (the mean over the
step's pairs of their preference losses). The executor
computes on the store's GPU device (the CPU in tests), with the model's stages (``trainer.model.stages``:
the template; ``trainer.model.generic``: a transformers model's own modules).
"""

from __future__ import annotations

import dataclasses
import math
import sys
import time
from dataclasses import dataclass, field

import torch

from tiermem.errors import UserError
from tiermem.faults import HOOKS
from tiermem.futures import all_of
from tiermem.optim.finite import NonFiniteUpdate, all_finite
from tiermem.specs import state_name
from tiermem.store.prefetch import Prefetcher
from trainer.model.layers import shift_labels
from trainer.model.select import model_stages
from trainer.model.weights import all_weights
from trainer.outputs.weights_io import NonFiniteWeights
from trainer.run import pieces
from trainer.run.offload import Stash


class NonFiniteStep(UserError):
    """A step whose loss or gradient norm is not finite: it is not applied, so the store and the last
    checkpoint keep the step before."""

    def __init__(self, step: int, loss: float, norm: float):
        self.step = step
        super().__init__(f"step {step}: gradient norm is {norm} (loss {loss}); the step was not applied, the "
                         f"weights stay those after step {step - 1}: lower learning_rate, check the data, or resume "
                         "from the last checkpoint")


@dataclass
class StepResult:
    loss: float  # mean over the step's trained tokens
    grad_norm: float  # before clipping
    tokens: int  # non-padding tokens
    seconds: float
    wait_transfer: float  # the GPU stood idle waiting for weights to arrive
    wait_optimizer: float  # ... waiting for the optimizer to finish a group's update
    waits_by_phase: dict  # "phase group" -> {"transfer": s, "optimizer": s} (phase: forward, loss, backward)
    figures: dict = field(default_factory=dict)  # an objective's figures of the step (stage dpo: the rewards...)

    @property
    def compute(self) -> float:
        return max(self.seconds - self.wait_transfer - self.wait_optimizer, 0.0)



def squared_norm(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The squared L2 norm of ``tensors`` together: each one's norm in one foreach call (as PyTorch's
    clip_grad_norm_ takes them), squared and added (a mixture-of-experts layer has hundreds of tensors: a
    reduction and an add each were hundreds of kernel launches a layer)."""
    if not tensors:
        return torch.zeros(())
    return torch.stack(torch._foreach_norm(tensors, 2)).pow(2).sum()

class Executor:
    def __init__(self, store, cfg, dtype: torch.dtype, optimizer, max_grad_norm: float,
                 loss_chunk_tokens: int, activation_budget: int | None = None, keep_layers: int = 0, reducer=None,
                 piece_rows: int | None = None, act_host: tuple = (None, 0)):
        """``reducer`` (``trainer.parallel.dp.GradReducer``, several ranks): each group's gradient is reduced to the
        rank that owns it, which alone hands it to the store; the loss, the token counts and the norm are the
        world's. ``act_host`` (tier, n): the boundary activations 0..n-1 (layer i's input) live in that host tier
        (``trainer.run.offload``), the rest on the GPU."""
        self.store, self.cfg, self.dtype, self.optimizer = store, cfg, dtype, optimizer
        self.reducer = reducer
        if reducer is not None:
            reducer.hand = self._hand_grads
            reducer.read_partial = lambda g: self._partials(g, False)
            reducer.keep_partial = lambda g, grads: self.store.store_group(
                g, "grad", {state_name(n, "grad"): t for n, t in grads.items()})
            reducer.wait = lambda fut: self.store.wait(fut, "gradient_partials")
        self.device = store.device
        self.max_grad_norm = max_grad_norm
        self.loss_chunk = loss_chunk_tokens
        self.prefetch = Prefetcher(store, health=optimizer.check)
        self.local_names = {}
        for w in all_weights(cfg):
            self.local_names.setdefault(w.group, {})[w.name] = w.local
        self.model = model_stages(cfg, dtype, self.device)
        self._waits = [0.0, 0.0]
        self._phase_waits: dict = {}
        self.phase, self.layer = "starting", None  # what the GPU is doing now (for tiermem top)
        self.at_pass = 0  # the pass of the step running now (1, 2, ...)
        self.activation_budget = activation_budget  # bytes of boundary activations a pass may keep; None: any
        self.last_passes = 1
        # decoder layers (the first ones whose weights live in HBM) whose forward keeps its activations, so that
        # their backward needs no recompute (tiermem_keep_activations)
        self.keep_layers = keep_layers
        self.last_kept = 0
        # rows the GPU computes at once (tiermem_physical_batch_size: the planner's): a micro-batch of more rows
        # runs as pieces of this many (trainer.run.pieces); None: the micro-batches as they are
        self.piece_rows = piece_rows
        self.act_host = act_host
        self.stash = None  # the pass's boundary activations off the GPU (trainer.run.offload.Stash)
        # before_commit(step, result): the step's figures, before the optimizer takes the step (a committed
        # step's figures must outlive a trainer killed before it logs them)
        self.before_commit = None
        # the head's loss when it is not the cross-entropy over the trained tokens (stage dpo's preference loss:
        # trainer.run.preference.PreferenceHead); None: the cross-entropy
        self.objective = None
        # the trainer's thread, the copy lanes, the prefetcher and the optimizer hand work to each other
        # many times a step: a 5 ms GIL switch interval (Python's default) would add up to waits
        sys.setswitchinterval(min(sys.getswitchinterval(), 0.0005))

    # -- helpers ---------------------------------------------------------------------------------
    def _drain(self) -> None:
        self.store.sync_device()

    def _take(self, req, phase: str) -> dict[str, torch.Tensor]:
        view, on_opt, on_xfer = Prefetcher.take(req, self._drain)
        self._waits[0] += on_xfer
        self._waits[1] += on_opt
        if not on_xfer and not on_opt:
            return view
        w = self._phase_waits.setdefault(f"{phase} {req.group}", {"transfer": 0.0, "optimizer": 0.0})
        w["transfer"] += on_xfer
        w["optimizer"] += on_opt
        return view

    def _weights(self, view) -> dict[str, torch.Tensor]:
        names = self.local_names[view.group]
        return {names[k]: t for k, t in view.tensors.items()}

    def _hand_grads(self, group, grads: dict[str, torch.Tensor]) -> None:
        named = {state_name(n, "grad"): g for n, g in grads.items()}
        if self.optimizer.grads_home(group):  # (an attached trainer's: also kept for the service's redo)
            self.store.store_group(group, "grad", named)
        if self.optimizer.grads_on_gpu(group):  # updated on the GPU: no round trip through DRAM
            self.store.offer(group, "grad", named)

    def _sums_at_home(self, group) -> bool:
        """Whether the group's gradient is summed where the optimizer reads it: its home is in HBM and the step
        hands it there (a group that lives in HBM, updated from it). The backward then adds every micro-batch's
        gradient, over all of a step's passes, into that home: no partial sums go out and come back between
        passes (two copies of the group's fp32 gradient a pass), and the sum is added in the order one pass
        adds it."""
        if self.reducer is not None or not self.optimizer.grads_home(group) or self.optimizer.grads_on_gpu(group):
            return False
        return self.store.in_device_memory(group, "grad")

    def _grad_home(self, group, names) -> list[torch.Tensor]:
        """The gradient tensors in HBM of a group that ``_sums_at_home``, in the order of the weights ``names``."""
        views = self.store.gpu_views(group, "grad")
        return [views[state_name(n, "grad")] for n in names]

    def _home_sums(self, group, names, first: bool) -> dict[str, torch.Tensor]:
        """The HBM home of the gradient of a group computed apart (the LM head's, the embedding's), by weight
        name, for the model to add every micro-batch's gradient into: zeroed on the step's first pass. (No
        vocab x hidden tensor of a pass's own: the home is the sum.)"""
        names = list(names)
        home = self._grad_home(group, names)
        if first:
            torch._foreach_zero_(home)
        return dict(zip(names, home))

    def _partials(self, group, first: bool):
        """On a pass after the first, start reading back the group's gradient partial sums of the earlier
        passes into fresh GPU buffers: (name -> buffer, future), or None on the first pass. Started before
        the group's compute is queued, the copy runs while the GPU computes (it waits for the kernels queued
        so far, which may still use the buffers' memory)."""
        if first:
            return None
        bufs, futs = {}, []
        for n in self.local_names[group]:
            spec = self.store.spec(state_name(n, "grad"))
            bufs[n] = torch.empty(spec.shape, dtype=spec.dtype, device=self.device)
            futs.append(self.store.read(spec.name, out=bufs[n]))
        return bufs, all_of(futs)

    def _grads(self, group, grads: dict[str, torch.Tensor], partials, last: bool, at_home: bool = False,
               first: bool = True):
        """Hand a layer's gradient of this pass on: partial sums go to the store between passes and come
        back (``partials``, from ``_partials``) to be added; the last pass's sum is the gradient, whose
        squared norm is returned. ``at_home``: ``grads`` are the group's home in HBM, summed there over the
        passes so far (``_sums_at_home``): nothing goes anywhere before the last pass. Several ranks: the
        pass's gradient goes to the group's owner, which keeps the partial sums (``trainer.parallel.dp``)."""
        if self.reducer is not None:
            self.reducer.reduce(group, grads, first, last)
            return None
        if at_home and not last:
            return None
        if partials is not None:
            prev, fut = partials
            self.store.wait(fut, "gradient_partials")
            for n, g in grads.items():
                g.add_(prev[n])
        if last:
            self._hand_grads(group, grads)
            return squared_norm(list(grads.values()))
        self.store.store_group(group, "grad", {state_name(n, "grad"): g for n, g in grads.items()})
        return None

    def kept(self) -> set:
        """The layers whose activations a step keeps: the first ``keep_layers`` of those whose weights live in
        HBM (a streamed layer's slot is reused before its backward)."""
        out: set = set()
        for i in range(self.cfg.num_layers if self.keep_layers else 0):
            if self.store.in_device_memory(i, "param"):
                out.add(i)
                if len(out) == self.keep_layers:
                    break
        return out

    def passes(self, batches: list) -> list[list]:
        """The step's micro-batches in groups whose boundary activations fit the activation budget."""
        if self.activation_budget is None:
            return [batches]
        per_token = (self.cfg.num_layers + 1) * self.cfg.hidden_size * self.dtype.itemsize
        out, cur, used = [], [], 0
        for b in batches:
            need = b[0].numel() * per_token
            if cur and used + need > self.activation_budget:
                out.append(cur)
                cur, used = [], 0
            cur.append(b)
            used += need
        out.append(cur)
        return out

    # -- one step --------------------------------------------------------------------------------
    def step(self, batches: list[tuple[torch.Tensor, torch.Tensor, int]], step: int, lr: float) -> StepResult:
        """Run optimizer step ``step`` (0-based) over ``batches`` [(input_ids, labels, n_tokens)] at ``lr``.

        When the boundary activations of all micro-batches do not fit the activation budget, the step runs
        as several layer-major passes; gradients add up in the store between passes.
        """
        t_start = time.perf_counter()
        self._waits = [0.0, 0.0]
        self._phase_waits = {}
        trained = sum(int((shift_labels(b[1]) != -100).sum()) for b in batches)
        tokens = sum(b[2] for b in batches)
        batches = pieces.cut(batches, self.piece_rows)
        groups = self.passes(batches) if batches else []
        self.last_passes = max(len(groups), 1)
        world = self.reducer.world if self.reducer is not None else None
        n_pass = len(groups)
        if world is not None:  # (the world's step: its tokens normalise every rank's loss; every rank runs the
            counts = [0] * world.size  # world's number of passes, as each pass's reductions are collective)
            counts[world.rank] = len(groups)
            got = world.sum([trained, tokens, *counts])
            trained, tokens, n_pass = int(got[0]), int(got[1]), max(int(x) for x in got[2:])
            self.last_passes = max(n_pass, 1)
        scale = 1.0 / max(trained, 1) if self.objective is None else self.objective.begin(batches)
        loss = sumsq = None
        for p in range(n_pass):
            self.at_pass = p + 1
            if p >= len(groups):  # (no rows of this rank in this pass: zeros to the owners, in a pass's order)
                for g in ("head", *reversed(range(self.cfg.num_layers)), "embed"):
                    self.reducer.reduce(g, None, p == 0, p == n_pass - 1)
                continue
            part, sq = self._pass(groups[p], step, scale, p == 0, p == n_pass - 1, len(batches))
            loss = part if loss is None else loss + part
            sumsq = sq if sq is not None else sumsq

        # 4. exact global-norm clipping, then the store's optimizer (overlaps the next forward)
        self._drain()
        if world is not None:
            sumsq = self.reducer.finish()
            loss = world.sum([float(loss) if loss is not None else 0.0])[0]
        norm = math.sqrt(float(sumsq))
        loss_value = float(loss) * scale
        if not (math.isfinite(norm) and math.isfinite(loss_value)):
            group = self._nonfinite_group()  # (weights an update made inf or NaN: say so, not the step)
            err = NonFiniteStep(step + 1, loss_value, norm) if group is None else NonFiniteUpdate(step, group) \
                if step else NonFiniteWeights(f"group {group}", "the model as loaded (step 1 used it)")
            err.quiet = world is not None and not world.lead  # (the world's norm: every rank finds it)
            raise err
        grad_scale = None
        if self.max_grad_norm > 0:
            coef = self.max_grad_norm / (norm + 1e-6)
            if coef < 1.0:
                grad_scale = 1.0 / coef
        result = StepResult(loss_value, norm, tokens, time.perf_counter() - t_start, self._waits[0],
                            self._waits[1], self._phase_waits,
                            self.objective.figures() if self.objective is not None else {})
        if self.before_commit is not None:
            self.before_commit(step + 1, result)
        self.optimizer.step(step + 1, lr, grad_scale)
        self.phase, self.layer = "optimizer", None
        return dataclasses.replace(result, seconds=time.perf_counter() - t_start)

    def _nonfinite_group(self):
        """The first group whose compute copy (the weights a step uses) holds inf or NaN, or None: asked once a step's
        loss or norm is not finite (the optimizer's CPU worker does not check what it writes: tiermem.optim)."""
        for w in all_weights(self.cfg):
            if self.store.holds(w.name) and not all_finite([self.store.read(w.name).result()]):
                return w.group
        return None

    def _pass(self, batches: list, step: int, scale: float, first: bool, last: bool, n_micro: int):
        """Forward, loss and backward of ``batches`` (of ``n_micro`` micro-batches in the step), layer-major;
        (summed loss, squared gradient norm on the last pass else None)."""
        cfg, dev = self.cfg, self.device
        L, tied, model = cfg.num_layers, cfg.tie_word_embeddings, self.model
        req = self.prefetch.request
        r_embed = req("embed", "param", step)
        r_fwd = [req(i, "param", step) for i in range(L)]
        r_head = req("head", "param", step)
        r_tied = req("embed", "param", step) if tied else None
        r_bwd = [req(i, "param", step) for i in reversed(range(L))]
        r_emb = req("embed", "param", step) if model.embed_grads_need_weights else None
        ids = [b[0].to(dev, non_blocking=True) for b in batches]
        targets = [shift_labels(b[1]).to(dev, non_blocking=True) for b in batches]
        masks = [b[3].to(dev, non_blocking=True) if len(b) > 3 else None for b in batches]
        ctx = model.contexts(ids, masks, n_micro, True)
        # (a row cut into chunks keeps its attention's graph alone: trainer.model.chunked)
        keep = self.kept() if all(c.router is None for c in ctx) else set()
        self.last_kept = len(keep)
        if self.stash is not None:
            self.stash.clear()
        self.stash = stash = Stash(self.store, *self.act_host, keep)
        acts, graphs, aux = self._forward(ids, ctx, keep, r_embed, r_fwd, step)

        # 2. loss + its backward, chunked over tokens
        self.phase, self.layer = "loss", "head"
        head_home = self._sums_at_home("head")
        head_partials = None if head_home or self.reducer is not None else self._partials("head", first)
        view = self._take(r_head, "loss")
        tied_view = self._take(r_tied, "loss") if tied else None
        loss = torch.zeros((), dtype=torch.float32, device=dev)
        head_grads = self._home_sums("head", view.tensors, first) if head_home else None
        g_tied = None
        grads_y = []
        for mb, h in enumerate(acts[L]):  # (the micro-batches' gradients added into the first's, or the home's)
            head_loss_backward = model.head_loss_backward if self.objective is None else \
                self.objective.head_loss_backward(model, batches[mb])
            part, gh, head_grads, g_tied = head_loss_backward(
                h, targets[mb], view.tensors, tied_view.tensors if tied else None, scale, self.loss_chunk,
                acc=head_grads, tied_acc=g_tied)
            loss += part
            grads_y.append(gh)
        acts[L] = None
        view.release()
        if tied_view is not None:
            tied_view.release()
        sq = [self._grads("head", head_grads, head_partials, last, head_home, first)]

        # 3. backward, layer-major, with recompute
        self.phase = "backward"
        embed_home = self._sums_at_home("embed")
        own_partials = self.reducer is None  # (several ranks: the owners read the partial sums back)
        embed_partials = self._partials("embed", first) if L == 0 and not embed_home and own_partials else None
        for n, i in enumerate(reversed(range(L))):
            self.layer = i
            stash.prefetch(i)
            if i:  # (the next layer's input on its way back while this one computes)
                stash.prefetch(i - 1)
            at_home = self._sums_at_home(i)
            partials = None if at_home or not own_partials else self._partials(i, first)
            if i == 0 and not embed_home and own_partials:  # (the embedding's with layer 0's)
                embed_partials = self._partials("embed", first)
            view = self._take(r_bwd[n], "backward")
            w = self._weights(view)
            acc: list[torch.Tensor] | None = None
            home = self._grad_home(i, view.tensors) if at_home else None
            for mb in range(len(ids)):
                if i in keep:  # (no recompute: the forward kept the layer's graph)
                    grads_y[mb], g_w = model.graph_backward(graphs[i][mb], grads_y[mb])
                    graphs[i][mb] = None
                else:
                    x = stash.take(i, mb, acts[i][mb])
                    grads_y[mb], g_w = model.layer_backward(i, w, x, grads_y[mb], ctx[mb])
                    del x
                acts[i][mb] = None
                if acc is None and home is not None:  # (summed where the optimizer reads it: no copy home)
                    (torch._foreach_copy_ if first else torch._foreach_add_)(home, g_w)
                    acc = home
                elif acc is None:
                    acc = [g.float() for g in g_w]
                else:
                    torch._foreach_add_(acc, g_w)
            view.release()
            sq.append(self._grads(i, dict(zip(view.tensors.keys(), acc)), partials, last, at_home, first))
            HOOKS.point("backward", step + 1)

        # the embedding's gradient: every micro-batch's input gradient, plus the tied LM head's
        self.phase, self.layer = "backward", "embed"
        view = self._take(r_emb, "backward") if r_emb is not None else None
        home = self._home_sums("embed", self.local_names["embed"], first) if embed_home else None
        g_embed = model.embed_grads(view.tensors if view is not None else None, ids, grads_y, ctx, g_tied, acc=home)
        if view is not None:
            view.release()
        sq.append(self._grads("embed", g_embed, embed_partials, last, embed_home, first))
        del grads_y, acts
        if aux is not None:
            loss = loss + aux / scale  # (the caller scales the summed loss by scale)
        return loss, (sum(sq) if last and self.reducer is None else None)

    def _forward(self, ids: list, ctx: list, keep: set, r_embed, r_fwd: list, step: int):
        """1. The forward, layer-major, keeping every micro-batch's boundary activations (and, for the ``keep``
        layers, their whole graphs): (activations by layer, graphs by kept layer, a sparse model's load-balancing
        loss (weighted) or None)."""
        model, graphs = self.model, {}
        with torch.no_grad():
            self.phase, self.layer = "forward", "embed"
            view = self._take(r_embed, "forward")
            acts = [[model.embed(view.tensors, x, c) for x, c in zip(ids, ctx)]]
            view.release()
            self.stash.put(0, acts[0])
            for i in range(self.cfg.num_layers):
                self.layer = i
                view = self._take(r_fwd[i], "forward")
                w = self._weights(view)
                if i in keep:
                    outs = [model.layer_graph(i, w, x, c) for x, c in zip(acts[i], ctx)]
                    graphs[i] = [g for _, g in outs]
                    acts.append([y for y, _ in outs])
                    acts[i] = [None] * len(ids)  # (the graph holds the input)
                else:
                    acts.append([model.layer(i, w, x, c) for x, c in zip(acts[i], ctx)])
                    acts[i] = self.stash.drop(i, acts[i])  # (written out: the GPU's copy let go)
                self.stash.put(i + 1, acts[i + 1])
                view.release()
                HOOKS.point("forward", step + 1)
            aux = model.forward_done(ctx)
        return acts, graphs, aux

    def evaluate(self, batches: list[tuple[torch.Tensor, torch.Tensor, int]], version: int) -> tuple[float, int]:
        """Forward only, layer-major, over ``batches`` with the weights of ``version`` (updates done so far):
        (summed loss over the trained tokens, their count)."""
        total = sum(float(x) for x in self.forward_losses(batches, version))
        return total, sum(int((shift_labels(b[1]) != -100).sum()) for b in batches)

    def forward_losses(self, batches: list, version: int, per_row: bool = False) -> list[torch.Tensor]:
        """Forward only, layer-major, over ``batches`` with the weights of ``version``: each batch's summed
        cross-entropy over its trained tokens, or (``per_row``) each of its rows' (a tensor [rows]: the negated
        log-probability of a row's trained tokens, as stage dpo's reference needs)."""
        cfg, dev = self.cfg, self.device
        req = self.prefetch.request
        r_embed = req("embed", "param", version)
        r_fwd = [req(i, "param", version) for i in range(cfg.num_layers)]
        r_head = req("head", "param", version)
        r_tied = req("embed", "param", version) if cfg.tie_word_embeddings else None
        ids = [b[0].to(dev) for b in batches]
        model = self.model
        ctx = model.contexts(ids, [b[3].to(dev) if len(b) > 3 else None for b in batches], len(batches), False)
        self.phase, self.layer = "evaluation", None
        with torch.no_grad():
            view = self._take(r_embed, "eval")
            hs = [model.embed(view.tensors, x, c) for x, c in zip(ids, ctx)]
            view.release()
            for i in range(cfg.num_layers):
                view = self._take(r_fwd[i], "eval")
                w = self._weights(view)
                hs = [model.layer(i, w, h, c) for h, c in zip(hs, ctx)]
                view.release()
            view = self._take(r_head, "eval")
            tied_view = self._take(r_tied, "eval") if r_tied is not None else None
            tied_w = tied_view.tensors if tied_view is not None else None
            out = []
            for h, b in zip(hs, batches):
                targets = shift_labels(b[1]).to(dev)
                if per_row:
                    out.append(torch.stack([model.head_loss(h[r: r + 1], targets[r: r + 1], view.tensors, tied_w,
                                                            self.loss_chunk) for r in range(h.shape[0])]))
                else:
                    out.append(model.head_loss(h, targets, view.tensors, tied_w, self.loss_chunk))
            view.release()
            if tied_view is not None:
                tied_view.release()
        return out

    def close(self) -> None:
        self.prefetch.close()
