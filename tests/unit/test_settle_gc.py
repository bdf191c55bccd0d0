"""settle_gc: a serving child freezes its start-up objects and raises the GC thresholds (issue 12 item 2)."""

import subprocess
import sys

from shardserver.workers._subprocess import GC_THRESHOLD

_CHILD = """
import gc, json
from shardserver.api.app import create_app  # a real start-up object graph (FastAPI, pydantic)
from shardserver.workers._subprocess import settle_gc
before = (gc.get_threshold(), gc.get_freeze_count())
settle_gc()
garbage = []
garbage.append(garbage)  # a cycle made after start-up is still collected
del garbage
print(json.dumps([before, gc.get_threshold(), gc.get_freeze_count(), gc.collect()]))
"""


def test_settle_gc_freezes_startup_objects_and_raises_thresholds():
    import json

    out = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, timeout=60, check=True)
    (thr_before, frozen_before), thr_after, frozen_after, collected = json.loads(out.stdout)
    assert thr_before == [700, 10, 10] and frozen_before == 0
    assert thr_after == list(GC_THRESHOLD) == [50_000, 20, 100]
    assert frozen_after > 10_000  # FastAPI + pydantic + shardserver modules are in the permanent generation
    assert collected == 1  # the one-list cycle
