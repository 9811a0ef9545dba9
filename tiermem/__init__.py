"""tiermem: a tiered store (HBM, pinned host DRAM, NVMe) for training state that does not fit on one GPU.

The store owns every persistent byte of training state and places it on a tier by policy. It knows
nothing of models: the trainer (package ``trainer``) asks it for groups of named tensors.
"""

from tiermem.errors import UserError

__version__ = "0.1.0"
__all__ = ["UserError", "__version__"]
