"""Rotary position embeddings as the published checkpoints configure them: the inverse frequencies of each
RoPE type, the attention factor their cos/sin carry, the tables a micro-batch's layers use, and
LLaMA-Factory's ``rope_scaling`` training key applied to config.json.

Types (``rope_type`` of ``rope_scaling`` / transformers 5's ``rope_parameters``), each computed as transformers
computes it (``modeling_rope_utils``), in float32:

- ``default``: ``1 / theta^(2i/d)``;
- ``linear``: the default frequencies divided by ``factor``;
- ``llama3``: Llama 3.1's: low frequencies divided by ``factor``, high ones kept, a smooth blend between;
- ``yarn``: each frequency a blend of the default (extrapolated) and the divided-by-``factor`` (interpolated)
  one by a linear ramp over the dimensions between the correction bounds of ``beta_fast`` and ``beta_slow``
  (truncated to whole dimensions unless ``truncate`` is false); cos and sin are multiplied by the attention
  factor: ``attention_factor`` if given, else ``0.1 ln(factor) + 1`` (or the ratio of that with ``mscale`` and
  ``mscale_all_dim`` when both are given);
- ``dynamic`` (NTK): for a sequence of ``seq`` > ``max_position_embeddings`` tokens the base grows to
  ``theta (factor seq / max_pos - factor + 1)^(d/(d-2))``; at most ``max_position_embeddings`` tokens, the
  default frequencies;
- ``longrope``: ``1 / (ext_i theta^(2i/d))`` with ``ext`` the ``long_factor`` list for sequences longer than
  ``original_max_position_embeddings``, else ``short_factor``; cos and sin multiplied by ``attention_factor``,
  else ``sqrt(1 + ln(factor) / ln(original_max_position_embeddings))`` (``factor`` defaulting to
  ``max_position_embeddings / original_max_position_embeddings``).

The sequence length that ``dynamic`` and ``longrope`` depend on is a micro-batch's padded length (transformers':
the largest position id + 1). transformers' rotary module also remembers the longest length it has seen beyond
``max_position_embeddings`` and keeps that one's frequencies for shorter rows until one of at most
``max_position_embeddings`` tokens comes; here each micro-batch gets the frequencies of its own length, as a
fresh transformers model computes them, so a step's result does not depend on the steps before it (a resumed
run ends where the uninterrupted one does).
"""

from __future__ import annotations

import math

import torch

TYPES = ("default", "linear", "llama3", "yarn", "dynamic", "longrope")
# LLaMA-Factory's rope_scaling values (its RopeScaling)
LLAMAFACTORY_TYPES = ("linear", "dynamic", "yarn", "llama3")


def _exponents(d: int, device=None) -> torch.Tensor:
    return torch.arange(0, d, 2, dtype=torch.int64, device=device).float() / d


def inv_freq(p: dict, head_dim: int, max_pos: int, seq_len: int | None = None) -> torch.Tensor:
    """The inverse frequencies (float32, ``head_dim / 2``) of RoPE parameters ``p`` (``rope_type``,
    ``rope_theta`` and the type's keys, as ``trainer.model.config`` checked them) for a sequence of ``seq_len``
    tokens (None: the model's own length; only ``dynamic`` and ``longrope`` depend on it)."""
    d, theta, kind = head_dim, float(p["rope_theta"]), p["rope_type"]
    if kind == "dynamic":
        factor = float(p["factor"])
        if seq_len is None or seq_len <= max_pos:  # (transformers' initial frequencies, in Python floats)
            base = theta * ((factor * max_pos / max_pos) - (factor - 1)) ** (d / (d - 2))
        else:  # (transformers' update for a longer sequence: float32 tensor arithmetic)
            grown = factor * torch.tensor(seq_len, dtype=torch.int64) / max_pos - (factor - 1)
            base = theta * grown ** (d / (d - 2))
        return 1.0 / (base ** _exponents(d))
    if kind == "longrope":
        long = seq_len is not None and seq_len > int(p["original_max_position_embeddings"])
        ext = torch.tensor(p["long_factor" if long else "short_factor"], dtype=torch.float32)
        return 1.0 / (ext * theta ** _exponents(d))
    if kind == "yarn":
        return _yarn(p, d, theta, max_pos)
    inv = 1.0 / (theta ** _exponents(d))
    if kind == "linear":
        return inv / float(p["factor"])
    if kind == "llama3":
        return _llama3(inv, p)
    return inv


def _llama3(inv: torch.Tensor, p: dict) -> torch.Tensor:
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


def _yarn_factor(p: dict, max_pos: int) -> float:
    factor = p.get("factor")
    return float(factor) if factor is not None else max_pos / float(p["original_max_position_embeddings"])


