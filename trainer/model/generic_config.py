"""The generic path's model as read from config.json: the transformers class and config it takes, checked
(one line naming what is missing), its skeleton on the meta device with real buffers, its routers, the kernels
its hybrid layers run, and its weights by group (``GenericConfig``). What computes it: ``trainer.model.generic``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch
from torch import nn

from trainer.model.config import ModelConfigError, MoeSpec, check_layers, check_weights
from trainer.model.weights import Weight

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
    experts: tuple[int, int] | None = None  # (routed experts, top_k) as config.json says, for the active count
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
        layer's ``experts`` tensors, stacked on their first dimension) counted at top_k of num_experts (from
        config.json, whether or not transformers records the routers' logits: DeepSeek-V3's it does not)."""
        return self._count(self._weights, active)

    def layer_params(self, i: int, active: bool = False) -> int:
        """Layer ``i``'s parameters (``active``: as ``num_params``), for the planner's FLOPs."""
        return self._count([w for w in self._weights if w.group == i], active)

    def expert_params(self, i: int, active: bool = False) -> int:
        """Layer ``i``'s routed experts' parameters (``active``: as ``num_params``), for the planner's estimate."""
        return self._count([w for w in self._weights if w.group == i and self._routed(w)], active)

    def _routed(self, w: Weight) -> bool:
        """Whether ``w`` is a layer's routed experts' tensor (stacked on its first dimension)."""
        return bool(self.experts) and ".experts." in w.name and w.shape[:1] == (self.experts[0],)

    def _count(self, weights: list[Weight], active: bool) -> int:
        n = 0.0
        for w in weights:
            k = 1
            for d in w.shape:
                k *= d
            if active and self._routed(w):
                k = k * self.experts[1] / self.experts[0]
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
                         moe=moe, routers=routers, experts=routed_experts(config),
                         notes=[kernels] if kernels else [])


def routed_experts(config) -> tuple[int, int] | None:
    """(routed experts, top_k) of a mixture of experts' config, or None for a dense model."""
    experts = next((getattr(config, k) for k in ("num_experts", "n_routed_experts", "num_local_experts")
                    if isinstance(getattr(config, k, None), int)), None)
    top_k = getattr(config, "num_experts_per_tok", None)
    ok = isinstance(experts, int) and isinstance(top_k, int) and 0 < top_k <= experts
    return (experts, top_k) if ok else None


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
    for name, fn in vars(module).items():
        while callable(fn):  # (through any wrapper transformers' hub kernels put around it)
            free = getattr(getattr(fn, "__code__", None), "co_freevars", ())
            if "is_new_implementation" in free and "package" in free:
                cells = dict(zip(free, fn.__closure__))
                bound[name] = (cells["package"].cell_contents, cells["is_new_implementation"].cell_contents)
                break
            fn = _wrapped_in(fn)
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


def _wrapped_in(fn):
    """The function a wrapper calls: ``__wrapped__`` (functools.wraps), or the ``func`` a module-like wrapper's
    forward closes over (transformers >= 5.25 with the ``kernels`` package installed makes each hub-kernel function
    such a module); None when there is none."""
    inner = getattr(fn, "__wrapped__", None)
    if inner is not None:
        return inner
    forward = getattr(type(fn), "forward", None)
    code = getattr(forward, "__code__", None)
    if code is None or "func" not in code.co_freevars or not forward.__closure__:
        return None
    return forward.__closure__[code.co_freevars.index("func")].cell_contents


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
    routed = routed_experts(config)
    if not sparse or routed is None:
        return (), None
    experts, top_k = routed
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


def _one_line(e: Exception) -> str:
    return " ".join(str(e).split())[:200]
