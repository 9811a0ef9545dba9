"""The model's shape, read from a Hugging Face config.json: the Llama family (Llama 2/3, Mistral, Qwen2,
Qwen3), its mixture-of-experts members (Qwen3-MoE, Mixtral: ``MoeSpec``) and gpt-oss (attention sinks, sliding
windows on alternate layers, experts with biases and a clamped SwiGLU), with RoPE given as ``rope_theta`` +
``rope_scaling`` (published checkpoints) or as transformers 5's ``rope_parameters``, of any type
``trainer.model.rope`` computes. What the template does not compute raises ``NotCovered`` (the generic path may:
``tiermem_model_path: auto`` falls back to it); what nothing here can compute exactly, or a malformed config,
``ModelConfigError``: one line either way.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path

import torch

from trainer.model import rope as rope_math


class ModelConfigError(ValueError):
    """config.json asks for what this model code cannot compute, or is malformed: one line saying what, and
    what is supported (the trainer reports it as a user error)."""


class NotCovered(ModelConfigError):
    """config.json asks for what the template does not compute (a RoPE type, an activation); the generic path
    over transformers' own modules may: ``tiermem_model_path: auto`` takes it there."""


SUPPORTED = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "MixtralForCausalLM": "mixtral",
    "GptOssForCausalLM": "gpt_oss",
}
ROPE_TYPES = rope_math.TYPES

# What config.json may ask, checked before any of its tensors is listed (the listing, the store's catalog and the
# planner all grow with them: a config of 10 million layers ran `tiermem plan` for minutes into a MemoryError):
# - a weight of more than 2**35 elements (64 GiB in bf16, its fp32 gradient 128 GiB) fits no GPU to compute with:
#   the largest published, Llama 3.1 405B's embedding, has 2.1 G (16 times fewer);
# - a decoder of more than 4096 layers is 32 times the deepest published (126): each layer is a group the store
#   streams, versions and updates on its own, and the planner simulates them one by one;
# - more than 2**18 weights (1.3 M tensors of state with their gradients, master weights and moments) is 5 times a
#   235B mixture of experts (Qwen3's: 94 layers of 128 experts, 37 K weights).
# Past these, the run's budgets (the planner's one line: the state does not fit) say the rest.
MAX_ELEMENTS = 1 << 35
MAX_LAYERS = 4096
MAX_WEIGHTS = 1 << 18


@dataclass(frozen=True)
class MoeSpec:
    """The mixture-of-experts feed-forward of the sparse layers: each token goes through ``top_k`` of
    ``num_experts`` SwiGLU experts, weighted by its router probabilities (renormalised over the top-k when
    ``norm_topk_prob``). Dense layers (Qwen3-MoE's ``mlp_only_layers``, or off ``decoder_sparse_step``) keep
    the plain MLP of ``intermediate_size``."""

    num_experts: int
    top_k: int
    intermediate_size: int  # each expert's
    norm_topk_prob: bool
    sparse_layers: tuple[int, ...]
    block: str  # the layer's MoE module: "mlp" (Qwen3-MoE) or "block_sparse_moe" (Mixtral)
    proj: tuple[str, str, str]  # an expert's gate, up and down projections
    aux_loss_coef: float  # the router's load-balancing loss weight (0: off), see load_balancing_coef
    # "swiglu": softmax over all experts, then the top-k; experts as one tensor per expert and projection.
    # "gpt_oss": the top-k router logits (with the router's bias), softmax over them; the experts stacked in
    # three tensors with biases as the checkpoints store them (gate_up_proj [E, H, 2I], its gate and up columns
    # interleaved; down_proj [E, I, H]) and the clamped SwiGLU ``(clamp(up) + 1) * g * sigmoid(alpha g)`` with
    # ``g = min(gate, limit)``, ``up`` clamped to +-limit
    kind: str = "swiglu"
    alpha: float = 0.0
    limit: float = 0.0

    def expert_params(self, hidden: int) -> int:
        biases = 2 * self.intermediate_size + hidden if self.kind == "gpt_oss" else 0
        return 3 * hidden * self.intermediate_size + biases

    def router_params(self, hidden: int) -> int:
        return self.num_experts * (hidden + (1 if self.kind == "gpt_oss" else 0))


