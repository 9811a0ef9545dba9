"""The template's decoder layer compiled with ``torch.compile`` (the ``torch_compile`` key).

The layer is a stateless function of the weights it is handed (views into a streaming slot or into a group
that lives in HBM), so one compiled function serves every layer of the model: its forward without gradient,
the recomputing backward and a kept graph each compile once per micro-batch shape (dynamic after a second
shape). What it buys on the GPU is fusion: the RMSNorms' casts and reductions, RoPE, SwiGLU and the residual
adds become a few kernels instead of dozens (tools/profile_step.py shows the share of elementwise kernels;
docs/measurements.md what it bought). ``auto`` compiles on CUDA only: on a CPU the compile costs more than a
small run gains, and the CPU's exactness tests run the eager layer.
"""

from __future__ import annotations

import torch

from trainer.model import chunked
from trainer.model.layers import decoder_layer

_COMPILED: dict = {}
_PARTS: dict = {}


class CompileError(ValueError):
    """``torch_compile`` asks for what cannot be compiled (one line for the user)."""


def choose(setting, backend: str, mode: str | None, mcfg, on_cuda: bool) -> tuple[str, str | None] | None:
    """(backend, mode) when this run compiles its decoder layer, None when it runs the eager one. ``setting``
    is ``torch_compile``: true, false or auto (CUDA and a dense template model)."""
    sparse, generic = mcfg.moe is not None, mcfg.generic
    if setting == "auto":
        return (backend, mode) if on_cuda and not sparse and not generic else None
    if not setting:
        return None
    if generic:
        raise CompileError("torch_compile: true is not supported yet on the generic model path (the template's "
                           "architectures only)")
    if sparse:
        raise CompileError("torch_compile: true is not supported yet for mixture-of-experts layers (their routing "
                           "has data-dependent shapes)")
    return backend, mode


def layer_function(how: tuple[str, str | None] | None):
    """The decoder layer function to run: ``decoder_layer`` itself, or compiled as ``how`` says (one compiled
    function per (backend, mode) in a process)."""
    if how is None:
        return decoder_layer
    if how not in _COMPILED:
        backend, mode = how
        _COMPILED[how] = torch.compile(decoder_layer, backend=backend, mode=mode)
    return _COMPILED[how]


def chunk_parts(how: tuple[str, str | None] | None) -> tuple:
    """The (pre-attention, post-attention) functions of a layer run in sequence chunks
    (``trainer.model.chunked``): themselves, or compiled as ``how`` says (each chunk the same shape)."""
    if how is None:
        return chunked.pre_attention, chunked.post_attention
    if how not in _PARTS:
        backend, mode = how
        _PARTS[how] = tuple(torch.compile(f, backend=backend, mode=mode)
                            for f in (chunked.pre_attention, chunked.post_attention))
    return _PARTS[how]
