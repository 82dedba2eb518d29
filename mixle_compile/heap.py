"""Garbage collection while a spec is read, checked and compiled.

Reading, checking and compiling a spec allocate millions of small objects that live until the
pass ends (positions, parameters, updates, plan entries). CPython's full collections walk every
live object, and they come more often the more objects survive, so on a large spec they cost more
than linear time (measured with ``benchmarks/bench_reader.py``: on an 8,000-tensor compile they
were over a quarter of the time and grew 7x for 4x the tensors). The passes create almost no
reference cycles, so they run with full collections paused: the young generations are still
collected, and the setting is restored when the pass ends, however it ends.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

# gc.set_threshold's third value: full collections only after this many young ones (CPython runs
# one when the count exceeds the threshold; see the documentation of gc.set_threshold).
_NO_FULL_COLLECTIONS = 1 << 30


@contextlib.contextmanager
def full_collections_paused() -> Iterator[None]:
    """Within the block, collect only the young generations; afterwards, the thresholds as they were."""
    thresholds = gc.get_threshold()
    gc.set_threshold(thresholds[0], thresholds[1], _NO_FULL_COLLECTIONS)
    try:
        yield
    finally:
        gc.set_threshold(*thresholds)