@dataclass
class ModelConfig:
    generic = False  # (a model of the generic path is a trainer.model.generic.GenericConfig)
    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v (and for llama's attention_bias also o) projections carry biases
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool  # Qwen3: RMSNorm over head_dim on q and k before RoPE
    rope: dict = field(default_factory=dict)  # rope_type, rope_theta, and the scaling parameters
    sliding_window: int | None = None  # (Mistral, Qwen2/3: the template attends causally within cutoff_len <= it)
    sinks: bool = False  # gpt-oss: a learned sink logit per head in each softmax (self_attn.sinks)
    windows: tuple = ()  # gpt-oss: each layer's sliding window (None: full causal attention); () none
    norm_weight_fp32: bool = False  # gpt-oss: the RMSNorm's weight multiplies the fp32 normalised input
    initializer_range: float = 0.02
    max_position_embeddings: int = 4096
    pad_token_id: int | None = None  # the embedding row Hugging Face never trains (nn.Embedding padding_idx)
    moe: MoeSpec | None = None
    raw: dict = field(default_factory=dict, repr=False)  # config.json as read (or as rope_scaling set it), for export
    notes: list = field(default_factory=list, repr=False, compare=False)  # note: lines said at start
    # how this run computes its decoder layers: (backend, mode) of torch.compile, or None for the eager layer
    # (torch_compile; trainer.model.compiled)
    compile: tuple | None = field(default=None, repr=False, compare=False)
    # tokens a layer computes at once over a long row (tiermem_seq_chunk; trainer.model.chunked); None: auto
    seq_chunk: int | None = field(default=None, repr=False, compare=False)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def inv_freq(self, seq_len: int | None = None) -> torch.Tensor:
        """RoPE inverse frequencies (float32), with the configured scaling applied, for rows of ``seq_len``
        tokens (None: the model's own length)."""
        return rope_math.inv_freq(self.rope, self.head_dim, self.max_position_embeddings, seq_len)

    def window(self, layer: int) -> int | None:
        """Layer ``layer``'s sliding attention window (None: full causal attention)."""
        return self.windows[layer] if self.windows else None

    def is_sparse(self, layer: int) -> bool:
        return self.moe is not None and layer in self.moe.sparse_layers

    def layer_params(self, layer: int = 0, active: bool = False) -> int:
        """Parameters of decoder layer ``layer``; ``active``: those one token computes with (its top-k
        experts of a sparse layer, not all of them)."""
        h, q, kv, i = self.hidden_size, self.q_size, self.kv_size, self.intermediate_size
        n = h * q + 2 * h * kv + q * h + 2 * h
        if self.is_sparse(layer):
            m = self.moe
            n += m.router_params(h) + (m.top_k if active else m.num_experts) * m.expert_params(h)
        else:
            n += 3 * h * i
        if self.attention_bias:
            n += q + 2 * kv
        if self.o_bias:
            n += h
        if self.mlp_bias:
            n += 2 * i + h
        if self.qk_norm:
            n += 2 * self.head_dim
        if self.sinks:
            n += self.num_heads
        return n

    def expert_params(self, layer: int = 0, active: bool = False) -> int:
        """Parameters of decoder layer ``layer``'s routed experts (``active``: a token's top-k); 0 for a dense one."""
        if not self.is_sparse(layer):
            return 0
        return (self.moe.top_k if active else self.moe.num_experts) * self.moe.expert_params(self.hidden_size)

    def num_params(self, active: bool = False) -> int:
        """All parameters, or (``active``) those one token computes with: what 6 N tokens counts."""
        emb = self.vocab_size * self.hidden_size
        layers = sum(self.layer_params(i, active) for i in range(self.num_layers))
        return emb * (1 if self.tie_word_embeddings else 2) + self.hidden_size + layers


def _rope(raw: dict, where: str, head_dim: int, max_pos: int, default_theta: float = 10000.0,
          default: dict | None = None) -> dict:
    """The RoPE parameters of config.json (``rope_parameters``, else ``rope_scaling`` + ``rope_theta``, else
    ``default``), standardised as transformers standardises them; a type or form the template does not compute
    raises NotCovered, a malformed one ModelConfigError."""
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and any(isinstance(v, dict) for v in params.values()):  # per-layer-type form
        raise NotCovered(f"{where}: per-layer-type rope_parameters are not supported by the template")
    if not isinstance(params, dict):
        scaling = raw.get("rope_scaling")
        if scaling is not None and not isinstance(scaling, dict):
            raise ModelConfigError(f"{where}: rope_scaling must be a mapping, got {scaling!r}"[:300])
        params = dict(scaling) if scaling else dict(default or {})
    params = dict(params)
    kind = params.get("rope_type", params.get("type", "default")) or "default"
    if kind not in ROPE_TYPES:
        raise NotCovered(f"{where}: RoPE type '{kind}' is not supported by the template; it computes "
                         f"{', '.join(ROPE_TYPES)}")
    params["rope_type"] = kind
    params.setdefault("rope_theta", raw.get("rope_theta", default_theta))
    partial = params.get("partial_rotary_factor", raw.get("partial_rotary_factor"))
    if partial is not None and partial != 1:
        raise NotCovered(f"{where}: partial_rotary_factor {partial} is not supported by the template (it rotates "
                         "the whole head)")
    orig = "original_max_position_embeddings"
    if kind in ("llama3", "yarn", "longrope"):  # (transformers: a top-level value wins, else max_position_embeddings)
        top = raw.get(orig)
        params[orig] = top if isinstance(top, int) and not isinstance(top, bool) else params.get(orig, max_pos)
        if isinstance(params[orig], bool) or not isinstance(params[orig], int) or params[orig] < 1:
            raise ModelConfigError(f"{where}: RoPE {orig} must be a positive integer, got {params[orig]!r}")
    need = {"linear": ("factor",), "dynamic": ("factor",), "yarn": ("factor",),
            "llama3": ("factor", "low_freq_factor", "high_freq_factor"), "longrope": ("short_factor", "long_factor")}
    for key in need.get(kind, ()):
        if key not in params:
            raise ModelConfigError(f"{where}: RoPE type '{kind}' needs '{key}'")
    numbers = [k for k in ("rope_theta", "factor", "low_freq_factor", "high_freq_factor", "attention_factor",
                           "beta_fast", "beta_slow", "mscale", "mscale_all_dim") if params.get(k) is not None]
    for key in numbers:  # (yarn's factor may be null: max_position_embeddings / original_max_position_embeddings)
        value = params[key]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or (
                value <= 0 and key not in ("mscale", "mscale_all_dim", "beta_fast", "beta_slow")):
            raise ModelConfigError(f"{where}: RoPE {key} must be a positive number, got {value!r}")
    if kind == "dynamic" and head_dim <= 2:
        raise ModelConfigError(f"{where}: dynamic RoPE needs a head_dim above 2, got {head_dim}")
    if kind == "longrope":
        for key in ("short_factor", "long_factor"):
            value = params[key]
            if not isinstance(value, list) or len(value) != head_dim // 2 or not all(
                    isinstance(x, (int, float)) and not isinstance(x, bool) and x > 0 for x in value):
                raise ModelConfigError(f"{where}: RoPE {key} must be a list of {head_dim // 2} positive numbers")
    return params


