"""The model's shape, read from a Hugging Face config.json: the Llama family (Llama 2/3, Mistral, Qwen2,
Qwen3), with RoPE given as ``rope_theta`` + ``rope_scaling`` (published checkpoints) or as transformers
5's ``rope_parameters``. Anything this trainer cannot compute exactly is refused with one line.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch


class ModelConfigError(ValueError):
    """config.json asks for what this model code cannot compute, or is malformed: one line saying what, and
    what is supported (the trainer reports it as a user error)."""


SUPPORTED = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
ROPE_TYPES = ("default", "linear", "llama3")


@dataclass
class ModelConfig:
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
    sliding_window: int | None = None
    initializer_range: float = 0.02
    max_position_embeddings: int = 4096
    pad_token_id: int | None = None  # the embedding row Hugging Face never trains (nn.Embedding padding_idx)
    raw: dict = field(default_factory=dict, repr=False)  # config.json as read, for export

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def inv_freq(self) -> torch.Tensor:
        """RoPE inverse frequencies (float32), with the configured scaling applied."""
        d = self.head_dim
        theta = float(self.rope["rope_theta"])
        inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
        kind = self.rope["rope_type"]
        if kind == "linear":
            inv = inv / float(self.rope["factor"])
        elif kind == "llama3":
            inv = _llama3_scale(inv, self.rope)
        return inv

    def layer_params(self) -> int:
        h, q, kv, i = self.hidden_size, self.q_size, self.kv_size, self.intermediate_size
        n = h * q + 2 * h * kv + q * h + 3 * h * i + 2 * h
        if self.attention_bias:
            n += q + 2 * kv
        if self.o_bias:
            n += h
        if self.mlp_bias:
            n += 2 * i + h
        if self.qk_norm:
            n += 2 * self.head_dim
        return n

    def num_params(self) -> int:
        emb = self.vocab_size * self.hidden_size
        return emb * (1 if self.tie_word_embeddings else 2) + self.hidden_size + self.num_layers * self.layer_params()


def _llama3_scale(inv: torch.Tensor, p: dict) -> torch.Tensor:
    factor = float(p["factor"])
    low, high = float(p["low_freq_factor"]), float(p["high_freq_factor"])
    old_len = float(p["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv
    long_wave = wavelen > old_len / low
    short_wave = wavelen < old_len / high
    scaled = torch.where(long_wave, inv / factor, inv)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    return torch.where(~long_wave & ~short_wave, blended, scaled)


def _rope(raw: dict, where: str) -> dict:
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and "full_attention" in params:  # per-layer-type form
        raise ModelConfigError(f"{where}: per-layer-type rope_parameters are not supported")
    if not isinstance(params, dict):
        params = dict(raw.get("rope_scaling") or {})
        params.setdefault("rope_theta", raw.get("rope_theta", 10000.0))
    params = dict(params)
    kind = params.get("rope_type", params.get("type", "default")) or "default"
    if kind not in ROPE_TYPES:
        raise ModelConfigError(f"{where}: RoPE scaling '{kind}' is not supported yet; supported: "
                               f"{', '.join(ROPE_TYPES)}")
    params["rope_type"] = kind
    params.setdefault("rope_theta", raw.get("rope_theta", 10000.0))
    need = {"linear": ("factor",),
            "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}
    for key in need.get(kind, ()):
        if key not in params:
            raise ModelConfigError(f"{where}: RoPE type '{kind}' needs '{key}'")
    return params


def _int(raw: dict, key: str, where: str, default=None, low: int = 1) -> int:
    value = raw.get(key, default) if default is not None else raw[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ModelConfigError(f"{where}: {key} must be an integer of at least {low}, got {value!r}")
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
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise ModelConfigError(f"{where}: hidden_act '{act}' is not supported (only silu)")
    try:
        h, heads = _int(raw, "hidden_size", where), _int(raw, "num_attention_heads", where)
        cfg = ModelConfig(
            family=family,
            vocab_size=_int(raw, "vocab_size", where),
            hidden_size=h,
            intermediate_size=_int(raw, "intermediate_size", where),
            num_layers=_int(raw, "num_hidden_layers", where),
            num_heads=heads,
            num_kv_heads=_int(raw, "num_key_value_heads", where, heads) if raw.get("num_key_value_heads") else heads,
            head_dim=_int(raw, "head_dim", where, h // heads) if raw.get("head_dim") else h // heads,
            rms_norm_eps=_float(raw, "rms_norm_eps", where, 1e-6),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=family == "qwen2" or (family in ("llama", "qwen3") and bool(raw.get("attention_bias"))),
            o_bias=family in ("llama", "qwen3") and bool(raw.get("attention_bias")),
            mlp_bias=family == "llama" and bool(raw.get("mlp_bias")),
            qk_norm=family == "qwen3",
            rope=_rope(raw, where),
            sliding_window=raw.get("sliding_window") if _uses_window(raw, family) else None,
            initializer_range=float(raw.get("initializer_range", 0.02)),
            max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
            pad_token_id=raw.get("pad_token_id") if isinstance(raw.get("pad_token_id"), int) else None,
            raw=raw,
        )
    except KeyError as e:
        raise ModelConfigError(f"{where}: missing key {e.args[0]!r}") from None
    if cfg.head_dim < 1:
        raise ModelConfigError(f"{where}: hidden_size {h} is smaller than num_attention_heads {heads}; set head_dim")
    if cfg.num_heads % cfg.num_kv_heads:
        raise ModelConfigError(f"{where}: num_attention_heads must be a multiple of num_key_value_heads")
    return cfg


def _uses_window(raw: dict, family: str) -> bool:
    if family == "mistral":
        return raw.get("sliding_window") is not None
    if family in ("qwen2", "qwen3"):
        return bool(raw.get("use_sliding_window", False)) and raw.get("sliding_window") is not None
    return False


def load_model_config(model_dir: str | Path) -> ModelConfig:
    path = Path(model_dir)
    if not path.is_dir():
        raise ModelConfigError(f"model_name_or_path: {model_dir} is not a directory (tiermem reads local Hugging Face "
                          "model directories; download the model first, e.g. `hf download ORG/NAME --local-dir DIR`)")
    cfg_path = path / "config.json"
    if not cfg_path.is_file():
        raise ModelConfigError(f"model_name_or_path: {model_dir} has no config.json")
    try:
        raw = json.loads(cfg_path.read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelConfigError(f"{cfg_path}: not valid JSON: {e}") from None
    return model_config_from_dict(raw, str(cfg_path))
