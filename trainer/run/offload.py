"""A step's boundary activations where the plan put them: on the GPU, or (the first ``host`` of them: layer i's
input for i < host) in the store's host tier (issue 39).

The forward writes such an activation to an extent the store reserves for it (``Store.reserve`` / ``put``, the
device-to-host lane) as soon as the layer before has made it, while the next layer computes, and lets go of the
GPU copy once that layer has read it (the lane holds it until the copy has run). The backward reads each one back
into a fresh GPU tensor one layer ahead of its use (``get``, the host-to-device lane), as the prefetcher fetches
weights, and frees the extent once it is back. The bytes go out and come back unchanged: the step is the same.

    stash = Stash(store, "dram", host, keep)          # per pass
    stash.put(i, tensors)                             # boundary i (each micro-batch's) made: written out if i < host
    acts[i] = stash.drop(i, acts[i])                  # ... its GPU copies let go once layer i has read them
    stash.prefetch(i)                                 # the backward: boundary i on its way back
    x = stash.take(i, mb, acts[i][mb])                # ... here (or the GPU's own copy)
"""

from __future__ import annotations

import torch


class Stash:
    def __init__(self, store, tier: str | None, host: int, keep: set = frozenset()):
        """``host``: boundaries 0..host-1 live in ``tier`` (a kept layer's input is its graph's: not written)."""
        self.store, self.tier = store, tier
        self.host = {i for i in range(host if tier else 0) if i not in keep}
        self._out: dict = {}  # boundary -> [(place, shape, dtype, put future)] by micro-batch
        self._back: dict = {}  # boundary -> [(GPU tensor, get future)]
        self.moved = 0  # bytes written out (and read back) this pass

    def put(self, i: int, tensors: list[torch.Tensor]) -> None:
        if i not in self.host:
            return
        out = []
        for t in tensors:
            t = t.contiguous()
            n = t.numel() * t.element_size()
            place = self.store.reserve(self.tier, n)
            out.append((place, t.shape, t.dtype, self.store.put(t, place)))
            self.moved += n
        self._out[i] = out

    def drop(self, i: int, tensors: list) -> list:
        """Boundary ``i``'s GPU copies let go (None in their place) where it lives in the host tier."""
        return [None] * len(tensors) if i in self._out else tensors

    def prefetch(self, i: int) -> None:
        if i not in self._out or i in self._back:
            return
        back = []
        for place, shape, dtype, written in self._out[i]:
            self.store.wait(written, "activations")  # (written long since: the forward's)
            buf = torch.empty(shape, dtype=dtype, device=self.store.device)
            back.append((buf, self.store.get(place, buf)))
        self._back[i] = back

    def take(self, i: int, mb: int, here: torch.Tensor | None) -> torch.Tensor | None:
        """Micro-batch ``mb``'s boundary ``i`` on the GPU: read back (waited for; its extent freed once all of the
        boundary's micro-batches are back), or ``here``, the GPU's own copy."""
        if i not in self._out:
            return here
        self.prefetch(i)
        buf, fut = self._back[i][mb]
        self.store.wait(fut, "activations")
        self._back[i][mb] = (None, None)
        if all(b is None for b, _ in self._back[i]):
            for place, *_ in self._out.pop(i):
                self.store.unreserve(place)
            del self._back[i]
        return buf

    def clear(self) -> None:
        """Free whatever a pass left (a failed step's): every copy waited for, every extent given back."""
        for i, out in list(self._out.items()):
            for _, fut in self._back.pop(i, []):
                if fut is not None:
                    fut.exception()
            for place, _, _, written in out:
                written.exception()
                self.store.unreserve(place)
        self._out.clear()
