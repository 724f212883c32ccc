"""The server's garbage-collection clock (paged_experts/server/gc_pauses.py): each collection counted once in
its generation, with its duration; nothing counted once uninstalled, nor a collection whose start it missed; the
heap freeze (freeze_heap / release_heap) collects first and holds until its last holder releases it."""

from __future__ import annotations

import gc
import weakref

from paged_experts.server.gc_pauses import GcPauseClock, clock, freeze_heap, frozen_objects, release_heap


def test_the_clock_counts_each_collection_in_its_generation() -> None:
    watch = GcPauseClock()
    watch.install()
    gc.disable()  # no automatic collection between the snapshots (gc.collect still runs the callbacks)
    try:
        garbage = [[i] for i in range(50_000)]  # tracked objects, so a full collection has work to do
        before = watch.snapshot()
        gc.collect(2)
        gc.collect(0)
        after = watch.snapshot()
        del garbage
    finally:
        gc.enable()
        watch.uninstall()
    assert after.collections[2] - before.collections[2] == 1  # exactly the forced full collection
    assert after.collections[0] - before.collections[0] >= 1
    assert after.pause_s[2] > before.pause_s[2] and after.max_pause_s >= after.pause_s[2] - before.pause_s[2]
    gc.collect(2)  # uninstalled: not counted
    assert watch.snapshot() == after


def test_a_collection_inside_another_counts_once_and_its_time_once() -> None:
    """3.12 can start a collection inside another's callback: both are counted, the time only the outer one's."""
    watch = GcPauseClock()
    watch._on_gc("start", {"generation": 2})
    watch._on_gc("start", {"generation": 0})
    sum(i * i for i in range(200_000))  # CPU time inside both
    watch._on_gc("stop", {"generation": 0})
    inner = watch.snapshot()
    assert inner.collections == (1, 0, 0) and inner.pause_s == (0.0, 0.0, 0.0)
    watch._on_gc("stop", {"generation": 2})
    done = watch.snapshot()
    assert done.collections == (1, 0, 1) and done.pause_s[0] == 0.0 and done.pause_s[2] > 0


def test_a_stop_without_its_start_is_not_counted() -> None:
    watch = GcPauseClock()
    watch._on_gc("stop", {"generation": 2})  # installed during a collection: its start was not seen
    assert watch.snapshot().collections == (0, 0, 0)
    watch._on_gc("start", {"generation": 1})
    watch._on_gc("stop", {"generation": 1})
    assert watch.snapshot().collections == (0, 1, 0)


def test_the_process_clock_is_installed_once() -> None:
    assert clock() is clock()
    assert sum(1 for cb in gc.callbacks if getattr(cb, "__self__", None) is clock()) == 1


class _Node:
    pass


def test_the_freeze_collects_first_and_the_heap_stays_frozen_until_its_last_holder_releases_it() -> None:
    """Two in-process servers froze the heap: the first to stop leaves the other's freeze in place."""
    gc.unfreeze()
    gc.disable()  # no automatic collection: only the freeze's own may free the cycle
    try:
        node = _Node()
        node.cycle = node  # type: ignore[attr-defined]
        alive = weakref.ref(node)
        del node  # garbage that only a collection frees
        first = freeze_heap()
        assert alive() is None  # collected, not frozen for the process's life
        survivor = [object()]
        second = freeze_heap()
        assert 0 < first <= second == frozen_objects() == gc.get_freeze_count()
        release_heap()
        assert frozen_objects() > 0 and not any(o is survivor for o in gc.get_objects())
        release_heap()
        assert frozen_objects() == 0 and any(o is survivor for o in gc.get_objects())
    finally:
        gc.enable()
        gc.unfreeze()