def _int(raw: dict, key: str, where: str, default=None, low: int = 1) -> int:
    value = raw.get(key, default) if default is not None else raw[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ModelConfigError(f"{where}: {key} must be an integer of at least {low}, got {value!r}")
    return value


def _bool(raw: dict, key: str, where: str) -> bool:
    """A true/false key (absent or null: false); a string such as "false" is refused, not read as true."""
    value = raw.get(key)
    if value is not None and not isinstance(value, bool):
        raise ModelConfigError(f"{where}: {key} must be true or false, got {value!r}"[:300])
    return bool(value)


def _token_id(raw: dict, key: str, where: str, vocab: int) -> int | None:
    """A special token's id (absent or null: none) inside the vocabulary; a negative one counts from its end, as
    nn.Embedding's padding_idx does."""
    value = raw.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not -vocab <= value < vocab:
        raise ModelConfigError(f"{where}: {key} must be a token id of the vocabulary (vocab_size {vocab}), got "
                               f"{value!r}"[:300])
    return value


def _float(raw: dict, key: str, where: str, default: float) -> float:
    value = raw.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ModelConfigError(f"{where}: {key} must be a positive finite number, got {value!r}")
    return float(value)


def model_config_from_dict(raw: dict, where: str = "config.json") -> ModelConfig:
    if not isinstance(raw, dict):
        raise ModelConfigError(f"{where}: expected a JSON object of the model's settings")
    archs = raw.get("architectures") or []
    if not isinstance(archs, list):
        raise ModelConfigError(f"{where}: architectures must be a list of class names")
    arch = archs[0] if archs else None
    if arch not in SUPPORTED:
        raise ModelConfigError(f"{where}: architecture {arch or '(none given)'} is not supported; supported: "
                          + ", ".join(SUPPORTED))
    family = SUPPORTED[arch]
    qwen3ish = family in ("qwen3", "qwen3_moe")
    oss = family == "gpt_oss"
    if "num_hidden_layers" in raw:
        check_layers(_int(raw, "num_hidden_layers", where), where)
    act = raw.get("hidden_act", "silu")
    if act != "silu" and not oss:  # (gpt-oss's experts have their own activation, whatever hidden_act says)
        raise NotCovered(f"{where}: hidden_act '{act}' is not supported by the template (only silu)")
    try:
        h, heads = _int(raw, "hidden_size", where), _int(raw, "num_attention_heads", where)
        head_dim = _int(raw, "head_dim", where, 1) if raw.get("head_dim") else (64 if oss else h // heads)
        max_pos = _int(raw, "max_position_embeddings", where, 131072 if oss else 4096)
        n_layers = _int(raw, "num_hidden_layers", where)
        bias = _bool(raw, "attention_bias", where) if raw.get("attention_bias") is not None else oss
        cfg = ModelConfig(
            family=family,
            vocab_size=_int(raw, "vocab_size", where),
            hidden_size=h,
            intermediate_size=_int(raw, "intermediate_size", where),
            num_layers=n_layers,
            num_heads=heads,
            num_kv_heads=_int(raw, "num_key_value_heads", where, heads) if raw.get("num_key_value_heads") else heads,
            head_dim=head_dim,
            rms_norm_eps=_float(raw, "rms_norm_eps", where, 1e-5 if oss else 1e-6),
            tie_word_embeddings=_bool(raw, "tie_word_embeddings", where),
            attention_bias=family == "qwen2" or (family in ("llama", "gpt_oss") or qwen3ish) and bias,
            o_bias=(family in ("llama", "gpt_oss") or qwen3ish) and bias,
            mlp_bias=family == "llama" and _bool(raw, "mlp_bias", where),
            qk_norm=qwen3ish,
            rope=_rope(raw, where, head_dim, max_pos, *((150000.0, GPT_OSS_ROPE) if oss else ())),
            sliding_window=_int(raw, "sliding_window", where) if _uses_window(raw, family) else None,
            sinks=oss,
            windows=_windows(raw, n_layers, where) if oss else (),
            norm_weight_fp32=oss,
            initializer_range=_float(raw, "initializer_range", where, 0.02),
            max_position_embeddings=max_pos,
            pad_token_id=_token_id(raw, "pad_token_id", where, _int(raw, "vocab_size", where)),
            moe=_moe(raw, family, where),
            raw=raw,
        )
    except KeyError as e:
        raise ModelConfigError(f"{where}: missing key {e.args[0]!r}") from None
    if cfg.head_dim < 1:
        raise ModelConfigError(f"{where}: hidden_size {h} is smaller than num_attention_heads {heads}; set head_dim")
    if cfg.head_dim % 2:
        raise ModelConfigError(f"{where}: head_dim {cfg.head_dim} is odd: RoPE rotates pairs of dimensions")
    if cfg.num_heads % cfg.num_kv_heads:
        raise ModelConfigError(f"{where}: num_attention_heads must be a multiple of num_key_value_heads")
    h, m = cfg.hidden_size, cfg.moe
    check_weights({"the embedding (vocab_size x hidden_size)": cfg.vocab_size * h,
                   "q_proj (hidden_size x num_attention_heads x head_dim)": h * cfg.q_size,
                   "the MLP (hidden_size x intermediate_size)": h * cfg.intermediate_size,
                   **({"an expert (hidden_size x moe_intermediate_size)": h * m.intermediate_size,
                       "the router (hidden_size x num_experts)": h * m.num_experts} if m else {})},
                  cfg.num_layers * (9 + (3 * m.num_experts if m else 0)), where)
    return cfg


# gpt-oss's RoPE where config.json gives none (transformers' GptOssConfig), and its rope_theta default 150000
GPT_OSS_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                "original_max_position_embeddings": 4096}


def _windows(raw: dict, n_layers: int, where: str) -> tuple:
    """gpt-oss's sliding window of each layer: ``layer_types`` (default: sliding on even layers, full on odd
    ones, as transformers'), ``sliding_window`` tokens (default 128) on the sliding ones."""
    types = raw.get("layer_types") or ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n_layers)]
    if not isinstance(types, list) or len(types) != n_layers or not set(types) <= {"sliding_attention",
                                                                                     "full_attention"}:
        raise ModelConfigError(f"{where}: layer_types must list sliding_attention or full_attention for each of the "
                               f"{n_layers} layers, got {types!r}")
    window = _int(raw, "sliding_window", where, 128) if "sliding_attention" in types else None
    return tuple(window if t == "sliding_attention" else None for t in types)


