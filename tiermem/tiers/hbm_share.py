"""HBM one process owns and another maps: a service's device tier, shared with its attached trainer.

The service allocates the block in its own context and keeps it for its whole life; the trainer maps it, so a
trainer that dies leaves it intact and the next one maps it again. The block dies with the service (a service's
crash loses what lives in HBM: ``tiermem.service`` recovers it from a checkpoint, or from the DRAM copies that
``durability: step`` keeps).

- CUDA: a torch allocation on the trainer's GPU, exported by PyTorch's CUDA IPC
  (``UntypedStorage._share_cuda_``: ``cudaIpcGetMemHandle`` and a reference counter) and opened by the trainer
  (``UntypedStorage._new_shared_cuda``, as ``torch.multiprocessing`` rebuilds a shared CUDA tensor).
- The CPU stand-in: a ``memfd`` (anonymous shared memory the kernel frees with its last user) that the trainer
  opens as ``/proc/<service pid>/fd/<fd>``.

    block = OwnedBlock(nbytes, device)      # the service's
    desc = block.export()                   # JSON, sent to the trainer with the layout
    mapped = open_block(desc, device)       # the trainer's view: a uint8 tensor of desc["bytes"]
"""

from __future__ import annotations

import base64
import contextlib
import mmap
import os

import torch

from tiermem.errors import UserError


def _b64(data: bytes | None) -> str | None:
    return None if data is None else base64.b64encode(data).decode()


def _unb64(text: str | None) -> bytes | None:
    return None if text is None else base64.b64decode(text)


@contextlib.contextmanager
def _plain_segments():
    """Allocate with cudaMalloc'd segments, whose legacy IPC handle any process of the user opens, even where the
    process runs with expandable segments (their IPC hands over file descriptors through pidfd_getfd, which a
    restricted ptrace scope refuses between unrelated processes)."""
    expandable = "expandable_segments:true" in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "").replace(" ", "").lower()
    setting = getattr(torch.cuda.memory, "_set_allocator_settings", None)
    if not expandable or setting is None:
        yield
        return
    setting("expandable_segments:False")
    try:
        yield
    finally:
        setting("expandable_segments:True")


class OwnedBlock:
    """``nbytes`` of zeroed device memory this process owns and may export (``export``)."""

    def __init__(self, nbytes: int, device: torch.device):
        self.nbytes, self.device = nbytes, device
        self._fd = self._mm = None
        if device.type == "cuda":
            with _plain_segments():
                self.tensor = torch.zeros(max(nbytes, 1), dtype=torch.uint8, device=device)
        else:
            self._fd = os.memfd_create("tiermem-hbm", os.MFD_CLOEXEC)
            os.ftruncate(self._fd, max(nbytes, 1))
            self._mm = mmap.mmap(self._fd, max(nbytes, 1))
            self.tensor = torch.frombuffer(self._mm, dtype=torch.uint8)

    def export(self) -> dict:
        """What another process of this user needs to map the block (``open_block``)."""
        if self.device.type != "cuda":
            return {"kind": "memfd", "pid": os.getpid(), "fd": self._fd, "bytes": self.nbytes}
        dev, handle, size, offset, rc_handle, rc_offset, ev_handle, ev_sync = \
            self.tensor.untyped_storage()._share_cuda_()
        return {"kind": "cuda_ipc", "device": int(dev), "handle": _b64(handle), "size": int(size),
                "offset": int(offset), "ref_counter": _b64(rc_handle), "ref_counter_offset": int(rc_offset),
                "event": _b64(ev_handle), "event_sync": bool(ev_sync), "bytes": self.nbytes}

    def close(self) -> None:
        self.tensor = None
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError:
                pass  # views still alive: the mapping goes with the last one
            os.close(self._fd)
            self._mm = self._fd = None


class MappedBlock:
    """Another process's block (``OwnedBlock.export``) mapped here: ``tensor``, a uint8 tensor of its bytes."""

    def __init__(self, desc: dict, device: torch.device):
        kind, n = desc.get("kind"), int(desc["bytes"])
        self._mm = None
        if kind == "memfd":
            if device.type == "cuda":
                raise UserError("the service keeps its HBM in host memory (its device is cpu) but this trainer "
                                f"computes on {device}: give the service's config the trainer's device")
            path = f"/proc/{int(desc['pid'])}/fd/{int(desc['fd'])}"
            try:
                fd = os.open(path, os.O_RDWR)
            except OSError as e:
                raise UserError(f"cannot map the service's HBM stand-in ({path}): {os.strerror(e.errno)}") from None
            try:
                self._mm = mmap.mmap(fd, max(n, 1))
            finally:
                os.close(fd)
            self.tensor = torch.frombuffer(self._mm, dtype=torch.uint8)[:n]
        elif kind == "cuda_ipc":
            if device.type != "cuda" or device.index not in (None, desc["device"]):
                raise UserError(f"the service holds its HBM on cuda:{desc['device']} but this trainer computes on "
                                f"{device}: give the service's config the trainer's device")
            torch.cuda._lazy_init()
            storage = torch.UntypedStorage._new_shared_cuda(
                desc["device"], _unb64(desc["handle"]), desc["size"], desc["offset"], _unb64(desc["ref_counter"]),
                desc["ref_counter_offset"], _unb64(desc["event"]), desc["event_sync"])
            whole = torch.empty(0, dtype=torch.uint8, device=torch.device("cuda", desc["device"]))
            whole.set_(storage, 0, (storage.nbytes(),), (1,))
            self.tensor = whole[:n]
        else:
            raise UserError(f"the service shares its HBM in a way this trainer does not know ({str(kind)[:40]!r}); "
                            "run the same tiermem version on both sides")

    def close(self) -> None:
        self.tensor = None
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError:
                pass
            self._mm = None


def open_block(desc: dict, device: torch.device) -> MappedBlock:
    return MappedBlock(desc, device)