def _yarn(p: dict, d: int, theta: float, max_pos: int) -> torch.Tensor:
    factor = _yarn_factor(p, max_pos)
    old_len = float(p["original_max_position_embeddings"])
    fast, slow = p.get("beta_fast") or 32, p.get("beta_slow") or 1

    def bound(rotations: float) -> float:  # the dimension that turns ``rotations`` times over old_len tokens
        return d * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = bound(fast), bound(slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(d // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    wave = theta ** (torch.arange(0, d, 2).float() / d)
    keep = 1 - ramp  # the share of each dimension that keeps its pretrained (extrapolated) frequency
    return (1.0 / (factor * wave)) * (1 - keep) + (1.0 / wave) * keep


def attention_factor(p: dict, max_pos: int) -> float:
    """The factor cos and sin are multiplied by (1.0 but for yarn and longrope)."""
    kind = p["rope_type"]
    given = p.get("attention_factor")
    if kind == "yarn":
        if given is not None:
            return float(given)
        factor = _yarn_factor(p, max_pos)

        def m(scale: float, ms: float = 1.0) -> float:
            return 1.0 if scale <= 1 else 0.1 * ms * math.log(scale) + 1.0

        ms, ms_all = p.get("mscale"), p.get("mscale_all_dim")
        return float(m(factor, ms) / m(factor, ms_all)) if ms and ms_all else m(factor)
    if kind == "longrope":
        if given is not None:
            return float(given)
        old_len = float(p["original_max_position_embeddings"])
        factor = p.get("factor")
        factor = float(factor) if factor is not None else max_pos / old_len
        return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(old_len))
    return 1.0


def tables(p: dict, head_dim: int, max_pos: int, seq_len: int, device: torch.device, dtype: torch.dtype):
    """cos and sin [seq_len, head_dim] for positions 0..seq_len-1 (each half of the head the same frequencies,
    as the rotate-half form of the rotation takes them), times the attention factor, in ``dtype``."""
    inv = inv_freq(p, head_dim, max_pos, seq_len).to(device)
    freqs = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv)
    emb = torch.cat([freqs, freqs], dim=-1)
    scale = attention_factor(p, max_pos)
    return (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)


class Rope:
    """The cos/sin tables of one model for micro-batches of any length: one table, grown as needed and sliced,
    where the frequencies do not depend on the length; else a table for each length's frequencies (the
    latest few kept)."""

    def __init__(self, p: dict, head_dim: int, max_pos: int, device: torch.device, dtype: torch.dtype):
        self.p, self.head_dim, self.max_pos, self.device, self.dtype = p, head_dim, max_pos, device, dtype
        self._made: dict = {}

    def _variant(self, seq_len: int):
        """Which frequencies a sequence of ``seq_len`` tokens takes: None where all lengths take the same."""
        kind = self.p["rope_type"]
        if kind == "dynamic":
            return seq_len if seq_len > self.max_pos else None
        if kind == "longrope":
            return seq_len > int(self.p["original_max_position_embeddings"])
        return None

    def tables(self, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        key = self._variant(seq_len)
        have = self._made.get(key)
        if have is None or have[0].shape[0] < seq_len:
            have = tables(self.p, self.head_dim, self.max_pos, seq_len, self.device, self.dtype)
            if len(self._made) > 8:
                self._made.clear()
            self._made[key] = have
        return have[0][:seq_len], have[1][:seq_len]


def llamafactory_scaling(raw: dict, kind: str, cutoff_len: int) -> tuple[dict, str]:
    """config.json ``raw`` with LLaMA-Factory's ``rope_scaling: kind`` applied for rows of ``cutoff_len``
    tokens, as its ``configure_rope`` does for training, and a line saying what changed. The pretrained length
    is the scaling's ``original_max_position_embeddings`` where config.json has one, else
    ``max_position_embeddings``; rows no longer than it leave config.json as it is; longer ones set ``factor``
    to ceil(cutoff_len / length), ``max_position_embeddings`` to length x factor, and replace the model's
    scaling with ``{rope_type, factor}`` (plus ``original_max_position_embeddings``: the length, for dynamic,
    yarn and llama3; and ``low_freq_factor`` 1, ``high_freq_factor`` 4 for llama3). The scaling is written where
    config.json keeps it: in ``rope_parameters`` (transformers 5, with its ``rope_theta``) or ``rope_scaling``."""
    params = raw.get("rope_parameters") if isinstance(raw.get("rope_parameters"), dict) else None
    current = params if params is not None else raw.get("rope_scaling")
    if isinstance(current, dict) and "original_max_position_embeddings" in current:
        old = current["original_max_position_embeddings"]
    else:
        old = raw.get("max_position_embeddings")
    if not isinstance(old, int) or isinstance(old, bool) or old <= 0:
        return raw, (f"note: rope_scaling: {kind} has no effect here: config.json gives no max_position_embeddings "
                     "to scale from")
    if cutoff_len <= old:
        return raw, (f"note: rope_scaling: {kind} has no effect here: cutoff_len {cutoff_len} is within the model's "
                     f"{old} positions (LLaMA-Factory disables the scaling then)")
    factor = float(math.ceil(cutoff_len / old))
    scaling: dict = {"rope_type": kind, "factor": factor}
    if kind in ("dynamic", "yarn", "llama3"):
        scaling["original_max_position_embeddings"] = old
    if kind == "llama3":
        scaling.update(low_freq_factor=1.0, high_freq_factor=4.0)
    out = dict(raw, max_position_embeddings=int(old * factor))
    if params is not None:
        out["rope_parameters"] = dict(scaling, rope_theta=params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    else:
        out["rope_scaling"] = scaling
    return out, (f"note: rope_scaling: {kind} with factor {factor:g} for cutoff_len {cutoff_len} (the model's "
                 f"{old} positions, max_position_embeddings now {int(old * factor)}), as LLaMA-Factory sets it; "
                 "the exported config.json says so")
