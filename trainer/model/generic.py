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

transformers is needed for this path only (``pip install 'tiermem[generic]'``). A model it cannot take is
refused with one line naming what is missing.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from trainer.model.config import ModelConfigError, MoeSpec, check_layers, check_weights
from trainer.model.moe import RouterStats
from trainer.model.weights import Weight


class _Entered(Exception):
    """Raised by the last layer's stand-in: the backbone's forward has handed every layer its inputs."""


_NO_DECAY = [re.compile(p) for p in (r"bias", r"layernorm", r"rmsnorm", r"(?:^|\.)norm(?:$|\.)", r"_norm(?:$|\.)")]


def _no_decay(model: nn.Module, name: str) -> bool:
    """As the Hugging Face Trainer decides: no weight decay on a parameter inside an ``nn.LayerNorm`` or whose
    name reads as a bias or a normalisation weight."""
    parts = name.split(".")
    if any(isinstance(model.get_submodule(".".join(parts[:i])), nn.LayerNorm) for i in range(1, len(parts))):
        return True
    return any(p.search(name.lower()) for p in _NO_DECAY)


@dataclass
class GenericConfig:
    """A model of the generic path: its skeleton (parameters on meta) and its weights by group."""

    generic = True
    family: str
    arch: str
    raw: dict = field(repr=False)
    model: nn.Module = field(repr=False)
    backbone_name: str
    layers_name: str  # the layer list's full name, e.g. "model.layers"
    head_modules: list[str]  # the backbone's children after the layers that hold parameters, in order
    num_layers: int
    hidden_size: int
    vocab_size: int
    tie_word_embeddings: bool
    embed_name: str  # the input embedding's weight
    head_weight: str  # the LM head's weight (the embedding's when tied)
    pad_token_id: int | None = None
    sliding_window: int | None = None  # (the model's own masks apply its windows)
    moe: MoeSpec | None = None  # a mixture of experts: its routers (kind "generic"; "generic-no-aux": no loss)
    routers: tuple = ()  # (the module class transformers records router logits from, the output's index)
    notes: list = field(default_factory=list, repr=False)  # note: lines said at start (why auto came here)
    _weights: list[Weight] = field(default_factory=list, repr=False)
    layouts: dict = field(default_factory=dict, repr=False)  # model directory -> its DiskLayout (weights_io)

    def buffers(self) -> dict[str, torch.Tensor]:
        """The persistent buffers, which checkpoints hold beside the weights but training does not change
        (DeepSeek-V3's and GLM-4.5's ``e_score_correction_bias``): name -> the model's tensor."""
        saved = set(self.model.state_dict())
        return {n: b for n, b in self.model.named_buffers() if n in saved}

    def set_buffer(self, name: str, t: torch.Tensor) -> None:
        """A persistent buffer's value, as a checkpoint holds it (the stages copy the buffers when made)."""
        with torch.no_grad():
            self.buffers()[name].copy_(t)

    def weights(self) -> list[Weight]:
        return list(self._weights)

    def num_params(self, active: bool = False) -> int:
        """Every parameter; ``active``: what a token computes with, a mixture of experts' routed experts (a
        layer's ``experts`` tensors, stacked on their first dimension) counted at top_k of num_experts."""
        return self._count(self._weights, active)

    def layer_params(self, i: int, active: bool = False) -> int:
        """Layer ``i``'s parameters (``active``: as ``num_params``), for the planner's FLOPs."""
        return self._count([w for w in self._weights if w.group == i], active)

    def _count(self, weights: list[Weight], active: bool) -> int:
        n = 0.0
        for w in weights:
            k = 1
            for d in w.shape:
                k *= d
            if active and self.moe is not None and ".experts." in w.name and w.shape[:1] == (self.moe.num_experts,):
                k = k * self.moe.top_k / self.moe.num_experts
            n += k
        return int(n)

    def init_weight(self, w: Weight, gen: torch.Generator, device: torch.device) -> torch.Tensor:
        """A fresh fp32 tensor as transformers initialises it, seeded from ``gen``: the model's ``_init_weights`` on
        the module that owns it and then on each module above it, as ``initialize_weights`` applies it (children
        before parents: Qwen3-Next's MoE block initialises its router's weight), this tensor alone made real for
        it (a fused experts module's other tensor, 15 GB of DeepSeek-V3's, stays on the meta device; the buffers
        those modules hold are put back as they were)."""
        owner, _, leaf = w.name.rpartition(".")
        parts = owner.split(".") if owner else []
        chain = [self.model.get_submodule(".".join(parts[:i])) for i in range(len(parts), -1, -1)]
        kept = [(m, k, b.clone()) for m in chain for k, b in m.named_buffers(recurse=False, remove_duplicate=False)]
        meta = getattr(chain[0], leaf)
        setattr(chain[0], leaf, nn.Parameter(torch.empty(w.shape, dtype=torch.float32, device=device)))
        seed = int(torch.randint(0, 2**62, (1,), generator=gen, device=gen.device))
        on_gpu = device.type == "cuda"
        cuda = [device.index if device.index is not None else torch.cuda.current_device()] if on_gpu else []
        try:
            with torch.random.fork_rng(devices=cuda), torch.no_grad():
                torch.manual_seed(seed)
                for m in chain:
                    self.model._init_weights(m)
            return getattr(chain[0], leaf).detach()
        finally:
            setattr(chain[0], leaf, meta)
            for m, k, b in kept:
                setattr(m, k, b)


