"""The model's training state as the store sees it: the tensors' specs (each weight's compute copy, fp32
master in bf16 mode, gradient and Adam's moments, grouped as the store streams them) and the config of a
training run's own (embedded) store."""

from __future__ import annotations

import copy

import torch

from tiermem.config import MOMENTS, StoreConfig, check_host_budget, load_store_config
from tiermem.errors import ConfigError
from tiermem.plan.resolve import resolve_auto
from tiermem.specs import TensorSpec, state_name
from tiermem.tiers import registry
from tiermem.tiers.base import DEVICE, HOST
from tiermem.yamlfile import read_yaml
from trainer.model.weights import all_weights

# the keys a run's checks ask about (the user's, or left to tiermem): the host tier's and the device tier's
HOST_PATH = f"tiers.{registry.primary(HOST)}.path"
DEVICE_KEY = f"tiers.{registry.primary(DEVICE)}.device"


def store_settings(value) -> StoreConfig:
    """The tiermem config of a training run as it is written (a file path, an inline mapping, or the defaults),
    nothing resolved: its ``set_keys`` say what the user chose. Embedded runs default the DRAM arena to
    ``anonymous`` (private huge pages: nothing to share, nothing left behind, fast to pin)."""
    data = read_yaml(value, "tiermem config file") if isinstance(value, str) else copy.deepcopy(value or {})
    tiers = {} if data.get("tiers") is None else data["tiers"]
    if not isinstance(tiers, dict):
        raise ConfigError(f"tiers: expected a mapping of tiers (gpu, dram, nvme) to their settings, got {tiers!r}")
    data["tiers"] = tiers
    for key in (registry.primary(HOST), registry.primary(DEVICE)):
        if tiers.get(key) is None:
            tiers[key] = {}
        elif not isinstance(tiers[key], dict):
            raise ConfigError(f"tiers.{key}: expected a mapping of settings, got {tiers[key]!r}")
    cfg = load_store_config(data, str(value) if isinstance(value, str) else "tiermem")
    if HOST_PATH not in cfg.set_keys:
        cfg.tiers.host_tier.path = "anonymous"
    return cfg


def store_config(value, here: bool = True) -> StoreConfig:
    """The tiermem config of a training run (``store_settings``) with every ``auto`` (the GPU tier's device among
    them) resolved by ``tiermem.plan.resolve``. ``here``: the run is on this machine, whose memory bounds the
    DRAM budget (``tiermem plan`` for another machine checks against that one's)."""
    cfg = store_settings(value)
    if here:
        check_host_budget(cfg)
    if cfg.durability != "checkpoint":
        raise ConfigError("tiermem.durability: step is a service's setting (its config for `tiermem serve`): an "
                          "embedded run's state lives and dies with its process; resume from a checkpoint")
    return resolve_auto(cfg, "embedded")


def explicit_gpu_share(scfg: StoreConfig) -> bool:
    """Whether the run's tiermem config sets optimizer.gpu_share itself (then it wins over the planner's split)."""
    return "optimizer.gpu_share" in scfg.set_keys


def wants_cuda(scfg: StoreConfig) -> bool:
    """Whether the run's tiermem config computes on CUDA where there is one (device auto or cuda)."""
    return DEVICE_KEY not in scfg.set_keys or scfg.tiers.device_tier.device.startswith("cuda")


def state_specs(model_cfg, dtype: torch.dtype) -> list[TensorSpec]:
    """Every tensor of the run's state: ``param`` in ``dtype``; ``master`` (when ``dtype`` is not fp32),
    ``grad`` and both moments in fp32."""
    specs = []
    for w in all_weights(model_cfg):
        specs.append(TensorSpec(w.name, w.shape, dtype, "param", w.group))
        kinds = (("master",) if dtype != torch.float32 else ()) + ("grad", *MOMENTS)
        for kind in kinds:
            specs.append(TensorSpec(state_name(w.name, kind), w.shape, torch.float32, kind, w.group))
    return specs
