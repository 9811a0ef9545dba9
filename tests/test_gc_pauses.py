"""The trainer's garbage-collector pauses: timed, and what is alive after the first step kept out of later
collections (trainer.gc_pauses)."""

import gc

from trainer.gc_pauses import GcPauses


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
        counted = pauses.total
        frozen = pauses.freeze()
        assert frozen >= len(kept) and gc.get_freeze_count() == frozen
        assert pauses.total == counted  # (the freeze's own collection is no step's pause)
        gc.collect()
        assert gc.get_freeze_count() == frozen  # a collection after it leaves them where they are
    finally:
        pauses.close()
    assert gc.get_freeze_count() == 0  # given back to the collector
    assert pauses._timed not in gc.callbacks

