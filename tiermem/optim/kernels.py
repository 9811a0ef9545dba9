"""The AdamW arithmetic the optimizer runs: torch's fused kernel, in place or out of place.

``fused_adamw`` updates weights and moments in place (the GPU worker's working copies, embedded runs).

``adamw_out_of_place`` leaves the old weights, moments and gradient untouched and writes the new weights
and moments to other memory: a crash in the middle loses nothing a redo needs. It walks the tensors in
chunks small enough to stay in the CPU's caches: each chunk of the old state is copied to its new place
and updated there by the same fused kernel, so the memory traffic is close to the in-place update's
(the old state read once, the new written once) instead of a whole undo copy beside it. Chunks are
multiples of 64 elements, the fused kernel's per-thread units are aligned the same way, so every element
goes through the same code path as in one whole-tensor call: the result is bit-identical.
"""

from __future__ import annotations

import torch

# elements per chunk: old and new weights and moments plus the gradient of a chunk are 28 MiB in fp32
CHUNK = 1 << 20


def fused_adamw(ps, gs, ms, vs, step: int, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
                grad_scale: float | None, device) -> None:
    """torch's fused AdamW over lists of same-device tensors, in place (gradients unscaled in place too)."""
    if not ps:
        return
    # made on the device (a fill, not a copy from pageable memory, which would make the host wait for the
    # stream); the kernel only reads the step, so every tensor shares one
    step_t = torch.full((), float(step), dtype=torch.float32, device=device)
    steps = [step_t] * len(ps)
    scale = None if grad_scale is None else torch.full((), grad_scale, dtype=torch.float32, device=device)
    torch._fused_adamw_(ps, gs, ms, vs, [], steps, lr=lr, beta1=beta1, beta2=beta2, weight_decay=weight_decay,
                        eps=eps, amsgrad=False, maximize=False, grad_scale=scale, found_inf=None)


def adamw_out_of_place(rows, step: int, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
                       grad_scale: float | None, chunk: int = CHUNK) -> None:
    """``rows``: (old weight, gradient, old exp_avg, old exp_avg_sq, new weight, new exp_avg, new exp_avg_sq)
    per tensor, CPU tensors of one shape; an old moment given as None starts at zero (the first update).
    The new tensors receive the update; the old ones and the gradient keep their bytes."""
    assert chunk % 64 == 0
    scratch = torch.empty(min(chunk, max((r[1].numel() for r in rows), default=0)), dtype=torch.float32) \
        if grad_scale is not None else None
    for p, g, m, v, p2, m2, v2 in rows:
        p, g, m, v, p2, m2, v2 = (None if t is None else t.reshape(-1) for t in (p, g, m, v, p2, m2, v2))
        for a in range(0, p.numel(), chunk):
            b = min(p.numel(), a + chunk)
            srcs, dsts = [p[a:b]], [p2[a:b]]
            for old, new in ((m, m2), (v, v2)):
                if old is None:
                    new[a:b].zero_()
                else:
                    srcs.append(old[a:b])
                    dsts.append(new[a:b])
            torch._foreach_copy_(dsts, srcs)
            gc = g[a:b]
            if scratch is not None:  # the kernel unscales the gradient in place: a copy takes it
                gc = scratch[: b - a]
                gc.copy_(g[a:b])
            fused_adamw([p2[a:b]], [gc], [m2[a:b]], [v2[a:b]], step, lr, beta1, beta2, eps, weight_decay,
                        grad_scale, "cpu")
