"""Binary search of a sorted numpy array from the trio thread, without releasing the GIL.

`ndarray.searchsorted` releases the GIL for every call, however small the search. On the
daemon's trio thread that is a cost of its own: while it searches, a worker thread (a source
read between two system calls, the page-store thread) takes the GIL, and the trio thread waits
to get it back. With four worker threads busy, a manifest lookup took 12 us of CPU and 38 us
of wall time with `searchsorted`, 3.3 and 3.5 us with `bisect` over the same array (a
manifest of 200,000 paths, 20,000 lookups, on a 2-core VM; `bisect` reads the array through
the sequence protocol, about 18 element reads). So the searches on the
request path (a path's manifest index, a target's read-ahead list) go through here; vectorised
searches of many values at once (a whole manifest against another) keep `np.searchsorted`.
"""

from __future__ import annotations

import bisect

import numpy as np


def index_left(array: np.ndarray, value, lo: int = 0) -> int:
    """`array.searchsorted(value)` (side="left") of a sorted 1-D array, holding the GIL."""
    return bisect.bisect_left(array, value, lo)
