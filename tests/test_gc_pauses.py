"""The trainer's garbage-collector pauses: timed, and what is alive after the first step kept out of later
collections (trainer.run.gc_pauses)."""

import gc

from trainer.run.gc_pauses import GcPauses


class Node:
    def __init__(self):
        self.other = self


def test_collections_are_timed_and_freeze_keeps_live_objects_out_until_close():
    pauses = GcPauses()
    try:
        before = pauses.total
        for _ in range(20000):
            Node()  # cycles: only the collector frees them
        gc.collect()
        assert pauses.total > before
        kept = [Node() for _ in range(1000)]
        ids = {id(k) for k in kept}
        counted = pauses.total
        frozen = pauses.freeze()
        # (frozen objects that die leave the count: other threads of a full test run free some at any time)
        assert frozen >= len(kept) and 0 < gc.get_freeze_count() <= frozen
        assert not ids & {id(o) for o in gc.get_objects()}  # every kept object out of the collector's generations
        assert pauses.total == counted  # (the freeze's own collection is no step's pause)
        gc.collect()
        assert not ids & {id(o) for o in gc.get_objects()}  # a collection after it leaves them where they are
    finally:
        pauses.close()
    assert gc.get_freeze_count() == 0  # given back to the collector
    assert pauses._timed not in gc.callbacks