def check_layers(n: int, where: str) -> None:
    """At most MAX_LAYERS decoder layers (see above), checked before any layer is built or listed."""
    if n > MAX_LAYERS:
        raise ModelConfigError(f"{where}: num_hidden_layers {n:,} is more than tiermem takes ({MAX_LAYERS:,}: 32 times "
                               "the deepest published model)")


def check_weights(sizes: dict[str, int], count: int, where: str) -> None:
    """The largest weights (name -> elements) within MAX_ELEMENTS, and about ``count`` weights within MAX_WEIGHTS
    (see above)."""
    for what, n in sizes.items():
        if n > MAX_ELEMENTS:
            raise ModelConfigError(f"{where}: {what} would have {n:,} elements, more than a GPU can compute with (at "
                                   f"most 2**35: 64 GiB in bf16)")
    if count > MAX_WEIGHTS:
        raise ModelConfigError(f"{where}: {count:,} weights (layers x experts) are more than tiermem takes "
                               f"({MAX_WEIGHTS:,}: 5 times the largest published mixture of experts)")


def _moe(raw: dict, family: str, where: str) -> MoeSpec | None:
    """The MoE block of Qwen3-MoE or Mixtral, with transformers' defaults for keys config.json leaves out."""
    if family == "qwen3_moe":
        n_layers = _int(raw, "num_hidden_layers", where)
        step = _int(raw, "decoder_sparse_step", where, 1)
        dense = raw.get("mlp_only_layers") or []
        if not isinstance(dense, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in dense):
            raise ModelConfigError(f"{where}: mlp_only_layers must be a list of layer indices, got {dense!r}")
        key = "num_experts" if "num_experts" in raw else "num_local_experts"  # (transformers 5 writes the latter)
        n_exp = _int(raw, key, where, 128, low=0)
        sparse = tuple(i for i in range(n_layers) if i not in dense and n_exp > 0 and (i + 1) % step == 0)
        if not sparse:
            return None
        return MoeSpec(n_exp, _int(raw, "num_experts_per_tok", where, 8),
                       _int(raw, "moe_intermediate_size", where, 768), _bool(raw, "norm_topk_prob", where),
                       sparse, "mlp", ("gate_proj", "up_proj", "down_proj"), _coef(raw, where, 0.001))
    if family == "mixtral":
        jitter = raw.get("router_jitter_noise") or 0.0
        if jitter:
            raise ModelConfigError(f"{where}: router_jitter_noise {jitter} is not supported (random noise on the "
                                   "router's input cannot be recomputed exactly); set it to 0")
        return MoeSpec(_int(raw, "num_local_experts", where, 8), _int(raw, "num_experts_per_tok", where, 2),
                       _int(raw, "intermediate_size", where), True, tuple(range(_int(raw, "num_hidden_layers", where))),
                       "block_sparse_moe", ("w1", "w3", "w2"), _coef(raw, where, 0.001))
    if family == "gpt_oss":
        key = "num_experts" if "num_experts" in raw else "num_local_experts"  # (transformers' attribute_map)
        every = tuple(range(_int(raw, "num_hidden_layers", where)))
        return MoeSpec(_int(raw, key, where, 128), _int(raw, "num_experts_per_tok", where, 4),
                       _int(raw, "intermediate_size", where), False, every, "mlp",
                       ("gate_up_proj", "gate_up_proj", "down_proj"), _coef(raw, where, 0.001), "gpt_oss",
                       _float(raw, "swiglu_alpha", where, 1.702), _float(raw, "swiglu_limit", where, 7.0))
    return None


