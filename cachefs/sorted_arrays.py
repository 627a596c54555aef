"""Binary search of a sorted numpy array from the trio thread, without releasing the GIL.

`ndarray.searchsorted` releases the GIL for every call, however small the search. On the
daemon's trio thread that is a cost of its own: while it searches, a worker thread (a source
read between two system calls, the page-store thread) takes the GIL, and the trio thread waits
to get it back. With four worker threads busy, a manifest lookup took 11.9 us of CPU and 37.3 us
of wall time searching with `searchsorted`, 4.7 and 5.1 us with `bisect` over the same array,
which reads it through the sequence protocol, about 18 element reads (`python
scripts/bench_lookup.py`: a manifest of 200,000 paths, medians of 5 passes; with no worker
busy, 4.4 and 5.1 us). So the searches on the request path (a path's manifest index, a
target's read-ahead list, a block's row on the SSD) go through here; vectorised searches of
many values at once (a whole manifest against another) keep `np.searchsorted`.
"""

from __future__ import annotations

import bisect

import numpy as np


def index_left(array: np.ndarray, value, lo: int = 0) -> int:
    """`array.searchsorted(value)` (side="left") of a sorted 1-D array, holding the GIL."""
    return bisect.bisect_left(array, value, lo)
