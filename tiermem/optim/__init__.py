"""The optimizer: AdamW over store-resident groups (``StoreAdamW``), its arithmetic (``kernels``) and the
interface the trainer and the service call (``interface.Optimizer``)."""

from tiermem.optim.interface import Gate, Optimizer
from tiermem.optim.store_adamw import AdamWConfig, OptimSettings, StoreAdamW, default_threads

__all__ = ["AdamWConfig", "Gate", "OptimSettings", "Optimizer", "StoreAdamW", "default_threads"]