def _coef(raw: dict, where: str, default: float) -> float:
    """The load-balancing loss weight config.json asks for: router_aux_loss_coef when output_router_logits is
    set, else 0 (the trainer's ``moe_aux_loss_coef`` overrides it: ``load_balancing_coef``)."""
    if not raw.get("output_router_logits", False):
        return 0.0
    value = raw.get("router_aux_loss_coef", default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ModelConfigError(f"{where}: router_aux_loss_coef must be a non-negative number, got {value!r}")
    return float(value)


def load_balancing_coef(cfg: ModelConfig, override: float | None) -> ModelConfig:
    """``cfg`` with the router's load-balancing loss weight a run trains with: ``override`` (LLaMA-Factory's
    ``moe_aux_loss_coef``: a positive value turns the loss on with that weight, 0 turns it off) or, when None,
    what config.json says (``output_router_logits`` and ``router_aux_loss_coef``)."""
    if cfg.moe is None or override is None:
        return cfg
    if override and cfg.moe.kind == "generic-no-aux":  # (the generic path: as the model's transformers class)
        raise ModelConfigError(f"moe_aux_loss_coef: {getattr(cfg, 'arch', 'this model')} adds no load-balancing "
                               "loss in transformers (its router is balanced otherwise); set it to 0 or leave it unset")
    return dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, aux_loss_coef=float(override)))


