"""DeadlineBuckets: the TTL index of a shard (shardserver.workers.ttl)."""

from __future__ import annotations

import pytest

from shardserver.workers.ttl import DeadlineBuckets


def test_due_keys_come_out_in_bucket_order_and_the_bucket_holding_now_is_split():
    t = DeadlineBuckets(1.0)
    deadlines = {"a": 10.2, "b": 10.9, "c": 11.5, "d": 9.0, "e": 30.0}
    for k, d in deadlines.items():
        t.add(k, d)
    assert len(t) == 5
    assert t.pop_due(8.99, deadlines.get) == []
    assert t.pop_due(10.5, deadlines.get) == ["d", "a"]  # "b" shares a's bucket but is not due
    assert len(t) == 3
    assert t.pop_due(10.9, deadlines.get) == ["b"]
    assert t.pop_due(29.0, deadlines.get) == ["c"]
    assert t.pop_due(30.0, deadlines.get) == ["e"] and len(t) == 0


def test_moved_and_dropped_keys_are_skipped_and_a_key_filed_twice_in_one_bucket_comes_back_twice():
    t = DeadlineBuckets(0.25)
    now = {"a": 5.0, "b": 5.1, "c": 5.05}
    for k, d in now.items():
        t.add(k, d)
    now["a"] = 100.0          # moved later: its first item is stale
    t.add("a", 100.0)
    del now["b"]              # dropped
    t.add("c", 5.2)           # filed again in the same bucket (5.0-5.25), deadline unchanged
    assert t.pop_due(6.0, now.get) == ["c", "c"]
    assert len(t) == 1
    assert t.pop_due(99.9, now.get) == []
    assert t.pop_due(100.0, now.get) == ["a"]


def test_rebuild_keeps_one_item_per_live_key():
    t = DeadlineBuckets(0.25)
    for i in range(100):
        t.add("k", float(i))
    t.rebuild([("k", 99.0), ("j", 50.0)])
    assert len(t) == 2
    assert t.pop_due(1000.0, {"k": 99.0, "j": 50.0}.get) == ["j", "k"]


def test_granularity_must_be_positive():
    with pytest.raises(ValueError, match="granularity_s must be > 0"):
        DeadlineBuckets(0)
