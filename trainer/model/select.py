"""Which path computes a model: the hand-written template (``trainer.model.stages``) for the architectures
it covers (the fast path), else the generic path (``trainer.model.generic``: the transformers model's own
modules run over the streamed weights), else one line naming what is missing. A config.json of a template
architecture that asks for what the template does not compute (a RoPE type, an activation: ``NotCovered``)
goes to the generic path under ``auto``, with a ``note:`` line saying why (the config's ``note``).
"""

from __future__ import annotations

from pathlib import Path

import torch

from trainer.model.config import SUPPORTED, ModelConfigError, NotCovered, model_config_from_dict, read_config_json
from trainer.model.rope import llamafactory_scaling
from trainer.model.stages import TemplateStages


def read_config(model_dir: str | Path) -> tuple[dict, str]:
    """config.json of ``model_dir`` as a dict, and its path (for messages)."""
    cfg_path = Path(model_dir) / "config.json"
    return read_config_json(model_dir), str(cfg_path)


def model_from_dict(raw: dict, where: str = "config.json", path: str = "auto"):
    """The model's config for the path that computes it: ``path`` "auto" (the template where it covers the
    architecture, else the generic path), "template" or "generic"."""
    archs = raw.get("architectures") if isinstance(raw, dict) else None
    arch = archs[0] if isinstance(archs, list) and archs else None
    if not isinstance(raw, dict) or path == "template":
        return model_config_from_dict(raw, where)
    from trainer.model.generic_config import generic_config

    if path == "auto" and arch in SUPPORTED:
        try:
            return model_config_from_dict(raw, where)
        except NotCovered as uncovered:
            try:
                cfg = generic_config(raw, where)
            except ModelConfigError:
                raise uncovered from None
            why = str(uncovered).removeprefix(f"{where}: ")
            cfg.notes.append(f"note: the template does not cover this model ({why}): the generic path computes it")
            return cfg

    try:
        return generic_config(raw, where)
    except ModelConfigError as e:
        if path == "generic":
            raise
        raise ModelConfigError(f"{e}; the template takes {', '.join(SUPPORTED)}") from None


def load_model(model_dir: str | Path, path: str = "auto", rope_scaling: str | None = None, cutoff_len: int = 0,
               depth: int | None = None):
    """The model of ``model_dir`` for ``path``; with LLaMA-Factory's ``rope_scaling`` for rows of ``cutoff_len``
    tokens, its config.json scaled first (what changed in the config's notes); ``depth``: the same family at
    that many decoder layers (``at_depth``: ``tiermem plan --largest``)."""
    raw, where = read_config(model_dir)
    if depth is not None and isinstance(raw, dict):
        raw, where = at_depth(raw, depth), f"{where} at num_hidden_layers {depth}"
    note = None
    if rope_scaling is not None and isinstance(raw, dict):
        raw, note = llamafactory_scaling(raw, rope_scaling, cutoff_len)
    cfg = model_from_dict(raw, where, path)
    if note:
        cfg.notes.insert(0, note)
    return cfg


def at_depth(raw: dict, depth: int) -> dict:
    """config.json of the same model with ``depth`` decoder layers: a per-layer list the length of the layers
    (gpt-oss's and Qwen3-Next's ``layer_types``) cut to them, or its pattern repeated to them."""
    out = dict(raw, num_hidden_layers=depth)
    n = raw.get("num_hidden_layers")
    for key, value in raw.items():
        if isinstance(value, list) and value and len(value) == n and key != "architectures":
            out[key] = [value[i % len(value)] for i in range(depth)]
    return out


def model_stages(cfg, dtype: torch.dtype, device: torch.device):
    """The computation of ``cfg``'s model in the executor's terms."""
    if cfg.generic:
        from trainer.model.generic import GenericStages

        return GenericStages(cfg, dtype, device)
    return TemplateStages(cfg, dtype, device)