def _class_and_config(raw: dict, where: str):
    """The transformers causal-LM class config.json names and its config, checked for what the generic path
    cannot take."""
    archs = raw.get("architectures") or []
    arch = archs[0] if isinstance(archs, list) and archs else None
    if arch is None:
        raise ModelConfigError(f"{where}: no architectures given; name the model class (e.g. \"LlamaForCausalLM\")")
    try:
        import transformers
    except ImportError:
        raise ModelConfigError(f"{where}: architecture {arch} needs the generic path, which needs transformers: "
                               "pip install 'tiermem[generic]'") from None
    cls = getattr(transformers, arch, None)
    if cls is None:
        raise ModelConfigError(f"{where}: architecture {arch} is not supported: transformers "
                               f"{transformers.__version__} has no class {arch}")
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if arch not in set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values()):
        raise ModelConfigError(f"{where}: architecture {arch} is not supported: not one of transformers' causal "
                               "language models (the generic path takes decoder-only models)")
    for key in ("num_hidden_layers", "n_layer", "num_layers", "n_layers"):  # (before the config class makes a
        n = raw.get(key)                                                  # list of its layers' kinds)
        if isinstance(n, int) and not isinstance(n, bool):
            check_layers(n, where)
    try:
        config = cls.config_class.from_dict(dict(raw))
    except Exception as e:  # noqa: BLE001 - any config class's own validation
        raise ModelConfigError(f"{where}: transformers cannot read it as {arch}'s config: {_one_line(e)}") from None
    _check_size(config, where)
    if getattr(config, "is_encoder_decoder", False):
        raise ModelConfigError(f"{where}: architecture {arch} is not supported: an encoder-decoder model")
    for key, value in config.to_dict().items():
        used = not key.startswith("summary")  # (a sequence-summary head's, not the causal LM's)
        if used and ("dropout" in key or "pdrop" in key) and isinstance(value, (int, float)) and value > 0:
            raise ModelConfigError(f"{where}: {key} {value} is not supported (dropout cannot be recomputed "
                                   f"exactly); set it to 0")
        if "jitter" in key and isinstance(value, (int, float)) and value > 0:
            raise ModelConfigError(f"{where}: {key} {value} is not supported (random noise on the router's input "
                                   "cannot be recomputed exactly); set it to 0")
    return arch, cls, config


def _check_size(config, where: str) -> None:
    """What config.json asks within trainer.model.config's bounds, from the transformers config's own figures,
    before the model is built (its layers and real buffers: rotary frequencies of a head_dim of billions)."""
    dims = {k: getattr(config, k, None) for k in ("num_hidden_layers", "hidden_size", "vocab_size",
                                                   "intermediate_size", "num_attention_heads", "head_dim")}
    dims = {k: v for k, v in dims.items() if isinstance(v, int) and not isinstance(v, bool)}
    for k, v in dims.items():
        if v < 0:
            raise ModelConfigError(f"{where}: {k} must not be negative, got {v}")
    if "num_hidden_layers" in dims:
        check_layers(dims["num_hidden_layers"], where)
    h = dims.get("hidden_size", 0)
    check_weights({"the embedding (vocab_size x hidden_size)": h * dims.get("vocab_size", 0),
                   "the MLP (hidden_size x intermediate_size)": h * dims.get("intermediate_size", 0),
                   "the attention's heads (num_attention_heads x head_dim)": h * dims.get("num_attention_heads", 0)
                   * dims.get("head_dim", 0)}, 0, where)


