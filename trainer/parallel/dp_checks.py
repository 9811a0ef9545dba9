"""What a run of several ranks does not support yet, refused in one line (exit code 2) before anything starts,
and the store config of one rank.

Several ranks share one store per host (``trainer.parallel.dp_session``): the compute copy lives in the DRAM arena (or
on NVMe), where every rank reads it, and a group's other state there or in its owner's HBM. The compute copy in
HBM (a pin of ``param`` to ``gpu``), state in HBM with several hosts, a service's run (``tiermem_server``) across
hosts, hosts with different numbers of ranks, a load-balancing loss (whose statistics are a micro-batch's, which
several ranks split) and kept activations (which need weights in HBM) are refused. (One host's ranks attached
to its service: ``trainer.parallel.dp_service``.)
"""

from __future__ import annotations

from tiermem.errors import ConfigError
from tiermem.tiers import registry
from tiermem.tiers.base import DEVICE
from trainer.state import HOST_PATH, store_config, store_settings

NOT_YET = "is not supported yet with several ranks"


def check_supported(cfg, world, mcfg=None) -> None:
    """Refuse (ConfigError, one line) what ``world`` (several ranks) cannot run; nothing when it is one rank."""
    if not world.several:
        return
    n = f"{world.size} ranks"
    if world.size % max(world.local_size, 1):
        raise ConfigError(f"hosts with different numbers of ranks are {NOT_YET[3:]} ({n}, {world.local_size} on "
                          "this host): start the same --nproc-per-node on every host")
    if cfg.tiermem_server and world.size > world.local_size:
        raise ConfigError(f"tiermem_server with several hosts is not supported yet ({n} on "
                          f"{world.size // world.local_size} hosts): a service is one host's store; drop "
                          "tiermem_server (each host then has an embedded store) or run on one host")
    chosen = store_settings(cfg.tiermem)
    on_gpu = sorted(k for k, t in chosen.pins().items() if t == registry.primary(DEVICE))
    if "param" in on_gpu:
        raise ConfigError(f"placement pins param to gpu: the compute copy in HBM {NOT_YET} ({n}: every rank "
                          "reads every group's from the host's arena); pin it to dram or nvme")
    if on_gpu and world.size > world.local_size:
        raise ConfigError(f"placement pins {', '.join(on_gpu)} to gpu: state in HBM is not supported yet with "
                          f"several hosts ({n} on {world.size // world.local_size} hosts); pin it to dram or nvme")
    if HOST_PATH in chosen.set_keys and chosen.tiers.host_tier.path == "anonymous" and world.local_size > 1:
        raise ConfigError(f"tiers.dram.path: anonymous cannot be shared by the {world.local_size} ranks of this host; "
                          "set it to a tmpfs directory such as /dev/shm (the default with several ranks)")
    device = chosen.tiers.device_tier.device
    if device.startswith("cuda:"):
        raise ConfigError(f"tiers.gpu.device: {device} names one GPU, but each of the {n} computes on its own "
                          "(cuda:LOCAL_RANK): set device to auto or cuda")
    keep = cfg.tiermem_keep_activations
    if keep not in ("auto", 0):
        raise ConfigError(f"tiermem_keep_activations: {keep} {NOT_YET} ({n}): it needs weights in HBM, which the "
                          "ranks' shared store does not keep; set it to 0 or auto")
    moe = mcfg.moe if mcfg is not None else None
    if moe is not None and moe.aux_loss_coef:
        raise ConfigError(f"the router's load-balancing loss {NOT_YET} ({n}): its statistics are a micro-batch's, "
                          "which the ranks split; set moe_aux_loss_coef: 0 or run one process")


def rank_store_config(cfg, world):
    """The store config of one rank: with several ranks on a host the arena is a file under /dev/shm unless the
    config names another directory (the ranks map it by name), and each rank computes on cuda:LOCAL_RANK."""
    scfg = store_config(cfg.tiermem)
    if not world.several:
        return scfg
    if HOST_PATH not in scfg.set_keys:
        scfg.tiers.host_tier.path = "/dev/shm"
    if scfg.tiers.device_tier.device.startswith("cuda"):
        scfg.tiers.device_tier.device = f"cuda:{world.local_rank}"
    return scfg
