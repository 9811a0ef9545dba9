"""Small helpers over ``concurrent.futures.Future``: completed futures and chaining."""

from __future__ import annotations

import concurrent.futures as cf
import threading
from collections.abc import Callable
from typing import Any


def started(pool: cf.ThreadPoolExecutor, n: int) -> cf.ThreadPoolExecutor:
    """``pool`` with ``n`` of its worker threads started now, by the calling thread. A pool otherwise starts its
    threads on demand, from whichever thread submits, and on Linux a new thread inherits its creator's
    priority: a store's I/O and copy threads must not inherit the CPU worker's lowered one."""
    barrier = threading.Barrier(n)

    def meet() -> None:
        try:
            barrier.wait(timeout=30)
        except threading.BrokenBarrierError:
            pass

    for f in [pool.submit(meet) for _ in range(n)]:
        f.result()
    return pool


def done_future(value: Any = None) -> cf.Future:
    f: cf.Future = cf.Future()
    f.set_result(value)
    return f


def failed_future(exc: BaseException) -> cf.Future:
    f: cf.Future = cf.Future()
    f.set_exception(exc)
    return f


def forward(src: cf.Future, dst: cf.Future, value: Any = None, use_value: bool = False) -> None:
    """Complete ``dst`` when ``src`` completes: with src's result (or ``value``), or with its exception."""

    def cb(f: cf.Future) -> None:
        if dst.done():
            return
        exc = f.exception()
        if exc is not None:
            dst.set_exception(exc)
        else:
            dst.set_result(value if use_value else f.result())

    src.add_done_callback(cb)


def then(fut: cf.Future, fn: Callable[[Any], cf.Future], run_on_error: bool = False) -> cf.Future:
    """A future for ``fn(result)`` (which returns a future), started when ``fut`` completes.

    With ``run_on_error`` the next step runs even if ``fut`` failed (ordering only) and gets None.
    """
    out: cf.Future = cf.Future()

    def cb(f: cf.Future) -> None:
        exc = f.exception()
        if exc is not None and not run_on_error:
            out.set_exception(exc)
            return
        try:
            nxt = fn(None if exc is not None else f.result())
        except BaseException as e:  # noqa: BLE001 - surfaced through the future
            out.set_exception(e)
            return
        forward(nxt, out)

    fut.add_done_callback(cb)
    return out


def all_of(futures: list[cf.Future], value: Any = None) -> cf.Future:
    """One future that completes with ``value`` when all ``futures`` have, or with the first error
    (after all of them have finished, so no buffer is still in use when a caller sees the failure)."""
    out: cf.Future = cf.Future()
    if not futures:
        out.set_result(value)
        return out
    remaining = [len(futures)]
    errors: list[BaseException] = []
    lock = threading.Lock()

    def cb(f: cf.Future) -> None:
        with lock:
            if f.exception() is not None:
                errors.append(f.exception())
            remaining[0] -= 1
            last = remaining[0] == 0
        if last:
            if errors:
                out.set_exception(errors[0])
            else:
                out.set_result(value)

    for f in futures:
        f.add_done_callback(cb)
    return out