def _skeleton(cls, config) -> nn.Module:
    """The model built as ``from_pretrained`` builds it: on the meta device (no memory: DeepSeek-V3's fused experts
    are 30 GB a layer), then its buffers made real on the CPU and drawn by the model's own ``_init_weights``
    (rotary frequencies, a router's score bias), each module after those inside it; the parameters stay on meta."""
    with torch.device("meta"):
        model = cls._from_config(config, dtype=torch.float32)  # (buffers in fp32 whatever config.json says)
    modules = list(model.modules())
    for m in modules:
        for k, b in list(m.named_buffers(recurse=False, remove_duplicate=False)):
            setattr(m, k, torch.empty_like(b, device="cpu"))
    with torch.no_grad():
        for m in reversed(modules):
            model._init_weights(m)
    return model


def generic_config(raw: dict, where: str = "config.json") -> GenericConfig:
    """The generic path's view of config.json, or one line naming what it lacks."""
    arch, cls, config = _class_and_config(raw, where)
    try:
        model = _skeleton(cls, config)
    except Exception as e:  # noqa: BLE001 - whatever the model class refuses
        raise ModelConfigError(f"{where}: transformers cannot build {arch}: {_one_line(e)}") from None
    model.eval()  # (no dropout; the step's semantics are the trainer's)
    backbone_name = getattr(model, "base_model_prefix", "model")
    backbone = getattr(model, backbone_name, None)
    if not isinstance(backbone, nn.Module):  # (Llama 4's text model: prefix "language_model", held as "model")
        from transformers import PreTrainedModel

        inner = [(n, m) for n, m in model.named_children() if isinstance(m, PreTrainedModel)]
        if len(inner) == 1:
            backbone_name, backbone = inner[0]
    n_layers = getattr(config, "num_hidden_layers", None)
    if not isinstance(backbone, nn.Module) or not isinstance(n_layers, int):
        raise ModelConfigError(f"{where}: architecture {arch} is not supported: no decoder backbone "
                               f"'{backbone_name}' with num_hidden_layers")
    children = list(backbone.named_children())
    lists = [i for i, (_, m) in enumerate(children) if isinstance(m, nn.ModuleList) and len(m) == n_layers]
    if len(lists) != 1:
        raise ModelConfigError(f"{where}: architecture {arch} is not supported: its decoder layers do not form one "
                               f"list of num_hidden_layers={n_layers} modules")
    at = lists[0]
    layers_name = f"{backbone_name}.{children[at][0]}"
    head_modules = [f"{backbone_name}.{n}" for n, m in children[at + 1:] if any(True for _ in m.parameters())]
    emb_in, emb_out = model.get_input_embeddings(), model.get_output_embeddings()
    if emb_in is None or emb_out is None:
        raise ModelConfigError(f"{where}: architecture {arch} is not supported: no input embedding or LM head")
    by_param = {id(p): n for n, p in model.named_parameters()}
    embed_name, head_weight = by_param[id(emb_in.weight)], by_param[id(emb_out.weight)]
    weights = _grouped(model, layers_name, [f"{backbone_name}.{n}" for n, _ in children[:at]])
    check_weights({}, len(weights), where)
    if embed_name not in {w.name for w in weights if w.group == "embed"}:
        raise ModelConfigError(f"{where}: architecture {arch} is not supported: its input embedding does not sit "
                               "before the layer list")
    pad = getattr(config, "pad_token_id", None)
    routers, moe = _routers(model, config, model.get_submodule(layers_name), raw, where)
    kernels = kernels_note(model, model.get_submodule(layers_name))
    return GenericConfig(family=str(getattr(config, "model_type", arch)), arch=arch, raw=raw, model=model,
                         backbone_name=backbone_name, layers_name=layers_name, head_modules=head_modules,
                         num_layers=n_layers, hidden_size=int(config.hidden_size), vocab_size=int(config.vocab_size),
                         tie_word_embeddings=emb_out.weight is emb_in.weight, embed_name=embed_name,
                         head_weight=head_weight, pad_token_id=pad if isinstance(pad, int) else None, _weights=weights,
                         moe=moe, routers=routers, notes=[kernels] if kernels else [])


