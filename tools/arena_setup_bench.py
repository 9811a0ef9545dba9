"""Arena setup variants on the GPU machine: how to make and pin a big shared-memory arena fast.

    python3 tools/arena_setup_bench.py [--size 16GiB]

Each variant creates a fresh /dev/shm file of --size, maps it, makes its pages resident and registers
it with CUDA; prints seconds per phase, and the H2D rate of a copy that crosses a 1 GiB chunk boundary
(a copy must not fall back to a pageable one). Baseline in the same run: a
``pin_memory=True`` allocation of the same size.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import ctypes
import mmap
import os
import sys
import time

import torch

from tiermem.sizes import parse_size

CHUNK = 1 << 30


def thp_settings() -> str:
    out = []
    for f in ("enabled", "shmem_enabled"):
        try:
            out.append(f"{f}={open(f'/sys/kernel/mm/transparent_hugepage/{f}').read().strip()}")
        except OSError as e:
            out.append(f"{f}=? ({e.strerror})")
    return " ".join(out)


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
MAP_FIXED, MAP_POPULATE, MAP_NORESERVE = 0x10, 0x8000, 0x4000


def _mmap(addr, length, prot, flags, fd=-1):
    r = _libc.mmap(addr, length, prot, flags, fd, 0)
    if r in (None, ctypes.c_void_p(-1).value):
        raise OSError(ctypes.get_errno(), "mmap failed")
    return r


def run_files(variant: str, size: int) -> dict:
    """Many chunk files, made in parallel and mapped back to back into one reserved range."""
    n = max(size // CHUNK, 1)
    paths = [f"/dev/shm/arena-bench-{os.getpid()}-{i}" for i in range(n)]
    t = {}
    t0 = time.perf_counter()
    fds = [os.open(p, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600) for p in paths]
    for fd in fds:
        os.ftruncate(fd, CHUNK)
    if "fallocate" in variant:
        with cf.ThreadPoolExecutor(16) as ex:
            list(ex.map(lambda fd: os.posix_fallocate(fd, 0, CHUNK), fds))
    t["fallocate"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    anon = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_NORESERVE
    base_addr = _mmap(None, n * CHUNK, 0, anon)
    rw, flags = mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED | MAP_FIXED | MAP_POPULATE
    with cf.ThreadPoolExecutor(16) as ex:
        list(ex.map(lambda i: _mmap(base_addr + i * CHUNK, CHUNK, rw, flags, fds[i]), range(n)))
    for fd in fds:
        os.close(fd)
    t["touch"] = time.perf_counter() - t0
    buf = (ctypes.c_uint8 * (n * CHUNK)).from_address(base_addr)
    base = torch.frombuffer(buf, dtype=torch.uint8)
    t.update(_register_and_copy(base, n * CHUNK))
    base = None
    _libc.munmap(ctypes.c_void_p(base_addr), ctypes.c_size_t(n * CHUNK))
    for p in paths:
        os.unlink(p)
    t["total"] = t["fallocate"] + t["touch"] + t["register"]
    return t


def _register_and_copy(base: torch.Tensor, size: int) -> dict:
    t = {}
    cudart = torch.cuda.cudart()
    t0 = time.perf_counter()
    ptr = base.data_ptr()
    rcs = [int(cudart.cudaHostRegister(ptr, size, 0))]
    t["register"] = time.perf_counter() - t0
    assert all(rc == 0 for rc in rcs), rcs
    n = min(2 << 30, size // 2)
    src = base[CHUNK - n // 2: CHUNK + n // 2] if size > CHUNK else base[:n]
    dst = torch.empty(n, dtype=torch.uint8, device="cuda")
    src.fill_(7)
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(3):
        dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    t["h2d_gbps"] = 3 * n / (time.perf_counter() - t0) / 1e9
    assert int(dst[::4096].min()) == 7
    cudart.cudaHostUnregister(ptr)
    return t


def run_anon(variant: str, size: int) -> dict:
    """Private anonymous memory with transparent huge pages (not shareable: a reference only)."""
    mm = mmap.mmap(-1, size, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    mm.madvise(mmap.MADV_HUGEPAGE)
    base = torch.frombuffer(mm, dtype=torch.uint8)
    t = {"fallocate": 0.0}
    t0 = time.perf_counter()
    _touch(base, size)
    t["touch"] = time.perf_counter() - t0
    t.update(_register_and_copy(base, size))
    base = None
    try:
        mm.close()
    except BufferError:
        pass
    t["total"] = t["touch"] + t["register"]
    return t


def _touch(base: torch.Tensor, size: int) -> None:
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with cf.ThreadPoolExecutor(16) as ex:
            step = 256 << 20
            list(ex.map(lambda o: base[o:o + step].fill_(0), range(0, size, step)))
    finally:
        torch.set_num_threads(prev)


def run(variant: str, size: int) -> dict:
    if variant.startswith("files"):
        return run_files(variant, size)
    if variant.startswith("anon"):
        return run_anon(variant, size)
    path = f"/dev/shm/arena-bench-{os.getpid()}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    os.ftruncate(fd, size)
    t = {}
    t0 = time.perf_counter()
    if "fallocate" in variant:
        os.posix_fallocate(fd, 0, size)
    t["fallocate"] = time.perf_counter() - t0
    mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    os.close(fd)
    if "huge" in variant:
        mm.madvise(mmap.MADV_HUGEPAGE)
    base = torch.frombuffer(mm, dtype=torch.uint8)
    t0 = time.perf_counter()
    if "touch" in variant:
        _touch(base, size)
    if variant == "tiermem":  # what the arena itself does
        from tiermem.tiers.dram import _touch_parallel

        _touch_parallel(base)
    t["touch"] = time.perf_counter() - t0
    t.update(_register_and_copy(base, size))
    base = None
    try:
        mm.close()
    except BufferError:
        pass
    os.unlink(path)
    t["total"] = t["fallocate"] + t["touch"] + t["register"]
    return t


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="16GiB")
    ap.add_argument("--variants", default="touch,tiermem,anon-huge")
    ap.add_argument("--big", help="variants to run again at --big-size")
    ap.add_argument("--big-size", default="64GiB")
    args = ap.parse_args()
    size = parse_size(args.size)
    print("THP:", thp_settings(), "| torch threads", torch.get_num_threads(), flush=True)
    t0 = time.perf_counter()
    p = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    base = time.perf_counter() - t0
    del p
    print(f"baseline pin_memory=True {size >> 30} GiB: {base:.2f} s", flush=True)
    print(f"{'variant':24s} {'fallocate':>9s} {'touch':>7s} {'register':>8s} {'total':>7s} {'h2d GB/s':>8s}")
    for v in args.variants.split(","):
        r = run(v, size)
        print(f"{v:24s} {r['fallocate']:9.2f} {r['touch']:7.2f} {r['register']:8.2f} {r['total']:7.2f} "
              f"{r['h2d_gbps']:8.1f}", flush=True)
    if args.big:
        for v in args.big.split(","):
            r = run(v, parse_size(args.big_size))
            print(f"{v + ' ' + args.big_size:24s} {r['fallocate']:9.2f} {r['touch']:7.2f} {r['register']:8.2f} "
                  f"{r['total']:7.2f} {r['h2d_gbps']:8.1f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
