"""Property tests of the extent allocator: no overlap, alignment, capacity, reuse of freed space."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from tiermem.tiers.extents import ExtentAllocator, OutOfSpace

ops = st.lists(st.one_of(st.tuples(st.just("alloc"), st.integers(1, 40_000)),
                         st.tuples(st.just("free"), st.integers(0, 1000))), max_size=80)


@settings(max_examples=200, deadline=None)
@given(ops)
def test_random_alloc_free(seq):
    cap = 256 * 1024
    a = ExtentAllocator(cap, 4096, base=4096)
    live = []
    for op, arg in seq:
        if op == "alloc":
            try:
                e = a.allocate(arg)
            except OutOfSpace:
                assert a.largest_free() < arg  # refused only when no free run is large enough
                continue
            assert e.offset % 4096 == 0 and e.nbytes % 4096 == 0 and e.nbytes >= arg
            assert 4096 <= e.offset and e.end <= 4096 + cap
            live.append(e)
        elif live:
            a.free(live.pop(arg % len(live)))
        spans = sorted((e.offset, e.end) for e in live)
        assert all(x[1] <= y[0] for x, y in zip(spans, spans[1:])), "overlapping live extents"
        assert a.used_bytes() == sum(e.nbytes for e in live) <= cap
        free = a.free_extents()
        assert all(x.end < y.offset for x, y in zip(free, free[1:])), "free list not coalesced"
    for e in live:
        a.free(e)
    assert a.free_bytes() == cap and a.fragmentation() == 0.0
    assert a.allocate(cap).nbytes == cap  # all space reusable as one run


def test_fragmentation_and_double_free():
    a = ExtentAllocator(4 * 4096, 4096)
    es = [a.allocate(4096) for _ in range(4)]
    a.free(es[0])
    a.free(es[2])
    assert a.fragmentation() == 0.5
    try:
        a.free(es[0])
    except ValueError:
        pass
    else:
        raise AssertionError("double free accepted")


@settings(max_examples=100, deadline=None)
@given(ops)
def test_reserve_rebuilds_the_same_allocator(seq):
    """A reopened arena's allocator, rebuilt by reserving the recorded extents, has the same free space,
    and refuses an extent that overlaps one already reserved."""
    cap = 256 * 1024
    a = ExtentAllocator(cap, 4096, base=4096)
    live = []
    for op, arg in seq:
        if op == "alloc":
            try:
                live.append(a.allocate(arg))
            except OutOfSpace:
                pass
        elif live:
            a.free(live.pop(arg % len(live)))
    b = ExtentAllocator(cap, 4096, base=4096)
    for e in reversed(live):
        b.reserve(e)
    assert b.free_extents() == a.free_extents() and b.used_bytes() == a.used_bytes()
    for e in live:
        try:
            b.reserve(e)
        except ValueError:
            continue
        raise AssertionError(f"{e} reserved twice")