def kernels_note(model: nn.Module, layers: nn.ModuleList) -> str | None:
    """Which implementation transformers runs a hybrid layer's linear attention (its convolution and recurrent
    state kernels) with: the functions its layers' modules call that transformers binds, when the model is
    imported, to the fast package where that is installed (flash-linear-attention, causal-conv1d) and to its own
    PyTorch code otherwise (``use_kernel_func_from_hub_with_fallback``); one ``note:`` line, None for a model
    without such layers."""
    import inspect
    import sys

    module = sys.modules[type(model).__module__]
    bound = {}  # function name -> (its package, whether the fast one is bound)
    for fn in vars(module).values():
        while callable(fn):  # (through any wrapper transformers' hub kernels put around it)
            free = getattr(getattr(fn, "__code__", None), "co_freevars", ())
            if "is_new_implementation" in free and "package" in free:
                cells = dict(zip(free, fn.__closure__))
                bound[fn.__name__] = (cells["package"].cell_contents, cells["is_new_implementation"].cell_contents)
                break
            fn = getattr(fn, "__wrapped__", None)
    called = set()  # the global names the layers' modules' methods use
    for cls in {type(m) for m in layers.modules()}:
        for fn in vars(cls).values():
            fn = inspect.unwrap(fn) if callable(fn) else fn  # (a forward under transformers' decorators)
            called.update(getattr(getattr(fn, "__code__", None), "co_names", ()))
    used = {n: v for n, v in bound.items() if n in called}
    if not used:
        return None
    names = {"fla": "flash-linear-attention", "causal_conv1d": "causal-conv1d"}
    fast = sorted({names.get(p, p) for p, new in used.values() if new})
    slow = sorted({names.get(p, p) for p, new in used.values() if not new})
    if not slow:
        return f"note: the linear attention runs the fast kernels of {' and '.join(fast)}"
    return (f"note: the linear attention runs transformers' PyTorch fallback for {', '.join(sorted(used))}"
            + (f" (the fast kernels of {' and '.join(fast)} for the rest)" if fast else "")
            + f": exact but slower; pip install {' '.join(slow)} for the fast kernels")


def _routers(model: nn.Module, config, layers: nn.ModuleList, raw: dict, where: str):
    """A mixture of experts' routers, as transformers records their logits (``_can_record_outputs``): ((the
    router's module class, the index of its logits in its output), the MoeSpec), or ((), None). The load-balancing
    loss is the causal-LM class's own where it has one (``router_aux_loss_coef``, its module's
    ``load_balancing_loss_func``): on as config.json says; kind "generic-no-aux" where it has none."""
    import sys

    backbone = next((m for m in model.children() if m is not layers and any(x is layers for x in m.children())), None)
    spec = next((rec["router_logits"] for m in (model, backbone) if isinstance(
        rec := getattr(m, "_can_record_outputs", None), dict) and "router_logits" in rec), None)
    if spec is None:
        return (), None
    target, index = getattr(spec, "target_class", spec), getattr(spec, "index", 0)
    sparse = tuple(i for i, layer in enumerate(layers) if any(isinstance(m, target) for m in layer.modules()))
    experts = next((getattr(config, k) for k in ("num_experts", "n_routed_experts", "num_local_experts")
                    if isinstance(getattr(config, k, None), int)), None)
    top_k = getattr(config, "num_experts_per_tok", None)
    if not sparse or not isinstance(experts, int) or not isinstance(top_k, int):
        return (), None
    has_loss = hasattr(model, "router_aux_loss_coef") and hasattr(sys.modules[type(model).__module__],
                                                                  "load_balancing_loss_func")
    coef = 0.0
    if has_loss and getattr(config, "output_router_logits", False):
        coef = config.router_aux_loss_coef
        if isinstance(coef, bool) or not isinstance(coef, (int, float)) or not coef >= 0 or coef == float("inf"):
            raise ModelConfigError(f"{where}: router_aux_loss_coef must be a non-negative number, got {coef!r}")
    inter = getattr(config, "moe_intermediate_size", None) or getattr(config, "intermediate_size", 0)
    moe = MoeSpec(experts, top_k, int(inter), bool(getattr(config, "norm_topk_prob", False)), sparse, "", ("", "", ""),
                  float(coef), "generic" if has_loss else "generic-no-aux")
    return (target, index), moe


def _grouped(model: nn.Module, layers_name: str, before: list[str]) -> list[Weight]:
    """The model's parameters as the store's weights, in forward order: those of the backbone's modules
    ``before`` the layer list in "embed", each layer's in its own group (named inside the layer), the rest (the
    final norm, the LM head) in "head"."""
    embed, layers, head = [], [], []
    for name, p in model.named_parameters():
        decay = not _no_decay(model, name)
        if name.startswith(layers_name + "."):
            idx, local = name[len(layers_name) + 1:].split(".", 1)
            layers.append(Weight(name, tuple(p.shape), int(idx), decay, local))
        elif any(name.startswith(b + ".") for b in before):
            embed.append(Weight(name, tuple(p.shape), "embed", decay))
        else:
            head.append(Weight(name, tuple(p.shape), "head", decay))
    return embed + sorted(layers, key=lambda w: w.group) + head  # (a stable sort: registration order inside)


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


def _one_line(e: Exception) -> str:
    return " ".join(str(e).split())[:200]


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