def _uses_window(raw: dict, family: str) -> bool:
    if family in ("mistral", "mixtral"):
        return raw.get("sliding_window") is not None
    if family in ("qwen2", "qwen3", "qwen3_moe"):
        return bool(raw.get("use_sliding_window", False)) and raw.get("sliding_window") is not None
    return False


# config.json is a few KiB; a larger one is not a model's config
MAX_CONFIG_BYTES = 16 << 20


def read_config_json(model_dir: str | Path) -> dict:
    """config.json of ``model_dir`` as read (a regular file, JSON), or one line naming what is wrong."""
    path = Path(model_dir)
    if not path.is_dir():
        raise ModelConfigError(f"model_name_or_path: {model_dir} is not a directory (tiermem reads local Hugging Face "
                          "model directories; download the model first, e.g. `hf download ORG/NAME --local-dir DIR`)")
    cfg_path = path / "config.json"
    try:
        st = cfg_path.stat()
    except FileNotFoundError:
        raise ModelConfigError(f"model_name_or_path: {model_dir} has no config.json") from None
    if not stat.S_ISREG(st.st_mode):  # (a FIFO would wait for a writer: refused unopened, as tiermem.files does)
        raise ModelConfigError(f"config.json {cfg_path} is not a regular file")
    if st.st_size > MAX_CONFIG_BYTES:
        raise ModelConfigError(f"{cfg_path}: {st.st_size:,} bytes is too large for a model's config.json")
    try:
        fd = os.open(cfg_path, os.O_RDONLY | os.O_NONBLOCK)
        with os.fdopen(fd, "rb") as f:
            return json.loads(f.read(MAX_CONFIG_BYTES + 1))
    except OSError as e:
        raise ModelConfigError(f"{cfg_path}: cannot be read: {e.strerror}") from None
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise ModelConfigError(f"{cfg_path}: not valid JSON: {str(e)[:200]}") from None


def load_model_config(model_dir: str | Path) -> ModelConfig:
    return model_config_from_dict(read_config_json(model_dir), str(Path(model_dir) / "config.json"))
